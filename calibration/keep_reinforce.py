"""The pieces of DistillCache's REINFORCE training (calibration.distill_keep runs the loop): one
example's fixed inputs (the consumer's own prefill: K/V, per-token features, the layers' normed
inputs where the network reads them, the full cache's log-probs of the scored continuation
tokens), keep sets sampled from the policy's scores at a budget (Gumbel top-k = a Plackett-Luce
sample, with its log-probability), and the reward of a keep
set: minus the mean per-step KL(full cache || kept cache) over the scored tokens, teacher-forced.

The consumer scores and reads its own cache, as real.quality's `oracle@distill:B` does. The
protected tokens (sinks, the recent window) are kept as shared.keep.Selection keeps them; only
the rest is sampled. No gradients flow through the model: only through the scores' log-probability.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from calibration.kl import kl_sum, layer_cache
from shared import kv
from shared.keep import features, kept_cache, next_positions
from shared.keep.distill import DistillNet
from shared.keep.policy import POLICIES, SNAPKV_WINDOW, Needs, layer_views
from shared.keep.select import keep_indices, protected
from shared.models import LoadedModel

HEURISTICS = ("streaming", "snapkv", "h2o")  # scored at preparation for the validation's comparison


@dataclass
class Prepared:
    """One context and its scored continuations, ready for any number of keep sets."""

    layer_kv: list[tuple[torch.Tensor, torch.Tensor]]  # [n_kv, T, hd] per layer
    feats: torch.Tensor  # [L, n_kv, T, F]
    normed: torch.Tensor | None  # [L, T, d] (the layers' normed inputs) where the network reads them
    continuations: list[tuple[list[int], int]]  # (ids, first scored index)
    reference: list[torch.Tensor]  # the full cache's log-probs [scored, vocab] per continuation
    heuristic: dict[str, list[torch.Tensor]]  # name -> scores [n_kv, T] per layer

    @property
    def num_tokens(self) -> int:
        return int(self.layer_kv[0][0].shape[1])

    def scores(self, net: DistillNet) -> torch.Tensor:
        """The network's scores [L, n_kv, T] for every layer (differentiable in its weights)."""
        return net(torch.arange(self.feats.shape[0]), self.feats, self.normed)


@torch.inference_mode()
def continuation_logprobs(consumer: LoadedModel, cache, ids: list[int], start: int) -> torch.Tensor:
    """float32 log-probs [len(ids) - start, vocab] of ids[start:] read on top of `cache` (start >= 1;
    positions continue at the cache's logical length); the cache is cropped back afterwards."""
    length = cache.get_seq_length()
    pos = next_positions(cache, len(ids), consumer.device)
    logits = consumer.model(
        input_ids=torch.tensor([ids], device=consumer.device), cache=cache, position_ids=pos, use_cache=True
    ).logits[0]
    cache.crop(length - cache.get_seq_length())
    return torch.log_softmax(logits[start - 1 : len(ids) - 1].float(), -1)


def prepare(
    consumer: LoadedModel, context_ids: list[int], continuations: list[tuple[list[int], int]], normed: bool = False
) -> Prepared:
    """One context's fixed inputs; `normed`: keep the layers' normed inputs too (a probe reads them)."""
    with torch.inference_mode():
        states = kv.capture_states(consumer, context_ids, kv.Capture.KV | kv.Capture.NORMED)[0]
        views = list(layer_views(consumer, states, Needs.WINDOW_ATTENTION | Needs.ACCUMULATED_ATTENTION, SNAPKV_WINDOW))
        feats = torch.stack([features.token_features(v) for v in views])
    feats = feats.clone()  # a normal tensor: the network's forward on it is differentiated
    heuristic = {name: [POLICIES[name]().score(v) for v in views] for name in HEURISTICS}
    # own storage, not views of the forward's buffers (a pool of prepared examples stays small)
    layer_kv = [(k.clone(), v.clone()) for k, v in (states[i].kv() for i in range(len(states)))]
    inputs = None
    if normed:
        layers: list[torch.Tensor] = []
        for i in range(len(states)):
            x = states[i].normed
            assert x is not None  # captured above
            layers.append(x)
        inputs = torch.stack(layers).clone()
    full = layer_cache(consumer, layer_kv)
    reference = [continuation_logprobs(consumer, full, ids, start) for ids, start in continuations]
    return Prepared(layer_kv, feats, inputs, list(continuations), reference, heuristic)


def reward(consumer: LoadedModel, ex: Prepared, keep: list[torch.Tensor]) -> float:
    """Minus the mean per-step KL(full || kept) over every continuation's scored tokens, nats."""
    cache = kept_cache(consumer, ex.layer_kv, keep)
    total = steps = 0.0
    for (ids, start), ref in zip(ex.continuations, ex.reference):
        total += float(kl_sum(ref, continuation_logprobs(consumer, cache, ids, start)))
        steps += ref.shape[0]
    return -total / steps


def plackett_luce_logp(scores: torch.Tensor, picks: torch.Tensor) -> torch.Tensor:
    """log P of drawing `picks` [..., m] in that order, without replacement, from softmax(scores
    [..., N]) (float64 inside): sum over picks of s_pick - log(sum of exp s over what is left)."""
    s = scores.double()
    logz = torch.logsumexp(s, -1, keepdim=True)
    p = (s - logz).exp().gather(-1, picks)  # [..., m]
    taken_before = torch.cumsum(p, -1) - p
    return (s.gather(-1, picks) - logz - torch.log((1 - taken_before).clamp_min(1e-30))).sum(-1)


def sample_keep(
    scores: torch.Tensor, kept: int, sinks: int, window: int, generator: torch.Generator
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """One keep set per layer [n_kv, kept] (ascending) sampled from scores [L, n_kv, T] (Gumbel
    top-k over the unprotected tokens), and its log-probability [L, n_kv] (differentiable)."""
    L, n_kv, T = scores.shape
    forced = protected(T, sinks, window)[:kept]
    free = torch.ones(T, dtype=torch.bool)
    free[forced] = False
    others = torch.nonzero(free).flatten()
    m = kept - forced.numel()
    if m == 0:
        return [forced.sort().values.expand(n_kv, -1).contiguous()] * L, scores.sum(-1) * 0
    s = scores[..., others]  # [L, n_kv, N]
    u = torch.rand(s.shape, generator=generator, dtype=torch.float64).clamp(1e-12, 1 - 1e-12)
    picks = (s.detach().double() - torch.log(-torch.log(u))).topk(m, dim=-1).indices  # [L, n_kv, m] in draw order
    logp = plackett_luce_logp(s, picks)
    chosen = torch.cat([forced.expand(L, n_kv, -1), others[picks]], dim=-1).sort(dim=-1).values
    return list(chosen.unbind(0)), logp


def greedy_keep(layer_scores: list[torch.Tensor], kept: int, sinks: int, window: int) -> list[torch.Tensor]:
    """The deterministic keep sets a Selection takes from these scores (shared.keep.select)."""
    return [keep_indices(s, kept, sinks, window) for s in layer_scores]
