"""Rotary position embedding: inverse frequencies per rope type, (cos, sin) tables, rotation.

Computes what transformers' rotary embedding computes, op for op (frequencies and cos/sin in
float32, cast to the activations' dtype, then `x * cos + rotate_half(x) * sin` in that dtype), so
keys match the reference cache. Types: default, linear, llama3 (the ones Llama-family
checkpoints use); any other is refused by name. Knows nothing about layers or caches.
"""

from __future__ import annotations

import math

import torch

TYPES = ("default", "linear", "llama3")


def inv_freq(rope: dict, head_dim: int) -> tuple[torch.Tensor, float]:
    """([head_dim / 2] float32 inverse frequencies, attention scaling) for a config's rope dict."""
    kind = rope.get("rope_type", "default")
    if kind not in TYPES:
        raise ValueError(f"rope_type: {kind!r} is not one of {TYPES}")
    base = float(rope["rope_theta"])
    freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim))
    if kind == "linear":
        freq = freq / rope["factor"]
    elif kind == "llama3":
        factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        old = rope["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old / low, old / high
        wavelen = 2 * math.pi / freq
        scaled = torch.where(wavelen > low_wavelen, freq / factor, freq)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        freq = torch.where(medium, smoothed, scaled)
    return freq, 1.0


class Rope:
    def __init__(self, rope: dict, head_dim: int, device: torch.device):
        freq, self.scaling = inv_freq(rope, head_dim)
        self.inv_freq = freq.to(device)  # [hd / 2] float32

    def tables(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) for positions pos [...] -> [..., hd] each, in dtype."""
        freqs = pos[..., None].float() * self.inv_freq  # [..., hd / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.scaling != 1.0:
            cos, sin = cos * self.scaling, sin * self.scaling
        return cos.to(dtype), sin.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, hd] rotated by cos/sin [T, hd] (token-major, as projections produce it)."""
    cos, sin = cos[:, None], sin[:, None]  # [T, 1, hd]
    return x * cos + rotate_half(x) * sin
