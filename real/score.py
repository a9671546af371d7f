"""Scoring one answer to a real.tasks example: SQuAD exact match and token F1 against the gold
answer (qa.metrics), RULER's recall (the share of the gold values that appear in the answer, as
RULER's string-match metric counts them) and whether it is identical to the oracle's answer (the
consumer's own prefill, same greedy decoding). Knows nothing about models."""

from __future__ import annotations

from qa.metrics import exact_match, f1_score, normalize_answer
from real.tasks import Example


def recall(prediction: str, answers: tuple[str, ...]) -> float:
    """Share of the gold values found in the answer (normalized text, whole words)."""
    text = f" {normalize_answer(prediction)} "
    return sum(f" {normalize_answer(a)} " in text for a in answers) / len(answers)


def score(prediction: str, example: Example, oracle: str | None = None) -> dict:
    """{"em", "f1", "recall"} of the answer, and "identical_to_oracle" when `oracle` is given."""
    row = {
        "em": exact_match(prediction, example.answer),
        "f1": f1_score(prediction, example.answer),
        "recall": recall(prediction, example.answers),
    }
    if oracle is not None:
        row["identical_to_oracle"] = prediction == oracle
    return row
