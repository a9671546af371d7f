"""The same exactness checks with both services on CUDA (skipped where there is no GPU; run by
`make gpu-check`, bench.gpu_check)."""

import pytest
import torch

from shared.models import load_model
from shared.pb import common_pb2
from tests.conftest import prompt, running_pair
from tests.test_end_to_end import CONTEXT, NEW, QUESTION, local_greedy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("mode", ["raw", "oracle", "quant", "scd"])
async def test_modes_on_cuda_match_local_model(mode, tmp_path):
    local = load_model("tiny-llama", "bfloat16", "cuda")
    tok = local.tokenizer
    ctx_ids = tok(CONTEXT)["input_ids"]
    q_ids = tok(QUESTION, add_special_tokens=False)["input_ids"]
    cpu_ref = load_model("tiny-llama", "bfloat16", "cpu")
    expected = local_greedy(cpu_ref.model, ctx_ids, q_ids, NEW, tok.eos_token_id)
    options, kw = {}, {}
    if mode == "scd":
        from calibration.distill import distill
        from tests.test_scd import heldout, random_corpus

        art = distill(local, local, random_corpus(8, 96, 0), heldout(2, 1), corpus_name="random", generations=1,
                      log=lambda m: None)
        art.save(tmp_path / "a.safetensors")
        options, kw = {"schedule": ".".join(["F64"] * 4)}, {"artifacts": str(tmp_path)}
    async with running_pair("tiny-llama", dtype="bfloat16", device="cuda", producer_kw=kw, consumer_kw=kw) as pair:
        ids, _, stats = await pair.generate(context=prompt(CONTEXT), question=prompt(QUESTION), max_new_tokens=NEW,
                                            transfer=common_pb2.CodecSpec(name=mode, options=options))
    assert stats.generated_tokens == len(ids) >= 1
    if mode in ("raw", "oracle", "scd"):  # CUDA kernels round differently from CPU ones: first tokens only
        assert ids[:2] == expected[:2]


async def test_predictor_artifact_trains_and_serves_on_cuda(tmp_path):
    """A heterogeneous artifact with a learned predictor, trained on CUDA, served by both services
    on CUDA: the tokens equal the in-process codec path on the same device."""
    from calibration.predictor_training import TrainConfig
    from tests.test_predictor import codec_reference, hetero_artifact

    consumer_path, directory = tmp_path / "consumer", tmp_path / "artifacts"
    directory.mkdir()
    producer, consumer, art = hetero_artifact(consumer_path, directory, "cuda",
                                              TrainConfig(mse_steps=20, kl_steps=4, batch=2), ["R8.P.R8.R8"])
    tok = consumer.tokenizer
    ctx_ids, q_ids = tok(CONTEXT)["input_ids"], tok(QUESTION, add_special_tokens=False)["input_ids"]
    expected = codec_reference(producer, consumer, art, "R8.P.R8.R8", ctx_ids, q_ids, 8)
    kw = {"artifacts": str(directory)}
    async with running_pair("tiny-llama", consumer_model=str(consumer_path), device="cuda", producer_kw=kw,
                            consumer_kw=kw) as pair:
        ids, _, _ = await pair.generate(context=prompt(CONTEXT), question=prompt(QUESTION), max_new_tokens=8,
                                        transfer=common_pb2.CodecSpec(name="scd", options={"schedule": "R8.P.R8.R8"}))
    assert ids[:2] == expected[:2]


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
            tasks = [asyncio.ensure_future(collect(engine.stream(ids, raw.encoder({}, codec_lib.EncodeRequest(0)), keep_payloads)))
                     for ids in rows]
            await asyncio.sleep(0.05)
        batched = await asyncio.gather(*tasks)
    pool.shutdown()
    for (solo_layers, _), (layers, done) in zip(solo, batched):
        assert done.batch_size == 3
        for a, b in zip(solo_layers, layers):
            for name in a.packed:
                assert a.packed[name].device.type == "cpu"
                torch.testing.assert_close(a.packed[name], b.packed[name], atol=1e-4, rtol=1e-4)
