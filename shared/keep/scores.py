"""The heuristic scorers, one function each: higher score = keep. The math is NVIDIA kvpress'
(0.5.4, kvpress/presses/*_press.py; checked on the same tensors by bench/keep/kvpress_check.py),
written here because kvpress pins transformers < 5.3.

Shapes: keys [n_kv, T, hd] post-RoPE; attention probabilities per query head [H, ..., T] with
H = n_kv * groups and query head h reading KV head h // groups (transformers' repeat_kv order).
Scores are float32 [n_kv, T]. Knows nothing about models, budgets or caches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def recency(num_tokens: int, num_kv_heads: int) -> torch.Tensor:
    """StreamingLLM: the most recent tokens score highest (the sinks are the selection's,
    select.py; with them this keeps kvpress StreamingLLMPress' set)."""
    return torch.arange(num_tokens, dtype=torch.float32).expand(num_kv_heads, num_tokens).clone()


def key_norm(keys: torch.Tensor) -> torch.Tensor:
    """KnormPress: the lowest L2 norm of the key is kept, -||k|| over the head dim."""
    return -keys.float().norm(dim=-1)


def group_mean(per_query_head: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[H, T] -> [n_kv, T]: the mean over the query heads sharing a KV head."""
    H, T = per_query_head.shape
    return per_query_head.view(num_kv_heads, H // num_kv_heads, T).mean(1)


def h2o(accumulated: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """ObservedAttentionPress (H2O): the attention each key received over the whole prefill,
    accumulated [H, T] (sum over queries of the causal softmax), divided by the number of queries
    that could see it (T - t: key t is seen by queries t..T-1), averaged per KV group."""
    T = accumulated.shape[-1]
    seen_by = torch.arange(T, 0, -1, dtype=torch.float32, device=accumulated.device)
    return group_mean(accumulated.float() / seen_by, num_kv_heads)


def snapkv(window_attention: torch.Tensor, num_kv_heads: int, kernel_size: int = 5) -> torch.Tensor:
    """SnapKVPress: window_attention [H, w, T] = the causal softmax of the context's last w
    queries over all T keys. Mean over the window's queries of the attention on the T - w keys
    before it, smoothed by an average pool of `kernel_size` (zero padding counted, as torch's
    avg_pool1d does), averaged per KV group; the window itself scores max + 1 (always kept). A
    context no longer than the window is all window: every token scores the same (kvpress refuses
    it; here a short context is simply kept by the selection's own rules)."""
    H, w, T = window_attention.shape
    if w >= T:
        return torch.ones(num_kv_heads, T, dtype=torch.float32, device=window_attention.device)
    scores = window_attention[..., : T - w].float().mean(dim=1)  # [H, T - w]
    scores = F.avg_pool1d(scores[None], kernel_size=kernel_size, padding=kernel_size // 2, stride=1)[0]
    scores = group_mean(scores, num_kv_heads)
    return F.pad(scores, (0, w), value=scores.max().item() + 1)
