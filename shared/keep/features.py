"""DistillCache's per-token features: what its network reads about each context token of one layer
and KV head, from a LayerView with both attention statistics (the observation window's attention
and the accumulated attention).

Per token t of a context of T tokens, per KV head (query heads pooled over their group): the window's
mean attention to t (log, and pooled over 5 and 17 neighbours), the window's largest attention to
t, the entropy of the window's attention to t over its queries, the accumulated attention per query
that could see t (H2O's), the key and value norms, then position: t / T, the log distance from
the end, and the sink and recent flags. Every feature but the four of position is standardized
within its layer and head (a keep set is a ranking within one head: only relative values matter).
Knows nothing about networks, budgets or training.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from shared.keep.policy import LayerView

NAMES = (
    "window",
    "window_pool5",
    "window_pool17",
    "window_max",
    "window_entropy",
    "h2o",
    "key_norm",
    "value_norm",
    "position",
    "from_end",
    "sink",
    "recent",
)
STANDARDIZED = 8  # the first 8 are z-scored per head
SINKS, RECENT = 4, 64  # the flags' spans: the selection's default protected tokens


def _pool(x: torch.Tensor, k: int) -> torch.Tensor:
    """Mean over k neighbours along the last dim of x [n, T] (edges: the neighbours that exist)."""
    return F.avg_pool1d(x[:, None], k, stride=1, padding=k // 2, count_include_pad=False)[:, 0]


def _group(x: torch.Tensor, n_kv: int, reduce: str = "mean") -> torch.Tensor:
    """[H, T] -> [n_kv, T] over the query heads sharing a KV head."""
    grouped = x.view(n_kv, x.shape[0] // n_kv, x.shape[-1])
    return grouped.amax(1) if reduce == "max" else grouped.mean(1)


def _z(x: torch.Tensor) -> torch.Tensor:
    return (x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True).clamp_min(1e-6)


@torch.no_grad()
def token_features(view: LayerView) -> torch.Tensor:
    """float32 [n_kv, T, len(NAMES)] for one layer's view (window and accumulated attention set)."""
    if view.window_attention is None or view.accumulated_attention is None:
        raise ValueError(f"layer {view.index}: distill features need window_attention and accumulated_attention")
    n_kv, T, _ = view.keys.shape
    wa = view.window_attention.float()  # [H, w, T]
    w = wa.shape[1]
    log = lambda a: torch.log(a * T + 1e-6)  # relative to uniform attention 1 / T
    mean = wa.mean(1)  # [H, T]
    share = wa / wa.sum(1, keepdim=True).clamp_min(1e-12)  # over the window's queries
    entropy = -(share * torch.log(share.clamp_min(1e-12))).sum(1) / math.log(max(w, 2))  # [H, T]
    seen_by = torch.arange(T, 0, -1, dtype=torch.float32, device=wa.device)
    h2o = view.accumulated_attention.float() / seen_by  # [H, T]
    t = torch.arange(T, dtype=torch.float32, device=wa.device)
    position = (t / T).expand(n_kv, T)
    from_end = (torch.log1p(T - 1 - t) / math.log(max(T, 2))).expand(n_kv, T)
    sink = (t < SINKS).float().expand(n_kv, T)
    recent = (t >= T - RECENT).float().expand(n_kv, T)
    standardized = [
        log(_group(mean, n_kv)),
        log(_group(_pool(mean, 5), n_kv)),
        log(_group(_pool(mean, 17), n_kv)),
        log(_group(wa.amax(1), n_kv, "max")),
        _group(entropy, n_kv),
        log(_group(h2o, n_kv)),
        view.keys.float().norm(dim=-1),
        view.values.float().norm(dim=-1),
    ]
    cols = [_z(x) for x in standardized] + [position, from_end, sink, recent]
    return torch.stack(cols, dim=-1)
