"""bench.serving.verify's real-pair path without the services: it asks the examples real.quality
scores (the same ids, in the consumer's chat format), its audit summary counts recall and
precision as defined, a stopped run's rows summarize, and the figures read them."""

from __future__ import annotations

import json

import pytest

from bench.figures.real_verify import real_verify
from bench.serving import verify
from bench.serving.audit import flag_summary

BASE = {
    "pair": "P->C",
    "weights": "pretrained",
    "model": "p->c",
    "dtype": "float32",
    "artifact": "abc",
    "schedule": "s11",
    "context_tokens_asked": 1024,
    "max_new_tokens": 48,
    "consumer_model": {"model": "c", "dtype": "float32"},
}


def test_real_sets_ask_the_examples_real_quality_scores():
    from bench.harness.question_sets import RealSets
    from real import tasks

    source = RealSets("smollm2-pc", context_tokens=256)
    asked = list(source.asked("test", 6))
    made = tasks.examples(source.tokenizer, "test", 6, 256)
    assert [q.context.token_ids.ids for q in asked] == [ex.context_ids for ex in made]
    assert [q.question.token_ids.ids for q in asked] == [ex.question_ids for ex in made]
    assert [q.labels["family"] for q in asked] == [ex.family for ex in made]
    assert source.end_id == tasks.end_id(source.tokenizer) and source.schedule() == {"schedule": "s11"}
    assert [source.f1(q.gold, q) for q in asked] == [1.0] * 6 and source.f1("no idea", asked[0]) == 0.0


def record(index: int, policy: str, identical: bool, f1: float, decision: str = "", ids=(1, 2), fraction: float = 0.0) -> dict:
    anchor = "none" if not fraction else "attention"
    one = dict.fromkeys(verify.SAMPLE_KEYS, 0) | {
        "policy": policy,
        "repair_fraction": fraction,
        "anchor_choice": anchor,
        "ids": list(ids),
        "prediction": "x",
        "identical_to_oracle": identical,
        "f1": f1,
        "cost": 0.1,
        "audit_decision": decision,
        "audit_layer_errors": [0.1, 0.2],
        "verify_decision": "",
    }
    return {
        **BASE,
        "kind": "verify_example",
        "set": "test",
        "index": index,
        "split": "test",
        "family": "qa",
        "seed": index,
        "context_tokens": 1024,
        "gold": "g",
        **one,
    }


def run_of(cases: list[tuple[bool, str]]) -> list[dict]:
    """Per example (scd identical to the oracle, the fallback's audit decision): its rows."""
    rows = []
    for i, (same, decision) in enumerate(cases):
        scd_ids = (1, 2) if same else (1, 3)
        rows += [
            record(i, "oracle", True, 1.0),
            record(i, "scd", same, 1.0 if same else 0.0, ids=scd_ids),
            record(i, "scd+repair", True, 1.0, fraction=0.1),
            record(i, "scd+audit_fallback", True, 1.0, decision, ids=(1, 2) if decision.startswith("diverged") else scd_ids),
            record(i, "scd+verify", True, 1.0),
        ]
    return rows


def test_flag_summary_counts_recall_precision_and_false_alarms():
    # 3 diverged (2 flagged), 5 agreeing (1 flagged)
    cases = (
        [(False, "diverged: prefilled locally")] * 2
        + [(False, "ok")]
        + [(True, "diverged: prefilled locally")]
        + [(True, "ok")] * 4
    )
    line = flag_summary(run_of(cases), BASE)
    assert (line["n"], line["diverged"], line["flagged"], line["flagged_diverged"]) == (8, 3, 3, 2)
    assert line["recall"] == pytest.approx(2 / 3, abs=1e-4) and line["precision"] == pytest.approx(2 / 3, abs=1e-4)
    assert line["false_alarm_rate"] == pytest.approx(1 / 5) and line["unflagged_same_as_scd"] == 1.0
    assert line["by_family"]["qa"] == {"n": 8, "diverged": 3, "flagged": 3, "flagged_diverged": 2}


def test_a_stopped_run_summarizes_and_the_figures_read_it(tmp_path):
    folder = tmp_path / "real"
    folder.mkdir()
    rows = folder / "verify-pc-1024.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in run_of([(False, "diverged"), (True, "ok"), (True, "ok")])))
    verify.summarize(rows, folder / "audit-pc-1024.jsonl")
    summaries = {
        (r["policy"], r["repair_fraction"]): r for r in map(json.loads, rows.read_text().splitlines()) if r["kind"] == "verify"
    }
    assert set(summaries) == {
        ("oracle", 0.0),
        ("scd", 0.0),
        ("scd+repair", 0.1),
        ("scd+audit_fallback", 0.0),
        ("scd+verify", 0.0),
    }
    scd = summaries[("scd", 0.0)]
    assert (scd["n"], scd["identical_count"], scd["f1"], scd["f1_gap"], scd["stopped_early"]) == (
        3,
        2,
        pytest.approx(66.67),
        pytest.approx(33.33),
        True,
    )
    assert "identical_to_oracle" in scd and scd["artifact"] == "abc" and "ids" not in scd
    figures = real_verify(folder)
    assert "| `scd+verify` | 100.0 | +0.0 |" in figures["tables"] and "| `scd+repair 10%` |" in figures["tables"]
    assert figures["by_schedule"]["s11"]["audit"]["recall"] == 1.0 and figures["by_schedule"]["s11"]["r10"]["n"] == 3
    assert "| P->C | `s11` | 3 | 1 | 1 | 1 | 1.00 | 1.00 | 0.00 |" in figures["audit_table"]
