"""bench.serving.quality chooses the headline schedule on one split and labels the rows it reports: the
cheapest schedule within the pair's F1 target on the rows it is given, nothing when none is."""

from __future__ import annotations

from bench.harness.pairs import pick_headline
from bench.serving.quality import label, table


def _row(mode: str, schedule: str, bytes_per_token: float, gap: float, **extra) -> dict:
    return {
        "pair": "heterogeneous",
        "layers": 2,
        "ctx": 512,
        "ctx_tokens": 511,
        "mode": mode,
        "schedule": schedule,
        "bytes_per_token": bytes_per_token,
        "bytes_ratio_vs_raw": None,
        "f1": 99.0 - gap,
        "em": 99.0 - gap,
        "f1_gap_vs_oracle": gap,
        "identical_to_oracle": 1.0,
        "encode_cost_ratio": None,
        "predictor_flops_ratio": 0.0,
        "consumer_flops_ratio": 0.0,
        **extra,
    }


def test_headline_is_the_cheapest_schedule_within_the_target():
    rows = [
        _row("oracle", "-", 0, 0.0),
        _row("raw", "-", 1024, 0.0),
        _row("scd", "R2.R32", 38, 6.5),
        _row("scd", "R2.R64", 70, 1.0),
        _row("scd", "R2.R128", 134, 0.0),
    ]
    assert pick_headline(rows, 2.0) == "R2.R64"  # raw is cheaper than nothing but is not a schedule
    assert pick_headline(rows, 0.5) == "R2.R128"
    assert pick_headline(rows, 7.0) == "R2.R32"
    assert pick_headline([r for r in rows if r["schedule"] != "R2.R128"], -1.0) is None


def test_test_rows_say_what_chose_them():
    rows = [
        _row("oracle", "-", 0, 0.0),
        _row("recompute", "end=1,start=0", 768, 30.0),
        _row("scd", "R2.R64", 70, 1.0, f1_ci95=[96.0, 99.5], f1_gap_ci95=[-0.5, 3.0]),
        _row("scd", "R2.R128", 134, 0.0),
    ]
    out = label(rows, "R2.R64", "validation", "artifacts/qa-base-to-tuned.safetensors")
    assert [(r["headline"], r["selected_on"]) for r in out] == [
        (False, None),
        (False, "calibration"),
        (True, "validation"),
        (False, "validation"),
    ]
    assert out[2]["artifact"] == "artifacts/qa-base-to-tuned.safetensors"
    assert out[2]["calibration_corpus"].startswith("qa:tuned:train") and "artifact" not in out[0]
    text = table(out)
    assert "| **`R2.R64`** |" in text and "| 96.0-99.5 |" in text and "| -0.5..+3.0 |" in text
    assert text.splitlines()[4].endswith("| validation |")
