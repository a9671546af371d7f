"""Per-layer math on a Hugging Face decoder, done with the model's own modules so results match
its forward bit for bit: K/V from a layer's normalized input (Patch), RoPE on pre-RoPE keys
(Reuse), and running a span of decoder layers from a hidden state (Recompute).

`rope` and `kv_pre_rope` are differentiable (the SCD predictor trains through them); the caller
picks the grad mode. Supports Llama-style attention (Llama, Qwen2 with q/k/v biases, Qwen3 with k_norm). Knows
nothing about codecs or the wire.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from transformers import DynamicCache
from transformers.masking_utils import create_causal_mask

from shared.kv import layer_kv
from shared.models import LoadedModel


def positions(loaded: LoadedModel, num_tokens: int, start: int = 0) -> torch.Tensor:
    return torch.arange(start, start + num_tokens, device=loaded.device)[None]  # [1, T]


def _rope_fn(loaded: LoadedModel, layer: int):
    attn = loaded.layers[layer].self_attn
    return sys.modules[type(attn).__module__].apply_rotary_pos_emb


def rope_tables(loaded: LoadedModel, like: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's (cos, sin) for positions pos [1, T] in like's dtype, kept on the positions
    tensor: a decoder passes the same positions for every layer, so they are computed once per
    request, not once per layer (position tensors are never modified in place)."""
    cached = getattr(pos, "_scd_rope", None)
    if cached is not None and cached[0] is loaded.model and cached[1] == like.dtype:
        return cached[2]
    tables = loaded.model.model.rotary_emb(like, position_ids=pos)
    pos._scd_rope = (loaded.model, like.dtype, tables)  # type: ignore[attr-defined]
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
    joined = (torch.cat([cos for cos, _ in tables], dim=1), torch.cat([sin for _, sin in tables], dim=1))
    pos._scd_rope = (loaded.model, dtype, joined)  # type: ignore[attr-defined]
    return pos


def rope(loaded: LoadedModel, layer: int, keys_pre: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Apply the model's rotary embedding: keys_pre [n_kv, T, hd] -> post-RoPE [n_kv, T, hd]."""
    cos, sin = rope_tables(loaded, keys_pre, pos)  # [1, T, hd] each
    # Rotated token-major, [1, T, n_kv, hd] (unsqueeze_dim=2): the layout keys come in from a
    # projection, where the elementwise ops run over contiguous memory. The model's own function
    # rotates a query and a key: one head stands in for the query (its result is dropped). Every
    # op is elementwise, so the keys' values are the same as rotating [1, n_kv, T, hd].
    k = keys_pre.transpose(0, 1)[None]
    _, keys = _rope_fn(loaded, layer)(k[:, :, :1], k, cos, sin, unsqueeze_dim=2)
    return keys[0].transpose(0, 1)


def kv_pre_rope(loaded: LoadedModel, layer: int, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pre-RoPE keys (after k_norm where the model has one) and values from the layer's
    normalized input normed [T, d] -> ([n_kv, T, hd], [n_kv, T, hd])."""
    attn: Any = loaded.layers[layer].self_attn  # the model's own attention class: k_proj, v_proj, k_norm (Qwen3)
    info = loaded.info
    shape = (normed.shape[0], info.num_kv_heads, info.head_dim)
    keys = attn.k_proj(normed).view(shape)  # [T, n_kv, hd]
    if hasattr(attn, "k_norm"):
        keys = attn.k_norm(keys)
    values = attn.v_proj(normed).view(shape)
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
    model = loaded.model.model
    cache = DynamicCache(config=loaded.model.config)
    h = hidden[None].to(loaded.dtype)  # [1, T, d]
    pos = positions(loaded, hidden.shape[0])
    mask = create_causal_mask(config=model.config, inputs_embeds=h, attention_mask=None, cache=cache, position_ids=pos)
    emb = model.rotary_emb(h, position_ids=pos)
    out = []
    for index in range(start, end):
        h = model.layers[index](h, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True, position_embeddings=emb)
        keys, values = layer_kv(cache, index)
        out.append((keys[0], values[0]))
    return out
