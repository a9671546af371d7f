"""The policy interface and registry, and a Selection: one policy at one budget with its protected
tokens, turning one prefill's per-layer states into keep sets.

A policy declares the statistics it needs (`Needs`) and scores one layer's tokens from a
`LayerView` (higher = keep). The heuristics are here; a learned policy (DistillCache: a small
network over per-token features such as attention statistics, value norms, entropy and position,
trained offline with REINFORCE on a per-step KL reward) is one more class with the same `score`,
registered under its name when the pair's artifact carries its weights: the selection, the kept
cache and the evaluation do not change. Knows nothing about codecs, wire types or gRPC.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from shared import model as forward
from shared.keep import attention, scores
from shared.keep.select import MAX_COUNT, Budget, keep_indices
from shared.kv import LayerState
from shared.models import LoadedModel


class Needs(enum.Flag):
    """What a policy reads beyond a layer's K/V (computed from the layer's normed input)."""

    NONE = 0
    WINDOW_ATTENTION = enum.auto()  # [H, w, T]: the context's last w queries over every key
    ACCUMULATED_ATTENTION = enum.auto()  # [H, T]: every query's attention summed per key
    NORMED = enum.auto()  # [T, d]: the layer's normed input itself (a learned policy's probe reads it)


@dataclass(frozen=True)
class LayerView:
    index: int
    keys: torch.Tensor  # [n_kv, T, hd], post-RoPE
    values: torch.Tensor  # [n_kv, T, hd]
    window_attention: torch.Tensor | None = None  # [H, w, T] float32
    accumulated_attention: torch.Tensor | None = None  # [H, T] float32
    normed: torch.Tensor | None = None  # [T, d]: the layer's input_layernorm output (Needs.NORMED)


class Policy(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def needs(self) -> Needs: ...

    @property
    def observation(self) -> int:
        """Query rows of WINDOW_ATTENTION (the context's last ones)."""
        ...

    def score(self, view: LayerView) -> torch.Tensor:
        """[n_kv, T] float32, higher = keep."""
        ...


@dataclass(frozen=True)
class Heuristic:
    """A policy that is one scoring function of the layer's view (shared.keep.scores)."""

    name: str
    needs: Needs
    scorer: Callable[[LayerView], torch.Tensor]
    observation: int = 0

    def score(self, view: LayerView) -> torch.Tensor:
        return self.scorer(view)


def _h2o(view: LayerView) -> torch.Tensor:
    if view.accumulated_attention is None:
        raise ValueError("h2o: the layer view lacks accumulated_attention")
    return scores.h2o(view.accumulated_attention, view.keys.shape[0])


def _snapkv(view: LayerView) -> torch.Tensor:
    if view.window_attention is None:
        raise ValueError("snapkv: the layer view lacks window_attention")
    return scores.snapkv(view.window_attention, view.keys.shape[0], SNAPKV_KERNEL)


SNAPKV_WINDOW, SNAPKV_KERNEL = 64, 5  # kvpress' SnapKVPress defaults (window_size, kernel_size)

# name -> a new policy. SnapKV's observation window is the end of the context (question-agnostic:
# one keep set serves every question; a question-aware variant would score with the question's
# queries and could not be reused across questions). DistillCache registers here.
POLICIES: dict[str, Callable[[], Policy]] = {
    "streaming": lambda: Heuristic("streaming", Needs.NONE, lambda v: scores.recency(v.keys.shape[1], v.keys.shape[0])),
    "knorm": lambda: Heuristic("knorm", Needs.NONE, lambda v: scores.key_norm(v.keys)),
    "h2o": lambda: Heuristic("h2o", Needs.ACCUMULATED_ATTENTION, _h2o),
    "snapkv": lambda: Heuristic("snapkv", Needs.WINDOW_ATTENTION, _snapkv, SNAPKV_WINDOW),
}


def layer_views(loaded: LoadedModel, states: dict[int, LayerState], needs: Needs, observation: int):
    """One LayerView per layer of a prefill's states (K/V, and the layer's normed input where
    `needs` asks for attention), in layer order."""
    for index in range(len(states)):
        yield layer_view(loaded, states[index], needs, observation)


def layer_view(loaded: LoadedModel, state: LayerState, needs: Needs, observation: int) -> LayerView:
    """The LayerView of one layer's state (a producer scores each layer as its prefill reaches it)."""
    keys, values = state.kv()
    window = accumulated = None
    normed = state.normed
    if needs and normed is None:
        raise ValueError(f"layer {state.index}: the policy needs the layer's normed input ({needs}); capture NORMED")
    if normed is not None and needs & (Needs.WINDOW_ATTENTION | Needs.ACCUMULATED_ATTENTION):
        q = attention.queries(forward.of(loaded), state.index, normed)
        if Needs.WINDOW_ATTENTION in needs:
            window = attention.window_attention(q, keys, observation)
        if Needs.ACCUMULATED_ATTENTION in needs:
            accumulated = attention.accumulated_attention(q, keys)
    return LayerView(state.index, keys, values, window, accumulated, normed if Needs.NORMED in needs else None)


def layer_scores(policy: Policy, loaded: LoadedModel, states: dict[int, LayerState]) -> list[torch.Tensor]:
    """The policy's scores [n_kv, T] per layer of one prefill's states (one pass serves every
    budget of the policy)."""
    return [policy.score(view) for view in layer_views(loaded, states, policy.needs, policy.observation)]


@dataclass(frozen=True)
class Selection:
    """A policy at a budget; `sinks` first and `window` last tokens always kept; `shared`: one keep
    set for every KV head of a layer (else each KV head keeps its own, as kvpress does)."""

    policy: Policy
    budget: Budget
    sinks: int = 4
    window: int = 64
    shared: bool = False

    @property
    def label(self) -> str:
        opts = []
        if (self.sinks, self.window) != (4, 64):
            opts.append(f"sinks={self.sinks},window={self.window}")
        if self.shared:
            opts.append("heads=shared")
        return ":".join([self.policy.name, str(self.budget), *([",".join(opts)] if opts else [])])

    def select(self, layer_scores: list[torch.Tensor]) -> list[torch.Tensor]:
        """Kept positions [n_kv, n] per layer (ascending) from the policy's scores per layer."""
        return [keep_indices(s, self.budget.kept(s.shape[-1]), self.sinks, self.window, self.shared) for s in layer_scores]

    def keep(self, loaded: LoadedModel, states: dict[int, LayerState]) -> list[torch.Tensor]:
        """Kept positions [n_kv, n] per layer (ascending), from one prefill's states."""
        return self.select(layer_scores(self.policy, loaded, states))


def parse_fields(text: str) -> tuple[str, Budget, dict]:
    """(policy name, budget, Selection's keyword fields) of a selection's text, without building the
    policy (a learned one's weights are the scoring side's: the producer's, not the caller's)."""
    name, _, rest = text.partition(":")
    budget, _, opts = rest.partition(":")
    if name not in POLICIES:
        raise ValueError(f"keep policy: {name!r} is not one of {sorted(POLICIES)}")
    if not budget:
        raise ValueError(f"keep {text!r}: no budget (a fraction such as 0.25 or a count such as 256)")
    kw: dict = {}
    for opt in filter(None, opts.split(",")):
        key, _, value = opt.partition("=")
        if key in ("sinks", "window") and value.isascii() and value.isdigit():
            if int(value) > MAX_COUNT:
                raise ValueError(f"keep option {key}={value[:24]}: above {MAX_COUNT}")
            kw[key] = int(value)
        elif key == "heads" and value in ("shared", "each"):
            kw["shared"] = value == "shared"
        else:
            raise ValueError(f"keep option: {opt!r} is not sinks=N, window=N or heads=shared|each")
    return name, Budget.parse(budget), kw


def parse_selection(text: str) -> Selection:
    """'snapkv:0.25', 'h2o:256', 'knorm:0.5:sinks=0,window=0,heads=shared'."""
    name, budget, kw = parse_fields(text)
    return Selection(POLICIES[name](), budget, **kw)
