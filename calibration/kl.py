"""The one loss every offline tool measures: teacher-forced KL(C with its own cache || C with a
reconstructed cache) over scored continuation tokens (answers to questions about the context).

Schedule search, predictor training (with gradients), recompute-span profiling and the tests all
call these, so "loss" means the same number everywhere. No grad mode is forced: callers choose.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache

from shared import kv
from shared.models import LoadedModel


def layer_cache(consumer: LoadedModel, layer_kv: Sequence[tuple[torch.Tensor, torch.Tensor]], batch: int = 1) -> DynamicCache:
    """A cache holding layer_kv ([n_kv, T, hd] each, post-RoPE) for `batch` continuations of one context."""
    cache = kv.empty_cache(consumer)
    for i, (k, v) in enumerate(layer_kv):
        cache.update(k[None].expand(batch, -1, -1, -1), v[None].expand(batch, -1, -1, -1), i)
    return cache


def scored_logprobs(
    consumer: LoadedModel,
    layer_kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
    continuations: Sequence[tuple[Sequence[int], int]],
    logical_length: int | None = None,
) -> list[torch.Tensor]:
    """Log-probs C assigns to each continuation's scored tokens on top of the context in layer_kv.

    continuations: (ids, start) with ids[start:] scored (start >= 1: the token before the first
    scored one predicts it). Returns one float32 [len(ids) - start, vocab] per continuation, in
    order; continuations of one length run as one batch. logical_length: the context's length
    when layer_kv holds only some of its tokens (a kept cache, shared.keep: the continuations
    run at the positions after the whole context)."""
    out: dict[int, torch.Tensor] = {}
    stored = int(layer_kv[0][0].shape[1])
    for length in sorted({len(ids) for ids, _ in continuations}):
        group = [i for i, (ids, _) in enumerate(continuations) if len(ids) == length]
        ids = torch.tensor([list(continuations[i][0]) for i in group], device=consumer.device)  # [b, n]
        extra = {}
        if logical_length is not None and logical_length != stored:  # positions continue after the whole context
            extra["position_ids"] = torch.arange(logical_length, logical_length + length, device=consumer.device)[None]
        cache = layer_cache(consumer, layer_kv, len(group))
        logits = consumer.model(input_ids=ids, cache=cache, use_cache=True, **extra).logits
        logp = torch.log_softmax(logits.float(), -1)  # [b, n, vocab]
        for row, i in enumerate(group):
            start = continuations[i][1]
            out[i] = logp[row, max(start - 1, 0) : length - 1]  # the positions that predict ids[start:]
    return [out[i] for i in range(len(continuations))]


def kl_sum(ref: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """Sum over positions of KL(ref || logp), both [N, vocab] log-probs."""
    return (ref.exp() * (ref - logp)).sum()
