"""DistillCache's first stage for a network that reads normed inputs (shared.keep.distill's probe):
fit it to the attention the full cache gives each context token while the consumer answers.

The teacher is the consumer on its own full cache, teacher-forced on a train example's question
and gold answer: per layer and KV head, a context token's target is the largest attention it gets
from a query that predicts an answer token (the last question token through the answer's
second-to-last, every query head of the KV head's group). The probe sees only the token's normed
input to the layer, never the question: it learns which tokens answers of this pair's tasks read,
as a retaining head (Locret) does. The loss is ListNet's: the cross-entropy of the softmax of the
scores over the unprotected tokens (not the sinks, not the recent window) against the targets
renormalized there. REINFORCE (calibration.distill_keep) may then refine it on the KL reward.

Knows nothing about budgets' selection beyond the protected spans, codecs or services.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shared import kv
from shared import model as forward
from shared.keep import attention
from shared.keep.distill import DistillNet
from shared.keep.select import Budget, protected
from shared.models import LoadedModel


@dataclass
class Target:
    """One train example: the layers' normed inputs over the context and each token's target."""

    normed: torch.Tensor  # [L, T, d] float16
    attention: torch.Tensor  # [L, n_kv, T] float32: the largest attention from an answer-predicting query


@torch.inference_mode()
def target(consumer: LoadedModel, context_ids: list[int], qa_ids: list[int], answer_start: int) -> Target:
    """The targets of one context read by `qa_ids` (question then answer; the answer's first id at
    `answer_start` >= 1), from one prefill of context + qa by the consumer."""
    if not 1 <= answer_start < len(qa_ids):
        raise ValueError(f"answer_start: {answer_start} outside 1..{len(qa_ids) - 1}")
    T, model = len(context_ids), forward.of(consumer)
    states = kv.capture_states(consumer, list(context_ids) + list(qa_ids), kv.Capture.KV | kv.Capture.NORMED)[0]
    normed, targets = [], []
    for index in range(len(states)):
        state = states[index]
        keys, _ = state.kv()
        assert state.normed is not None
        q = attention.queries(model, index, state.normed)
        probs = attention.window_attention(q, keys, len(qa_ids))[:, answer_start - 1 : -1, :T]  # [H, answers, T]
        n_kv = keys.shape[0]
        targets.append(probs.amax(1).view(n_kv, -1, T).amax(1))
        normed.append(state.normed[:T].half())
    return Target(torch.stack(normed), torch.stack(targets).float())


def free_span(num_tokens: int, sinks: int, window: int) -> slice:
    """The tokens a selection chooses among: all but shared.keep.select.protected's (the sinks and
    the recent window), which leave one contiguous span."""
    return slice(min(sinks, num_tokens), max(min(sinks, num_tokens), num_tokens - window))


def listnet_loss(scores: torch.Tensor, attention_: torch.Tensor, sinks: int, window: int) -> torch.Tensor:
    """Mean over layers and KV heads of the cross-entropy of softmax(scores) against the target
    attention renormalized, over the unprotected tokens; scores / attention [L, n_kv, T]."""
    span = free_span(scores.shape[-1], sinks, window)
    s, a = scores[..., span], attention_[..., span]
    p = a / a.sum(-1, keepdim=True).clamp_min(1e-12)
    return -(p * torch.log_softmax(s, -1)).sum(-1).mean()


def recall(scores: torch.Tensor, attention_: torch.Tensor, fraction: float, sinks: int, window: int) -> float:
    """The share of the unprotected tokens' target attention that the top `fraction` of the whole
    context, less the protected tokens, holds (mean over layers and KV heads)."""
    T = scores.shape[-1]
    span = free_span(T, sinks, window)
    n = max(0, min(span.stop - span.start, Budget(fraction=fraction).kept(T) - protected(T, sinks, window).numel()))
    s, a = scores[..., span], attention_[..., span]
    held = a.gather(-1, s.topk(n, dim=-1).indices).sum(-1)
    return float((held / a.sum(-1).clamp_min(1e-12)).mean())


def fit(
    net: DistillNet,
    train: list[Target],
    held: list[Target],
    epochs: int,
    lr: float,
    sinks: int,
    window: int,
    seed: int,
    log: Callable[[dict], None],
) -> None:
    """Adam on listnet_loss, one example per step, `epochs` passes in a seeded order; logs per
    epoch the train loss and the held-out loss and recall at 25 %."""
    if net.inputs != ("normed",):
        raise ValueError(f"keep_attention.fit: fits a probe over normed inputs only, not inputs {net.inputs}")
    rng = random.Random(seed)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    order = list(range(len(train)))

    def scores(t: Target) -> torch.Tensor:
        return net(torch.arange(t.normed.shape[0]), None, t.normed.float())

    for epoch in range(1, epochs + 1):
        rng.shuffle(order)
        losses = []
        for i in order:
            loss = listnet_loss(scores(train[i]), train[i].attention, sinks, window)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        with torch.no_grad():
            held_loss = [float(listnet_loss(scores(t), t.attention, sinks, window)) for t in held]
            held_recall = [recall(scores(t), t.attention, 0.25, sinks, window) for t in held]
        log(
            {
                "kind": "warm",
                "epoch": epoch,
                "loss": round(statistics.fmean(losses), 5),
                "held_loss": round(statistics.fmean(held_loss), 5) if held else None,
                "held_recall_25": round(statistics.fmean(held_recall), 4) if held else None,
            }
        )
