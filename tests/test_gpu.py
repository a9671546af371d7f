"""Both services on CUDA against CPU float32 references (skipped where there is no GPU; run by
`make gpu-check`, bench.serving.gpu_check).

Rule (tests/greedy.py): the whole greedy sequence from the services equals the reference's up to
the first position where the reference's top-2 logits are within NEAR_TIE, and entirely when there
is no such position. References: raw and oracle, the model's own float32 prefill on CPU; quant, its
own CPU run (the context K/V through the same int8 codec on CPU); scd, with a distilled artifact
or a learned-predictor one trained on the GPU, the codec's encode/decode path on CPU with the
artifact as saved. The services run float32 on CUDA, so their kernels differ
from the reference's by rounding only."""

import pytest
import torch

from shared.models import load_model
from shared.pb import common_pb2
from tests.conftest import prompt, running_pair
from tests.greedy import agree_up_to_near_tie, context_cache, greedy_with_margins, scd_cache
from tests.test_end_to_end import CONTEXT, NEW, QUESTION

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
MIN_COMPARED = 4  # a reference that ties before this many tokens would make the check vacuous


def assert_agrees(got: list[int], ref: list[int], margins: list[float]) -> None:
    ok, compared = agree_up_to_near_tie(got, ref, margins)
    assert compared >= min(MIN_COMPARED, len(ref)), f"reference ties at position {compared}: {margins}"
    assert ok, f"{got} != {ref} within the first {compared} positions (margins {margins})"


async def serve_and_compare(mode: str, device: str, tmp_path, consumer_extra: dict | None = None) -> None:
    """One request of `mode` through both services on `device` (float32) against the CPU float32
    reference of that mode, under the rule. `consumer_extra`: more consumer settings."""
    cpu = load_model("tiny-llama", "float32", "cpu")
    tok = cpu.tokenizer
    ctx_ids = tok(CONTEXT)["input_ids"]
    q_ids = tok(QUESTION, add_special_tokens=False)["input_ids"]
    options, kw = {}, {}
    if mode == "scd":
        from calibration.distill import distill
        from tests.test_scd import heldout, random_corpus, states_of

        art = distill(cpu, cpu, random_corpus(8, 96, 0), heldout(2, 1), corpus_name="random", generations=1, log=lambda m: None)
        art.save(tmp_path / "a.safetensors")
        schedule = ".".join(["F64"] * cpu.info.num_layers)
        options, kw = {"schedule": schedule}, {"artifacts": str(tmp_path)}
        cache = scd_cache(cpu, cpu, art, schedule, ctx_ids, states_of)
    else:
        cache = context_cache(cpu, ctx_ids, 8 if mode == "quant" else None)
        options = {"bits": "8", "group_size": "32"} if mode == "quant" else {}
    ref, margins = greedy_with_margins(cpu, cache, q_ids, NEW)
    consumer_kw = {**kw, **(consumer_extra or {})}
    async with running_pair("tiny-llama", dtype="float32", device=device, producer_kw=kw, consumer_kw=consumer_kw) as pair:
        ids, _, stats = await pair.generate(
            context=prompt(CONTEXT),
            question=prompt(QUESTION),
            max_new_tokens=NEW,
            transfer=common_pb2.CodecSpec(name=mode, options=options),
        )
    assert stats.generated_tokens == len(ids)
    assert_agrees(ids, ref, margins)


@pytest.mark.parametrize("mode", ["raw", "oracle", "quant", "scd"])
async def test_modes_on_cuda_match_a_cpu_float32_reference(mode, tmp_path):
    await serve_and_compare(mode, "cuda", tmp_path)


@pytest.mark.parametrize("mode", ["raw", "oracle", "scd"])
async def test_the_engine_process_on_cuda_matches_a_cpu_float32_reference(mode, tmp_path):
    """--engine-process on CUDA: the KV pool reaches the engine process by CUDA IPC, the frontend's
    rebuilds are synchronized before the engine reads them."""
    await serve_and_compare(mode, "cuda", tmp_path, {"engine_process": True})


async def train_serve_and_compare(device: str, tmp_path) -> None:
    """A heterogeneous artifact with a learned predictor, trained on `device`, served by both
    services on `device`: the whole sequence against the codec path in-process on CPU (float32,
    the artifact as saved), under the rule."""
    from calibration.predictor_training import TrainConfig
    from shared.scd.artifact import Artifact
    from tests.test_predictor import hetero_artifact
    from tests.test_scd import states_of

    consumer_path, directory = tmp_path / "consumer", tmp_path / "artifacts"
    directory.mkdir()
    hetero_artifact(consumer_path, directory, device, TrainConfig(mse_steps=20, kl_steps=4, batch=2), ["R8.P.R8.R8"])
    producer, consumer = load_model("tiny-llama", "float32", "cpu"), load_model(str(consumer_path), "float32", "cpu")
    art = Artifact.load(directory / "tiny-hetero.safetensors")
    tok = consumer.tokenizer
    ctx_ids, q_ids = tok(CONTEXT)["input_ids"], tok(QUESTION, add_special_tokens=False)["input_ids"]
    ref, margins = greedy_with_margins(consumer, scd_cache(producer, consumer, art, "R8.P.R8.R8", ctx_ids, states_of), q_ids, 8)
    kw = {"artifacts": str(directory)}
    async with running_pair(
        "tiny-llama", consumer_model=str(consumer_path), device=device, producer_kw=kw, consumer_kw=kw
    ) as pair:
        ids, _, _ = await pair.generate(
            context=prompt(CONTEXT),
            question=prompt(QUESTION),
            max_new_tokens=8,
            transfer=common_pb2.CodecSpec(name="scd", options={"schedule": "R8.P.R8.R8"}),
        )
    assert_agrees(ids, ref, margins)


async def test_predictor_artifact_trains_and_serves_on_cuda(tmp_path):
    await train_serve_and_compare("cuda", tmp_path)


async def test_batched_prefill_with_the_copy_stream_matches_batch_one_on_cuda():
    """The producer's engine on CUDA: encodes on the side copy stream after each layer's event;
    a batched forward's float32 payloads equal batch-1 ones."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from producer.encode import EncodePool
    from producer.prefill import PrefillEngine
    from shared import codecs as codec_lib
    from tests.test_prefill_engine import collect, contexts, held, keep_payloads

    loaded = load_model("tiny-llama", "float32", "cuda")
    raw = codec_lib.create_codecs(loaded, ["raw"])["raw"]
    rows = contexts(64, 32, 96, seed=5)
    pool = EncodePool(2, loaded.device)
    assert pool.cuda
    with ThreadPoolExecutor(1) as compute:
        engine = PrefillEngine(loaded, compute, pool)
        solo = [await collect(engine.stream(ids, raw.encoder({}, codec_lib.EncodeRequest(0)), keep_payloads)) for ids in rows]
        with held(compute):
            tasks = [
                asyncio.ensure_future(collect(engine.stream(ids, raw.encoder({}, codec_lib.EncodeRequest(0)), keep_payloads)))
                for ids in rows
            ]
            await asyncio.sleep(0.05)
        batched = await asyncio.gather(*tasks)
    pool.shutdown()
    for (solo_layers, _), (layers, done) in zip(solo, batched):
        assert done.batch_size == 3
        for a, b in zip(solo_layers, layers):
            for name in a.packed:
                assert a.packed[name].device.type == "cpu"
                torch.testing.assert_close(a.packed[name], b.packed[name], atol=1e-4, rtol=1e-4)
