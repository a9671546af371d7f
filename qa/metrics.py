"""SQuAD-style answer scoring: normalized exact match and token F1, as fractions in [0, 1].

Owns the normalization (lowercase, drop punctuation and the articles a/an/the, collapse
whitespace) and the bag-of-tokens F1, following the official SQuAD v1.1 evaluation script.
Knows nothing about models or the task generator.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Iterable

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(text: str) -> str:
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def f1_score(prediction: str, gold: str) -> float:
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not pred or not ref:  # SQuAD convention: both empty -> 1, one empty -> 0
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def score(pairs: Iterable[tuple[str, str]]) -> dict[str, float]:
    """Mean EM and F1 over (prediction, gold) pairs: {"n", "em", "f1"}."""
    n = em = f1 = 0.0
    for prediction, gold in pairs:
        n += 1
        em += exact_match(prediction, gold)
        f1 += f1_score(prediction, gold)
    if n == 0:
        raise ValueError("no pairs to score")
    return {"n": int(n), "em": em / n, "f1": f1 / n}


def bootstrap_ci(values: list[float], level: float = 0.95, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `values` (resampled with replacement,
    `resamples` times, seeded: the same values give the same interval). For a paired difference
    (a mode's F1 gap to the oracle on the same examples) pass the per-example differences."""
    import random

    if not values:
        raise ValueError("no values to resample")
    rng, n = random.Random(seed), len(values)
    means = sorted(sum(rng.choices(values, k=n)) / n for _ in range(resamples))
    tail = (1 - level) / 2
    return means[int(tail * (resamples - 1))], means[int(round((1 - tail) * (resamples - 1)))]
