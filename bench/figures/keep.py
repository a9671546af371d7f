"""Token selection's figures (shared.keep): the summary rows `python -m real.quality` writes with
`MODE@POLICY:BUDGET` modes to bench/results/real/keep-*.jsonl, one table per file (its oracle is
that run's own), and the check of the scorers against NVIDIA kvpress
(bench/results/real/keep-kvpress.json, bench.keep.kvpress_check). Measures nothing."""

from __future__ import annotations

import json
from pathlib import Path

from bench.figures.real_pair import _interval, cost_cells
from bench.figures.rows import rows_of

HEADER = (
    "| mode | kept | bytes/token | x fewer than raw bf16 | F1 | 95% | gap to oracle | 95% | EM | identical |",
    "|---|---|---|---|---|---|---|---|---|---|",
)


def _line(r: dict) -> str:
    kept = "100%" if r.get("keep") is None else f"{r['keep']['kept_share']:.0%}"
    cost = cost_cells(r)
    return (
        f"| `{r['mode']}` | {kept} | {cost} | {100 * r['f1']:.1f} | {_interval(r['f1_ci95'], '{:.1f}')} | "
        f"{100 * r['f1_gap']:+.1f} | {_interval(r['f1_gap_ci95'])} | {100 * r['em']:.1f} | {r['identical_to_oracle']:.0%} |"
    )


def keep(root: Path) -> dict:
    folder = root / "bench/results/real"
    tables, cells = [], {}
    for path in sorted(folder.glob("keep-*.jsonl")):
        rows = [r for r in rows_of(path) if r.get("kind") == "summary"]
        if not rows:
            continue
        model = rows[0]["consumer_model"]
        title = (
            f"**{rows[0]['pair']}**, {rows[0]['split']} split, {rows[0]['context_tokens_asked']} tokens, n = {rows[0]['n']} "
            f"per mode (`{path.relative_to(root)}`; consumer `{model['model']}`, {model['dtype']}; artifact `{rows[0]['artifact']}`)"
        )
        tables.append("\n".join([title, "", *HEADER, *(_line(r) for r in rows)]))
        cells[path.stem] = {r["mode"]: {**r, "f1_pt": 100 * r["f1"], "gap_pt": 100 * r["f1_gap"]} for r in rows}
    check = folder / "keep-kvpress.json"
    kvpress = json.loads(check.read_text()) if check.exists() else None
    if kvpress:
        scored = [r for r in kvpress["rows"] if "score_max_abs_diff" in r]
        kvpress["max_score_diff"] = max(r["score_max_abs_diff"] for r in scored)
        kvpress["tie_only_sets"] = sum(1 for r in kvpress["rows"] for k, v in r.items() if k.startswith("keep_equal@") and not v)
    return {"tables": "\n\n".join(tables) or "(no rows yet)", "cells": cells, "kvpress": kvpress}
