"""The figures of `make bench-verify` (bench/results/verify.jsonl) for docs/results.md: the quality
table (per pair and set: each policy's identical-to-oracle share and cost), the speed table (the
0.5B shape's 256-token answers) and the targets checked on the rows. Measures nothing."""

from __future__ import annotations

import statistics
from pathlib import Path

from bench.figures.rows import ROOT, rows_of

QUALITY_POLICIES = ("scd", "scd+repair", "scd+audit_fallback", "scd+audit_repair", "scd+verify")


ANCHOR_CHOICES = ("attention", "audit_error", "both")


def _name(r: dict) -> str:
    if r["policy"] != "scd+repair":
        return r["policy"]
    choice = r.get("anchor_choice", "attention")
    return f"{r['policy']} {r['repair_fraction']:.0%}" + (f" {choice}" if choice not in ("attention", "all") else "")


def _anchor_table(quality: list[dict]) -> str:
    """Per pair and repair fraction that ran with more than one anchor choice: each choice's mean
    identical-to-oracle share over the shifted sets and its median cost (x an own prefill)."""
    repairs = [r for r in quality if r["policy"] == "scd+repair" and r["set"] != "in_distribution"]
    cells: dict[tuple[str, float], dict[str, list[dict]]] = {}
    for r in repairs:
        cells.setdefault((r["pair"], r["repair_fraction"]), {}).setdefault(r["anchor_choice"], []).append(r)
    out = ["| pair | repaired | " + " | ".join(ANCHOR_CHOICES) + " |", "|---|---|" + "---|" * len(ANCHOR_CHOICES)]
    for (pair, fraction), by in sorted(cells.items()):
        if len(by) < 2:
            continue
        row = []
        for choice in ANCHOR_CHOICES:
            rs = by.get(choice)
            if not rs:
                row.append("-")
                continue
            same = statistics.fmean(r["identical_to_oracle"] for r in rs)
            cost = statistics.median(r["cost_ratio_vs_prefill"] for r in rs)
            row.append(f"{same:.2f} ({cost:.2f}x)")
        out.append(f"| {pair} | {fraction:.0%} | " + " | ".join(row) + " |")
    return "\n".join(out)


def _quality_table(rows: list[dict]) -> str:
    names = list(dict.fromkeys(_name(r) for r in rows if r["policy"] in QUALITY_POLICIES))
    out = [
        "| pair | set | n | oracle F1 | " + " | ".join(names) + " |",
        "|---" * (len(names) + 4) + "|",
    ]
    groups: dict[tuple[str, str], dict[str, dict]] = {}
    for r in rows:
        groups.setdefault((r["pair"], r["set"]), {})[_name(r)] = r
    for (pair, name), by in groups.items():
        oracle = by.get("oracle", {})
        f1 = "-" if oracle.get("f1") is None else f"{oracle['f1']:.1f}"
        cells = []
        for n in names:
            r = by.get(n)
            if r is None:
                cells.append("-")
                continue
            accepted = f", {r['accepted_draft_fraction']:.0%} accepted" if r.get("accepted_draft_fraction") is not None else ""
            cells.append(f"{r['identical_to_oracle']:.2f} ({r['cost_ratio_vs_prefill']:.2f}x{accepted})")
        out.append(f"| {pair} | {name} | {oracle.get('n', '-')} | {f1} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def _speed_table(rows: list[dict]) -> str:
    out = [
        "| model | weights | dtype | device | link | policy | n | TTFT p50 | first verified p50 | completion p50 | identical | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['model']} ({r['set']}) | {r['weights']} | {r['dtype']} | {_device(r)} | {r['link']} | {r['policy']} | {r['n']} |"
            f" {r['ttft_ms_p50']:.0f} ms | {r['time_to_verified_ms_p50']:.0f} ms | {r['completion_ms_p50']:.0f} ms |"
            f" {r['identical_to_oracle']:.2f} | {r['load_avg_1m']} |"
        )
    return "\n".join(out)


def _device(row: dict) -> str:
    return row.get("device", "cpu")  # rows before the field ran on this project's CPU


def _raw_and_verify(rows: list[dict]) -> tuple[dict | None, dict | None]:
    """The last raw row and the last +verify row among rows in file order."""
    last = lambda keep: next((r for r in reversed(rows) if keep(r["policy"])), None)
    return last(lambda p: p == "raw"), last(lambda p: p.endswith("+verify"))


def _speed_ratio(rows: list[dict]) -> tuple[float, str]:
    """(completion of the +verify policy / raw's, that policy) among one device's speed rows."""
    raw, ver = _raw_and_verify(rows)
    if raw is None or ver is None:
        return float("nan"), ""
    return ver["completion_ms_p50"] / raw["completion_ms_p50"], ver["policy"]


def _runs_of(rows: list[dict]) -> list[dict[str, dict]]:
    """Speed rows in file order split into invocations (policy -> row): one starts where a policy repeats."""
    groups: list[dict[str, dict]] = []
    for r in rows:
        if not groups or r["policy"] in groups[-1]:
            groups.append({})
        groups[-1][r["policy"]] = r
    return groups


def _paired(groups: list[dict[str, dict]]) -> dict:
    """The +verify policy's completion / raw's, run by run (run i of both shares a context), over
    every invocation whose rows carry per-run times: {n, below (runs where +verify finished
    first), median, lo, hi, invocations}; n = 0 without per-run times."""
    ratios: list[float] = []
    used = 0
    for by_policy in groups:
        raw, ver = _raw_and_verify(list(by_policy.values()))
        if raw is None or ver is None or "completion_ms_each" not in raw or "completion_ms_each" not in ver:
            continue
        used += 1
        ratios += [v / r for v, r in zip(ver["completion_ms_each"], raw["completion_ms_each"], strict=True)]
    if not ratios:
        return {"n": 0, "below": 0, "median": float("nan"), "lo": float("nan"), "hi": float("nan"), "invocations": 0}
    return {
        "n": len(ratios),
        "below": sum(x < 1 for x in ratios),
        "median": statistics.median(ratios),
        "lo": min(ratios),
        "hi": max(ratios),
        "invocations": used,
    }


def verify(root: Path = ROOT) -> dict:
    path = root / "bench/results/verify.jsonl"
    rows = rows_of(path) if path.exists() else []
    quality = [r for r in rows if r["weights"] == "trained"]
    speed = [r for r in rows if r["weights"] != "trained"]
    verified = [r for r in quality if r["policy"] == "scd+verify"]
    shifted_repair = [
        r
        for r in quality
        if r["policy"] == "scd+repair" and r["set"] != "in_distribution" and r["repair_fraction"] < 1 and _by_attention(r)
    ]
    by_error = [r for r in quality if r["policy"] == "scd+repair" and r.get("anchor_choice") == "audit_error"]
    deep_error = [r for r in by_error if r["pair"] != "heterogeneous" and r["set"] != "in_distribution"]
    flagged = _flagged_sets(quality)
    small = [r for r in quality if r["policy"] == "scd+repair" and r["repair_fraction"] <= 0.2 and _by_attention(r)]
    big = [r for r in quality if r["policy"] == "scd+repair" and r["repair_fraction"] >= 0.5]
    speed_ratio, speed_policy = _speed_ratio([r for r in speed if _device(r) == "cpu"])
    gpu_rows = [r for r in speed if _device(r).startswith("cuda")]
    gpu_by = {r["policy"]: r for r in gpu_rows}  # the latest GPU run's row per policy
    gpu_ratio, _ = _speed_ratio(list(gpu_by.values()))
    return {
        "rows": len(rows),
        "quality_table": _quality_table(quality) if quality else "(no rows)",
        "anchor_table": _anchor_table(quality) if by_error else "(no rows with another anchor choice)",
        "error_cost_lo": min((r["cost_ratio_vs_prefill"] for r in deep_error), default=float("nan")),
        "error_cost_hi": max((r["cost_ratio_vs_prefill"] for r in deep_error), default=float("nan")),
        "speed_table": _speed_table(speed) if speed else "(no rows)",
        "verify_min_identical": min((r["identical_to_oracle"] for r in verified), default=float("nan")),
        "verify_sets": len(verified),
        "verify_cost_lo": min((r["cost_ratio_vs_prefill"] for r in verified), default=float("nan")),
        "verify_cost_hi": max((r["cost_ratio_vs_prefill"] for r in verified), default=float("nan")),
        "repair_best_shifted": max((r["identical_to_oracle"] for r in shifted_repair), default=float("nan")),
        "repair_worst_shifted": min((r["identical_to_oracle"] for r in shifted_repair), default=float("nan")),
        "repair_cost_small_lo": min((r["cost_ratio_vs_prefill"] for r in small), default=float("nan")),
        "repair_cost_small_hi": max((r["cost_ratio_vs_prefill"] for r in small), default=float("nan")),
        "repair_cost_big_lo": min((r["cost_ratio_vs_prefill"] for r in big), default=float("nan")),
        "speed_ratio": speed_ratio,
        "speed_policy": speed_policy,
        "speed_ratio_gpu": gpu_ratio,
        "gpu_paired": _paired(_runs_of(gpu_rows)),
        "gpu_speed": gpu_by,  # policy -> its GPU row ({} without one)
        "gpu_oracle_over_raw": (gpu_by["oracle"]["completion_ms_p50"] / gpu_by["raw"]["completion_ms_p50"])
        if {"oracle", "raw"} <= set(gpu_by)
        else float("nan"),
        **flagged,
    }


def _by_attention(r: dict) -> bool:
    return r.get("anchor_choice", "attention") == "attention"


def _flagged_sets(quality: list[dict]) -> dict:
    """The audit's REPAIR against its FALLBACK on the (pair, set) rows where the audit flags
    caches often (FALLBACK's cost over one own prefill): their cost ranges, and in how many
    REPAIR's identical share is below FALLBACK's."""
    by: dict[tuple[str, str], dict[str, dict]] = {}
    for r in quality:
        by.setdefault((r["pair"], r["set"]), {})[r["policy"]] = r
    pairs = [
        (g["scd+audit_fallback"], g["scd+audit_repair"])
        for g in by.values()
        if "scd+audit_fallback" in g and "scd+audit_repair" in g and g["scd+audit_fallback"]["cost_ratio_vs_prefill"] > 1
    ]
    nan = float("nan")
    fb = [f["cost_ratio_vs_prefill"] for f, _ in pairs]
    ar = [a["cost_ratio_vs_prefill"] for _, a in pairs]
    return {
        "flagged_sets": len(pairs),
        "fallback_cost_lo": min(fb, default=nan),
        "fallback_cost_hi": max(fb, default=nan),
        "audit_repair_cost_lo": min(ar, default=nan),
        "audit_repair_cost_hi": max(ar, default=nan),
        "audit_repair_worse": sum(a["identical_to_oracle"] < f["identical_to_oracle"] for f, a in pairs),
        "audit_repair_cheaper": sum(a["cost_ratio_vs_prefill"] < f["cost_ratio_vs_prefill"] for f, a in pairs),
    }
