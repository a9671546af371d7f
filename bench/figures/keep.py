"""Token selection's figures (shared.keep): the summary rows `python -m real.quality` writes with
`MODE@POLICY:BUDGET` modes to bench/results/real/keep-*.jsonl, one table per file (its oracle is
that run's own; a KL-only run gets a KL table), the check of the scorers against NVIDIA kvpress
(bench/results/real/keep-kvpress.json, bench.keep.kvpress_check) and DistillCache's training per
pair (bench/results/keep/distill-*.jsonl, calibration.distill_keep). Measures nothing."""

from __future__ import annotations

import json
from pathlib import Path

from bench.figures.real_pair import _interval, cost_cells
from bench.figures.rows import rows_of

HEADER = (
    "| mode | kept | bytes/token | x fewer than raw bf16 | F1 | 95% | gap to oracle | 95% | EM | identical |",
    "|---|---|---|---|---|---|---|---|---|---|",
)


def _mode(r: dict) -> str:
    """The mode's cell; a DistillCache mode names what its weights read (none named: the first,
    attention-feature weights)."""
    keep = r.get("keep") or {}
    if not keep.get("selection", "").startswith("distill"):
        return f"`{r['mode']}`"
    weights = keep.get("weights", {"inputs": ["features"]})
    return f"`{r['mode']}` [{'+'.join(weights['inputs'])}]"


def _line(r: dict) -> str:
    kept = "100%" if r.get("keep") is None else f"{r['keep']['kept_share']:.0%}"
    cost = cost_cells(r)
    return (
        f"| {_mode(r)} | {kept} | {cost} | {100 * r['f1']:.1f} | {_interval(r['f1_ci95'], '{:.1f}')} | "
        f"{100 * r['f1_gap']:+.1f} | {_interval(r['f1_gap_ci95'])} | {100 * r['em']:.1f} | {r['identical_to_oracle']:.0%} |"
    )


KL_HEADER = (
    "| mode | kept | text windows | mean next-token KL (nats) | 95% |",
    "|---|---|---|---|---|",
)


def _kl_line(r: dict) -> str:
    """A KL-only row (`--n 0 --windows K`): C's mean KL over 64 real tokens after each window."""
    kept = "100%" if r.get("keep") is None else f"{r['keep']['kept_share']:.0%}"
    return (
        f"| {_mode(r)} | {kept} | {r['windows']} | {r['mean_kl']:.4f} | {r['mean_kl_ci95'][0]:.4f}..{r['mean_kl_ci95'][1]:.4f} |"
    )


def training(root: Path) -> dict:
    """DistillCache's training per pair (and inputs, where not the attention features: "real-normed")
    from its curve (calibration.distill_keep's JSON lines): the run's record, the attention fit's
    first and last epoch (a probe over normed inputs), the validation KL at the start and at the chosen step, the heuristics' on
    the same validation examples, and the mean train reward per fraction in the first and last
    quarter of the steps."""
    out = {}
    for path in sorted((root / "bench/results/keep").glob("distill-*.jsonl")):
        rows = rows_of(path)
        done = next((r for r in rows if r["kind"] == "done"), None)
        if done is None:
            continue
        vals = {r["step"]: r for r in rows if r["kind"] == "validation" and "distill" in r}
        heur = next(r["heuristics"] for r in rows if r["kind"] == "validation" and "heuristics" in r)
        steps = [r for r in rows if r["kind"] == "step"]
        q = max(1, len(steps) // 4)
        quarter = lambda part, f: (
            sum(r["reward"] for r in part if r["fraction"] == f) / max(1, sum(r["fraction"] == f for r in part))
        )
        reward = {str(f): [round(quarter(steps[:q], f), 3), round(quarter(steps[-q:], f), 3)] for f in done["budgets"]}
        mean = lambda kl: round(sum(kl.values()) / len(kl), 3)
        warm = [r for r in rows if r["kind"] == "warm"]
        inputs = done.get("inputs", "features")  # the first runs' networks read attention features
        out[done["pair"] + ("" if inputs == "features" else f"-{inputs}")] = {
            **done,
            "minutes": round((done["train_s"] + done["prepare_s"]) / 60),
            "start": vals[0]["distill"],
            "chosen": vals[done["chosen_step"]]["distill"],
            "start_mean": mean(vals[0]["distill"]),
            "chosen_mean": mean(vals[done["chosen_step"]]["distill"]),
            "heuristics": heur,
            "heuristics_mean": {k: mean(v) for k, v in heur.items()},
            "reward_quarters": reward,
            "file": str(path.relative_to(root)),
            "warm_first": warm[0] if warm else None,
            "warm_last": warm[-1] if warm else None,
        }
    return out


POINTS_HEADER = [
    "| artifact | codec point | kept | policy | loss (nats per answer token) | bytes/token | keep weights |",
    "|---|---|---|---|---|---|---|",
]


def points(root: Path) -> str:
    """Keep points on the artifact's loss scale (`python -m calibration.keep_points`; the rows it
    wrote into the artifact, `bench/results/real/keep-points-*.jsonl`), by codec point and policy."""
    lines = []
    for path in sorted((root / "bench/results/real").glob("keep-points-*.jsonl")):
        for r in sorted(
            rows_of(path), key=lambda r: (r["mode"], r["options"].get("schedule", ""), r["keep"].split(":")[0], r["kept_share"])
        ):
            policy, fraction = r["keep"].split(":")[:2]
            codec = r["mode"] + (f":{r['options']['schedule']}" if "schedule" in r["options"] else "")
            lines.append(
                f"| `{r['artifact']}` | {codec} | {100 * float(fraction):.0f} % | {policy} | {r['loss']:.3f} |"
                f" {r['bytes_per_token']:.0f} | {r.get('keep_weights', '-')} |"
            )
    return "\n".join([*POINTS_HEADER, *lines]) if lines else "(no keep points measured)"


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
        if not rows[0]["n"]:  # KL-only
            title = title.replace(f"n = {rows[0]['n']} per mode", f"task-free KL, {rows[0]['windows']} text windows per mode")
            tables.append("\n".join([title, "", *KL_HEADER, *(_kl_line(r) for r in rows)]))
            cells[path.stem] = {r["mode"]: r for r in rows}
            continue
        tables.append("\n".join([title, "", *HEADER, *(_line(r) for r in rows)]))
        oracle_f1 = next((r["f1"] for r in rows if r["mode"] == "oracle"), None)
        cells[path.stem] = {
            r["mode"]: {
                **r,
                "f1_pt": 100 * r["f1"],
                "gap_pt": 100 * r["f1_gap"],
                "gap_ci_pt": [100 * x for x in r["f1_gap_ci95"]],
                "oracle_share_pt": 100 * r["f1"] / oracle_f1 if oracle_f1 else None,  # the share of the run's oracle's F1
            }
            for r in rows
        }
    check = folder / "keep-kvpress.json"
    kvpress = json.loads(check.read_text()) if check.exists() else None
    if kvpress:
        scored = [r for r in kvpress["rows"] if "score_max_abs_diff" in r]
        kvpress["max_score_diff"] = max(r["score_max_abs_diff"] for r in scored)
        kvpress["tie_only_sets"] = sum(1 for r in kvpress["rows"] for k, v in r.items() if k.startswith("keep_equal@") and not v)
    return {
        "tables": "\n\n".join(tables) or "(no rows yet)",
        "cells": cells,
        "kvpress": kvpress,
        "training": training(root),
        "points": points(root),
    }
