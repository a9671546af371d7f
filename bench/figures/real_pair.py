"""The real pair's figures (SmolLM2-135M-Instruct P -> its fine-tune C, and P -> P), from the
summary rows `python -m real.quality` writes to bench/results/real_quality.jsonl: one table per
(pair, split, context length), and the headline (the schedule chosen on validation, as measured
on test). Measures nothing."""

from __future__ import annotations

from pathlib import Path

from bench.figures.rows import RESULTS, cells_of, rows_of

ROWS = "real_quality.jsonl"
HEADER = (
    "| mode | bytes/token | x fewer than raw bf16 | F1 | 95% | gap to oracle | 95% | EM | identical | recall | KL (nats/token) |",
    "|---|---|---|---|---|---|---|---|---|---|---|",
)


def _pct(values: list[float]) -> str:
    return "..".join(f"{100 * v:+.1f}" if i else f"{100 * v:.1f}" for i, v in enumerate(values))


def _gap(values: list[float]) -> str:
    return "..".join(f"{100 * v:+.1f}" for v in values)


def _line(r: dict) -> str:
    kl = "-" if r["mean_kl"] is None else f"{r['mean_kl']:.4f}"
    return (
        f"| `{r['mode']}` | {r['bytes_per_token']:g} | {r['bytes_ratio_vs_bf16_raw']:.1f} | {100 * r['f1']:.1f} | "
        f"{_pct(r['f1_ci95']).replace('+', '')} | {100 * r['f1_gap']:+.1f} | {_gap(r['f1_gap_ci95'])} | {100 * r['em']:.1f} | "
        f"{r['identical_to_oracle']:.0%} | {100 * r['recall']:.1f} | {kl} |"
    )


def real_pair(root: Path = RESULTS.parents[1]) -> dict:
    path = root / "bench/results" / ROWS
    if not path.exists():
        return {"tables": "(no rows yet: python -m real.quality)", "cells": {}}
    summaries = [r for r in rows_of(path) if r.get("kind") == "summary"]
    cells = cells_of(summaries, "pair", "split", "context_tokens_asked")
    tables, out = [], {}
    for (pair, split, ctx), rows in cells.items():
        model = rows[0]["consumer_model"]
        title = (
            f"**{pair}**, {split} split, {ctx} tokens, n = {rows[0]['n']} per mode "
            f"(consumer `{model['model']}`, {model['dtype']}; artifact `{rows[0]['artifact']}`)"
        )
        tables.append("\n".join([title, "", *HEADER, *(_line(r) for r in rows)]))
        out[f"{pair}|{split}|{ctx}"] = {r["mode"]: r for r in rows}
    return {"tables": "\n\n".join(tables), "cells": out}
