"""`make bench-audit`: does the consumer's cache audit (shared.audit) catch the SCD answers that
silently differ from the consumer's own prefill, on the shifted sets of qa.shifted, and at what
cost? Through the real services, the heterogeneous QA pair as bench.serving.quality runs it.

Per example, four requests: mode "oracle" (the reference; its rebuild_ms is the consumer's own
context prefill), mode "scd" with AUDIT_POLICY_REPORT (the rebuilt cache's answer and the audit's
decision), mode "scd" with AUDIT_POLICY_FALLBACK (the answer a client gets with the audit on) and
with AUDIT_POLICY_UPGRADE (a flagged cache is transferred again with the artifact's lowest-loss
schedule, and prefilled locally if that is flagged too).
An answer diverged when its greedy tokens differ from the oracle's; flagged when the audit's
decision starts with "diverged". One JSON line per set:
  {"set", "in_distribution", "n", "diverged", "flagged_diverged", "flagged_agreeing",
   "audit_cost_ratio", "oracle_f1", "oracle_em", "scd_f1", "scd_em", "identical_rate",
   "fallback_identical_rate", "fallback_flagged", "upgrade_identical_rate", "upgrade_local_rate",
   "upgrade_bytes_ratio", "audit_ms", "oracle_prefill_ms", "layer_error_median", "layer_thresholds"}
(F1/EM in points 0-100, null for a set without gold; cost = median over requests of audit_ms /
the oracle's rebuild_ms of the same example; *_ms are medians), then a summary line
  {"recall", "false_alarm_rate", "cost_ratio", "fallback_identical_rate", ..., "layer_error_auroc"}
recall over the shifted sets' diverged answers, false alarms over the in-distribution agreeing
ones, fallback (and upgrade) identical over the shifted sets; upgrade_local_rate = share of upgrade
requests that still ended in a local prefill, upgrade_bytes_ratio = upgrade bytes / report bytes; layer_error_auroc says per layer whether any
threshold on that error could tell those diverged answers from the agreeing in-distribution ones
(0.5: no signal, 1.0: a perfect one). Written to bench/results/audit.jsonl and
audit.md (audit-<pair>.* for another --pair); every example's record to bench/runs/audit/examples.jsonl.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc

from bench.harness import flops, pairs, provenance, services
from bench.harness.pairs import PAIRS
from consumer.api.client import ConsumerClient
from qa.metrics import exact_match, f1_score
from qa.shifted import SETS, ShiftedExample, examples
from shared.pb import consumer_pb2
from shared.scd.artifact import Artifact

ROOT = services.ROOT
RESULTS = ROOT / "bench/results"
DEFAULT_PAIR = "heterogeneous"  # its headline schedule R2.R64: bench.serving.quality's fewest bytes within 2 F1 of the oracle
TARGETS = {
    "recall": (">=", 0.9),
    "false_alarm_rate": ("<=", 0.1),
    "cost_ratio": ("<=", 0.15),
    "fallback_identical_rate": (">=", 0.95),
}


async def ask(
    client: ConsumerClient, ex: ShiftedExample, end_id: int, mode: str, options: dict, audit: int, positions: int
) -> dict:
    a = await pairs.ask(client, ex.context, ex.question, end_id, mode, options, audit=audit, audit_positions=positions)
    s = a.stats
    return {
        "ids": list(a.ids),
        "text": a.text,
        "tokens": s.context_tokens,
        "rebuild_ms": s.rebuild_ms,
        "bytes": s.bytes_received,
        "audit_ms": s.audit_ms,
        "decision": s.audit_decision,
        "layer_errors": [round(e, 5) for e in s.audit_layer_errors],
        "layer_thresholds": [round(t, 5) for t in s.audit_layer_thresholds],
    }


async def until_reachable(call: Callable[[], Awaitable], timeout_s: float = 60.0) -> None:
    """Retry `call` while it fails UNAVAILABLE: the consumer is SERVING as soon as it is loaded,
    but its channel may still be backing off from a producer that was not listening yet."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await call()
            return
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            await asyncio.sleep(1.0)


async def run_sets(
    address: str, names: list[str], n: int, schedule: dict, positions: int, end_id: int, on_set: Callable[[str, list[dict]], None]
) -> list[dict]:
    """One record per example: the oracle's, report's and fallback's answers and the audit's view;
    `on_set` sees each set's records as soon as the set is done."""
    records = []
    async with ConsumerClient(address) as client:
        warm = next(examples("in_distribution", 1))
        await until_reachable(lambda: ask(client, warm, end_id, "scd", schedule, consumer_pb2.AUDIT_POLICY_OFF, positions))
        for _ in range(2):  # first calls at these shapes are slow: keep them out of the timings
            await ask(client, warm, end_id, "oracle", {}, consumer_pb2.AUDIT_POLICY_OFF, positions)
            await ask(client, warm, end_id, "scd", schedule, consumer_pb2.AUDIT_POLICY_REPORT, positions)
        for name in names:
            done = len(records)
            for index, ex in enumerate(examples(name, n)):
                oracle = await ask(client, ex, end_id, "oracle", {}, consumer_pb2.AUDIT_POLICY_OFF, positions)
                report = await ask(client, ex, end_id, "scd", schedule, consumer_pb2.AUDIT_POLICY_REPORT, positions)
                fallback = await ask(client, ex, end_id, "scd", schedule, consumer_pb2.AUDIT_POLICY_FALLBACK, positions)
                upgrade = await ask(client, ex, end_id, "scd", schedule, consumer_pb2.AUDIT_POLICY_UPGRADE, positions)
                records.append(
                    {
                        "set": name,
                        "index": index,
                        "gold": ex.answer,
                        "oracle": oracle,
                        "report": report,
                        "fallback": fallback,
                        "upgrade": upgrade,
                    }
                )
            on_set(name, records[done:])
    return records


def _points(values: list[float]) -> float:
    return round(100 * statistics.fmean(values), 2)


def _flagged(answer: dict) -> bool:
    return answer["decision"].startswith("diverged")


def set_row(name: str, recs: list[dict]) -> dict:
    diverged = [r["report"]["ids"] != r["oracle"]["ids"] for r in recs]
    flagged = [_flagged(r["report"]) for r in recs]
    gold = [r for r in recs if r["gold"] is not None]

    def quality(key: str, metric) -> float | None:
        return _points([metric(r[key]["text"], r["gold"]) for r in gold]) if gold else None

    layers = len(recs[0]["report"]["layer_errors"])
    return {
        "set": name,
        "in_distribution": SETS[name].in_distribution,
        "n": len(recs),
        "diverged": sum(diverged),
        "flagged_diverged": sum(d and f for d, f in zip(diverged, flagged)),
        "flagged_agreeing": sum(f and not d for d, f in zip(diverged, flagged)),
        "audit_cost_ratio": cost_ratio(recs),
        "oracle_f1": quality("oracle", f1_score),
        "oracle_em": quality("oracle", exact_match),
        "scd_f1": quality("report", f1_score),
        "scd_em": quality("report", exact_match),
        "identical_rate": round(1 - sum(diverged) / len(recs), 4),
        "fallback_identical_rate": round(statistics.fmean(r["fallback"]["ids"] == r["oracle"]["ids"] for r in recs), 4),
        "fallback_flagged": sum(_flagged(r["fallback"]) for r in recs),
        "upgrade_identical_rate": round(statistics.fmean(r["upgrade"]["ids"] == r["oracle"]["ids"] for r in recs), 4),
        "upgrade_local_rate": round(statistics.fmean(r["upgrade"]["decision"].endswith("prefilled locally") for r in recs), 4),
        "upgrade_bytes_ratio": round(
            sum(r["upgrade"]["bytes"] for r in recs) / max(1, sum(r["report"]["bytes"] for r in recs)), 3
        ),
        "audit_ms": round(statistics.median(r["report"]["audit_ms"] for r in recs), 2),
        "oracle_prefill_ms": round(statistics.median(r["oracle"]["rebuild_ms"] for r in recs), 2),
        "layer_error_median": [round(statistics.median(r["report"]["layer_errors"][i] for r in recs), 4) for i in range(layers)],
        "layer_thresholds": [round(t, 4) for t in recs[0]["report"]["layer_thresholds"]],
    }


def cost_ratio(recs: list[dict]) -> float:
    """Median over requests of audit_ms / the oracle's rebuild_ms of the same example (a median:
    the CPU is shared, and one slow call should not move the figure)."""
    return round(statistics.median(r["report"]["audit_ms"] / r["oracle"]["rebuild_ms"] for r in recs), 4)


def floor_cost_ratio(recs: list[dict]) -> float:
    """Fastest audit / fastest prefill: both at the machine's noise floor."""
    return round(min(r["report"]["audit_ms"] for r in recs) / min(r["oracle"]["rebuild_ms"] for r in recs), 4)


def flops_ratio(config: dict, tokens: float, positions: int) -> float:
    """Audit FLOPs / context prefill FLOPs (bench.harness.flops): about k/T on any model."""
    return round(flops.audit(config, tokens, positions) / flops.prefill(config, tokens), 4)


def cost_at_scale(
    tokens: list[int], positions: int, reps: int = 5, threads: int = 2, model_name: str = "qwen05b-random"
) -> list[dict]:
    """The audit's cost where it matters: on the Qwen2.5-0.5B-shaped random model (bf16, CPU),
    the same `shared.audit.audit` the consumer runs, over the cache of its own prefill (an exact
    cache: the audit's work does not depend on the data), timed interleaved with that prefill.
    One row per context length: medians of `reps`, and the load average."""
    import os

    import torch

    from bench.harness.workloads import ensure_qwen05b
    from shared import audit as cache_audit
    from shared import kv
    from shared.models import load_model

    torch.set_num_threads(threads)
    source = str(ensure_qwen05b()) if model_name == "qwen05b-random" else model_name
    model = load_model(source, "bfloat16", "cpu")
    config = model.model.config.to_dict()
    rows = []
    for t in tokens:
        ids = [4 + (7919 * i) % (config["vocab_size"] - 4) for i in range(t)]
        checked = cache_audit.positions(t, positions, seed=t)
        prefill_ms, audit_ms = [], []
        for rep in range(reps + 1):  # the first round warms up and is not counted
            started = time.perf_counter()
            cache = kv.prefill_context(model, torch.tensor([ids]))
            took = (time.perf_counter() - started) * 1e3
            report = cache_audit.audit(model, ids, cache, checked)
            if rep:
                prefill_ms.append(took)
                audit_ms.append(report.ms)
        p, a = statistics.median(prefill_ms), statistics.median(audit_ms)
        rows.append(
            {
                "scale": model_name,
                "tokens": t,
                "audit_positions": positions,
                "prefill_ms": round(p, 1),
                "audit_ms": round(a, 1),
                "cost_ratio": round(a / p, 4),
                "cost_ratio_flops": flops_ratio(config, t, positions),
                "max_error": round(report.max_error, 5),
                "threads": threads,
                "load": round(os.getloadavg()[0], 2),
                "weights": provenance.weights_of(model_name),
            }
        )
    return rows


def posthoc(diverged: list[dict], agreeing: list[dict], layers: int, quantile: float = 0.95) -> dict:
    """In-sample, optimistic: thresholds at each layer's `quantile` of the agreeing
    in-distribution errors of this run, and the recall / false alarms they would give."""
    if not diverged or len(agreeing) < 2:
        return {}
    cut = [
        statistics.quantiles([r["report"]["layer_errors"][i] for r in agreeing], n=100, method="inclusive")[
            round(100 * quantile) - 1
        ]
        for i in range(layers)
    ]

    def flags(r: dict) -> bool:
        return any(e > t for e, t in zip(r["report"]["layer_errors"], cut))

    return {
        "quantile": quantile,
        "thresholds": [round(t, 4) for t in cut],
        "recall": _rate(sum(map(flags, diverged)), len(diverged)),
        "false_alarm_rate": _rate(sum(map(flags, agreeing)), len(agreeing)),
    }


def auroc(positive: list[float], negative: list[float]) -> float | None:
    """P(a positive's score > a negative's), ties half: could any threshold separate them?"""
    if not positive or not negative:
        return None
    wins = sum((p > q) + 0.5 * (p == q) for p in positive for q in negative)
    return round(wins / (len(positive) * len(negative)), 3)


def flag_summary(records: list[dict], base: dict) -> dict:
    """The audit's recall and precision over bench.serving.verify's per-example rows (one set of
    examples, e.g. the real pair's test split): an SCD answer diverged when the `scd` policy's
    tokens differ from the oracle's; it was flagged when the `scd+audit_fallback` policy's audit
    of the same rebuilt cache (the transfer is deterministic) decided "diverged". recall = flagged
    among the diverged, precision = diverged among the flagged, false alarms = flagged among the
    agreeing; `unflagged_same_as_scd` checks the premise (an unflagged fallback answer is the scd
    answer); per-layer AUROC of the audit's error, diverged vs agreeing."""
    by: dict[tuple, dict[str, dict]] = {}
    for r in records:
        by.setdefault((r["set"], r["index"]), {})[r["policy"]] = r
    cases = [p for p in by.values() if {"oracle", "scd", "scd+audit_fallback"} <= set(p)]
    diverged = [not p["scd"]["identical_to_oracle"] for p in cases]
    flagged = [p["scd+audit_fallback"]["audit_decision"].startswith("diverged") for p in cases]
    hits = sum(d and f for d, f in zip(diverged, flagged))
    unflagged = [p for p, f in zip(cases, flagged) if not f]
    errors = [p["scd+audit_fallback"]["audit_layer_errors"] for p in cases]
    layers = len(errors[0]) if errors else 0
    families: dict[str, list[int]] = {}
    for p, d, f in zip(cases, diverged, flagged):
        counts = families.setdefault(p["scd"].get("family", p["scd"]["set"]), [0, 0, 0, 0])
        counts[0] += 1
        counts[1] += d
        counts[2] += f
        counts[3] += d and f
    return {
        **base,
        "kind": "audit",
        "n": len(cases),
        "diverged": sum(diverged),
        "flagged": sum(flagged),
        "flagged_diverged": hits,
        "recall": _rate(hits, sum(diverged)),
        "precision": _rate(hits, sum(flagged)),
        "false_alarm_rate": _rate(sum(flagged) - hits, len(cases) - sum(diverged)),
        "fallback_identical_rate": _rate(sum(p["scd+audit_fallback"]["identical_to_oracle"] for p in cases), len(cases)),
        "unflagged_same_as_scd": _rate(sum(p["scd+audit_fallback"]["ids"] == p["scd"]["ids"] for p in unflagged), len(unflagged)),
        "audit_cost_ratio": round(statistics.median(p["scd+audit_fallback"]["cost"] for p in cases), 4) if cases else None,
        "layer_error_auroc": [
            auroc([e[i] for e, d in zip(errors, diverged) if d], [e[i] for e, d in zip(errors, diverged) if not d])
            for i in range(layers)
        ],
        "largest_layer_error": {  # per example, its cache's largest per-layer error: min, median, max
            side: _spread([max(e) for e, d in zip(errors, diverged) if d == want and e])
            for side, want in (("diverged", True), ("agreeing", False))
        },
        "by_family": {f: dict(zip(("n", "diverged", "flagged", "flagged_diverged"), c)) for f, c in families.items()},
    }


def _spread(values: list[float]) -> list[float] | None:
    return [round(min(values), 4), round(statistics.median(values), 4), round(max(values), 4)] if values else None


def _rate(hits: int, total: int) -> float | None:
    return round(hits / total, 4) if total else None


def summary(rows: list[dict], records: list[dict], schedule: str, positions: int, config: dict) -> dict:
    shifted = [r for r in rows if not r["in_distribution"]]
    home = [r for r in rows if r["in_distribution"]]
    agreeing = sum(r["n"] - r["diverged"] for r in rows)
    home_sets = {r["set"] for r in home}
    diverged = [r for r in records if r["set"] not in home_sets and r["report"]["ids"] != r["oracle"]["ids"]]
    agreeing_home = [r for r in records if r["set"] in home_sets and r["report"]["ids"] == r["oracle"]["ids"]]
    layers = len(records[0]["report"]["layer_errors"]) if records else 0
    out = {
        "recall": _rate(sum(r["flagged_diverged"] for r in shifted), sum(r["diverged"] for r in shifted)),
        "false_alarm_rate": _rate(sum(r["flagged_agreeing"] for r in home), sum(r["n"] - r["diverged"] for r in home)),
        "cost_ratio": cost_ratio(records),
        "cost_ratio_floor": floor_cost_ratio(records),
        "cost_ratio_flops": flops_ratio(config, statistics.fmean(r["oracle"]["tokens"] for r in records), positions),
        "fallback_identical_rate": _rate(
            round(sum(r["fallback_identical_rate"] * r["n"] for r in shifted)), sum(r["n"] for r in shifted)
        ),
        "upgrade_identical_rate": _rate(
            round(sum(r["upgrade_identical_rate"] * r["n"] for r in shifted)), sum(r["n"] for r in shifted)
        ),
        "upgrade_local_rate": _rate(round(sum(r["upgrade_local_rate"] * r["n"] for r in shifted)), sum(r["n"] for r in shifted)),
        "false_alarm_rate_all_sets": _rate(sum(r["flagged_agreeing"] for r in rows), agreeing),
        "layer_error_auroc": [
            auroc([r["report"]["layer_errors"][i] for r in diverged], [r["report"]["layer_errors"][i] for r in agreeing_home])
            for i in range(layers)
        ],
        "posthoc_p95": posthoc(diverged, agreeing_home, layers),
        "schedule": schedule,
        "audit_positions": positions,
        "n_per_set": rows[0]["n"] if rows else 0,
    }
    out["meets"] = {k: None if out[k] is None else (out[k] >= v if op == ">=" else out[k] <= v) for k, (op, v) in TARGETS.items()}
    return out


def table(rows: list[dict], total: dict) -> str:
    def num(v, fmt: str = "{:.1f}") -> str:
        return "-" if v is None else fmt.format(v)

    lines = [
        f"Pair `{total['pair']}` (P = {total['producer']}, C = {total['consumer']}), scd `{total['schedule']}`, "
        f"{total['audit_positions']} audited positions, n = {total['n_per_set']} per set (`python -m bench.serving.audit`).",
        "",
        "| set | in dist. | n | oracle F1 / EM | scd F1 / EM | identical | diverged | flagged: diverged / agreeing "
        "| fallback identical | upgrade identical / local | audit cost | median layer errors (thresholds) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        errors = ", ".join(f"{e:.3f} ({t:.3f})" for e, t in zip(r["layer_error_median"], r["layer_thresholds"]))
        lines.append(
            f"| {r['set']} | {'yes' if r['in_distribution'] else 'no'} | {r['n']} | {num(r['oracle_f1'])} / {num(r['oracle_em'])} "
            f"| {num(r['scd_f1'])} / {num(r['scd_em'])} | {r['identical_rate']:.0%} | {r['diverged']} "
            f"| {r['flagged_diverged']} / {r['flagged_agreeing']} | {r['fallback_identical_rate']:.0%} "
            f"| {r['upgrade_identical_rate']:.0%} / {r['upgrade_local_rate']:.0%} "
            f"| {r['audit_cost_ratio']:.1%} | {errors} |"
        )
    ph = total["posthoc_p95"]
    lines += [
        "",
        "| | recall (shifted) | false alarms (in dist.) | audit cost | fallback identical (shifted) |",
        "|---|---:|---:|---:|---:|",
        "| target | >= 0.9 | <= 0.1 | <= 0.15 | >= 0.95 |",
        f"| measured | {num(total['recall'], '{:.3f}')} | {num(total['false_alarm_rate'], '{:.3f}')} "
        f"| {num(total['cost_ratio'], '{:.3f}')} | {num(total['fallback_identical_rate'], '{:.3f}')} |",
        "",
        f"Audit cost: median per-request ratio {total['cost_ratio']:.3f}, fastest audit / fastest prefill "
        f"{total['cost_ratio_floor']:.3f}, FLOPs ratio {total['cost_ratio_flops']:.3f}. "
        f"Per-layer AUROC of the audit error, diverged shifted vs agreeing in-distribution answers: "
        f"{', '.join(num(a, '{:.3f}') for a in total['layer_error_auroc'])} (0.5 = no signal). "
        f"Upgrade policy on the shifted sets: {num(total['upgrade_identical_rate'], '{:.3f}')} identical, "
        f"{num(total['upgrade_local_rate'], '{:.3f}')} still prefilled locally.",
    ]
    for row in total.get("cost_at_scale", []):
        lines.append(
            f"At scale ({row['scale']}, bf16, {row['tokens']} tokens, {row['threads']} threads, load {row['load']}): "
            f"audit {row['audit_ms']:.0f} ms vs the consumer's prefill {row['prefill_ms']:.0f} ms = "
            f"**{row['cost_ratio']:.1%}** (FLOPs {row['cost_ratio_flops']:.2%})."
        )
    if ph:
        lines.append(
            f"In-sample thresholds at each layer's 95th percentile of in-distribution errors "
            f"({', '.join(f'{t:.3f}' for t in ph['thresholds'])}) would give recall {num(ph['recall'], '{:.3f}')} "
            f"at false alarms {num(ph['false_alarm_rate'], '{:.3f}')}."
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.serving.audit", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--n", type=int, default=40, help="examples per set")
    p.add_argument("--sets", default=",".join(SETS), help=f"comma-separated, of: {', '.join(SETS)}")
    p.add_argument(
        "--schedule",
        default=None,
        help="SCD schedule (text such as R2.R64, or its name); '' = the artifact's default; default: the pair's headline",
    )
    p.add_argument("--audit-positions", type=int, default=8, help="context positions the audit checks (1..64)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument(
        "--scale-tokens",
        type=int,
        nargs="*",
        default=[2048],
        help="also time the audit against the prefill on the 0.5B-shaped model at these lengths ('' = skip)",
    )
    p.add_argument("--scale-only", action="store_true", help="only the 0.5B-scale cost rows (no services, no sets)")
    p.add_argument("--pair", default=DEFAULT_PAIR, choices=list(PAIRS))
    p.add_argument("--artifact", default=None, help="default: the pair's")
    p.add_argument("--out-dir", type=Path, default=RESULTS, help="where audit.{jsonl,md} go")
    p.add_argument(
        "--records",
        type=Path,
        default=ROOT / "bench/runs/audit/examples.jsonl",
        help="every example's answers, errors and decisions",
    )
    args = p.parse_args(argv)
    if args.scale_only:
        for row in cost_at_scale(args.scale_tokens, args.audit_positions):
            print(json.dumps(row), flush=True)
        return
    pair = PAIRS[args.pair]
    args.artifact = args.artifact or pair.artifact
    args.schedule = pair.headline if args.schedule is None else args.schedule
    names = [s for s in args.sets.split(",") if s]
    unknown = [s for s in names if s not in SETS]
    if unknown:
        p.error(f"unknown sets {unknown}; known: {list(SETS)}")
    artifact = Artifact.load(ROOT / args.artifact)
    entry = next((e for e in artifact.schedules if args.schedule in (e.name, e.schedule)), None)
    if args.schedule and entry is None:
        p.error(f"schedule {args.schedule!r} not in the artifact: {[e.schedule for e in artifact.schedules]}")
    from transformers import AutoTokenizer

    from qa.tokenizer import end_token_id

    end_id = end_token_id(AutoTokenizer.from_pretrained(ROOT / pair.consumer))
    schedule = {"schedule": entry.name} if entry else {}
    common = ["--dtype", args.dtype, "--log-level", "WARNING", "--artifacts", str(ROOT / args.artifact)]
    rows: list[dict] = []

    def on_set(name: str, recs: list[dict]) -> None:
        rows.append(set_row(name, recs))
        print(json.dumps(rows[-1]), flush=True)

    with services.running(
        ["--model", pair.producer, *common], ["--model", pair.consumer, *common, *services.NO_PREFIX_CACHE], log_dir=ROOT / "bench/runs/audit"
    ) as (
        _,
        c,
    ):
        records = asyncio.run(run_sets(c.address, names, args.n, schedule, args.audit_positions, end_id, on_set))
    config = json.loads((ROOT / pair.consumer / "config.json").read_text())
    total = summary(rows, records, entry.schedule if entry else "(artifact default)", args.audit_positions, config)
    total.update(pair=args.pair, producer=pair.producer.split("/")[-1], consumer=pair.consumer.split("/")[-1])
    ran_on = {
        "weights": provenance.TRAINED,
        "producer_model": pair.producer,
        "consumer_model": pair.consumer,
        "dtype": args.dtype,
        **provenance.artifact_fields(pair.artifact),
    }
    rows = [{**r, **ran_on} for r in rows]
    total.update(ran_on)
    if args.scale_tokens:  # after the services stopped: the timing has the machine to itself
        total["cost_at_scale"] = cost_at_scale(args.scale_tokens, args.audit_positions)
    print(json.dumps(total), flush=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = "audit" if args.pair == DEFAULT_PAIR else f"audit-{args.pair}"
    (args.out_dir / f"{stem}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*rows, total]))
    (args.out_dir / f"{stem}.md").write_text(table(rows, total) + "\n")
    args.records.parent.mkdir(parents=True, exist_ok=True)
    args.records.write_text("".join(json.dumps(r) + "\n" for r in records))
    print(table(rows, total), file=sys.stderr)


if __name__ == "__main__":
    main()
