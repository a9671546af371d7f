"""The kept cache: a transformers DynamicCache holding only the kept tokens of a context, each
with the K/V it had at its original position (keys keep their own RoPE), plus the context's
logical length, so tokens read on top of it continue at the original positions.

transformers 5.24 builds the attention mask from the cache's stored length (Cache.get_query_offset
and get_mask_sizes: every stored token is before the new ones) and RoPE from `position_ids`; so a
forward on a kept cache passes `position_ids=next_positions(cache, n)`, and every stored token
is visible, as it must be. On a plain DynamicCache next_positions gives what transformers derives
itself (stored length onwards): callers pass it for every cache. Every layer stores the same
number of tokens (transformers masks all layers by layer 0's length). Knows nothing about
policies or codecs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache

from shared import kv
from shared.models import LoadedModel


class KeptCache(DynamicCache):
    """`dropped` tokens of the context are not stored; positions continue at the logical length."""

    dropped: int = 0
    logical_length: int = 0


def next_positions(cache: DynamicCache | None, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """position_ids [1, n] for n tokens read on top of `cache`: its logical length onwards."""
    start = 0 if cache is None else cache.get_seq_length() + getattr(cache, "dropped", 0)
    return torch.arange(start, start + n, device=device)[None]


def gather(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """x [n_kv, T, hd] at the kept positions keep [n_kv, n] (each KV head its own) -> [n_kv, n, hd]."""
    return x.gather(1, keep[..., None].expand(-1, -1, x.shape[-1]))


def kept_cache(
    loaded: LoadedModel, layer_kv: Sequence[tuple[torch.Tensor, torch.Tensor]], keep: Sequence[torch.Tensor]
) -> KeptCache:
    """A cache of the kept tokens: layer_kv [(keys, values) [n_kv, T, hd]] of the whole context,
    keep [n_kv, n] per layer (one n for every layer)."""
    if len(keep) != len(layer_kv):
        raise ValueError(f"keep: {len(keep)} layers, the cache has {len(layer_kv)}")
    lengths = {int(k.shape[-1]) for k in keep}
    if len(lengths) != 1:
        raise ValueError(f"keep: kept counts {sorted(lengths)} differ across layers (one count per cache)")
    cache = KeptCache(config=loaded.model.config)
    num_tokens = int(layer_kv[0][0].shape[1])
    cache.logical_length, cache.dropped = num_tokens, num_tokens - lengths.pop()
    for layer, ((k, v), idx) in enumerate(zip(layer_kv, keep)):
        kv.put_layer(cache, layer, gather(k, idx.to(k.device)), gather(v, idx.to(v.device)))
    return cache
