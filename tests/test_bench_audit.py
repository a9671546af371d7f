"""The shifted evaluation sets (qa.shifted) keep their promises and are deterministic, and a small
run of the audit benchmark (bench.serving.audit) through the real services prints its JSON lines."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from bench.serving import audit
from qa import shifted
from qa.task import QUERY_CLOSE, QUERY_OPEN, SPLIT_SIZE, vocabulary

TRAINED_MAX_TOKENS = 120 * 5 + 1  # qa.train: up to 120 facts per context, + BOS


def tokens(text: str) -> int:
    return len(text.split()) + 1  # word-level tokenizer, + BOS


def words_after(context: str, rel: str, name: str) -> list[list[str]]:
    """The two words following each occurrence of the bigram (rel, name)."""
    w = context.split()
    return [w[i + 2 : i + 4] for i in range(len(w) - 1) if (w[i], w[i + 1]) == (rel, name)]


def asked(ex: shifted.ShiftedExample) -> tuple[str, str]:
    words = [w for w in ex.question.split() if w not in (QUERY_OPEN, QUERY_CLOSE)]
    return words[0], words[1]


@pytest.mark.parametrize("name", list(shifted.SETS))
def test_sets_are_deterministic_distinct_and_in_vocabulary(name):
    first, again = list(shifted.examples(name, 4)), list(shifted.examples(name, 4))
    assert first == again and len({e.context for e in first}) == 4
    vocab = set(vocabulary())
    for ex in first:
        assert set(ex.context.split()) <= vocab and set(ex.question.split()) <= vocab
    spec = shifted.SETS[name]
    assert spec.in_distribution == (name == "in_distribution")
    seeds = shifted.SEED_BASE + spec.number * shifted.SEED_STRIDE
    assert 1000 < seeds and seeds + shifted.SEED_STRIDE <= SPLIT_SIZE  # test split, away from seeds 0..999


def test_set_numbers_are_unique():
    assert len({s.number for s in shifted.SETS.values()}) == len(shifted.SETS)


def test_answered_sets_ask_a_unique_fact_and_gold_is_its_answer():
    for name in ("in_distribution", "long_context", "fact_in_random_tokens", "repeated_values", "fact_position_first",
                 "fact_position_last"):
        for ex in shifted.examples(name, 5):
            rel, name_ = asked(ex)
            (following,) = words_after(ex.context, rel, name_)
            assert ex.question.startswith(QUERY_OPEN) and ex.answer == " ".join(reversed(following))


def test_shapes_differ_from_training_as_promised():
    home = list(shifted.examples("in_distribution", 3))
    assert all(tokens(e.context) == 511 for e in home)
    assert all(tokens(e.context) > TRAINED_MAX_TOKENS + 150 for e in shifted.examples("long_context", 3))
    for ex in shifted.examples("base_question_format", 3):  # base rendering: `REL NAME` -> `V1 V2`
        assert QUERY_OPEN not in ex.question.split() and len(ex.question.split()) == 2
        (following,) = words_after(ex.context, *ex.question.split())
        assert ex.answer == " ".join(following)
    for ex in shifted.examples("fact_in_random_tokens", 5):
        rel, name = asked(ex)
        v2, v1 = ex.answer.split()
        counts = Counter(ex.context.split())
        assert counts[v1] == counts[v2] == 1 and tokens(ex.context) == 512
        assert counts["."] < 20  # random words, not facts
    for ex in shifted.examples("random_tokens", 5):
        assert ex.answer is None and words_after(ex.context, *asked(ex)) == [] and tokens(ex.context) == 512
    for ex in shifted.examples("repeated_values", 3):
        values = Counter(w for i, w in enumerate(ex.context.split()) if i % 5 in (2, 3))
        assert len(values) <= shifted.REPEATED_POOL and min(values.values()) > 1
    first, last = next(shifted.examples("fact_position_first", 1)), next(shifted.examples("fact_position_last", 1))
    assert first.context.split()[:2] == list(asked(first)) and last.context.split()[-5:-3] == list(asked(last))


def test_flops_ratio_is_about_k_over_t():
    config = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 512,
              "num_hidden_layers": 2}
    assert audit.flops_ratio(config, 511, 8) == pytest.approx(8 / 511, rel=0.5)


def test_cost_at_scale_times_the_audit_beside_the_prefill():
    (row,) = audit.cost_at_scale([64], 8, reps=1, threads=1, model_name="tiny-llama")
    assert row["scale"] == "tiny-llama" and row["tokens"] == 64 and row["prefill_ms"] > 0 and row["audit_ms"] > 0 and row["max_error"] < 0.05
    # the ms are rounded to 0.1 in the row, the ratio is not
    low, high = (row["audit_ms"] - 0.05) / (row["prefill_ms"] + 0.05), (row["audit_ms"] + 0.05) / (row["prefill_ms"] - 0.05)
    assert low <= row["cost_ratio"] <= high and 0 < row["cost_ratio_flops"] < 1


def test_a_small_run_prints_a_line_per_set_and_a_summary(tmp_path, capsys):
    audit.main(["--n", "2", "--sets", "in_distribution,random_tokens", "--out-dir", str(tmp_path),
                "--records", str(tmp_path / "examples.jsonl"), "--scale-tokens"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r.get("set") for r in lines] == ["in_distribution", "random_tokens", None]
    for row in lines[:2]:
        assert {"set", "in_distribution", "n", "diverged", "flagged_diverged", "flagged_agreeing", "audit_cost_ratio",
                "oracle_f1", "scd_f1", "identical_rate", "fallback_identical_rate", "upgrade_identical_rate",
                "upgrade_local_rate", "upgrade_bytes_ratio"} <= set(row)
        assert row["n"] == 2 and row["audit_cost_ratio"] > 0
    assert lines[1]["scd_f1"] is None  # no gold in random tokens
    assert {"recall", "false_alarm_rate", "cost_ratio", "fallback_identical_rate", "upgrade_identical_rate"} <= set(lines[2])
    assert lines[2]["pair"] == "heterogeneous" and "cost_at_scale" not in lines[2]
    assert lines[2]["weights"] == "trained" and lines[2]["artifact"].startswith("artifacts/")
    # random tokens diverge, are flagged, and UPGRADE re-transfers (more bytes) before prefilling locally
    assert lines[1]["upgrade_identical_rate"] == 1.0 and lines[1]["upgrade_bytes_ratio"] > 1.0
    assert (tmp_path / "audit.jsonl").read_text().count("\n") == 3 and "| random_tokens |" in (tmp_path / "audit.md").read_text()
