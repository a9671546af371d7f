"""Per-layer math on the consumer's decoder, done with our own forward (shared.model) so results
match its forward bit for bit: K/V from a layer's normalized input (Patch), RoPE on pre-RoPE keys
(Reuse), and running a span of decoder layers from a hidden state (Recompute).

`rope` and `kv_pre_rope` are differentiable (the SCD predictor trains through them); the caller
picks the grad mode. Supports the Llama family shared.model runs (Llama, Qwen2 with q/k/v biases,
Qwen3 with q/k norms). Knows nothing about codecs or the wire.
"""

from __future__ import annotations

import torch

from shared import model as own
from shared.models import LoadedModel


def positions(loaded: LoadedModel, num_tokens: int, start: int = 0) -> torch.Tensor:
    return torch.arange(start, start + num_tokens, device=loaded.device)[None]  # [1, T]


def rope_tables(loaded: LoadedModel, like: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's (cos, sin) for positions pos [1, T] in like's dtype, [T, hd] each, kept on the
    positions tensor: a decoder passes the same positions for every layer, so they are computed
    once per request, not once per layer (position tensors are never modified in place)."""
    model = own.of(loaded)
    cached = getattr(pos, "_scd_rope", None)
    if cached is not None and cached[0] is model and cached[1] == like.dtype:
        return cached[2]
    tables = model.rope.tables(pos[0], like.dtype)
    pos._scd_rope = (model, like.dtype, tables)  # type: ignore[attr-defined]
    return tables


def joined_positions(loaded: LoadedModel, parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Several requests' positions [1, T_i] joined along tokens -> [1, sum T_i], carrying their
    (cos, sin) in dtype joined from each part's own tables (rope_tables' cache on each part: every
    layer after a request's first reuses them). A batched rebuild then rotates each request's keys
    with exactly the values its own rebuild would: the same tables, computed over the same
    positions tensor, whatever else shares the batch."""
    pos = torch.cat(parts, dim=1)
    like = torch.empty(0, dtype=dtype, device=loaded.device)
    tables = [rope_tables(loaded, like, part) for part in parts]
    joined = (torch.cat([cos for cos, _ in tables]), torch.cat([sin for _, sin in tables]))
    pos._scd_rope = (own.of(loaded), dtype, joined)  # type: ignore[attr-defined]
    return pos


def rope(loaded: LoadedModel, layer: int, keys_pre: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Apply the model's rotary embedding: keys_pre [n_kv, T, hd] -> post-RoPE [n_kv, T, hd].
    Rotated token-major ([T, n_kv, hd], the layout keys come in from a projection, where the
    elementwise ops run over contiguous memory); every op is elementwise, so the values are the
    same in either layout."""
    cos, sin = rope_tables(loaded, keys_pre, pos)  # [T, hd] each
    return own.of(loaded).rotate(keys_pre.transpose(0, 1), cos, sin).transpose(0, 1)


def kv_pre_rope(loaded: LoadedModel, layer: int, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pre-RoPE keys (after k_norm where the model has one) and values from the layer's
    normalized input normed [T, d] -> ([n_kv, T, hd], [n_kv, T, hd])."""
    keys, values = own.of(loaded).kv_pre_rope(layer, normed)  # [T, n_kv, hd] each
    return keys.transpose(0, 1), values.transpose(0, 1)


@torch.inference_mode()
def kv_from_normed(loaded: LoadedModel, layer: int, normed: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache entries the layer would store for normalized input normed [T, d]: post-RoPE
    keys and values, [n_kv, T, hd] each."""
    keys, values = kv_pre_rope(loaded, layer, normed)
    return rope(loaded, layer, keys, pos), values


@torch.inference_mode()
def run_layers(loaded: LoadedModel, hidden: torch.Tensor, start: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Run decoder layers start..end-1 over the residual stream entering layer `start`,
    hidden [T, d] (context positions 0..T-1); returns each layer's (keys, values), [n_kv, T, hd]."""
    model = own.of(loaded)
    h = hidden.to(loaded.dtype)  # [T, d]
    cos, sin = model.tables(torch.arange(hidden.shape[0], device=loaded.device))
    out: list[tuple[torch.Tensor, torch.Tensor]] = []

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out.append((k.transpose(0, 1), v.transpose(0, 1)))  # [n_kv, T, hd]
        return own.causal(layer, q, k, v)

    for index in range(start, end):
        h = model.layer(index, h, cos, sin, attend)
    return out
