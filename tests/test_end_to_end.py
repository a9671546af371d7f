"""Greedy tokens through the real services equal the same model run locally, in raw and oracle
mode, for two architectures and two dtypes; raw works across different models (naive reuse).
The services and the local run use different kernels (the engine's batched, paged forward vs a
DynamicCache), so tokens are compared under tests/greedy.py's near-tie rule: identical up to a
first difference, allowed only where the local run's top-2 logits are a near tie."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from shared.models import load_model
from shared.pb import common_pb2
from tests.conftest import perturbed_model, prompt, running_pair
from tests.greedy import assert_greedy_agrees, near_tie_for

CONTEXT = "The producer reads a long context and the consumer writes the answer. " * 12
QUESTION = " Which layers are patched? alpha beta"
NEW = 24
pytestmark = pytest.mark.numeric  # tokens vs a reference computed by other kernels: also run under lowered ISAs


@torch.inference_mode()
def greedy_on(model, cache, q_ids: list[int], n: int, eos: int | None) -> tuple[list[int], list[float]]:
    """The question prefilled on `cache`, then greedy decode: the tokens and, per position, the
    gap between the top-2 logits (for tests/greedy.py's near-tie rule)."""
    logits = model(input_ids=torch.tensor([q_ids]), cache=cache, use_cache=True).logits[0, -1]
    out, margins = [], []
    for _ in range(n):
        top = torch.topk(logits.float(), 2).values
        margins.append(float(top[0] - top[1]))
        token = int(torch.argmax(logits))
        out.append(token)
        if token == eos:
            break
        logits = model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True).logits[0, -1]
    return out, margins


@torch.inference_mode()
def local_greedy(model, ctx_ids: list[int], q_ids: list[int], n: int, eos: int | None) -> tuple[list[int], list[float]]:
    """Context prefill, question prefilled on that cache, greedy decode, all in-process: the
    tokens and their top-2 margins."""
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([ctx_ids]), cache=cache, use_cache=True)
    return greedy_on(model, cache, q_ids, n, eos)


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-qwen2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_raw_and_oracle_match_local_model(arch: str, dtype: str):
    local = load_model(arch, dtype, "cpu")
    tok = local.tokenizer
    ctx_ids = tok(CONTEXT)["input_ids"]
    q_ids = tok(QUESTION, add_special_tokens=False)["input_ids"]
    expected, margins = local_greedy(local.model, ctx_ids, q_ids, NEW, tok.eos_token_id)
    async with running_pair(arch, dtype=dtype, producer_kw={"max_chunk_bytes": 1024}) as pair:
        for mode in ("raw", "oracle"):
            ids, text, stats = await pair.generate(
                context=prompt(CONTEXT), question=prompt(QUESTION), max_new_tokens=NEW,
                transfer=common_pb2.CodecSpec(name=mode),
            )
            assert_greedy_agrees(ids, expected, margins, near_tie_for(dtype), mode)
            assert text == tok.decode(ids, skip_special_tokens=True)
            assert stats.transfer.name == mode
            assert stats.context_tokens == len(ctx_ids) and stats.question_tokens == len(q_ids)
            assert stats.ttft_ms > 0
            if mode == "raw":
                # every K/V byte crossed, split over many 1 KiB chunks
                assert stats.bytes_received == stats.raw_kv_bytes == local.info.kv_bytes(len(ctx_ids))
            else:
                assert stats.bytes_received == 0
                # the context's own prefill rode in the question's engine task, timed apart from it
                assert stats.local_prefill_ms > 0 and stats.rebuild_ms == stats.local_prefill_ms
                assert stats.ttft_ms >= stats.local_prefill_ms + stats.question_prefill_ms
    if dtype == "float32":
        full = local.model.generate(torch.tensor([ctx_ids + q_ids]), max_new_tokens=NEW, do_sample=False)
        # one prefill of context + question: other shapes, other kernels than the two-step reference
        assert_greedy_agrees(full[0, len(ctx_ids) + len(q_ids):].tolist(), expected, margins, what="generate()")


async def test_raw_across_different_models_is_naive_reuse(tmp_path):
    """Producer tiny-llama feeding a consumer loaded (from_pretrained) with other weights of the
    same architecture: the consumer decodes on the producer's KV."""
    local_p = load_model("tiny-llama", "float32", "cpu")
    local_c = perturbed_model("tiny-llama", seed=1, scale=0.05, save_to=tmp_path)
    tok = local_c.tokenizer
    ctx_ids = tok(CONTEXT)["input_ids"]
    q_ids = tok(QUESTION, add_special_tokens=False)["input_ids"]
    cache = DynamicCache(config=local_p.model.config)
    with torch.inference_mode():
        local_p.model(input_ids=torch.tensor([ctx_ids]), cache=cache, use_cache=True)
    expected, margins = greedy_on(local_c.model, cache, q_ids, NEW, tok.eos_token_id)  # C decoding on P's K/V
    own, own_margins = local_greedy(local_c.model, ctx_ids, q_ids, NEW, tok.eos_token_id)
    async with running_pair("tiny-llama", consumer_model=str(tmp_path)) as pair:
        raw, _, _ = await pair.generate(context=prompt(CONTEXT), question=prompt(QUESTION), max_new_tokens=NEW,
                                        transfer=common_pb2.CodecSpec(name="raw"))
        oracle, _, _ = await pair.generate(context=prompt(CONTEXT), question=prompt(QUESTION), max_new_tokens=NEW,
                                           transfer=common_pb2.CodecSpec(name="oracle"))
    assert_greedy_agrees(raw, expected, margins, what="raw")
    assert_greedy_agrees(oracle, own, own_margins, what="oracle")
