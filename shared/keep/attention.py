"""The attention statistics the scorers read, computed from one layer's normalized input with our
own forward's functions (shared.model): the layer's post-RoPE queries, the causal softmax of the
context's last w queries over every key (SnapKV), and the causal softmax summed over every query
(H2O's accumulated attention), in float32 chunks of queries so a 4k context never holds [H, T, T].

The side that holds the cache computes them from its own prefill (the producer, before it sends;
the consumer for its own cache). Knows nothing about policies, budgets or caches.
"""

from __future__ import annotations

import math

import torch

from shared.model import Model

QUERY_CHUNK = 256  # query rows per softmax block: [H, 256, T] float32 at a time


@torch.inference_mode()
def queries(model: Model, layer: int, normed: torch.Tensor) -> torch.Tensor:
    """Post-RoPE queries [T, H, hd] of a context from position 0, from its normed input [T, d]."""
    T = normed.shape[0]
    q, _, _ = model.qkv_pre_rope(layer, normed)
    cos, sin = model.tables(torch.arange(T, device=normed.device))
    return model.rotate(q, cos, sin)


def _probs(q: torch.Tensor, keys: torch.Tensor, first: int) -> torch.Tensor:
    """Causal softmax [H, n, T] of queries q [n, H, hd] at positions first.. over keys [n_kv, T, hd]."""
    n, H, hd = q.shape
    n_kv, T, _ = keys.shape
    k = keys.float().repeat_interleave(H // n_kv, dim=0)  # [H, T, hd]
    logits = torch.matmul(q.float().transpose(0, 1), k.transpose(1, 2)) / math.sqrt(hd)  # [H, n, T]
    pos = torch.arange(first, first + n, device=q.device)[:, None]
    logits.masked_fill_(torch.arange(T, device=q.device)[None, :] > pos, float("-inf"))
    return torch.softmax(logits, dim=-1)


@torch.inference_mode()
def window_attention(q: torch.Tensor, keys: torch.Tensor, window: int) -> torch.Tensor:
    """[H, w, T]: the last w = min(window, T) queries' causal softmax over keys [n_kv, T, hd]."""
    T = keys.shape[1]
    w = min(window, T)
    return _probs(q[T - w :], keys, T - w)


@torch.inference_mode()
def accumulated_attention(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """[H, T]: each key's causal softmax weight summed over all T queries q [T, H, hd]."""
    T = keys.shape[1]
    total = torch.zeros(q.shape[1], T, dtype=torch.float32, device=q.device)
    for first in range(0, T, QUERY_CHUNK):
        total += _probs(q[first : first + QUERY_CHUNK], keys, first).sum(dim=1)
    return total
