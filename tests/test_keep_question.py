"""Question-aware SnapKV (shared.keep.question) on the committed QA pair: with the question's
queries as the window, the kept 10 % of a context hold the fact the question asks for, so the
consumer still answers it; SnapKV's question-blind window (the context's end) loses it. Scoring
without a question is an error, never a silent fallback."""

from __future__ import annotations

from pathlib import Path

import pytest

from calibration.keep_reinforce import continuation_logprobs
from qa.corpus import heldout_example
from qa.task import examples
from shared import kv
from shared.keep import Budget, Selection, kept_cache, parse_selection
from shared.keep.policy import POLICIES, layer_scores
from shared.keep.question import QuestionSnapKV, question_scores
from shared.models import load_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def consumer():
    return load_model(str(ROOT / "checkpoints" / "qa-tuned"), "float32", "cpu")


def _answers_right(consumer, held, scores, fraction: float) -> bool:
    """C's teacher-forced greedy answer tokens on the kept cache equal the gold answer's."""
    states = kv.capture_states(consumer, held.context_ids, kv.Capture.KV)[0]
    layer_kv = [states[i].kv() for i in range(len(states))]
    keep = Selection(POLICIES["snapkv"](), Budget(fraction=fraction), sinks=4, window=16).select(scores)
    logp = continuation_logprobs(consumer, kept_cache(consumer, layer_kv, keep), held.qa_ids, held.answer_start)
    return logp.argmax(-1).tolist() == held.qa_ids[held.answer_start :]


def test_the_question_window_keeps_the_asked_fact_where_the_context_end_does_not(consumer):
    right = {"snapkv": 0, "snapkv-q": 0}
    for e in examples("validation", 8, 256, "tuned"):
        held = heldout_example(e, consumer.tokenizer)
        question = held.qa_ids[: held.answer_start]
        states = kv.capture_states(consumer, held.context_ids, kv.Capture.KV | kv.Capture.NORMED)[0]
        blind = layer_scores(POLICIES["snapkv"](), consumer, states)
        aware = question_scores(consumer, held.context_ids, question)
        assert [s.shape for s in aware] == [s.shape for s in blind]
        right["snapkv"] += _answers_right(consumer, held, blind, 0.1)
        right["snapkv-q"] += _answers_right(consumer, held, aware, 0.1)
    assert right["snapkv-q"] >= 7 and right["snapkv"] <= 2, right


def test_without_a_question_snapkv_q_refuses_to_score(consumer):
    sel = parse_selection("snapkv-q:0.25")
    assert isinstance(sel.policy, QuestionSnapKV) and sel.policy.observation == 0
    held = heldout_example(next(iter(examples("validation", 1, 256, "tuned"))), consumer.tokenizer)
    states = kv.capture_states(consumer, held.context_ids, kv.Capture.KV | kv.Capture.NORMED)[0]
    with pytest.raises(ValueError, match="no question bound"):
        sel.keep(consumer, states)
    with pytest.raises(ValueError, match="question_ids is empty"):
        question_scores(consumer, held.context_ids, [])
