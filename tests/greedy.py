"""Greedy references for comparing token sequences across devices, and the rule they are
compared under.

Rule (`agree_up_to_near_tie`): a sequence matches a float32 reference when it is identical to the
reference's greedy tokens up to the first position where the reference's top-2 logits are within
NEAR_TIE of each other (there a kernel's rounding may legitimately pick the other token, and every
later position follows from that pick); with no such position, the whole sequence, stop token
included, must be identical. `agree_until_a_near_tie_divergence` is the stricter form for a
reference on the same device (the services against the same model run in-process): identical up
to the first position where the two differ, which must be a near tie of the reference (for
bfloat16, NEAR_TIE_BF16). The reference caches are built in-process: the context prefilled
as it is, through the quant codec, or through the SCD codec's encode/decode path.
"""

from __future__ import annotations

import torch

from shared import kv, layers, quantize
from shared.scd import ops
from shared.scd.schedule import Schedule

NEAR_TIE = 1e-3  # logit units; float32 CUDA and CPU kernels differ by ~1e-5 on the tiny models
# bfloat16 logits keep 8 significant bits: the tiny models' top logits are ~1.7-3.6, where one ulp
# is 2**-7 or 2**-6 (~0.016), so margins come in such steps and an exact tie (margin 0) is common. Two CPUs'
# kernels (AVX-512 vs AVX2 ATen reductions, oneDNN's bf16 GEMM vs its AVX2 path) move those logits
# by 1-2 ulps after the 4 bf16 layers (measured: ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
# changes tiny-qwen2's margins by up to 0.016 and flips a 0.016-margin token); 4 ulps of slack.
NEAR_TIE_BF16 = 0.0625


def near_tie_for(dtype: str) -> float:
    """The near-tie bound for greedy logits computed in `dtype` ("float32" or "bfloat16")."""
    return NEAR_TIE_BF16 if dtype == "bfloat16" else NEAR_TIE


@torch.inference_mode()
def context_cache(loaded, ctx_ids: list[int], bits: int | None = None, group_size: int = 32):
    """The model's own cache of the context; with `bits`, its K/V through the quant codec."""
    cache = kv.empty_cache(loaded)
    states = {}
    with kv.layer_capture(loaded, cache, kv.Capture.KV, lambda s: states.__setitem__(s.index, s)):
        kv.prefill_context(loaded, torch.tensor([ctx_ids], device=loaded.device), cache)
    if bits is None:
        return cache
    rebuilt = kv.empty_cache(loaded)
    for i, s in sorted(states.items()):
        keys, values = quantize.decode_kv(quantize.encode_kv(s.keys, s.values, bits, group_size), bits, group_size,
                                          tuple(s.keys.shape))
        kv.put_layer(rebuilt, i, keys.to(loaded.dtype), values.to(loaded.dtype))
    return rebuilt


@torch.inference_mode()
def scd_cache(producer, consumer, art, schedule: str, ctx_ids: list[int], states_of):
    """The consumer's cache rebuilt by the SCD codec path in-process from the producer's states."""
    actions = Schedule.parse(schedule, art.num_layers).actions
    states = states_of(producer, ctx_ids)
    cache = kv.empty_cache(consumer)
    pos = layers.positions(consumer, len(ctx_ids))
    for layer, action in enumerate(actions):
        payloads = {k: v.contiguous() for k, v in ops.encode_layer(art, layer, action, states[layer]).items()}
        kv.put_layer(cache, layer, *ops.decode_layer(art, layer, action, payloads, consumer, pos))
    return cache


@torch.inference_mode()
def greedy_with_margins(loaded, cache, q_ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """The question prefilled on `cache`, then greedy decoding (stops at EOS as the services do):
    the tokens and, per position, the gap between the top-2 logits (float32)."""
    device, eos = loaded.device, loaded.tokenizer.eos_token_id
    logits = loaded.model(input_ids=torch.tensor([q_ids], device=device), cache=cache, use_cache=True).logits[0, -1]
    ids, margins = [], []
    for _ in range(n):
        top = torch.topk(logits.float(), 2).values
        margins.append(float(top[0] - top[1]))
        ids.append(int(torch.argmax(logits)))
        if ids[-1] == eos:
            break
        logits = loaded.model(input_ids=torch.tensor([[ids[-1]]], device=device), cache=cache, use_cache=True).logits[0, -1]
    return ids, margins


def agree_up_to_near_tie(got: list[int], ref: list[int], margins: list[float], near_tie: float = NEAR_TIE) -> tuple[bool, int]:
    """(whether `got` matches `ref` under the rule above, the number of positions compared)."""
    tie = next((i for i, m in enumerate(margins) if m < near_tie), None)
    if tie is None:
        return got == ref, len(ref)
    return got[:tie] == ref[:tie], tie


def agree_until_a_near_tie_divergence(got: list[int], ref: list[int], margins: list[float],
                                      near_tie: float = NEAR_TIE) -> tuple[bool, int]:
    """(whether `got` is `ref`, or equals it up to a first difference at a position where the
    reference's top-2 margin is below `near_tie`; the number of positions that agree). Later
    positions are not compared: they follow from a different token."""
    diverged = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None)
    if diverged is None:
        return len(got) == len(ref), min(len(got), len(ref))  # one stopping early is no near tie
    return margins[diverged] < near_tie, diverged


def assert_greedy_agrees(got: list[int], ref: list[int], margins: list[float], near_tie: float = NEAR_TIE,
                         what: str = "") -> None:
    """agree_until_a_near_tie_divergence, failing with both sequences and the margin where they split."""
    ok, agreed = agree_until_a_near_tie_divergence(got, ref, margins, near_tie)
    at = f"; first difference at {agreed}, reference margin {margins[agreed]:.4g}" if agreed < len(margins) else ""
    assert ok, f"{what}: got {got}, reference {ref} (near tie < {near_tie}){at}"
