"""Question-aware SnapKV ("snapkv-q"): SnapKV's scores with the question's queries as the
observation window instead of the context's last tokens.

The side that scores reads the context and then the question (one prefill of both), and the
question's queries over the context's keys pick what is kept: the keep set answers that question
only. It needs a request that shows the producer the question, and a keep set (or a chunk stored
with it) can NOT be reused for another question on the same context: a cache key holds the
question's ids. Without a question (observation 0) scoring is an error, never a silent fallback.
Knows nothing about codecs or services.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared import kv
from shared.keep import scores
from shared.keep.policy import POLICIES, SNAPKV_KERNEL, LayerView, Needs, layer_scores
from shared.models import LoadedModel


@dataclass(frozen=True)
class QuestionSnapKV:
    """observation = the question's token count (0: not bound to a question yet)."""

    observation: int = 0
    name: str = "snapkv-q"
    needs: Needs = Needs.WINDOW_ATTENTION

    def score(self, view: LayerView) -> torch.Tensor:
        """[n_kv, T_context] from a view over context + question (T_context + observation tokens)."""
        if self.observation < 1 or view.window_attention is None:
            raise ValueError("snapkv-q: no question bound (score with question_scores(policy, model, context_ids, question_ids))")
        T = view.keys.shape[1] - self.observation
        if T < 1 or view.window_attention.shape[1] != self.observation:
            raise ValueError(
                f"snapkv-q: the view has {view.keys.shape[1]} tokens, not context + {self.observation} question tokens"
            )
        return scores.snapkv(view.window_attention, view.keys.shape[0], SNAPKV_KERNEL)[:, :T]


def question_scores(loaded: LoadedModel, context_ids: list[int], question_ids: list[int]) -> list[torch.Tensor]:
    """snapkv-q's scores [n_kv, len(context_ids)] per layer: one prefill of context + question by
    `loaded` (the side that holds the cache), the question's queries as the window."""
    if not question_ids:
        raise ValueError("snapkv-q: question_ids is empty (the policy scores with the question's queries)")
    states = kv.capture_states(loaded, list(context_ids) + list(question_ids), kv.Capture.KV | kv.Capture.NORMED)[0]
    return layer_scores(QuestionSnapKV(len(question_ids)), loaded, states)


POLICIES.setdefault("snapkv-q", QuestionSnapKV)
