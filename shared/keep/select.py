"""Budgets and keep sets: from scores [n_kv, T] to the kept token indices [n_kv, n] of one layer.

A budget is a fraction of the context's tokens (floor of fraction * T, as kvpress' ScorerPress
counts) or a count; every layer and every KV head keeps the same count (one kept length per
layer, what a transformers cache and the wire's per-layer arrays hold). The protected tokens come
first: the `sinks` first tokens, then the `window` most recent ones (most recent first when the
budget cannot hold them all); the rest of the budget goes to the highest scores among the others,
ties to the earlier position (a stable sort: the same scores give the same set on every run).
With `shared` one set serves every KV head, chosen on the heads' mean score. Knows nothing about
models or policies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_COUNT = 2**32 - 1  # the wire's uint32 (KeepSpec.count, .sinks, .window): a larger one cannot be asked


@dataclass(frozen=True)
class Budget:
    """fraction in (0, 1] of the context's tokens, or a count in 1..MAX_COUNT (exactly one of the two)."""

    fraction: float | None = None
    count: int | None = None

    def __post_init__(self):
        if (self.fraction is None) == (self.count is None):
            raise ValueError("budget: give a fraction or a count, not both or neither")
        if self.fraction is not None and not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"budget fraction: {self.fraction} is not in (0, 1]")
        if self.count is not None and not 1 <= self.count <= MAX_COUNT:
            raise ValueError(f"budget count: {self.count} is not in 1..{MAX_COUNT}")

    @classmethod
    def parse(cls, text: str) -> Budget:
        """'0.25' (a fraction) or '256' (a count)."""
        try:
            return cls(count=int(text)) if text.isascii() and text.isdigit() else cls(fraction=float(text))
        except ValueError as e:
            raise ValueError(f"budget: {text!r} is not a fraction in (0, 1] or a count in 1..{MAX_COUNT} ({e})") from None

    def kept(self, num_tokens: int) -> int:
        """Tokens kept per layer and KV head of a context of num_tokens (at least 1)."""
        n = int(num_tokens * self.fraction) if self.fraction is not None else int(self.count or 0)
        return max(1, min(num_tokens, n))

    def __str__(self) -> str:
        """What `parse` reads back as this budget, and nothing else: a count's digits, a fraction's
        shortest exact repr (always with a '.' or an exponent: 1.0, 0.4999999). Keys are made of it:
        `:g` printed fraction 1.0 as the count "1" and kept 6 digits, so two budgets keeping different
        counts shared a producer store key."""
        return str(self.count) if self.count is not None else repr(float(self.fraction or 0.0))


def protected(num_tokens: int, sinks: int, window: int) -> torch.Tensor:
    """The protected positions in priority order: sinks first, then the window, newest first."""
    first = list(range(min(sinks, num_tokens)))
    recent = [t for t in range(num_tokens - 1, max(num_tokens - 1 - window, -1), -1) if t >= len(first)]
    return torch.tensor(first + recent, dtype=torch.long)


def keep_indices(scores: torch.Tensor, n: int, sinks: int, window: int, shared: bool = False) -> torch.Tensor:
    """Kept positions [n_kv, n], ascending, from scores [n_kv, T] (higher = keep)."""
    n_kv, T = scores.shape
    if not 1 <= n <= T:
        raise ValueError(f"kept count: {n} is not in [1, {T}]")
    if shared:
        scores = scores.float().mean(dim=0, keepdim=True)
    forced = protected(T, sinks, window)[:n].to(scores.device)
    is_free = torch.ones(T, dtype=torch.bool, device=scores.device)
    is_free[forced] = False
    others = torch.nonzero(is_free).flatten()  # ascending: a stable sort breaks ties to the earlier
    order = torch.sort(scores.float()[:, others], dim=-1, descending=True, stable=True).indices
    rest = others[order[:, : n - forced.numel()]]
    chosen = torch.cat([forced.expand(scores.shape[0], -1), rest], dim=-1)
    chosen = torch.sort(chosen, dim=-1).values
    return chosen.expand(n_kv, -1).contiguous() if shared else chosen
