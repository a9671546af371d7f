"""The real pair's figures (SmolLM2-135M-Instruct P -> its fine-tune C, and P -> P), from the
summary rows `python -m real.quality` writes to bench/results/real/*.jsonl: one table per
(pair, split, context length), and per pair the schedule chosen on validation (`choose`), whose
test rows are the headline; the VERIFY, repair and audit rows of `bench.serving.verify --real`
through bench.figures.real_verify. Measures nothing."""

from __future__ import annotations

import json
from pathlib import Path

from bench.figures.real_verify import real_verify
from bench.figures.rows import RESULTS, cells_of, rows_of

HEADER = (
    "| mode | bytes/token | x fewer than raw bf16 | F1 | 95% | gap to oracle | 95% | EM | identical | recall | KL (nats/token) |",
    "|---|---|---|---|---|---|---|---|---|---|---|",
)


def _interval(values: list[float], fmt: str = "{:+.1f}", sep: str = "..") -> str:
    """An interval of fractions as points: '78.2..89.2' (fmt '{:.1f}') or '+5.5..+19.9'."""
    return sep.join(fmt.format(100 * v) for v in values)


def cost_cells(r: dict) -> str:
    """A summary row's 'bytes/token | x fewer than raw bf16' table cells ('- | -' when nothing is sent)."""
    if r["bytes_per_token"] is None:
        return "- | -"
    return f"{r['bytes_per_token']:g} | {r['bytes_ratio_vs_bf16_raw']:.1f}"


def _line(r: dict) -> str:
    kl = "-" if r["mean_kl"] is None else f"{r['mean_kl']:.4f}"
    cost = cost_cells(r)
    return (
        f"| `{r['mode']}` | {cost} | {100 * r['f1']:.1f} | "
        f"{_interval(r['f1_ci95'], '{:.1f}')} | {100 * r['f1_gap']:+.1f} | {_interval(r['f1_gap_ci95'])} | {100 * r['em']:.1f} | "
        f"{r['identical_to_oracle']:.0%} | {100 * r['recall']:.1f} | {kl} |"
    )


MAX_GAP = {"P->C": 0.02, "P->P": 0.01}  # the quality targets, as F1 fractions


def choose(validation: list[dict], max_gap: float) -> tuple[str, bool]:
    """(the schedule chosen on validation, whether it meets max_gap): the cheapest SCD mode whose
    F1 gap to the oracle is within max_gap, else the one with the smallest gap (then the cheapest)."""
    scd = [r for r in validation if r["mode"].startswith("scd:")]
    fit = [r for r in scd if r["f1_gap"] <= max_gap]
    if fit:
        return min(fit, key=lambda r: r["bytes_per_token"])["mode"], True
    return min(scd, key=lambda r: (r["f1_gap"], r["bytes_per_token"]))["mode"], False


def real_pair(root: Path = RESULTS.parents[1]) -> dict:
    folder = root / "bench/results/real"
    if not folder.exists():
        return {"tables": "(no rows yet: python -m real.quality)", "cells": {}}
    files = [f for f in sorted(folder.glob("*.jsonl")) if not f.name.startswith("keep-")]  # token selection: bench.figures.keep
    every = [r for f in files for r in rows_of(f) if r.get("kind") == "summary"]
    summaries = [r for r in every if r["n"]]  # task rows; n 0: a KL-only run (kl_tables)
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
    chosen = {}
    for pair, gap in MAX_GAP.items():
        validation = [r for r in summaries if (r["pair"], r["split"]) == (pair, "validation")]
        if validation:
            mode, met = choose(validation, gap)
            chosen[pair] = {
                "mode": mode,
                "met_on_validation": met,
                "validation": next(r for r in validation if r["mode"] == mode),
            }
    heads = {key: _headline(out, chosen, pair) for key, pair in (("pc", "P->C"), ("pp", "P->P")) if pair in chosen}
    return {
        "tables": "\n\n".join(tables),
        "kl_tables": kl_tables([r for r in every if not r["n"]]),
        "kl": {f"{r['pair']}|{r['mode']}": r for r in every if not r["n"] and r["context_tokens_asked"] == 1024},
        "cells": out,
        "chosen": chosen,
        "calibration": calibration(root),
        "recompute_loss": _recompute(root),
        "ttft": ttft(root),
        "verify": real_verify(folder),
        **heads,
    }


def kl_tables(rows: list[dict]) -> str:
    """The task-free measure's runs (`real.quality --n 0 --windows K`): per (pair, split, length),
    each mode's mean next-token KL of C against its own exact cache, with its interval and bytes."""
    out = []
    for (pair, split, ctx), mine in cells_of(rows, "pair", "split", "context_tokens_asked").items():
        model = mine[0]["consumer_model"]
        lines = [
            f"**{pair}**, {split} split, {ctx}-token windows of prose, {mine[0]['windows']} windows, the next 64 tokens "
            f"(consumer `{model['model']}`, {model['dtype']}; artifact `{mine[0]['artifact']}`)",
            "",
            "| mode | bytes/token | x fewer than raw bf16 | mean KL (nats/token) | 95% |",
            "|---|---|---|---|---|",
        ]
        for r in mine:
            cost = cost_cells(r)
            lo, hi = r["mean_kl_ci95"]
            lines.append(f"| `{r['mode']}` | {cost} | {r['mean_kl']:.4f} | {lo:.4f}..{hi:.4f} |")
        out.append("\n".join(lines))
    return "\n\n".join(out) or "(no KL rows yet: python -m real.quality --n 0 --windows K)"


TTFT_ROWS = "ttft-real.jsonl"


def ttft(root: Path) -> dict:
    """The real pair's TTFT rows (`python -m bench.serving.ttft --model-scale real`): a table, and
    warm SCD over the oracle and over raw per (context, bandwidth)."""
    path = root / "bench/results" / TTFT_ROWS
    if not path.exists():
        return {"table": "(no rows yet)", "ratios": {}}
    rows = [r for r in rows_of(path) if r["mode"] != "cached"]
    lines = [
        "| tokens | Mbit/s | store | mode | schedule | TTFT median ms (min-max) | MB sent | lower bound ms | efficiency | load |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        bw = "-" if r["bandwidth_mbit"] is None else f"{r['bandwidth_mbit']:g}"
        bound = "-" if r["ttft_lower_bound_ms"] is None else f"{r['ttft_lower_bound_ms']:.0f}"
        eff = "-" if r["efficiency"] is None else f"{r['efficiency']:.2f}"
        lines.append(
            f"| {r['ctx_tokens']} | {bw} | {r['store']} | {r['mode']} | {r['schedule'] or '-'} | "
            f"{r['ttft_ms_median']:.0f} ({r['ttft_ms_min']:.0f}-{r['ttft_ms_max']:.0f}) | {r['bytes'] / 1e6:.2f} | {bound} | "
            f"{eff} | {r['load_avg_1m']:.1f} |"
        )
    oracle = {r["ctx_tokens"]: r["ttft_ms_median"] for r in rows if r["mode"] == "oracle"}
    ratios = {}
    for r in rows:
        if r["mode"] == "scd" and r["store"] == "warm":
            raw = next(
                (
                    x
                    for x in rows
                    if (x["mode"], x["store"], x["ctx_tokens"], x["bandwidth_mbit"])
                    == ("raw", "warm", r["ctx_tokens"], r["bandwidth_mbit"])
                ),
                None,
            )
            key = f"{r['ctx_tokens']}@{r['bandwidth_mbit']:g}|{r['schedule']}"
            ratios[key] = {
                "ms": r["ttft_ms_median"],
                "vs_oracle": r["ttft_ms_median"] / oracle[r["ctx_tokens"]],
                "vs_raw": r["ttft_ms_median"] / raw["ttft_ms_median"] if raw else None,
            }
    return {
        "table": "\n".join(lines),
        "ratios": ratios,
        "model": rows[0]["model"],
        "dtype": rows[0]["dtype"],
        "weights": rows[0]["weights"],
    }


def _recompute(root: Path) -> str:
    """P -> C's recompute baseline on the calibration loss scale, beside naive reuse's, as text."""
    path = root / "artifacts/smollm2-pc.json"
    if not path.exists():
        return "-"
    cands = json.loads(path.read_text())["candidates"]
    raw = next(c for c in cands if c["mode"] == "raw")
    best = min((c for c in cands if c["mode"] == "recompute"), key=lambda c: c["loss"])
    span = f"layers {best['options']['start']}-{int(best['options']['end']) - 1}"
    return f"P -> C recomputing {span} {best['loss']:.3f} nats per answer token against naive reuse's {raw['loss']:.3f}"


def _headline(cells: dict, chosen: dict, pair: str, ctx: int = 1024) -> dict:
    """The test rows of one pair at `ctx` tokens, by role: the oracle, the schedule chosen on
    validation (`head`), naive reuse and quant at each width (`q2`, `q4`, `q8`) where measured,
    each with its F1 and gap in points."""
    test = cells.get(f"{pair}|test|{ctx}", {})
    roles = {
        "oracle": "oracle",
        "head": chosen[pair]["mode"],
        "naive": "naive",
        "q2": "quant:2",
        "q4": "quant:4",
        "q8": "quant:8",
    }
    out: dict = {"met_on_validation": chosen[pair]["met_on_validation"], "validation": _points(chosen[pair]["validation"])}
    for role, mode in roles.items():
        if mode in test:
            out[role] = _points(test[mode])
    out["others"] = [_points(r) for mode, r in test.items() if mode.startswith("scd:") and mode != roles["head"]]
    return out


def _points(r: dict) -> dict:
    """A summary row with F1, EM, recall and gaps in points (0-100) and its interval as text."""
    return {
        **r,
        "f1_pt": 100 * r["f1"],
        "em_pt": 100 * r["em"],
        "recall_pt": 100 * r["recall"],
        "gap_pt": 100 * r["f1_gap"],
        "gap_ci": "[" + _interval(r["f1_gap_ci95"], sep=", ") + "]",
    }


def calibration(root: Path) -> dict:
    """Per pair, what calibrating its artifact cost (the committed .json beside each artifact)."""
    out = {}
    for pair, name in (("P->C", "smollm2-pc"), ("P->P", "smollm2-pp")):
        path = root / "artifacts" / f"{name}.json"
        if path.exists():
            meta = json.loads(path.read_text())
            search = meta["search"]
            out[pair] = {
                "artifact": meta["artifact_id"],
                "wall_min": meta["calibration"]["wall_s"] / 60,
                "search_min": sum(search["wall_s"].values()) / 60,
                "evaluations": search["evaluations"],
                "evaluated": sum(search["evaluations"].values()),
                "layers": meta["geometry"]["num_layers"],
                "schedules": len(meta["schedules"]),
                "corpus": meta["corpus"]["name"],
            }
    return out
