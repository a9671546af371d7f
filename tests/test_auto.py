"""Mode `auto` on real services: the default mode, exact answers within a lossless budget, the
choice following the estimates, budgets refused with the option named, and a stream too slow to
finish abandoned mid-way for the consumer's own prefill (a producer that stalls between layers)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from consumer.api.client import ConsumerClient
from consumer.auto import planner as planner_mod
from producer.server import ProducerServer
from qa.task import make_example
from shared.config import ProducerConfig
from shared.models import load_model
from shared.pb import common_pb2, consumer_pb2
from tests.conftest import prompt, running_pair
from tests.hostile import consumer_of, record
from tests.test_end_to_end import CONTEXT, QUESTION
from tests.test_metrics import scrape, value
from tests.test_planner import slow_own_prefill

AUTO = common_pb2.CodecSpec(name="auto")


def fields(context: str = CONTEXT, **kw) -> dict:
    return dict(context=prompt(context), question=prompt(QUESTION), max_new_tokens=8, **kw)


async def test_auto_is_the_default_and_lossless_without_an_artifact():
    async with running_pair("tiny-llama", consumer_kw={"metrics_port": 0}) as pair:
        described = await pair.client.describe()
        assert described.default_mode == "auto" and "safest fixed mode now: raw" in described.default_mode_reason
        oracle, _, _ = await pair.generate(transfer=common_pb2.CodecSpec(name="oracle"), **fields("A " + CONTEXT))
        ids, _, stats = await pair.generate(**fields("A " + CONTEXT))  # no mode named: auto
        a = stats.auto
        assert a.exact and "lossless" in a.budget_source
        assert a.reason.startswith("fastest within the budget: oracle") and "prefix cache" in a.reason  # cached by the oracle run
        within = {c.mode for c in a.candidates if c.within_budget}
        assert within == {"oracle", "raw", "recompute"} and all(c.how == "exact" for c in a.candidates)
        assert ids == oracle
        ids, _, stats = await pair.generate(**fields("B " + CONTEXT))  # a new context: a remote one is measured first
        assert stats.auto.reason.startswith("cold start") and stats.transfer.name in ("raw", "recompute")
        assert stats.bytes_received > 0
        oracle, _, _ = await pair.generate(transfer=common_pb2.CodecSpec(name="oracle"), **fields("B " + CONTEXT))
        assert ids == oracle  # exact candidates only: the same tokens as the consumer's own prefill
        _, _, stats = await pair.generate(**fields("C " + CONTEXT))
        assert stats.auto.reason.startswith("fastest within the budget")
        assert [c.estimated_ms >= 0 for c in stats.auto.candidates if c.within_budget] == [True, True, True]
        assert sum(c.chosen for c in stats.auto.candidates) == 1
        described = await pair.client.describe()
        assert described.stats.auto_choices == 3 and described.estimates["link_mbit_s"] > 0
        assert described.estimates["local_prefill.ms_per_token"] > 0 and described.estimates["local_prefill.samples"] >= 1
        samples = scrape(pair.consumer.server.metrics_port)
        counted = sum(v for (name, _), v in samples.items() if name == "scd_auto_choices_total")
        cold = sum(v for (name, labels), v in samples.items() if name == "scd_auto_choices_total" and ("cold_start", "true") in labels)
        assert counted == 3 and cold == 1 and value(samples, "scd_auto_choices_total", mode="oracle", cold_start="false") >= 1


async def test_auto_follows_the_estimates():
    async with running_pair("tiny-llama", consumer_kw={"prefix_cache_bytes": 0}) as pair:
        await pair.generate(transfer=common_pb2.CodecSpec(name="oracle"), **fields())
        await pair.generate(transfer=AUTO, **fields())  # cold start: measures a remote candidate
        planner = pair.consumer.servicer.planner
        planner.link_bytes_per_ms.value = 1e-3  # the link crawls
        _, _, stats = await pair.generate(transfer=AUTO, **fields())
        assert stats.transfer.name == "oracle" and stats.bytes_received == 0
        planner.link_bytes_per_ms.value = 1e12
        slow_own_prefill(planner)  # the own prefill crawls
        _, _, stats = await pair.generate(transfer=AUTO, **fields())
        assert stats.transfer.name in ("raw", "recompute") and stats.bytes_received > 0
        narrowed = common_pb2.CodecSpec(name="auto", options={"candidates": "oracle"})
        _, _, stats = await pair.generate(transfer=narrowed, **fields())
        assert stats.transfer.name == "oracle" and [c.mode for c in stats.auto.candidates if c.within_budget] == ["oracle"]


async def test_named_requests_teach_the_overhead():
    """A named mode's TTFT, compared with the estimate made when it was admitted, teaches the
    learned overhead as auto's own choices do: an estimate for a mode that only callers name
    (no request asked auto) still comes to include what the model leaves out."""
    async with running_pair("tiny-llama", consumer_kw={"prefix_cache_bytes": 0}) as pair:
        planner = pair.consumer.servicer.planner
        seen: list[tuple[bool, float, float]] = []
        observe = planner.observe_overhead

        def record(remote: bool, actual_ms: float, base_ms: float) -> None:
            seen.append((remote, actual_ms, base_ms))
            observe(remote, actual_ms, base_ms)

        planner.observe_overhead = record
        raw = common_pb2.CodecSpec(name="raw")
        for _ in range(8):  # one context: after the first, store replays (the link sets their pace): confident
            await pair.generate(transfer=raw, **fields())
        taught = [(actual, base) for remote, actual, base in seen if remote and base > 0]
        assert taught, seen  # named requests' confident estimates reach the learner
        # it learns those within OVERHEAD_RATIO of their estimate (a busy host's few-ms TTFTs may all
        # miss by more, which is the rule working, not the path failing)
        within = [a / b for a, b in taught if 1 / planner_mod.OVERHEAD_RATIO <= a / b <= planner_mod.OVERHEAD_RATIO]
        learned = planner.overhead_ms["remote"]
        assert learned.count == len(within) and (learned.value is not None) == bool(within)
        described = await pair.client.describe()
        assert described.stats.auto_choices == 0  # no auto request taught it


async def test_a_request_derives_its_candidate_key_once():
    """Issue 45 item 2: the job builder derives auto's key of a request's transfer once and the job
    carries it (GenerateJob.candidate_key); the named mode's estimate, the mid-stream watch, what the
    finished request teaches the planner and the producer memory all read it, none derives it
    again. Mode auto derives one per candidate it scores, and none after its choice."""
    async with running_pair("tiny-llama", consumer_kw={"prefix_cache_bytes": 0, "probe_idle_s": 0}) as pair:
        chooser, planner = pair.consumer.servicer.chooser, pair.consumer.servicer.planner
        derive, derived = chooser.key, []

        def counted(mode: str, options) -> str:
            derived.append(mode)
            return derive(mode, options)

        chooser.key = counted  # type: ignore[method-assign]  # counts, then derives as before
        _, _, stats = await pair.generate(transfer=common_pb2.CodecSpec(name="raw"), **fields())
        assert derived == ["raw"] and stats.bytes_received > 0
        assert list(planner.bytes_per_token) == [derive("raw", dict(stats.transfer.options))]
        derived.clear()
        _, _, stats = await pair.generate(transfer=AUTO, **fields())
        scored = len(stats.auto.candidates) + sum(e.count for e in stats.auto.excluded)
        assert len(derived) == scored and scored >= 3


@pytest.mark.parametrize(
    "options, text",
    [
        ({"max_loss": "x"}, "transfer.options['max_loss']: 'x' is not a number"),
        ({"max_loss": "-1"}, "must be a finite number >= 0"),
        ({"max_loss": "nan"}, "must be a finite number >= 0"),
        ({"exact": "maybe"}, "transfer.options['exact']"),
        ({"exact": "true", "max_loss": "0.1"}, "set max_loss or exact, not both"),
        ({"schedule": "s0"}, "unknown option 'schedule' for mode 'auto'"),
        ({"candidates": "raw,teleport"}, "transfer.options['candidates']: unknown mode 'teleport'"),
        ({"candidates": "quant", "exact": "true"}, "no candidate meets exact"),
    ],
)
async def test_bad_budgets_are_refused_naming_the_option(options, text):
    async with running_pair("tiny-llama") as pair:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pair.generate(transfer=common_pb2.CodecSpec(name="auto", options=options), **fields())
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and text in err.value.details()
        _, _, stats = await pair.generate(**fields())  # and it keeps serving
        assert stats.HasField("auto")


async def recorded_raw_stream() -> list:
    """A real producer's raw stream of CONTEXT in 1 KiB chunks (many messages to stall between)."""
    model = load_model("tiny-llama", "float32", "cpu")
    ids = model.tokenizer(CONTEXT)["input_ids"]
    producer = ProducerServer(ProducerConfig(port=0, model="tiny-llama", device="cpu", max_chunk_bytes=1024, drain_grace_s=0))
    await producer.start()
    await producer.load()
    try:
        return await record(producer.address, ids, "raw")
    finally:
        await producer.stop(0)


def stalling(rec: list, stall_s) -> Callable:
    """A hostile-producer script replaying rec, waiting stall_s() seconds before every layer after
    the first (stall_s is read per call)."""

    def script(request):
        stall = stall_s()
        for i, message in enumerate(rec):
            if i > 1 and message.WhichOneof("kind") == "chunk" and message.chunk.chunk_index == 0 and message.chunk.kind == "k":
                yield stall
            yield message

    return script


async def test_a_stalling_stream_is_abandoned_for_the_own_prefill():
    rec = await recorded_raw_stream()
    stall = {"s": 0.0}

    script = stalling(rec, lambda: stall["s"])
    async with consumer_of(script, prefix_cache_bytes=0) as (consumer, fake):
        client = ConsumerClient(consumer.address)
        try:
            local = consumer_pb2.TRANSFER_FAILURE_POLICY_LOCAL_PREFILL
            raw = common_pb2.CodecSpec(name="raw")
            oracle = await client.generate(transfer=common_pb2.CodecSpec(name="oracle"), **fields(), timeout=60)
            fast = await client.generate(transfer=raw, on_transfer_failure=local, **fields(), timeout=60)
            assert not fast.stats.transfer_abandoned and fast.stats.bytes_received > 0  # bytes/token measured
            stall["s"] = 0.4
            slow = await client.generate(transfer=raw, on_transfer_failure=local, **fields(), timeout=60)
            assert slow.stats.transfer_abandoned and slow.stats.transfer.name == "oracle"
            assert "abandoned mid-stream" in slow.stats.transfer_failure and slow.ids == oracle.ids
            calls = fake.calls
            patient = await client.generate(transfer=raw, **fields(), timeout=60)  # FAIL policy: never abandoned
            assert not patient.stats.transfer_abandoned and patient.stats.transfer.name == "raw" and fake.calls == calls + 1
            described = await client.describe()
            assert described.stats.transfers_abandoned == 1
        finally:
            await client.channel.close()


async def test_one_stall_is_not_a_slow_stream():
    """A stream that pauses once (before its third layer) and then runs at full speed is kept: the
    watch leaves the slowest gap out of its rate; one slow throughout is still abandoned."""
    rec = await recorded_raw_stream()
    stalls = {"layers": set(), "s": 0.0}

    def script(request):
        layer = 0
        for message in rec:
            if message.WhichOneof("kind") == "chunk" and message.chunk.chunk_index == 0 and message.chunk.kind == "k":
                if layer in stalls["layers"]:
                    yield stalls["s"]
                layer += 1
            yield message

    async with consumer_of(script, prefix_cache_bytes=0) as (consumer, fake):
        client = ConsumerClient(consumer.address)
        try:
            local = consumer_pb2.TRANSFER_FAILURE_POLICY_LOCAL_PREFILL
            raw = common_pb2.CodecSpec(name="raw")
            await client.generate(transfer=common_pb2.CodecSpec(name="oracle"), **fields(), timeout=60)
            await client.generate(transfer=raw, on_transfer_failure=local, **fields(), timeout=60)  # bytes/token
            stalls.update(layers={2}, s=0.6)
            once = await client.generate(transfer=raw, on_transfer_failure=local, **fields(), timeout=60)
            assert not once.stats.transfer_abandoned and once.stats.transfer.name == "raw"
            stalls.update(layers={1, 2, 3}, s=0.6)
            throughout = await client.generate(transfer=raw, on_transfer_failure=local, **fields(), timeout=60)
            assert throughout.stats.transfer_abandoned and throughout.stats.transfer.name == "oracle"
        finally:
            await client.channel.close()


async def test_abandoned_and_cancelled_streams_among_good_ones_return_every_block():
    """Eight concurrent requests over one engine: stalled streams abandoned for the own prefill,
    fast ones, and calls the caller cancels mid-stream. Each answer is the oracle's; afterwards the
    KV pool, the KV admission queue and the call admission are back where they started."""
    import asyncio

    rec = await recorded_raw_stream()
    stalls = iter([0.0, 0.0] + [0.4, 0.0, 0.4, 0.0, 5.0, 0.4, 5.0, 0.0])  # two warm-ups, then per call as it arrives

    script = stalling(rec, lambda: next(stalls, 0.0))
    async with consumer_of(script, prefix_cache_bytes=0) as (consumer, _):
        servicer = consumer.servicer
        pool = servicer.batch.pool
        client = ConsumerClient(consumer.address)
        try:
            local = consumer_pb2.TRANSFER_FAILURE_POLICY_LOCAL_PREFILL
            raw = common_pb2.CodecSpec(name="raw")
            oracle = await client.generate(transfer=common_pb2.CodecSpec(name="oracle"), **fields(), timeout=60)
            for _ in range(2):  # bytes per token and the own prefill measured
                await client.generate(transfer=raw, on_transfer_failure=local, **fields(), timeout=60)
            free = pool.num_blocks  # no prefix cache: every block is free once the calls end

            async def one(cancel_after: float | None):
                call = asyncio.ensure_future(client.generate(transfer=raw, on_transfer_failure=local, **fields(), timeout=60))
                if cancel_after is None:
                    return await call
                await asyncio.sleep(cancel_after)
                call.cancel()
                return None

            answers = await asyncio.gather(*(one(0.3 if i in (4, 6) else None) for i in range(8)), return_exceptions=True)
            good = [a for a in answers if a is not None]
            assert len(good) == 6 and all(not isinstance(a, BaseException) for a in good), answers
            assert all(a.ids == oracle.ids for a in good)
            assert sum(a.stats.transfer_abandoned for a in good) >= 1
            for _ in range(100):  # the cancelled calls' releases run on the engine thread
                if pool.free_blocks == free and servicer.admission.inflight == 0:
                    break
                await asyncio.sleep(0.05)
            assert pool.free_blocks == free and servicer.kv_admission.queued == 0 and servicer.admission.inflight == 0
            assert not pool.k.any() and not pool.v.any()  # every released block was zeroed
            assert not servicer.batch.tasks or all(t.cancelled for t in servicer.batch.tasks)
        finally:
            await client.channel.close()


async def test_a_stale_link_estimate_is_probed():
    long = dict(context=prompt(CONTEXT * 4), question=prompt(QUESTION), max_new_tokens=4)
    # background probes off: this is the user request's probe. With them on, a link probe (due once
    # auto serves locally over a stale estimate, checked every 0.5 s) measured the link between the
    # picks below on a slow host, and the third pick had nothing stale left to probe
    async with running_pair("tiny-llama", consumer_kw={"prefix_cache_bytes": 0, "probe_idle_s": 0}) as pair:
        await pair.generate(transfer=common_pb2.CodecSpec(name="oracle"), **long)
        _, _, stats = await pair.generate(transfer=AUTO, **long)  # cold start: a remote candidate, the link measured
        assert stats.auto.reason.startswith("cold start") and stats.bytes_received >= 16 * 1024
        planner = pair.consumer.servicer.planner
        planner.link_bytes_per_ms.value = 1e-3  # as if the link had crawled: the own prefill wins...
        planner.link_sampled_at -= 60  # ...measured a minute ago...
        picks = [(await pair.generate(transfer=AUTO, **long))[2] for _ in range(3)]
        assert [s.transfer.name for s in picks[:2]] == ["oracle", "oracle"]
        assert picks[2].auto.reason.startswith("probe") and picks[2].bytes_received > 0  # ...so it is measured again
        assert planner.link_bytes_per_ms.value > 1.0 and not picks[2].transfer_abandoned


async def test_auto_on_the_trained_pair_keeps_to_the_calibrated_budget():
    """The shipped heterogeneous pair: raw / quant / recompute are measured at ~9 nats (naive reuse
    of another model's cache) and never meet a budget; the default budget is the artifact's
    default schedule's loss; a wider budget admits the cheaper schedule."""
    root = Path(__file__).resolve().parents[1]
    art = str(root / "artifacts" / "qa-base-to-tuned.safetensors")
    base, tuned = str(root / "checkpoints" / "qa-base"), str(root / "checkpoints" / "qa-tuned")
    ex = make_example(seed=5, split="test", ctx_tokens=256, task="tuned")
    async with running_pair(base, tuned, producer_kw={"artifacts": art}, consumer_kw={"artifacts": art}) as pair:
        oracle, _, _ = await pair.generate(transfer=common_pb2.CodecSpec(name="oracle"), context=prompt(ex.context),
                                           question=prompt(ex.question), max_new_tokens=4)
        _, _, stats = await pair.generate(context=prompt(ex.context), question=prompt(ex.question), max_new_tokens=4)
        a = stats.auto
        over = next(e for e in a.excluded if e.reason.startswith("over the loss budget"))
        assert "raw" in over.candidates and "quant(bits=8,group_size=32)" in over.candidates  # measured at ~9 nats
        assert all(c.within_budget for c in a.candidates) and not [c for c in a.candidates if c.mode == "raw"]
        described = await pair.client.describe()
        default = next(s for s in described.artifacts[0].schedules if s.name == described.artifacts[0].default_schedule)
        assert default.schedule == "R2.R64"  # the schedule chosen on validation, the README's headline
        assert a.max_loss == pytest.approx(default.calibrated_loss) and "default schedule s5" in a.budget_source
        assert {c.mode for c in a.candidates} == {"scd", "oracle"}
        assert {c.options["schedule"] for c in a.candidates if c.mode == "scd"} == {"s5", "s6"}  # the default admits itself
        wider = common_pb2.CodecSpec(name="auto", options={"max_loss": "0.3"})
        ids, _, stats = await pair.generate(transfer=wider, context=prompt(ex.context), question=prompt(ex.question),
                                            max_new_tokens=4)
        within = [c for c in stats.auto.candidates if c.within_budget]
        assert len([c for c in within if c.mode == "scd"]) == 3 and all(c.calibrated_loss <= 0.3 for c in within)
        chosen = next(c for c in stats.auto.candidates if c.chosen)
        assert chosen.within_budget and stats.transfer.name == chosen.mode
        if chosen.mode == "oracle":
            assert ids == oracle


@pytest.mark.numeric  # greedy tokens compared with the oracle's (the check's forward vs the own decode)
async def test_verified_decoding_admits_lossy_transfers_under_exact():
    """Under `exact`, a request asking for verified decoding gets the consumer's exact output
    whatever the transfer: the SCD schedules the default budget admits become candidates (`how`
    verified); with provisional delivery they win when their transfer comes first, and the answer
    is the oracle's; with verified tokens only, their first token waits for the exact cache, so
    an exact candidate wins; without verify they stay excluded, and naive reuse never enters."""
    root = Path(__file__).resolve().parents[1]
    art = str(root / "artifacts" / "qa-base-to-tuned.safetensors")
    base, tuned = str(root / "checkpoints" / "qa-base"), str(root / "checkpoints" / "qa-tuned")
    ex = make_example(seed=7, split="test", ctx_tokens=256, task="tuned")
    exact = common_pb2.CodecSpec(name="auto", options={"exact": "true"})
    ask = dict(context=prompt(ex.context), question=prompt(ex.question), max_new_tokens=6)
    kw = {"artifacts": art, "prefix_cache_bytes": 0}
    async with running_pair(base, tuned, producer_kw={"artifacts": art}, consumer_kw=kw) as pair:
        oracle, _, _ = await pair.generate(transfer=common_pb2.CodecSpec(name="oracle"), **ask)
        await pair.generate(transfer=common_pb2.CodecSpec(name="scd"), **ask)  # the link and scd measured
        _, _, stats = await pair.generate(transfer=exact, **ask)  # no verify: lossy candidates stay out
        assert {c.mode for c in stats.auto.candidates} == {"oracle"}
        out = next(e for e in stats.auto.excluded if e.reason.startswith("not exact"))
        assert "verified decoding would admit it" in out.reason and any(k.startswith("scd(") for k in out.candidates)
        slow_own_prefill(pair.consumer.servicer.planner)  # the own prefill crawls: the transfer comes first
        answer = await pair.client.generate(timeout=120, transfer=exact, verify=consumer_pb2.VERIFY_POLICY_PROVISIONAL, **ask)
        a = answer.stats.auto
        verified = [c for c in a.candidates if c.how == "verified"]
        assert verified and all(c.mode == "scd" and c.within_budget for c in verified)
        assert not [c for c in a.candidates if c.mode in ("raw", "quant")]  # naive reuse: over the default budget
        chosen = next(c for c in a.candidates if c.chosen)
        assert chosen.how == "verified" and answer.stats.transfer.name == "scd"
        assert answer.stats.verify_decision.startswith("verified") and answer.ids == oracle
        answer = await pair.client.generate(timeout=120, transfer=exact, verify=consumer_pb2.VERIFY_POLICY_VERIFIED, **ask)
        a = answer.stats.auto
        chosen = next(c for c in a.candidates if c.chosen)
        assert chosen.how == "exact" and answer.ids == oracle
        assert all("verified tokens wait for the exact cache" in c.detail for c in a.candidates if c.how == "verified")


def test_a_link_paced_stream_is_watched_from_the_call_on():
    """A shaped link delivers in bursts: nothing for a while, then several layers at once. When
    auto's estimate says the link paces the stream, the watch measures from the call on with every
    gap counted, and abandons it at its second layer; the rule for a stream the producer's forward
    paces (from the first layer, its slowest gap left out) reads the same bursts as fast."""
    import time

    from consumer.auto.chooser import AutoChoice, Budget, Candidate, Scored
    from consumer.auto.planner import Estimate, Ewma, TransferPlanner, mode_key
    from consumer.engine.decoding import Sampling
    from consumer.request.job import LOCAL_PREFILL, GenerateJob, GenerateResult
    from consumer.request.transfer import Transfer, TransferTooSlow
    from shared.codecs.raw import RawCodec

    planner = TransferPlanner()
    planner.local.add(100, 10.0)  # own prefill: ~10 ms ...
    planner.local.add(300, 30.0)
    planner.bytes_per_token.setdefault(mode_key("raw", {}), Ewma()).add(100.0)  # ... a transfer: 4 layers of 2500 B
    model = load_model("tiny-llama", "float32", "cpu")
    transfer = Transfer(model, None, None, None, planner)  # type: ignore[arg-type]  # watch reads the planner only
    raw = Candidate("raw", {}, 0.0, "exact")

    def job(link_paced: bool) -> GenerateJob:
        scored = [Scored(raw, True, Estimate(5.0, "", link_paced=link_paced), chosen=True)]
        return GenerateJob(
            "r", list(range(100)), [1], RawCodec(model), {}, 1, Sampling(), frozenset(), time.monotonic() + 60,
            on_failure=LOCAL_PREFILL, auto=AutoChoice(Budget(0.0, True), raw, "", scored), candidate_key=mode_key("raw", {}),
        )  # fmt: skip

    def bursts(link_paced: bool) -> int:
        """Layers received before the watch gave up (4: kept): 0.3 s of nothing, 2 layers, 0.3 s, 2 layers."""
        opened = time.perf_counter()
        check = transfer.watch(job(link_paced), GenerateResult("r", "raw", {}, 100, 1), 100, opened)
        assert check is not None
        for layer in range(4):
            if layer in (0, 2):
                time.sleep(0.3)
            try:
                check(2500 * (layer + 1))
            except TransferTooSlow:
                return layer + 1
        return 4

    assert bursts(link_paced=True) == 2
    assert bursts(link_paced=False) == 4
