"""Token selection, policy against policy on the same examples: from the task rows of every
bench/results/real/keep-*.jsonl run on C's own cache (`oracle@POLICY:FRACTION`), the paired F1
difference of DistillCache and question-aware SnapKV to each heuristic at the same fraction, over
the seeds both were measured on, with a 95 % bootstrap interval (qa.metrics.bootstrap_ci).
DistillCache's rows are told apart by what their weights read (`distill[features]`: the first
weights, over attention features; `distill[normed]`: the probe over normed inputs).
Measures nothing."""

from __future__ import annotations

from pathlib import Path

from bench.figures.rows import rows_of
from qa.metrics import bootstrap_ci

CHALLENGERS = ("distill", "snapkv-q")
HEURISTICS = ("streaming", "snapkv", "h2o", "knorm")
HEADER = (
    "| policy | kept | against | n | F1 difference (points) | 95% |",
    "|---|---|---|---|---|---|",
)


def _f1s(folder: Path) -> dict[tuple[str, str], dict[tuple[int, str, str, int], float]]:
    """(policy, fraction) -> {(seed, family, gold, context tokens): F1} of C's own kept cache, over every keep-*.jsonl
    file: an example is its seed, family and gold answer (a run resumed at --first 131 before
    real.tasks.examples was fixed asked other families at the same seeds: those never pair)."""
    out: dict[tuple[str, str], dict[tuple[int, str, str, int], float]] = {}
    for path in sorted(folder.glob("keep-*.jsonl")):
        for r in rows_of(path):
            head, at, keep = r.get("mode", "").partition("@")
            if r.get("kind") != "task" or head != "oracle" or not at:
                continue
            policy, _, fraction = keep.partition(":")
            if policy == "distill":  # which weights: rows before keep_weights ran the first, attention-feature ones
                policy += "[" + "+".join(r.get("keep_weights", {}).get("inputs", ["features"])) + "]"
            out.setdefault((policy, fraction), {})[(r["seed"], r["family"], r["gold"], r["context_tokens"])] = float(r["f1"])
    return out


def keep_paired(root: Path) -> dict:
    f1s = _f1s(root / "bench/results/real")
    lines, cells = [], {}
    for (policy, fraction), mine in sorted(f1s.items()):
        if policy.partition("[")[0] not in CHALLENGERS:
            continue
        for other in HEURISTICS:
            theirs = f1s.get((other, fraction), {})
            seeds = sorted(set(mine) & set(theirs))
            if not seeds:
                continue
            diffs = [mine[s] - theirs[s] for s in seeds]
            mean, (lo, hi) = sum(diffs) / len(diffs), bootstrap_ci(diffs)
            cells[f"{policy}:{fraction}-{other}"] = {"n": len(seeds), "diff_pt": 100 * mean, "ci_pt": [100 * lo, 100 * hi]}
            lines.append(
                f"| `{policy}` | {float(fraction):.0%} | `{other}` | {len(seeds)} | {100 * mean:+.1f} | {100 * lo:+.1f}..{100 * hi:+.1f} |"
            )
    return {"table": "\n".join([*HEADER, *lines]) if lines else "(no rows yet)", "cells": cells}
