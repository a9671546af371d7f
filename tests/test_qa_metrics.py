"""Tests for qa.metrics against hand-computed SQuAD-style EM and F1."""

from __future__ import annotations

import pytest

from qa.metrics import exact_match, f1_score, normalize_answer, score


def test_normalization_drops_case_punctuation_articles_and_extra_space():
    assert normalize_answer("  The  Kilo, Vanu . ") == "kilo vanu"
    assert normalize_answer("an apple a day") == "apple day"


@pytest.mark.parametrize(
    "pred, gold, em, f1",
    [
        ("kilo vanu", "kilo vanu", 1.0, 1.0),
        ("kilo vanu .", "Kilo vanu", 1.0, 1.0),
        ("vanu kilo", "kilo vanu", 0.0, 1.0),  # bag of tokens: order does not matter for F1
        ("kilo", "kilo vanu", 0.0, 2 * 1.0 * 0.5 / 1.5),  # P=1, R=1/2 -> F1=2/3
        ("kilo rasu tepo", "kilo vanu", 0.0, 2 * (1 / 3) * 0.5 / (1 / 3 + 0.5)),  # P=1/3, R=1/2 -> 0.4
        ("kilo kilo", "kilo vanu", 0.0, 0.5),  # clipped counts: 1 common, P=1/2, R=1/2
        ("rasu tepo", "kilo vanu", 0.0, 0.0),
        ("", "kilo vanu", 0.0, 0.0),
        ("the", "", 1.0, 1.0),  # both normalize to empty
    ],
)
def test_em_and_f1_hand_computed(pred, gold, em, f1):
    assert exact_match(pred, gold) == em
    assert f1_score(pred, gold) == pytest.approx(f1)


def test_score_averages():
    result = score([("kilo vanu", "kilo vanu"), ("kilo", "kilo vanu"), ("x y", "kilo vanu"), ("vanu kilo", "kilo vanu")])
    assert result["n"] == 4
    assert result["em"] == pytest.approx(0.25)
    assert result["f1"] == pytest.approx((1 + 2 / 3 + 0 + 1) / 4)
    with pytest.raises(ValueError):
        score([])


def test_bootstrap_interval_brackets_the_mean_and_narrows_with_n():
    from qa.metrics import bootstrap_ci

    few = [1.0, 0.0] * 10
    many = few * 20
    lo, hi = bootstrap_ci(few)
    assert lo < 0.5 < hi and 0.25 < lo and hi < 0.75
    lo_many, hi_many = bootstrap_ci(many)
    assert hi_many - lo_many < (hi - lo) / 3  # the interval shrinks like 1/sqrt(n)
    assert bootstrap_ci(few) == (lo, hi)  # seeded: reproducible
    assert bootstrap_ci([1.0] * 5) == (1.0, 1.0)
    with pytest.raises(ValueError):
        bootstrap_ci([])
