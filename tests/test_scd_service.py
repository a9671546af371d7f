"""The scd codec through the real services: full-rank exactness, budgets, and refusals."""

from __future__ import annotations

import grpc
import pytest

from calibration.distill import distill
from shared.models import load_model
from shared.pb import common_pb2, producer_pb2
from shared.scd.artifact import FORMAT_VERSION
from tests.conftest import prompt, running_pair
from tests.test_scd import heldout, random_corpus

CONTEXT = "Semantic cache distillation sends compact codes instead of the raw key value cache. " * 6


@pytest.fixture(scope="module")
def artifact_dir(tmp_path_factory):
    model = load_model("tiny-llama", "float32", "cpu")
    art = distill(model, model, random_corpus(12, 96, 0), heldout(3, 1), corpus_name="random", generations=2,
                  log=lambda m: None)
    path = tmp_path_factory.mktemp("artifacts")
    art.save(path / "tiny-llama-homogeneous.safetensors")
    return path, art


async def test_full_rank_scd_gives_raw_tokens_and_budgets_choose_schedules(artifact_dir):
    path, art = artifact_dir
    full = ".".join(["F64"] * 4)
    async with running_pair("tiny-llama", producer_kw={"artifacts": str(path)}, consumer_kw={"artifacts": str(path)}) as pair:
        fields = dict(context=prompt(CONTEXT), question=prompt(" which layers?"), max_new_tokens=16)
        raw, _, raw_stats = await pair.generate(transfer=common_pb2.CodecSpec(name="raw"), **fields)
        ids, _, stats = await pair.generate(transfer=common_pb2.CodecSpec(name="scd", options={"schedule": full}), **fields)
        assert ids == raw
        assert stats.transfer.options["schedule"] == full
        assert stats.bytes_received == raw_stats.bytes_received // 2  # fp16 codes at full rank vs fp32 K/V
        cheapest = art.schedules[0]
        ids, _, stats = await pair.generate(
            transfer=common_pb2.CodecSpec(name="scd", options={"max_bytes_per_token": str(cheapest.bytes_per_token)}), **fields)
        assert stats.transfer.options["schedule"] == cheapest.schedule
        assert stats.bytes_received == pytest.approx(cheapest.bytes_per_token * stats.context_tokens, rel=0.01)
        best = min(art.schedules, key=lambda e: e.loss)
        _, _, stats = await pair.generate(
            transfer=common_pb2.CodecSpec(name="scd", options={"max_loss": str(best.loss)}), **fields)
        assert float(stats.transfer.options["calibrated_loss"]) <= best.loss * (1 + 1e-5)
        from shared.pb import consumer_pb2, producer_pb2

        for reply in (await pair.stub.Describe(consumer_pb2.ConsumerServiceDescribeRequest()),
                      await pair.producer_stub.Describe(producer_pb2.ProducerServiceDescribeRequest())):
            (listed,) = reply.artifacts
            assert listed.artifact_id == art.artifact_id and listed.format_version == FORMAT_VERSION
            assert [(s.name, s.schedule, s.bytes_per_token) for s in listed.schedules] == \
                [(e.name, e.schedule, e.bytes_per_token) for e in art.schedules]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pair.generate(transfer=common_pb2.CodecSpec(name="scd", options={"max_loss": "-1"}), **fields)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_loss" in err.value.details()


@pytest.mark.parametrize("schedule, named", [
    ("R0.R8.R8.R8", "layer 0 action R0 has rank 0, must be in 1.."),
    ("R1000000000.R8.R8.R8", "rank 1000000000, must be in 1.."),
    ("R8.R8", "schedule: 2 actions for 4 layers"),
])
async def test_bad_ranks_are_invalid_argument_before_any_transfer(artifact_dir, schedule, named):
    path, _ = artifact_dir
    async with running_pair("tiny-llama", producer_kw={"artifacts": str(path)}, consumer_kw={"artifacts": str(path)}) as pair:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pair.generate(context=prompt(CONTEXT), question=prompt(" q"), max_new_tokens=2,
                                transfer=common_pb2.CodecSpec(name="scd", options={"schedule": schedule}))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and named in err.value.details()
        stats = (await pair.producer_stub.Describe(producer_pb2.ProducerServiceDescribeRequest())).stats
        assert stats.prefills_started == 0  # refused by the consumer itself


async def test_artifact_for_other_consumer_weights_is_refused(artifact_dir, tmp_path):
    path, _ = artifact_dir
    other = load_model("tiny-llama", "float32", "cpu")
    for p in other.model.parameters():
        p.data.mul_(1.01)
    other.model.save_pretrained(tmp_path)
    other.tokenizer.save_pretrained(tmp_path)
    async with running_pair("tiny-llama", consumer_model=str(tmp_path), producer_kw={"artifacts": str(path)},
                            consumer_kw={"artifacts": str(path)}) as pair:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pair.generate(context=prompt(CONTEXT), question=prompt(" q"), transfer=common_pb2.CodecSpec(name="scd"))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "no SCD artifact for producer digest" in err.value.details()
        # naming the artifact explicitly gets past the producer; the digests still must match
        art_id = next(iter(pair.consumer.servicer.codecs["scd"].artifacts)).artifact_id
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pair.generate(context=prompt(CONTEXT), question=prompt(" q"),
                                transfer=common_pb2.CodecSpec(name="scd", options={"artifact": art_id}))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "consumer weight digest" in err.value.details()


async def test_default_mode_is_scd_for_a_calibrated_pair_and_budgets_are_constraints(artifact_dir):
    """Issue 19: with the default mode set to scd, no mode -> the artifact's default schedule; a schedule named with a budget it
    misses is INVALID_ARGUMENT naming both; an unknown artifact option is INVALID_ARGUMENT; Describe
    gives each artifact's file name."""
    from shared.pb import consumer_pb2

    path, art = artifact_dir
    consumer_kw = {"artifacts": str(path), "default_mode": "scd"}
    async with running_pair("tiny-llama", producer_kw={"artifacts": str(path)}, consumer_kw=consumer_kw) as pair:
        described = await pair.stub.Describe(consumer_pb2.ConsumerServiceDescribeRequest())
        assert described.default_mode == "scd" and described.artifacts[0].file_name == "tiny-llama-homogeneous.safetensors"
        fields = dict(context=prompt(CONTEXT), question=prompt(" q"), max_new_tokens=2)
        _, _, stats = await pair.generate(**fields)
        best = min(art.schedules, key=lambda e: e.loss)
        assert stats.transfer.name == "scd" and stats.transfer.options["schedule"] == best.schedule
        worst = max(art.schedules, key=lambda e: e.loss)
        cheap = min(art.schedules, key=lambda e: e.bytes_per_token)
        for options, named in (
            ({"schedule": worst.name, "max_loss": str(worst.loss / 2)}, "max_loss"),
            ({"schedule": best.schedule, "max_bytes_per_token": str(cheap.bytes_per_token / 2)}, "max_bytes_per_token"),
            ({"artifact": "0123456789abcdef"}, "is not loaded here"),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await pair.generate(transfer=common_pb2.CodecSpec(name="scd", options=options), **fields)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, options
            assert named in err.value.details() and (named == "is not loaded here" or "schedule" in err.value.details())
        options = {"schedule": best.name, "max_loss": f"{best.loss * 1.01 + 1e-9:.9g}"}
        _, _, stats = await pair.generate(transfer=common_pb2.CodecSpec(name="scd", options=options), **fields)
        assert stats.transfer.options["max_loss"] == options["max_loss"]  # the stats echo the budget that was enforced


async def test_concurrent_requests_rebuild_their_layers_in_one_call_and_answer_as_alone(artifact_dir):
    """Requests whose Reuse / Patch layers reach the consumer's engine together are rebuilt in one
    decode (the pipeline's rebuild counters say so), and each answers exactly as it does alone."""
    import asyncio
    import threading

    path, art = artifact_dir
    schedule = "R8.P.F4.R16"
    consumer_kw = {"artifacts": str(path), "prefix_cache_bytes": 0}  # every request transferred and rebuilt
    async with running_pair("tiny-llama", producer_kw={"artifacts": str(path)}, consumer_kw=consumer_kw) as pair:
        questions = [" which layers?", " what is sent?", " how compact?", " why codes?"]
        spec = common_pb2.CodecSpec(name="scd", options={"schedule": schedule})

        def ask(q):
            return pair.generate(context=prompt(CONTEXT + q), question=prompt(q), max_new_tokens=6, transfer=spec)

        alone = [(await ask(q))[0] for q in questions]
        engine = pair.consumer.servicer.batch
        pipeline = pair.consumer.servicer.pipeline
        assert pipeline.batched_layers == 0 and pipeline.rebuilt_layers == 4 * len(questions)  # one at a time
        gate = threading.Event()
        held = engine.submit(gate.wait, 30)  # the engine waits while every request's first layer queues
        answers = asyncio.gather(*(ask(q) for q in questions))
        # wait (up to 60 s: a loaded 2-core machine took more than 6 s) until every request's first
        # layer is queued; the batching assertion below means nothing if the gate opens before that
        queued, queue = 0, []
        for _ in range(6000):
            queue = list(engine.jobs)
            queued = len({id(job.item.decoder) for job in queue if job.many is not None})
            if queued >= len(questions):  # later layers may queue within one poll
                break
            await asyncio.sleep(0.01)
        gate.set()
        assert queued >= len(questions), f"only {queued} of {len(questions)} requests' first layers queued before the gate opened"
        await asyncio.wrap_future(held)
        together = [ids for ids, _, _ in await answers]
        assert together == alone
        # the engine runs a contiguous run of queued rebuilds as one call (a plain job between two splits
        # it): each run's first wave holds one layer of each of its requests, decoded together
        runs, run = [], set()
        for job in queue:
            if job.many is None:
                runs.append(run)
                run = set()
            else:
                run.add(id(job.item.decoder))
        runs.append(run)
        shape = "".join("g" if job.many is not None else "." for job in queue)
        together_at_least = sum(len(r) for r in runs if len(r) > 1)
        assert together_at_least >= 2, f"no two requests' layers queued side by side: {shape}"
        assert pipeline.batched_layers >= together_at_least, (pipeline.batched_layers, shape)
        assert pipeline.rebuilt_layers == 8 * len(questions)
