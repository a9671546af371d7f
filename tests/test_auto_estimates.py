"""Mode auto's estimates learn (issue 31): one key per candidate, costs fitted as a fixed term plus
a per-token term over requests of different lengths, a confidence the choice uses, and user
requests that are probes at most 1 in 20. Driven without servers: the planner and the chooser of
the shipped heterogeneous pair, fed what a synthetic producer, link and consumer would measure."""

from __future__ import annotations

from pathlib import Path

import pytest

from consumer.api.client import prompt
from consumer.auto.chooser import Chooser
from consumer.auto.planner import Fit, Observation, TransferPlanner, mode_key, pipelined
from consumer.auto.producer_memory import ProducerMemory
from shared import codecs as codec_lib
from shared.models import load_model
from shared.pb import common_pb2
from shared.scd.artifact import discover
from tests.conftest import running_pair

ROOT = Path(__file__).resolve().parents[1]
ARTIFACT = ROOT / "artifacts" / "qa-base-to-tuned.safetensors"
LAYERS = 2
RTT_MS = 5.0
BYTES_PER_TOKEN = {"s5": 70.0, "s6": 134.0}


def producer_ms(T: int) -> float:
    return 15.0 + 0.2 * T


def encode_ms(T: int) -> float:
    return 2.0 + 0.01 * T


def rebuild_ms(T: int) -> float:
    return 3.0 + 0.02 * T


def local_ms(T: int) -> float:
    return 10.0 + 0.3 * T


LINK_B_PER_MS = 2000.0


def remote_truth(schedule: str, T: int) -> float:
    wire = BYTES_PER_TOKEN[schedule] * T / LINK_B_PER_MS
    return RTT_MS + pipelined([max(producer_ms(T), encode_ms(T)), wire, rebuild_ms(T)], LAYERS)


def transfer(options: dict, schedule: str, T: int, hit: bool = False) -> Observation:
    """What a transfer of T tokens measures: cold, its span paced by the producer's forward; a
    store hit (the same context again), the link's own rate."""
    nbytes = int(BYTES_PER_TOKEN[schedule] * T)
    return Observation(
        "scd",
        options,
        T,
        nbytes,
        rebuild_ms(T),
        sent_tokens=T,
        producer_prefill_ms=0.0 if hit else producer_ms(T),
        producer_encode_ms=0.0 if hit else encode_ms(T),
        producer_store_hit=hit,
        computed_tokens=0 if hit else T,
        queue_ms=0.0,
        header_ms=RTT_MS,
        span_ms=nbytes / LINK_B_PER_MS if hit else max(producer_ms(T), nbytes / LINK_B_PER_MS),
        span_bytes=nbytes,
    )


def own_prefill(T: int) -> Observation:
    return Observation("oracle", {}, T, 0, local_ms(T), local_tokens=T)


@pytest.fixture(scope="module")
def pair():
    loaded = load_model(str(ROOT / "checkpoints" / "qa-tuned"), "float32", "cpu")
    arts = discover([ARTIFACT])
    return loaded, codec_lib.create_codecs(loaded, artifacts=arts), arts[0]


def chooser_of(pair) -> Chooser:
    loaded, codecs, art = pair
    producer = art.meta["producer"]["weight_digest"]
    return Chooser(loaded, codecs, TransferPlanner(), ProducerMemory(), lambda c, ids, tenant="": 0,
                   lambda: producer, lambda: True, lambda: "float32")


def schedule_of(options) -> str:
    return {"R2.R64": "s5", "R2.R128": "s6", "s5": "s5", "s6": "s6", "": "s5"}[options.get("schedule", "")]


def test_named_and_no_mode_requests_teach_one_estimate_that_converges(pair):
    """The issue's item 1: one request on a 3-token context (auto's cold start measures scd), then
    named `scd` requests alternating with no-mode ones on 511 tokens. The estimate of the schedule
    the named requests use converges to what it costs, the cold-start schedule's is not a rate
    stretched from 3 tokens, and both are kept under one key each."""
    chooser = chooser_of(pair)
    planner, codecs = chooser.planner, pair[1]
    budget = chooser.budget({})
    first = chooser.choose(list(range(3)), budget)
    assert first.reason.startswith("cold start") and first.chosen.mode == "scd"
    planner.observe(transfer(dict(first.chosen.options), schedule_of(first.chosen.options), 3))
    named = codecs["scd"].resolve({})  # what a request naming scd with no options sends
    ctx = list(range(511))
    for i in range(8):
        planner.observe(transfer(named, "s5", 511, hit=i > 0))  # the same context again: replayed from the store
        choice = chooser.choose(ctx, budget)
        c = choice.chosen
        planner.observe(own_prefill(511) if c.mode == "oracle" else transfer(dict(c.options), schedule_of(c.options), 511))
    scored = {s.key: s for s in chooser.choose(ctx, budget).scored if s.within}
    art = pair[2].artifact_id
    s5, s6 = scored[f"scd(artifact={art},schedule=s5)"], scored[f"scd(artifact={art},schedule=s6)"]
    assert s5.estimate.confident and s5.estimate.ms == pytest.approx(remote_truth("s5", 511), rel=0.25), s5.estimate.detail
    assert s6.estimate.ms == pytest.approx(remote_truth("s6", 511), rel=1.0), s6.estimate.detail  # within 2x, not 17x
    assert chooser.key("scd", named) == s5.key  # the named default and auto's candidate: one key
    # the tables hold candidate keys only: a request carries its key (GenerateJob.candidate_key), no plain label is kept
    assert set(planner.bytes_per_token) <= set(scored) and mode_key("scd", named) not in planner.bytes_per_token
    assert not [k for k in planner.encode if "=," in k or k.endswith("=)") or k == "scd"]  # no empty-option keys
    snapshot = planner.snapshot()
    assert snapshot["producer_prefill.samples"] >= 9 and snapshot["producer_prefill.fixed_ms"] == pytest.approx(15.0, rel=0.05)
    assert snapshot["producer_prefill.ms_per_token"] == pytest.approx(0.2, rel=0.05)
    assert snapshot["link_lower_bound"] == 0.0 and snapshot["link_mbit_s"] == pytest.approx(LINK_B_PER_MS * 8e-3, rel=0.01)
    assert "producer_queue.age_s" in snapshot


def test_a_fit_needs_lengths_apart_to_split_fixed_and_per_token_costs():
    fit = Fit()
    for T in (3, 3, 3):
        fit.add(T, local_ms(T))
    near, far = fit.predict(5), fit.predict(511)
    assert near is not None and near.confident and near.ms == pytest.approx(local_ms(5), rel=0.5)
    assert far is not None and not far.confident and "3 tokens only" in far.why  # not a rate stretched silently
    for T in (64, 512, 100, 300):
        fit.add(T, local_ms(T))
    fixed, per_token, separated = fit.coefficients()  # type: ignore[misc]
    assert separated and fixed == pytest.approx(10.0, rel=0.05) and per_token == pytest.approx(0.3, rel=0.05)
    assert fit.predict(2048).confident is False and fit.predict(1000).confident  # within 2x of the longest measured


def test_a_user_request_is_a_probe_at_most_once_in_twenty(pair):
    """The own prefill wins and the link estimate goes stale: a user request is sent to measure it
    at most once in 20 choices, and its reason says so."""
    chooser = chooser_of(pair)
    planner = chooser.planner
    ctx = list(range(511))
    budget = chooser.budget({})
    for T in (64, 511):  # everything measured at both lengths
        planner.observe(transfer({**pair[1]["scd"].resolve({})}, "s5", T))
        planner.observe(transfer({**pair[1]["scd"].resolve({"schedule": "s6"})}, "s6", T))
        planner.observe(own_prefill(T))
    planner.link_bytes_per_ms.value = 1.0  # the link crawls: the own prefill wins
    planner.link_sampled_at -= 600  # measured ten minutes ago
    choices = [chooser.choose(ctx, budget) for _ in range(60)]
    at = [i for i, c in enumerate(choices) if c.reason.startswith("probe")]
    assert 1 <= len(at) <= 3, [c.reason[:60] for c in choices]
    assert all("at most 1 in 20" in choices[i].reason and choices[i].chosen.mode == "scd" for i in at)
    assert all(b - a >= 20 for a, b in zip(at, at[1:]))
    assert {c.chosen.mode for i, c in enumerate(choices) if i not in at} == {"oracle"}


def spiked(T: int, i: int, rng) -> float:
    """What a busy machine measures for the own prefill of T tokens: within 10% of local_ms, and
    every 4th request slowed 2-5x by something else (one-sided, proportional)."""
    ms = local_ms(T) * rng.uniform(0.9, 1.1)
    return ms * rng.uniform(2.0, 5.0) if i % 4 == 3 else ms


def test_load_spikes_and_mixed_lengths_move_the_estimates_little():
    """The mixed workload's lesson (issue 31's target: after 10 requests the median error of an
    estimate <= 25%): lengths 16-2048 in random order on a machine where one request in four is
    slowed 2-5x. The fit (least absolute relative error) stays within 15% of the cost at every
    length, the 2048-token spikes do not inflate the 16-token estimate, and the overhead learned
    per kind (a median) ignores a spike and an uncertain estimate's miss."""
    import random

    rng = random.Random(0)
    planner = TransferPlanner()
    for i in range(30):
        T = int(16 * 128 ** rng.random())
        planner.observe(Observation("oracle", {}, T, 0, spiked(T, i, rng), local_tokens=T))
    for T in (16, 64, 256, 1024, 2048):
        e = planner.estimate_local(T)
        assert e.confident and e.ms == pytest.approx(local_ms(T), rel=0.15), (T, e.detail)

    for miss in (3.0, 4.0, 2.0, 60.0, 3.5):  # one request 60 ms late (within 2x of its estimate)
        planner.observe_overhead(False, 100.0 + miss, 100.0)
    assert planner.overhead_ms["local"].value == pytest.approx(3.5)
    extrapolated = TransferPlanner()
    extrapolated.observe(own_prefill(100))
    far = extrapolated.estimate_local(2000)  # measured at 100 tokens only: its miss is the fit's
    assert not far.confident and far.base_ms is None
    near = extrapolated.estimate_local(100)
    assert near.confident and near.base_ms == pytest.approx(local_ms(100))


async def test_a_requests_context_is_packed_once_for_every_chain(monkeypatch):
    """Each service hashes a request's chains from one packing of its context ids: on the consumer
    the prefix keys and the producer memory share one Chains (auto asks chains under several roots
    of both); on the producer the flight key, the prefix flights and the store's plan share one."""
    import traceback

    from shared import chunks

    async with running_pair("tiny-llama", consumer_kw={"prefix_cache_bytes": 0}) as pair:
        assert pair.consumer.servicer.memory.chains is pair.consumer.servicer.pipeline.keys.chains
        tok = pair.consumer.servicer.loaded.tokenizer
        context = "Pack me once. " * 40
        n = len(tok(context)["input_ids"])
        packed: dict[str, int] = {"consumer": 0, "producer": 0}
        real = chunks._token_bytes

        def spy(ids):
            if len(ids) == n:
                side = "consumer" if any("/consumer/" in f.filename for f in traceback.extract_stack()) else "producer"
                packed[side] += 1
            return real(ids)

        monkeypatch.setattr(chunks, "_token_bytes", spy)
        _, _, stats = await pair.generate(context=prompt(context), question=prompt(" Why?"), max_new_tokens=2)
        assert stats.auto.reason.startswith("cold start") and stats.bytes_received > 0  # auto, to the producer
        named = common_pb2.CodecSpec(name="raw")
        await pair.generate(context=prompt(context), question=prompt(" Why?"), max_new_tokens=2, transfer=named)
        assert packed == {"consumer": 2, "producer": 2}  # once per request and side (a fresh id list each time)


def test_estimates_by_candidate_key_stay_bounded_whatever_options_callers_send():
    """Each distinct option set (a caller's keep value, say) is a key of its own; the planner keeps
    the ESTIMATE_KEYS most recently learned, so its memory and Describe's estimates stay bounded
    (before, 6000 keep values made Describe larger than a client's 4 MiB message limit)."""
    from consumer.auto.planner import ESTIMATE_KEYS

    planner = TransferPlanner()
    for i in range(3 * ESTIMATE_KEYS):
        options = {"keep": f"h2o:{i + 1}"}
        planner.observe(Observation("raw", options, 512, 512 * 100, 5.0, sent_tokens=512, computed_tokens=512,
                                    producer_prefill_ms=3.0, producer_encode_ms=1.0))  # fmt: skip
    for table in (planner.encode, planner.rebuild, planner.bytes_per_token):
        assert len(table) == ESTIMATE_KEYS
        assert planner.key("raw", {"keep": f"h2o:{3 * ESTIMATE_KEYS}"}) in table  # the latest kept
        assert planner.key("raw", {"keep": "h2o:1"}) not in table  # the oldest dropped
    assert len(planner.snapshot()) < 12 * ESTIMATE_KEYS
