"""The real pair's VERIFY, anchor-repair and audit figures, from the rows
`python -m bench.serving.verify --real ...` writes to bench/results/real/ (kind "verify": one
summary per policy; kind "audit": the audit's recall and precision on the same examples): one
table per (pair, split, context length, schedule), one audit table, and the cells by schedule
for the prose. Measures nothing."""

from __future__ import annotations

from pathlib import Path

from bench.figures.rows import cells_of, rows_of

HEADER = (
    "| policy | F1 | gap to oracle | 95% | identical to oracle | cost (x own prefill) | completion p50 ms | drafts accepted |",
    "|---|---|---|---|---|---|---|---|",
)
AUDIT_HEADER = (
    "| pair | schedule | n | SCD answers diverged | flagged | flagged and diverged | recall | precision | false alarms "
    "| fallback identical | audit cost (x own prefill) |",
    "|---|---|---|---|---|---|---|---|---|---|---|",
)


# the prose's names of the policies (docs templates: real[verify][by_schedule][s11][verify][n])
SHORT = {
    "scd+verify": "verify",
    "scd+audit_fallback": "fallback",
    "scd+audit_repair": "audit_repair",
    **{f"scd+repair {f}%": f"r{f}" for f in (5, 10, 20, 50)},
    "scd+repair 100% (all)": "rall",
}


def policy_name(r: dict) -> str:
    if r["policy"] != "scd+repair":
        return r["policy"]
    return f"scd+repair {r['repair_fraction']:.0%}" + (" (all)" if r["anchor_choice"] == "all" else "")


def _line(r: dict) -> str:
    gap = "-" if r["policy"] == "oracle" or r.get("f1_gap") is None else f"{r['f1_gap']:+.1f}"
    ci = "-" if gap == "-" else "..".join(f"{x:+.1f}" for x in r["f1_gap_ci95"])
    accepted = "-" if r["accepted_draft_fraction"] is None else f"{r['accepted_draft_fraction']:.0%}"
    return (
        f"| `{policy_name(r)}` | {r['f1']:.1f} | {gap} | {ci} | {r['identical_count']}/{r['n']} ({r['identical_to_oracle']:.0%}) "
        f"| {r['cost_ratio_vs_prefill']:.2f} | {r['completion_ms_p50']:.0f} | {accepted} |"
    )


def _audit_line(a: dict) -> str:
    def rate(v) -> str:
        return "-" if v is None else f"{v:.2f}"

    return (
        f"| {a['pair']} | `{a['schedule']}` | {a['n']} | {a['diverged']} | {a['flagged']} | {a['flagged_diverged']} "
        f"| {rate(a['recall'])} | {rate(a['precision'])} | {rate(a['false_alarm_rate'])} "
        f"| {rate(a['fallback_identical_rate'])} | {a['audit_cost_ratio']:.3f} |"
    )


def real_verify(folder: Path) -> dict:
    """{"tables", "audit_table", "by_schedule": {schedule: {policy (SHORT): row, "audit": row}},
    "<schedule>_auroc": the per-layer AUROC span}."""
    rows = [r for f in sorted(folder.glob("*.jsonl")) for r in rows_of(f)] if folder.exists() else []
    summaries = [r for r in rows if r.get("kind") == "verify"]
    audits = [r for r in rows if r.get("kind") == "audit"]
    if not summaries:
        return {"tables": "(no rows yet: python -m bench.serving.verify --real smollm2-pc)", "audit_table": "", "by_schedule": {}}
    tables, by_schedule = [], {}
    for (pair, split, ctx, schedule), cell in cells_of(summaries, "pair", "set", "context_tokens_asked", "schedule").items():
        model = cell[0]["consumer_model"]
        stopped = " (stopped early: n is what was measured)" if cell[0].get("stopped_early") else ""
        title = (
            f"**{pair}**, {split} split, {ctx} tokens, scd `{schedule}`, n = {cell[0]['n']} per policy{stopped} "
            f"(consumer `{model['model']}`, {model['dtype']}, {cell[0]['weights']} weights; artifact `{cell[0]['artifact']}`; "
            f"greedy, up to {cell[0]['max_new_tokens']} new tokens; through the services on loopback)"
        )
        tables.append("\n".join([title, "", *HEADER, *(_line(r) for r in cell)]))
        by_schedule[schedule] = {SHORT.get(policy_name(r), policy_name(r)): r for r in cell}
    for a in audits:
        by_schedule.setdefault(a["schedule"], {})["audit"] = a
    audit_table = "\n".join([*AUDIT_HEADER, *(_audit_line(a) for a in audits)]) if audits else ""
    aurocs = {f"{a['schedule']}_auroc": _span(a["layer_error_auroc"]) for a in audits}
    return {"tables": "\n\n".join(tables), "audit_table": audit_table, "by_schedule": by_schedule, **aurocs}


def _span(values: list[float | None]) -> str:
    """'0.38-0.73, best layer 7' of per-layer AUROCs."""
    known = [(v, i) for i, v in enumerate(values) if v is not None]
    if not known:
        return "-"
    best = max(known)
    return f"{min(known)[0]:.2f}-{best[0]:.2f}, best layer {best[1]}"
