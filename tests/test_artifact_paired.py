"""bench.figures.artifact_paired: two artifacts' rows paired by example, schedules mapped by name."""

import json

from bench.figures.artifact_paired import paired


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + json.dumps({"kind": "summary", "mode": "oracle"}) + "\n")


def _row(seed, mode, f1, prediction="x"):
    return {"kind": "task", "seed": seed, "family": "qa", "gold": "g", "context_tokens": 1024, "mode": mode, "f1": f1,
            "prediction": prediction}


def test_pairs_by_example_maps_schedules_and_skips_partial_examples(tmp_path):
    new, ref = tmp_path / "new.jsonl", tmp_path / "ref.jsonl"
    _write(new, [_row(1, "oracle", 1.0), _row(1, "scd:s1", 0.5), _row(2, "oracle", 1.0), _row(2, "scd:s1", 1.0),
                 _row(3, "oracle", 1.0)])  # example 3 lacks scd:s1: not whole, left out
    _write(ref, [_row(1, "oracle", 1.0), _row(1, "scd:s7", 0.0), _row(2, "oracle", 1.0, "other"), _row(2, "scd:s7", 1.0),
                 _row(3, "scd:s7", 0.0)])
    rows = {r["mode"]: r for r in paired(new, ref, {"s1": "s7"})}
    s1 = rows["scd:s1"]
    assert s1["reference_mode"] == "scd:s7" and s1["n"] == 2
    assert s1["f1_gap"] == 0.25 and s1["new_minus_reference"] == 0.25
    assert s1["oracle_answers_agree"] == 1  # example 2's reference oracle answered otherwise
    assert rows["oracle"]["f1_gap"] == 0.0
    assert paired(new, ref, {}) == [rows["oracle"]]  # unmapped: no scd:s1 in the reference
    alone = {r["mode"]: r for r in paired(new, ref, {"s2": "s7"}, strict=True)}["scd:s1"]
    assert alone["reference_mode"] is None and alone["new_minus_reference"] is None  # strict: s1 has no counterpart
    assert alone["n"] == 2 and alone["f1_gap"] == 0.25  # its gap alone, over the whole examples
    # and against each of the reference's modes, on the examples both hold
    assert alone["versus"] == {"scd:s7": {"n": 2, "new_minus_reference": 0.25, "new_minus_reference_ci95": [0.0, 0.5]}}


def test_schedules_pair_by_their_text():
    from bench.figures.artifact_paired import by_text

    assert by_text({"s0": "R2.R4", "s1": "R8.R8", "s2": "P8.P"}, {"s5": "R2.R4", "s7": "R8.R8"}) == {"s0": "s5", "s1": "s7"}
