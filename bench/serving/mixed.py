"""`python -m bench.serving.adaptive --mixed`: how close auto's TTFT estimates come on a mixed workload
(issue 31's target). Owns the workload, its rows and its summary; the services and the link are
bench.serving.adaptive's (loopback here: the estimates, not the link, are under test).

Workload: --mixed-requests steps; each draws a context length log-uniformly from 16 to 2048
tokens (seeded, so in random order) and sends a request naming no mode (the consumer's default,
auto at its default budget) on a context nobody saw; every other step on average it is followed
by a request that names a mode (the default-option `scd`, the own prefill `oracle`, or another
candidate within the budget, in turn) on another new context of the same length. Contexts up to
the QA task's longest are QA facts, longer ones random word ids of the pair's vocabulary.

Rows (one JSON line per request, to stdout and OUT_DIR/adaptive-mixed.jsonl): n, kind
(auto|named), ctx_tokens, candidate (the canonical key that ran), estimate_ms, ttft_ms, ratio
(estimate / measured), confident, probe, reason. `estimate_ms` is a TTFT estimate: what auto
estimated for the candidate's context KV (its `estimated_ms`) plus the question prefill as the
earlier requests measured it (their median; the same for every candidate: the context's KV is
what the estimator models). An auto row's is the estimate of its own choice; a named row's is
the estimate for that candidate that the auto request just before it (same length) made, before
the named request ran.

Summary (`mixed_summary`): after the first MIXED_SETTLE requests, the median absolute error of
auto's estimate for its choice (target <= ERROR_TARGET), and whether every estimate in the last
MIXED_WINDOW requests is within RATIO_TARGET x of the measured TTFT.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import statistics
from pathlib import Path

from bench.harness.workloads import Workload, note
from consumer.api.client import ConsumerClient, prompt

MIXED_LENGTHS = (16, 2048)  # context tokens, drawn log-uniformly
MIXED_SETTLE = 10  # requests before the error counts
MIXED_WINDOW = 20  # the last requests whose every estimate must be within RATIO_TARGET
ERROR_TARGET = 0.25  # median |estimate - ttft| / ttft of auto's choice
RATIO_TARGET = 2.0


def context_for(w: Workload, tokens: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """A new context of about `tokens` tokens and a question: QA facts where the task makes
    contexts that long, else random word ids (the task's question on them)."""
    ctx, question, _ = w.request(min(tokens, w.max_ctx or tokens), False)
    if len(ctx) < tokens:
        ctx = ctx + [rng.randrange(4, w.vocab_size) for _ in range(tokens - len(ctx))]
    return ctx[:tokens], question


def key_of(c) -> str:
    return c.key or c.mode


def named_pool(stats) -> list[tuple[str, dict]]:
    """Modes a caller names: the default-option scd and oracle, then each other remote candidate
    within the budget with its options (as named requests would)."""
    pool: list[tuple[str, dict]] = [("scd", {}), ("oracle", {})]
    for c in stats.auto.candidates:
        if c.within_budget and c.mode not in ("oracle", "scd"):
            pool.append((c.mode, {k: v for k, v in c.options.items() if v}))
    return pool


def estimate_for(auto_stats, transfer, default_schedule: str) -> object | None:
    """The candidate estimate of an auto request's stats that is the mode a named request ran: the
    same mode, and for scd the same schedule (the named one, else the artifact's default)."""
    for c in auto_stats.auto.candidates:
        if c.mode != transfer.name or c.estimated_ms < 0:
            continue
        if transfer.name == "scd":
            want = transfer.options.get("schedule_name") or transfer.options.get("schedule") or default_schedule
            if want in (c.options.get("schedule"), *([] if not c.key else [c.key.rsplit("schedule=", 1)[-1].rstrip(")")])):
                return c
            continue
        if all(transfer.options.get(k, v) == v for k, v in c.options.items() if v):
            return c
    return None


async def one(client: ConsumerClient, w: Workload, mode: str | None, options: dict, ctx, question, timeout_s: float):
    fields = dict(
        context=prompt(ids=ctx), question=prompt(ids=question), max_new_tokens=w.max_new_tokens, stop_token_ids=w.stop_ids
    )
    answer = await client.generate(timeout=timeout_s, mode=mode, options=options, **fields)
    return answer.stats


def row(n: int, kind: str, stats, chosen, estimate, question_ms: float) -> dict:
    ttft = stats.ttft_ms
    est = None if estimate is None or estimate.estimated_ms < 0 else estimate.estimated_ms + question_ms
    return {
        "n": n,
        "kind": kind,
        "ctx_tokens": stats.context_tokens,
        "candidate": chosen,
        "served": stats.transfer.name,
        "estimate_ms": None if est is None else round(est, 1),
        "kv_estimate_ms": None if estimate is None else round(estimate.estimated_ms, 1),
        "question_prefill_ms": round(stats.question_prefill_ms, 2),
        "question_estimate_ms": round(question_ms, 2),
        "ttft_ms": round(ttft, 1),
        "options": {k: v for k, v in stats.transfer.options.items() if v},
        "ratio": None if est is None or ttft <= 0 else round(est / ttft, 3),
        "confident": None if estimate is None else estimate.confident,
        "probe": stats.auto.probe if kind == "auto" else None,
        "fallback": stats.transfer_failure or None,
        "reason": stats.auto.reason[:160] if kind == "auto" else "",
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }


def question_estimate(rows: list[dict], stats) -> float:
    """The question prefill a TTFT estimate adds (the same for every candidate; auto estimates the
    context's KV): the median of the earlier requests' (this one's for the first)."""
    earlier = [r["question_prefill_ms"] for r in rows]
    return statistics.median(earlier) if earlier else stats.question_prefill_ms


async def mixed_run(w: Workload, address: str, args, emit) -> list[dict]:
    rng = random.Random(args.mixed_seed)
    lo, hi = MIXED_LENGTHS
    rows: list[dict] = []
    pool: list[tuple[str, dict]] = []
    turn = 0
    async with ConsumerClient(address) as client:
        described = await client.describe()
        default_schedule = next((a.default_schedule for a in described.artifacts if a.default_schedule), "")
        for _ in range(args.mixed_requests):
            tokens = int(round(lo * (hi / lo) ** rng.random()))
            ctx, question = context_for(w, tokens, rng)
            await asyncio.sleep(args.gap_ms / 1e3)
            auto = await one(client, w, None, {}, ctx, question, args.timeout_s)  # no mode: the default, auto
            chosen = next((c for c in auto.auto.candidates if c.chosen), None)
            rows.append(
                row(
                    len(rows) + 1,
                    "auto",
                    auto,
                    key_of(chosen) if chosen else auto.transfer.name,
                    chosen,
                    question_estimate(rows, auto),
                )
            )
            emit(rows[-1])
            pool = pool or named_pool(auto)
            if rng.random() >= 0.5:
                continue
            mode, options = pool[turn % len(pool)]
            turn += 1
            ctx, question = context_for(w, tokens, rng)
            await asyncio.sleep(args.gap_ms / 1e3)
            named = await one(client, w, mode, options, ctx, question, args.timeout_s)
            est = estimate_for(auto, named.transfer, default_schedule)
            label = key_of(est) if est is not None else mode
            rows.append(row(len(rows) + 1, "named", named, label, est, question_estimate(rows, named)))
            emit(rows[-1])
    return rows


def mixed_summary(rows: list[dict]) -> dict:
    """The targets on the rows: auto's median absolute error after MIXED_SETTLE requests, and the
    estimates of the last MIXED_WINDOW requests outside RATIO_TARGET x."""
    settled = [r for r in rows if r["kind"] == "auto" and r["n"] > MIXED_SETTLE and r["ratio"] is not None]
    errors = [abs(r["ratio"] - 1) for r in settled]
    last = [r for r in rows[-MIXED_WINDOW:] if r["ratio"] is not None]
    outside = [r for r in last if not 1 / RATIO_TARGET <= r["ratio"] <= RATIO_TARGET]
    median = statistics.median(errors) if errors else math.nan
    return {
        "summary": "mixed",
        "requests": len(rows),
        "auto_settled": len(settled),
        "median_abs_error": round(median, 3),
        "error_target": ERROR_TARGET,
        "error_met": bool(errors) and median <= ERROR_TARGET,
        "window": len(last),
        "outside_2x": [{k: r[k] for k in ("n", "kind", "candidate", "ctx_tokens", "estimate_ms", "ttft_ms")} for r in outside],
        "ratio_met": bool(last) and not outside,
        "by_candidate": {
            k: round(
                statistics.median(
                    abs(r["ratio"] - 1) for r in rows if r["candidate"] == k and r["ratio"] is not None and r["n"] > MIXED_SETTLE
                ),
                3,
            )
            for k in sorted({r["candidate"] for r in rows if r["ratio"] is not None and r["n"] > MIXED_SETTLE})
        },
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "cores": os.cpu_count(),
    }


def write(rows: list[dict], summary: dict, out_dir: Path) -> Path:
    out = out_dir / "adaptive-mixed.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in [*rows, summary]))
    within = "met" if summary["ratio_met"] else f"{len(summary['outside_2x'])} outside"
    note(
        f"mixed: median |error| of auto's choice {summary['median_abs_error']} (target <= {ERROR_TARGET}: "
        f"{'met' if summary['error_met'] else 'missed'}); last {summary['window']} within {RATIO_TARGET:g}x: "
        f"{within} -> {out}"
    )
    return out
