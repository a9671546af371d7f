"""Token selection, policy against policy on the same examples: from the task rows of every
bench/results/real/keep-*.jsonl run, on C's own cache (`oracle@POLICY:FRACTION`) or on a codec's
rebuild (`scd:s11@POLICY:FRACTION`), the paired F1 difference of DistillCache and question-aware
SnapKV to each heuristic at the same fraction on the same cache (DistillCache's to question-aware
SnapKV too; and, on a codec's, to the codec alone), over the examples both were measured on, with a 95 % bootstrap interval (qa.metrics.bootstrap_ci).
DistillCache's rows are told apart by what their weights read (`distill[features]`: the first
weights, over attention features; `distill[normed]`: the probe over normed inputs).
Measures nothing."""

from __future__ import annotations

from pathlib import Path

from bench.figures.rows import rows_of
from qa.metrics import bootstrap_ci
from real.tasks import CONTEXT_TOKENS

CHALLENGERS = ("distill", "snapkv-q")
HEURISTICS = ("streaming", "snapkv", "h2o", "knorm")
ALONE = ""  # a codec mode's rows without a selection: what its kept rows are compared with too
HEADER = (
    "| context tokens | cache | policy | kept | against | n | F1 difference (points) | 95% |",
    "|---|---|---|---|---|---|---|---|",
)

Example = tuple[int, str, str, int]


def _f1s(folder: Path) -> dict[tuple[str, str, str, int], dict[Example, float]]:
    """(cache, policy, fraction, context tokens asked) -> {(seed, family, gold, context tokens): F1}, over every
    keep-*.jsonl file; cache: "oracle" (C's own) or a codec mode such as "scd:s11" (P's choice on
    what SCD rebuilds; also its rows without a selection, policy ALONE). An example is its seed,
    family, gold answer and length (a run resumed at --first 131 before real.tasks.examples was
    fixed asked other families at the same seeds: those never pair)."""
    out: dict[tuple[str, str, str, int], dict[Example, float]] = {}
    for path in sorted(folder.glob("keep-*.jsonl")):
        for r in rows_of(path):
            head, at, keep = r.get("mode", "").partition("@")
            if r.get("kind") != "task" or (head == "oracle" and not at):
                continue
            policy, fraction = (keep.split(":") + [""])[:2] if at else (ALONE, "1")
            if policy == "distill":  # which weights: rows before keep_weights ran the first, attention-feature ones
                policy += "[" + "+".join(r.get("keep_weights", {}).get("inputs", ["features"])) + "]"
            tokens = min(CONTEXT_TOKENS, key=lambda c: abs(c - r["context_tokens"]))  # the length the run asked
            out.setdefault((head, policy, fraction, tokens), {})[(r["seed"], r["family"], r["gold"], r["context_tokens"])] = (
                float(r["f1"])
            )
    return out


def keep_paired(root: Path) -> dict:
    f1s = _f1s(root / "bench/results/real")
    lines, cells = [], {}
    for (head, policy, fraction, tokens), mine in sorted(f1s.items()):
        if policy.partition("[")[0] not in CHALLENGERS:
            continue
        against = HEURISTICS + (("snapkv-q",) if policy.startswith("distill") else ())  # the question-aware one too
        others = [(other, (head, other, fraction, tokens)) for other in against]
        if head != "oracle":
            others.append((f"{head} alone", (head, ALONE, "1", tokens)))  # what the selection costs on top of the codec
        for other, key in others:
            theirs = f1s.get(key, {})
            seeds = sorted(set(mine) & set(theirs))
            if not seeds:
                continue
            diffs = [mine[s] - theirs[s] for s in seeds]
            mean, (lo, hi) = sum(diffs) / len(diffs), bootstrap_ci(diffs)
            name = f"{tokens}:{head}@{policy.replace('[', '-').rstrip(']')}:{fraction}-{other}"  # a template key: no brackets
            cells[name] = {"n": len(seeds), "diff_pt": 100 * mean, "ci_pt": [100 * lo, 100 * hi]}
            lines.append(
                f"| {tokens} | `{head}` | `{policy}` | {float(fraction):.0%} | `{other}` | {len(seeds)} | {100 * mean:+.1f} |"
                f" {100 * lo:+.1f}..{100 * hi:+.1f} |"
            )
    return {"table": "\n".join([*HEADER, *lines]) if lines else "(no rows yet)", "cells": cells}
