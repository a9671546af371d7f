"""The figures of the serving benchmarks, from their committed rows: the transport ceiling, the
producer pool, the compose smoke run, the load test (with the text that says at which limits it
ran and what its head-of-line probe timed), the hostile-producer case count and the cache audit.
Part of bench.figures.figures (which assembles every section); measures nothing."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

from bench.figures.rows import ROOT, artifact_meta, cells_of, json_line, rows_of, span, span_words
from bench.harness.pairs import PAIRS
from bench.harness.rss_trend import MAX_RISE_PCT_PER_ROUND, second_half
from bench.serving.adaptive import settled_vs_fastest
from bench.serving.audit import table as audit_table
from shared.labels import mode_label

# ---- transport, pool, compose, load, contract ----------------------------------------------------


def transport(root: Path = ROOT) -> dict:
    """bench.micro.transport's rows: per chunk size the medians over the runs (rows without CPU columns
    are from before they were measured: shown as -)."""
    rows = rows_of(root / "bench/results/transport.jsonl")
    table = [
        "| chunk | runs | gRPC MB/s (bare reader) | consumer's reader MB/s | socket MB/s | ratio: bare / consumer's | CPU ms/MB: producer"
        " | consumer's reader | socket (both ends) | load |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    cells = {chunk: rs for (chunk,), rs in cells_of(rows, "chunk_bytes").items()}

    def med(rs: list[dict], key: str) -> float | None:
        got = [r[key] for r in rs if r.get(key) is not None]
        return statistics.median(got) if got else None

    def cell(value: float | None, fmt: str) -> str:
        return "-" if value is None else fmt.format(value)

    meds = {
        c: {
            k: med(rs, k)
            for k in (
                "grpc_MBps",
                "consumer_MBps",
                "socket_MBps",
                "ratio",
                "consumer_ratio",
                "producer_cpu_ms_per_MB",
                "consumer_cpu_ms_per_MB",
                "socket_cpu_ms_per_MB",
            )
        }
        for c, rs in cells.items()
    }
    best = max(meds, key=lambda c: meds[c]["ratio"] or 0.0)
    for chunk, rs in sorted(cells.items()):
        m = meds[chunk]
        size = f"{chunk // 2**20} MiB" if chunk >= 2**20 else f"{chunk // 1024} KiB"
        ratio = f"{cell(m['ratio'], '{:.3f}')} / {cell(m['consumer_ratio'], '{:.3f}')}"
        table.append(
            f"| {size} | {len(rs)} | {m['grpc_MBps']:.0f} | {cell(m['consumer_MBps'], '{:.0f}')} | {m['socket_MBps']:.0f}"
            f" | {'**' + ratio + '**' if chunk == best else ratio} | {cell(m['producer_cpu_ms_per_MB'], '{:.2f}')}"
            f" | {cell(m['consumer_cpu_ms_per_MB'], '{:.2f}')} | {cell(m['socket_cpu_ms_per_MB'], '{:.2f}')}"
            f" | {span([r.get('loadavg_1m') for r in rs if r.get('loadavg_1m') is not None], '{:.1f}')} |"
        )
    b = meds[best]
    return {
        "table": "\n".join(table),
        "gbps": span([round(m["grpc_MBps"] / 1000, 1) for m in meds.values()], "{:.1f}"),
        "max_gbit": max(m["grpc_MBps"] for m in meds.values()) * 8 / 1000,
        "best_ratio": b["ratio"],
        "best_consumer_ratio": b["consumer_ratio"] or b["ratio"],
        "best_gBps": b["grpc_MBps"] / 1000,
        "best_chunk": best,
        "consumer_cpu_ms_per_MB": b["consumer_cpu_ms_per_MB"],
        "weights": span_words(r.get("weights") for r in rows),
    }


def grpc_floor(root: Path = ROOT) -> dict:
    """bench.micro.grpc_floor's rows: per (loop, messages x bytes, concurrency) the medians over rounds."""
    rows = rows_of(root / "bench/results/grpc_floor.jsonl")
    table = [
        "| event loop | call | concurrency | rounds | calls/s | CPU ms per call: server / client / both | MB/s | socket MB/s | ratio | load |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    cells = cells_of(rows, "loop", "messages", "bytes", "concurrency")
    out: dict = {}
    for (loop, messages, size, conc), rs in sorted(cells.items(), key=lambda kv: (kv[0][2], kv[0][0])):
        m = {
            k: statistics.median(r[k] for r in rs) if all(k in r for r in rs) else None
            for k in (
                "calls_per_s",
                "server_cpu_ms_per_call",
                "client_cpu_ms_per_call",
                "total_cpu_ms_per_call",
                "MB_per_s",
                "socket_MBps",
                "ratio",
            )
        }
        body = f"{size} B" if size < 2**20 else f"{size // 2**20} MiB"
        bulk = m["ratio"] is not None
        if bulk:
            m["cpu_ms_per_MB"] = m["total_cpu_ms_per_call"] / (messages * size / 1e6)
        wire = f"{m['MB_per_s']:.0f} | {m['socket_MBps']:.0f} | {m['ratio']:.2f}" if bulk else "- | - | -"
        table.append(
            f"| {loop} | 1 request, {messages} x {body} | {conc} | {len(rs)} | {m['calls_per_s']:.0f}"
            f" | {m['server_cpu_ms_per_call']:.2f} / {m['client_cpu_ms_per_call']:.2f} / {m['total_cpu_ms_per_call']:.2f}"
            f" | {wire} | {span([r['load_avg_1m'] for r in rs], '{:.1f}')} |"
        )
        out[f"{loop}|{messages}x{size}|{conc}"] = m
    small = [v for k, v in out.items() if k.startswith("uvloop|") and v["ratio"] is None]
    bulk_cells = [v for v in out.values() if v["ratio"] is not None]
    return {
        "table": "\n".join(table),
        "cells": out,
        "small_ms": small[0]["total_cpu_ms_per_call"] if small else None,
        "bulk_ratio": span([round(v["ratio"], 2) for v in bulk_cells], "{:.2f}"),
        "bulk_ms_per_MB": span([round(v["cpu_ms_per_MB"], 2) for v in bulk_cells], "{:.2f}"),
        "grpcio": rows[0]["grpcio"] if rows else "",
    }


def log_cost(root: Path = ROOT) -> dict:
    """bench.micro.log_cost's rows: the median CPU per log line per routing, and the runs."""
    rows = rows_of(root / "bench/results/log_cost.jsonl")
    med = {v: statistics.median(r["cpu_us_per_line"] for r in rs) for (v,), rs in cells_of(rows, "variant").items()}
    return {**med, "runs": len(rows) // max(1, len(med)), "load": span([r["load_avg_1m"] for r in rows], "{:.1f}")}


REQUEST_TARGET_MS = 4.3  # issue #32: CPU per short request, three processes together


def request_floor(root: Path = ROOT) -> dict:
    """What one short QA-pair request must cost at least on this CPU, from other benches' rows:
    two gRPC calls (client -> consumer, consumer -> producer) at bench.micro.grpc_floor's small-call
    CPU, the context's bytes at its bulk CPU per MB, and four row-steps of the bare model's decode
    step at batch 32 (bench.micro.engine_step, one thread: a question prefill and ~3 tokens). Bytes per
    request at 512 tokens in float32 (bench.serving.throughput's setting): raw's are the K/V from the
    model's config; SCD's the median of bench.serving.ttft's QA-pair rows (bf16 runs: a lower bound)."""
    floor = grpc_floor(root)["cells"]
    small = floor["uvloop|2x64|32"]["total_cpu_ms_per_call"]
    per_mb = floor[f"uvloop|1x{1 << 20}|4"]["cpu_ms_per_MB"]
    step = engine_step(root)["cells"]["1|32"]["bare"]
    forward = 4 * step / 32
    ttft_rows = [
        r for r in rows_of(root / "bench/results/ttft.jsonl") if r["model"] == "qa-base->qa-tuned" and r["ctx_tokens"] == 512
    ]
    cfg = json.loads((root / "checkpoints/qa-tuned/config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    raw_bytes = cfg["num_hidden_layers"] * 2 * 512 * cfg["num_key_value_heads"] * head_dim * 4
    out = {"small_ms": small, "per_mb_ms": per_mb, "step_ms": step, "forward_ms": forward}
    for mode, nbytes in (("raw", raw_bytes), ("scd", statistics.median(r["bytes"] for r in ttft_rows if r["mode"] == "scd"))):
        mb = nbytes / 1e6
        floor_ms = 2 * small + per_mb * mb + forward
        out[mode] = {"mb": mb, "bytes_ms": per_mb * mb, "floor_ms": floor_ms, "left_ms": REQUEST_TARGET_MS - floor_ms}
    return out


def pool(root: Path = ROOT) -> dict:
    row = rows_of(root / "bench/results/pool.json")[0]
    return {**row, "line": json_line(row)}


def compose(root: Path = ROOT) -> dict:
    row = rows_of(root / "bench/results/compose.json")[0]
    return {**row, "line": json_line(row)}


def load(root: Path = ROOT) -> dict:
    """The load test's rows: one per limits setting (`limits`: defaults / raised) and the
    head-of-line probe's; what the shipped defaults are comes from shared.config."""
    from shared.config import ConsumerConfig, ProducerConfig

    rows = rows_of(root / "bench/results/load.jsonl")
    runs = [r for r in rows if "rounds" in r]
    # the latest probe of the consumer as shipped (in one process)
    hol = next((r for r in reversed(rows) if "hol_ttft_ratio" in r and not r.get("engine_process")), None)
    defaults = {"producer": ProducerConfig.max_inflight, "consumer": ConsumerConfig.max_inflight}
    at_defaults = [
        r
        for r in runs
        if (r.get("producer_max_inflight"), r.get("consumer_max_inflight")) == (defaults["producer"], defaults["consumer"])
        and not r.get("engine_process")
    ]
    texts = [_load_run_text(r, defaults) for r in runs]
    if not at_defaults:
        texts.append(
            f"No run at the shipped defaults (`--max-inflight` {defaults['producer']} on the producer, "
            f"{defaults['consumer']} on the consumer) is committed yet: the figures above are what a deployment "
            "with raised limits gets, not what a user of the defaults gets."
        )
    if hol is None:
        hol_text = "No head-of-line row is committed."
    elif hol.get("hol_request") == "cold":
        hol_text = (
            f"Head of line: a request with a context the producer has never seen (its forward needs the "
            f"producer's compute thread) took {hol['hol_ttft_beside_slow_reader_ms']:.1f} ms to its first token "
            f"beside a caller that stalls its own stream at ~1 KB/s, against {hol['hol_ttft_alone_ms']:.1f} ms for "
            f"the same kind of cold request alone: **{hol['hol_ttft_ratio']:.3f}x** (median of {hol['hol_runs']} "
            "interleaved repetitions, target < 1.2)."
        )
    else:
        hol_text = (
            f"Head of line: the committed row ({hol['hol_ttft_ratio']:.3f}x, {hol['hol_ttft_beside_slow_reader_ms']:.1f} "
            f"vs {hol['hol_ttft_alone_ms']:.1f} ms) timed a request whose context was already in the producer's "
            "store: it never waited for the compute thread, so it shows only that the event loop stays free "
            "beside a stalled reader, not that the compute thread does. `bench.serving.load_test` now times a cold "
            "request (a new context each time) beside the stalled reader against a cold request alone; that "
            "row has not been run yet."
        )
    return {
        "runs": runs,
        "hol": hol,
        "defaults": defaults,
        "at_defaults": at_defaults[0] if at_defaults else None,
        "lines": "\n".join(json_line(r) for r in rows),
        "runs_text": "\n\n".join(texts),
        "hol_text": hol_text,
        "max_rise": MAX_RISE_PCT_PER_ROUND,
        "readme": _load_readme(runs, at_defaults[0] if at_defaults else None, hol, defaults),
        "command": _load_command(at_defaults[0] if at_defaults else (runs[0] if runs else None)),
    }


LOAD_TEST_ROUNDS = 20  # bench.serving.load_test's --rounds default (what a plain `make load-test` runs)


def _load_command(r: dict | None) -> str:
    """The command that makes a row like `r`: `make load-test`, with --rounds when the row ran another count."""
    if r is None or r.get("rounds", LOAD_TEST_ROUNDS) == LOAD_TEST_ROUNDS:
        return "make load-test"
    return f'make load-test LOAD_ARGS="--rounds {r["rounds"]}"'


def _limits(r: dict) -> str:
    return f"producer {r.get('producer_max_inflight', '?')} / consumer {r.get('consumer_max_inflight', '?')} calls in flight"


def _refused(r: dict) -> str:
    by = r.get("refused_by_status")
    if by is None:
        return "refusals not counted (a run before they were)"
    return "refused: " + (", ".join(f"{n} {code}" for code, n in sorted(by.items())) or "none")


def _load_run_text(r: dict, defaults: dict) -> str:
    which = "**shipped defaults**" if r.get("limits") == "defaults" else "**limits raised** above the defaults"
    if r.get("engine_process"):
        which += ", the consumer with **`--engine-process`**"
    admitted = r.get("admitted_p50_ms", r.get("p50_ms")), r.get("admitted_p95_ms", r.get("p95_ms"))
    return (
        f"At the {which} ({_limits(r)}): {r['rounds']} rounds of {r['streams']} streams, {r['requests']} requests, "
        f"{r['ok']} answered, {r['cancelled']} cancelled or past their deadline on purpose, {_refused(r)}; "
        f"{r['unexpected_errors']} unexpected errors, {r['wrong_answers']} wrong answers, RSS growth "
        f"{r['rss_growth_pct']}% between round 2 and the last, {r['slots_leaked']} slots in flight after settling, "
        f"counters {'balanced' if r['accounting_balanced'] else 'NOT balanced'} on both services; answered calls "
        f"p50 {admitted[0]} ms, p95 {admitted[1]} ms (load {r['load_avg_1m']} on {r['cores']} cores)." + _rss_trend_text(r)
    )


def _rss_short(r: dict) -> str:
    t = (r.get("rss_trend") or {}).get("consumer") or {}
    if t.get("levels_off") is None:
        return f"RSS {r['rss_growth_pct']:+}%"
    verdict = "levels off" if t["levels_off"] else "does NOT level off"
    return f"the consumer's RSS {verdict} (its peak {t['peak_rise_pct_per_round']:+}% a round over rounds {r['rounds'] // 2 + 1}-{r['rounds']})"


def _rss_trend_text(r: dict) -> str:
    """The RSS verdict of a row that has one (bench.harness.rss_trend; rows before it only had rss_growth_pct)."""
    trends = r.get("rss_trend") or {}
    if not any(t.get("levels_off") is not None for t in trends.values()):
        return ""
    parts = []
    for name, t in trends.items():
        tail = second_half(r["rss_kib_per_round"][name])
        parts.append(
            f"the {name}'s RSS {'levels off' if t['levels_off'] else 'does NOT level off'} (second half: "
            f"{min(tail) / 1024:.0f}-{max(tail) / 1024:.0f} MiB, slope {t['slope_pct_per_round']:+}% a round, "
            f"peak {t['peak_rise_pct_per_round']:+}% a round)"
        )
    return f" Over the rounds, {' and '.join(parts)}; limit {r['max_rise_pct_per_round']}% a round."


def _load_readme(runs: list[dict], at_defaults: dict | None, hol: dict | None, defaults: dict) -> str:
    shown = at_defaults or (runs[0] if runs else None)
    if shown is None:
        return "no row committed."
    limits = (
        "at the shipped defaults"
        if at_defaults
        else (
            f"with limits raised to {_limits(shown)} (no row at the defaults {defaults['producer']} / {defaults['consumer']} yet)"
        )
    )
    text = (
        f"{shown['rounds']} rounds of {shown['streams']} concurrent Generate streams over all modes {limits}, a third "
        f"cancelled at random, some with tiny deadlines: {_refused(shown)}, {shown['unexpected_errors']} "
        f"unexpected errors, {shown['wrong_answers']} wrong answers, {_rss_short(shown)}, "
        f"{shown['slots_leaked']} slots leaked, counters {'balanced' if shown['accounting_balanced'] else 'NOT balanced'}"
    )
    if hol and hol.get("hol_request") == "cold":
        text += (
            f"; a cold request's TTFT beside a stalled ~1 KB/s reader is {hol['hol_ttft_ratio']:.3f}x the same "
            "kind of request alone"
        )
    elif hol:
        text += (
            f"; beside a stalled ~1 KB/s reader a store-hit request's TTFT is {hol['hol_ttft_ratio']:.3f}x its "
            "TTFT alone (the event loop stays free; the compute thread is not probed by that row)"
        )
    return text + "."


def contract(root: Path = ROOT) -> dict:
    text = (root / "tests/test_hostile_producer.py").read_text()
    return {"hostile_cases": len(re.findall(r"^@case\(", text, re.M))}


# ---- the cache audit (bench.serving.audit) ---------------------------------------------------------------

CONTEXT_SHIFTS = ("long_context", "fact_in_random_tokens", "random_tokens")  # sets whose context leaves the regime


def audit(root: Path = ROOT) -> dict:
    out = {}
    for stem in ("audit", "audit-deep-full", "audit-deep-lora"):
        rows = rows_of(root / f"bench/results/{stem}.jsonl")
        sets, total = {r["set"]: r for r in rows[:-1]}, rows[-1]
        pair = stem.replace("audit-", "").replace("audit", "heterogeneous")
        schedule = total["schedule"]
        if schedule == "(artifact default)":  # the artifact's lowest-loss schedule
            schedule = min(artifact_meta(PAIRS[pair].artifact)["schedules"], key=lambda s: s["loss"])["schedule"]
        out[pair] = {
            "lowest_loss": min(artifact_meta(PAIRS[pair].artifact)["schedules"], key=lambda s: s["loss"])["schedule"],
            "sets": sets,
            "total": total,
            "table": audit_table(rows[:-1], total),
            "schedule": schedule,
            "scale": (total.get("cost_at_scale") or [None])[0],
            "prefill_ms": statistics.median(r["oracle_prefill_ms"] for r in rows[:-1]),
            "random_flagged": sum(
                sets[s]["flagged_diverged"] + sets[s]["flagged_agreeing"] for s in ("fact_in_random_tokens", "random_tokens")
            ),
            "random_n": sum(sets[s]["n"] for s in ("fact_in_random_tokens", "random_tokens")),
            "context_shift_upgrade_local": span([round(100 * sets[s]["upgrade_local_rate"]) for s in CONTEXT_SHIFTS]),
            "shifted_bytes": statistics.median(sets[s]["upgrade_bytes_ratio"] for s in CONTEXT_SHIFTS),
        }
    return out


# ---- the batch engine ----------------------------------------------------------------------------


def _pairs(rows: list[dict]) -> dict[tuple, list[tuple[dict, dict]]]:
    """Per cell (model, weights, dtype, torch threads, engine process, mode, output, concurrency), the (max-batch 1,
    batched) row pairs of its latest run: every repetition of that run (rows with `run` and `rep`),
    or for older rows without them the last pair written."""
    pairs: dict[tuple, dict[tuple, dict]] = {}  # cell -> pair id -> {"one": row, "many": row, "line": int}
    legacy: dict[tuple, int] = {}  # cell -> sequence number of its open legacy pair
    for line, r in enumerate(rows):
        cell = (
            r["model"],
            r["weights"],
            r["dtype"],
            r.get("torch_threads", 0),
            r.get("engine_process", False),
            r["mode"],
            r["output"],
            r["concurrency"],
        )
        if "run" in r:
            pid: tuple = (r["run"], r["rep"])
        else:  # a legacy cell's max-batch-1 row opens a pair, its batched row closes it
            legacy[cell] = legacy.get(cell, 0) + (r["max_batch"] == 1)
            pid = ("", legacy[cell])
        entry = pairs.setdefault(cell, {}).setdefault(pid, {})
        entry["one" if r["max_batch"] == 1 else "many"] = r
        entry["line"] = line
    out = {}
    for cell, by_pair in pairs.items():
        done = [(pid, e) for pid, e in by_pair.items() if "one" in e and "many" in e]
        if not done:
            continue
        last_pid, _ = max(done, key=lambda pe: pe[1]["line"])
        chosen = [e for pid, e in done if (pid[0] == last_pid[0] if last_pid[0] else pid == last_pid)]
        out[cell] = [(e["one"], e["many"]) for e in sorted(chosen, key=lambda e: e["line"])]
    return out


def throughput(root: Path = ROOT) -> dict:
    """bench.serving.throughput's rows: per cell (model, mode, output, concurrency) the batched run beside
    its --max-batch 1 run, the ratios between them and the batched run's share of the bare
    forward's ceiling; with repetitions, the median over them (and their range)."""
    rows = rows_of(root / "bench/results/throughput.jsonl")
    cells = _pairs(rows)
    table = [
        "| model (weights, dtype, torch threads[, engine process]) | mode | output | streams | runs | tok/s batched / max-batch 1 | req/s ratio"
        " | TTFT p50 ms batched / 1 | TTFT p95 ms batched / 1 | batched / forward ceiling | consumer CPU ms/request"
        " (event loop) batched / 1 | producer CPU ms/request | client CPU ms/request | req/s batched / CPU-bound"
        " | identical | load |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def med(rs: list[dict], name: str) -> float | None:
        values = [r[name] for r in rs if r.get(name) is not None]
        return statistics.median(values) if values else None

    def ratio(values: list[float], fmt: str = "{:.1f}x") -> str:
        """The median, and the range over repetitions when there are several."""
        m = fmt.format(statistics.median(values))
        return m if len(values) == 1 else f"{m} ({span(values, fmt)})"

    def cpu(rs: list[dict], name: str) -> str:
        value = med(rs, f"{name}_cpu_ms_per_request")
        return "-" if value is None else f"{value:.1f}"

    summary = {}
    for key, pairs in sorted(cells.items()):
        ones, manys = [p[0] for p in pairs], [p[1] for p in pairs]
        model, weights, dtype, threads, split, mode, output, conc = key
        setting = f"{threads or 'default'}{', engine process' if split else ''}"
        threads = f"{threads}p" if split else threads  # the summary key: "1p" is one thread with --engine-process
        toks = [m["output_tokens_per_s"] / o["output_tokens_per_s"] for o, m in pairs]
        reqs = [m["requests_per_s"] / o["requests_per_s"] for o, m in pairs]
        ttfts = [m["ttft_p50_ms"] / o["ttft_p50_ms"] for o, m in pairs]
        ceilings = [m["output_tokens_per_s"] / m["forward_ceiling_tokens_per_s"] for m in manys]
        bounds = [m["requests_per_s"] / m["cpu_bound_requests_per_s"] for m in manys if m.get("cpu_bound_requests_per_s")]
        load = span([r["load_avg_1m"] for r in ones + manys], "{:.1f}")
        table.append(
            f"| {model} ({weights}, {dtype}, {setting}) | {mode} | {output} | {conc} | {len(pairs)}"
            f" | {med(manys, 'output_tokens_per_s'):.0f} / {med(ones, 'output_tokens_per_s'):.0f}: **{ratio(toks)}**"
            f" | {ratio(reqs)} | {med(manys, 'ttft_p50_ms'):.0f} / {med(ones, 'ttft_p50_ms'):.0f}"
            f" | {med(manys, 'ttft_p95_ms'):.0f} / {med(ones, 'ttft_p95_ms'):.0f} | {ratio(ceilings, '{:.2f}')}"
            f" | {cpu(manys, 'consumer')} ({cpu(manys, 'consumer_loop')}) / {cpu(ones, 'consumer')} ({cpu(ones, 'consumer_loop')})"
            f" | {cpu(manys, 'producer')} | {cpu(manys, 'client')} | {ratio(bounds, '{:.2f}') if bounds else '-'}"
            f" | {min(m['identical_to_batch1_rate'] for m in manys)} | {load} |"
        )
        cpu_bound = med(manys, "cpu_bound_requests_per_s")
        one_rate = med(ones, "requests_per_s")
        c = summary[f"{model}|{threads}|{mode}|{output}|{conc}"] = {
            "runs": len(pairs),
            "tok": statistics.median(toks),
            "tok_range": span(toks, "{:.1f}"),
            "req": statistics.median(reqs),
            "ttft": statistics.median(ttfts),
            "ceiling": statistics.median(ceilings),
            "ceiling_max": max(ceilings),
            "identical": min(m["identical_to_batch1_rate"] for m in manys),
            **{
                f"cpu_{name}": med(manys, f"{name}_cpu_ms_per_request")
                for name in ("consumer", "consumer_loop", "producer", "client")
            },
            **{f"cpu_{name}_1": med(ones, f"{name}_cpu_ms_per_request") for name in ("consumer", "consumer_loop")},
            "req_per_s": med(manys, "requests_per_s"),
            "tok_per_s": med(manys, "output_tokens_per_s"),
            "tok_per_s_1": med(ones, "output_tokens_per_s"),
            "ttft_ms": med(manys, "ttft_p50_ms"),
            "req_per_s_1": one_rate,
            # the rate at which the batched pipeline (producer + consumer + client) would use every core
            "cpu_bound": cpu_bound,
            "cpu_bound_ratio": cpu_bound / one_rate if cpu_bound and one_rate else None,
            # cores the batched consumer process used over the run (its CPU per request x requests/s)
            "consumer_cores": statistics.median(
                (m.get("consumer_cpu_ms_per_request") or 0.0) * m["requests_per_s"] / 1e3 for m in manys
            ),
            "cpu_total": statistics.median(
                sum(m.get(f"{name}_cpu_ms_per_request", 0.0) for name in ("consumer", "producer", "client")) for m in manys
            ),
            "cpus": manys[-1].get("cpus"),
        }
        if c["cpus"] and one_rate and c["cpu_consumer"] is not None and c["cpu_consumer_loop"] is not None:
            # a 4x on requests/s at most this much CPU per request in the three processes together
            c["need_4x_ms"] = c["cpus"] * 1e3 / (4 * one_rate)
            # what they spend outside the consumer's engine (its CPU beyond its event loop counts as the engine's)
            engine_ms = c["cpu_consumer"] - c["cpu_consumer_loop"]
            c["outside_engine_ms"] = c["cpu_total"] - engine_ms
            left = c["need_4x_ms"] - c["outside_engine_ms"]
            c["budget_note"] = (
                f"{c['outside_engine_ms']:.1f} ms: {left / c['need_4x_ms']:.0%} of the budget would be left for the engine's"
                f" forwards and rebuilds, which take {engine_ms:.1f} ms"
                if left > 0
                else f"{c['outside_engine_ms']:.1f} ms, the whole budget before the engine's forwards and rebuilds"
                f" ({engine_ms:.1f} ms)"
            )
    for key, c in summary.items():  # an --engine-process cell against the same cell run in one process
        model, threads, rest = key.split("|", 2)
        alone = summary.get(f"{model}|{threads[:-1]}|{rest}") if threads.endswith("p") else None
        if alone is not None:
            c["vs_one_process_tok"] = c["tok_per_s"] / alone["tok_per_s"]
            c["vs_one_process_req"] = c["req_per_s"] / alone["req_per_s"]
            c["vs_one_process_ttft"] = c["ttft_ms"] / alone["ttft_ms"]
            c["vs_one_process_batch1_tok"] = c["tok_per_s"] / alone["tok_per_s_1"]  # against the behaviour before batching
    f32 = [r["identical_to_batch1_rate"] for r in rows if r["dtype"] == "float32" and r["identical_to_batch1_rate"] is not None]
    worst = min(f32, default=0.0)
    over = sorted(k.replace("|", " ") for k, c in summary.items() if c["ceiling_max"] > 1.0)
    return {
        "ceiling_note": (
            "In every cell the batched engine stayed under its ceiling."
            if not over
            else f"In {len(over)} cell(s) the batched engine delivered more than the ceiling measured beside it"
            f" ({'; '.join(over)}): there the ceiling column is not a ceiling."
        ),
        "table": "\n".join(table),
        "cells": summary,
        "rows": len(rows),
        "identical_f32": "every request" if worst == 1.0 else f"at least {worst:.1%} of requests",
    }


def throughput_ab(root: Path = ROOT) -> dict:
    """The latest before / after run (`bench.serving.throughput --baseline DIR`, rows in
    throughput_ab.jsonl): bench.figures.ab's table of this build's batched consumer against the
    baseline's, per cell and metric (medians over the run's repetitions), each build's code, and the
    share of requests each batched consumer answered as this build's max-batch-1 one did."""
    from bench.figures import ab

    path = root / "bench/results/throughput_ab.jsonl"
    if not path.exists():
        return {"table": "(no before / after run yet)", **dict.fromkeys(
            ("before_code", "after_code", "reps", "short_request_cpu", "identical_before", "identical_after", "long_cpu",
             "long_tok"), "-")}
    rows = rows_of(path)
    latest = [r for r in rows if r["run"] == rows[-1]["run"]]
    before = [r for r in latest if r["build"] == "baseline"]
    after = [r for r in latest if r["build"] == "head" and r["max_batch"] > 1]
    total = {}
    for mode in sorted({r["mode"] for r in latest}):
        for build, rs in (("before", before), ("after", after)):
            cell = [ab.value(r, ab.TOTAL_CPU) for r in rs if (r["mode"], r["output"], r["concurrency"]) == (mode, "answer", 32)]
            total[mode, build] = statistics.median(cell) if cell else None
    short = "; ".join(
        f"{mode} {total[mode, 'before']:.1f} -> {total[mode, 'after']:.1f} ms ({total[mode, 'after'] / total[mode, 'before']:.2f}x)"
        for mode in sorted({m for m, _ in total}) if total[mode, "before"] and total[mode, "after"]
    )
    identical = {b: min(r["identical_to_batch1_rate"] for r in rs) for b, rs in (("before", before), ("after", after))}
    ratios: dict[str, list[float]] = {"cpu": [], "tok": []}  # after / before of the `long` cells' medians
    for key in sorted({ab.cell(r) for r in after if r["output"] == "long"}):
        for name, metric in (("cpu", ab.TOTAL_CPU), ("tok", "output_tokens_per_s")):
            b = [ab.value(r, metric) for r in before if ab.cell(r)[:4] == key[:4]]
            a = [ab.value(r, metric) for r in after if ab.cell(r) == key]
            if b and a:
                ratios[name].append(statistics.median(a) / statistics.median(b))
    return {
        "table": ab.table(before, after),
        "before_code": before[0]["code"],
        "after_code": after[0]["code"],
        "reps": len({r["rep"] for r in after}),
        "short_request_cpu": short,
        "identical_before": f"{identical['before']:.0%}",
        "identical_after": f"{identical['after']:.0%}",
        "long_cpu": span(ratios["cpu"], "{:.2f}x") if ratios["cpu"] else "-",
        "long_tok": span(ratios["tok"], "{:.2f}x") if ratios["tok"] else "-",
    }


def engine_step(root: Path = ROOT) -> dict:
    """bench.micro.engine_step's rows: per (torch threads, batch) the median over rounds of the engine's
    decode step, the bare model's, and the block gather's share of the engine's. Rows without a
    device ran on this project's CPU; CUDA cells are also keyed `model|cuda|batch`."""
    rows = rows_of(root / "bench/results/engine_step.jsonl")
    table = [
        "| model (weights, dtype) | device | torch threads | batch | engine step ms | bare step ms | engine / bare | gather share of the engine step"
        " | logits check ms: isfinite / product with zeros | rounds | load |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    cells: dict[tuple, list[dict]] = {}
    for r in rows:
        key = (r["model"], r["weights"], r["dtype"], r.get("device", "cpu"), r["torch_threads"], r["batch"])
        cells.setdefault(key, []).append(r)
    out: dict = {}
    for (model, weights, dtype, device, threads, batch), rs in sorted(cells.items()):
        engine = statistics.median(r["engine_step_ms"] for r in rs)
        bare = statistics.median(r["bare_step_ms"] for r in rs)
        gather = statistics.median(r["gather_ms"] for r in rs)
        checked = [r for r in rs if "logits_check_ms" in r]
        check = {
            "isfinite": statistics.median(r["logits_isfinite_ms"] for r in checked) if checked else None,
            "finite": statistics.median(r["logits_check_ms"] for r in checked) if checked else None,
        }
        check_text = f"{check['isfinite']:.2f} / {check['finite']:.2f}" if checked else "-"
        table.append(
            f"| {model} ({weights}, {dtype}) | {device} | {threads} | {batch} | {engine:.2f} | {bare:.2f} | {engine / bare:.2f}x"
            f" | {gather / engine:.0%} | {check_text} | {len(rs)} | {span([r['load_avg_1m'] for r in rs], '{:.1f}')} |"
        )
        cell = {"ratio": engine / bare, "gather": gather / engine, "engine": engine, "bare": bare, **check}
        if device.startswith("cuda"):
            out[f"{model}|cuda|{batch}"] = cell
            continue
        out[f"{model}|{threads}|{batch}"] = cell
        if model == "qa-tuned":
            out[f"{threads}|{batch}"] = cell  # the QA model's cells, as the text names them
    return {"table": "\n".join(table), "rows": len(rows), "cells": out}


def cell_host(host: str) -> str:
    """A cell key's host prefix: "" for rows that do not name their host (the cells the text cites
    from before), else "HOST|"."""
    return f"{host}|" if host else ""


def engine_forward(root: Path = ROOT) -> dict:
    """bench.micro.engine_step --compare's rows: per (model, dtype, context, batch) the medians over
    rounds of our pool step, the HF runner's and the bare HF step; per (model, dtype, prefill shape)
    ours against the runner's prefill forward. Cells `model|dtype|ctx|batch` and `model|dtype|shape`;
    rows that also time the plain pool forward (per-row SDPA, plain weights: the forward before the
    paged decode kernel and the packed weights) go to `kernel_table`, cells `kernel|model|dtype|ctx|batch`."""
    rows = rows_of(root / "bench/results/engine_forward.jsonl")
    steps: dict[tuple, list[dict]] = {}
    prefills: dict[tuple, list[dict]] = {}
    for r in rows:
        host = r.get("cpu", "")  # rows before bench.harness.provenance.host_fields: ""
        # rows naming the AMX kernels (decode_runs / prefill_runs, from code 91da341) are cells of their own
        if r["bench"] == "engine_forward":
            model = r["model"] + (" (AMX decode)" if "amx" in r.get("decode_runs", "") else "")
            steps.setdefault((host, model, r["dtype"], r["ctx_tokens"], r["batch"]), []).append(r)
        else:
            model = r["model"] + (" (AMX prefill)" if "amx" in r.get("prefill_runs", "") else "")
            prefills.setdefault((host, model, r["dtype"], r["prefill"]), []).append(r)
    table = [
        "| host | model | dtype | context | batch | ours (pool) ms | HF runner ms | bare HF ms | ours / runner | ours / bare | rounds | load |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    cells: dict = {}
    kernel = [
        "| host | model | dtype | context | batch | ours ms (decode attention, packed weights) | plain ms | HF runner ms | bare HF ms"
        " | ours / plain | ours / runner | rounds | load |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    later: dict[tuple, list[dict]] = {}  # rows that also time the plain forward (per-row SDPA, plain weights)
    for key, rs in list(steps.items()):
        if any("pool_plain_step_ms" in r for r in rs):
            later[key] = [r for r in rs if "pool_plain_step_ms" in r]
            steps[key] = [r for r in rs if "pool_plain_step_ms" not in r]
            if not steps[key]:
                del steps[key]
    for (host, model, dtype, ctx, batch), rs in sorted(later.items()):
        ours, plain, runner, bare = (
            statistics.median(r[k] for r in rs) for k in ("pool_step_ms", "pool_plain_step_ms", "runner_step_ms", "bare_step_ms")
        )
        how = ", ".join(sorted({f"{r['decode_attention']}, {'packed' if r['packed_weights'] else 'plain'}" for r in rs}))
        cells[f"kernel|{cell_host(host)}{model}|{dtype}|{ctx}|{batch}"] = {
            "ours": ours,
            "plain": plain,
            "ratio": ours / plain,
            "runner_ratio": ours / runner,
        }
        loads = [r["load_avg_1m"] for r in rs] + [r["load_avg_1m_end"] for r in rs]
        kernel.append(
            f"| {host or 'not recorded'} | {model} | {dtype} | {ctx} | {batch} | {ours:.2f} ({how}) | {plain:.2f} | {runner:.2f} | {bare:.2f}"
            f" | {ours / plain:.2f}x | {ours / runner:.2f}x | {len(rs)} | {span(loads, '{:.1f}')} |"
        )
    for (host, model, dtype, ctx, batch), rs in sorted(steps.items()):
        ours, runner, bare = (statistics.median(r[k] for r in rs) for k in ("pool_step_ms", "runner_step_ms", "bare_step_ms"))
        cells[f"{cell_host(host)}{model}|{dtype}|{ctx}|{batch}"] = {
            "ours": ours,
            "runner": runner,
            "bare": bare,
            "ratio": ours / runner,
        }
        loads = [r["load_avg_1m"] for r in rs] + [r["load_avg_1m_end"] for r in rs]
        table.append(
            f"| {host or 'not recorded'} | {model} | {dtype} | {ctx} | {batch} | {ours:.2f} | {runner:.2f} | {bare:.2f} | {ours / runner:.2f}x | {ours / bare:.2f}x"
            f" | {len(rs)} | {span(loads, '{:.1f}')} |"
        )
    prefill = [
        "| host | model | dtype | prefill forward | ours ms | HF runner ms | ours / runner | load |",
        "|---|---|---|---|---:|---:|---:|---:|",
    ]
    for (host, model, dtype, shape), rs in sorted(prefills.items()):
        ours, runner = (statistics.median(r[k] for r in rs) for k in ("pool_prefill_ms", "runner_prefill_ms"))
        cells[f"{cell_host(host)}{model}|{dtype}|{shape}"] = {"ours": ours, "runner": runner, "ratio": ours / runner}
        prefill.append(
            f"| {host or 'not recorded'} | {model} | {dtype} | {shape.replace('_', ' ')} | {ours:.1f} | {runner:.1f} | {ours / runner:.2f}x"
            f" | {span([r['load_avg_1m'] for r in rs], '{:.1f}')} |"
        )
    return {
        "table": "\n".join(table),
        "kernel_table": "\n".join(kernel),
        "prefill": "\n".join(prefill),
        "rows": len(rows),
        "cells": cells,
    }


def kv_check(root: Path = ROOT) -> dict:
    """bench.micro.engine_step's kv_check rows: per (model, dtype, context) the medians of the codecs'
    check of one request's rebuilt K/V (each tensor's peak against the layer's limits), the
    finiteness check by sums it replaced, and the product with zeros alone, timed in the same rounds.
    Rows from before the limits (no kv_check_sums_ms: their kv_check_ms timed the sums) are left out."""
    rows = [r for r in rows_of(root / "bench/results/kv_check.jsonl") if "kv_check_sums_ms" in r]
    table = [
        "| model (weights, dtype) | torch threads | context tokens | K/V tensors (MB) | check ms: peaks vs limits / sums (finiteness only) / product alone | peaks / sums | rounds | load |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    cells = cells_of(rows, "model", "weights", "dtype", "torch_threads", "ctx_tokens")
    out: dict = {}
    for (model, weights, dtype, threads, ctx), rs in sorted(cells.items()):
        check = statistics.median(r["kv_check_ms"] for r in rs)
        sums = statistics.median(r["kv_check_sums_ms"] for r in rs)
        product = statistics.median(r["kv_check_product_ms"] for r in rs)
        table.append(
            f"| {model} ({weights}, {dtype}) | {threads} | {ctx} | {rs[0]['tensors']} ({rs[0]['kv_bytes'] / 1e6:.0f}) "
            f"| {check:.2f} / {sums:.2f} / {product:.2f} | {check / sums:.1f}x | {len(rs)} | {span([r['load_avg_1m'] for r in rs], '{:.1f}')} |"
        )
        out[f"{model}|{ctx}"] = {"check": check, "sums": sums, "product": product, "ratio": check / sums}
    return {"table": "\n".join(table), "rows": len(rows), "cells": out}


def turns(root: Path = ROOT) -> dict:
    """bench.serving.turns' rows: the later turns' medians of TTFT and of its parts."""
    rows = [r for r in rows_of(root / "bench/results/turns.jsonl") if r["turn"] > 0]
    if not rows:
        return {"rows": 0}

    def med(name: str) -> float:
        return statistics.median(r[name] for r in rows)

    return {
        "rows": len(rows),
        "model": rows[0]["model"],
        "ttft": med("ttft_ms"),
        "producer_prefill": med("producer_prefill_ms"),
        "question": med("question_prefill_ms"),
        "rebuild": med("rebuild_ms"),
        "ctx": span([r["ctx_tokens"] for r in rows]),
        "load": span([r["load_avg_1m"] for r in rows], "{:.1f}"),
    }


def prefix(root: Path = ROOT) -> dict:
    """bench.serving.prefix's rows: per (workload, variant, eviction) the prefill it computed, the bytes it
    transferred, TTFT and whether answers equal the no-store run's."""
    rows = rows_of(root / "bench/results/prefix.jsonl")
    table = [
        "| model (weights, dtype, mode) | workload | variant | eviction | store budget | prefill tokens computed (saved) |"
        " transfer MB | TTFT p50 ms (later turns) | later turns' floor ms | identical to cold | load |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        budget = "-" if r["store_budget_bytes"] in (0, 1 << 40) else f"{r['store_budget_bytes'] / 2**20:.1f} MiB"
        floor = f"{r['question_prefill_later_p50_ms']:.1f}" if "question_prefill_later_p50_ms" in r else "-"
        table.append(
            f"| {r['model']} ({r['weights']}, {r['dtype']}, {r['mode']}) | {r['workload']} | {r['variant']} | {r['eviction']}"
            f" | {budget} | {r['prefill_tokens_computed']} ({r['prefill_tokens_saved_pct']:.1f}%) | {r['transfer_bytes'] / 1e6:.1f}"
            f" | {r['ttft_p50_ms']:.1f} ({r['ttft_later_p50_ms']:.1f}) | {floor} | {r['identical_to_cold_rate']} | {r['load_avg_1m']:.1f} |"
        )
    identical = min((r["identical_to_cold_rate"] for r in rows), default=0.0)
    return {
        "table": "\n".join(table),
        "rows": len(rows),
        "identical_min": identical,
        "turns": turns(root),
        **_prefix_targets(rows),
    }


def _prefix_targets(rows: list[dict]) -> dict:
    """The issue's targets read off the rows: multi-turn later-turn TTFT of the chunk stores
    (both unbounded, producer + consumer) over the whole-context store's; one document's later
    questions over their floor (the question prefill alone); cost-aware eviction's prefill tokens
    against LRU's, per (model, workload, variant); the float32 rows' identical rate."""

    def find(model: str, workload: str, variant: str, eviction: str) -> dict | None:
        return next(
            (r for r in rows if (r["model"], r["workload"], r["variant"], r["eviction"]) == (model, workload, variant, eviction)),
            None,
        )

    out: dict = {"multi_turn": {}, "one_doc": {}}
    for model in sorted({r["model"] for r in rows}):
        chunked, whole = find(model, "multi-turn", "producer+consumer-chunks", "none"), find(model, "multi-turn", "whole", "lru")
        if chunked and whole:
            out["multi_turn"][model] = {
                "ratio": chunked["ttft_later_p50_ms"] / whole["ttft_later_p50_ms"],
                "verdict": "met" if chunked["ttft_later_p50_ms"] <= whole["ttft_later_p50_ms"] / 4 else "not met",
                "chunked": chunked["ttft_later_p50_ms"],
                "floor": chunked.get("question_prefill_later_p50_ms") or 0.0,
                "whole": whole["ttft_later_p50_ms"],
            }
        doc = find(model, "one-doc", "producer+consumer-chunks", "none")
        if doc and doc.get("question_prefill_later_p50_ms"):
            out["one_doc"][model] = {
                "ratio": doc["ttft_later_p50_ms"] / doc["question_prefill_later_p50_ms"],
                "verdict": "met" if doc["ttft_later_p50_ms"] <= 1.3 * doc["question_prefill_later_p50_ms"] else "not met",
                "ttft": doc["ttft_later_p50_ms"],
                "floor": doc["question_prefill_later_p50_ms"],
            }
    pairs = []
    for r in rows:
        if r["eviction"] == "cost":
            lru = find(r["model"], r["workload"], r["variant"], "lru")
            if lru is not None:
                pairs.append((r["prefill_tokens_computed"], lru["prefill_tokens_computed"]))
    out["cost_vs_lru"] = {
        "cells": len(pairs),
        "not_more": sum(c <= lr for c, lr in pairs),
        "fewer": sum(c < lr for c, lr in pairs),
    }
    f32 = [r["identical_to_cold_rate"] for r in rows if r["dtype"] == "float32"]
    out["identical_f32_min"] = min(f32, default=0.0)
    return out


def adaptive(root: Path = ROOT) -> dict:
    """bench.serving.adaptive's rows: per cell every fixed candidate and auto, auto's ratio to the fastest
    fixed candidate within the budget, and the step run."""
    path = root / "bench/results/adaptive.jsonl"
    rows = rows_of(path) if path.exists() else []
    cells = cells_of([r for r in rows if "phase" not in r], "model", "ctx_tokens", "bandwidth_mbit", "delay_ms", "store")
    table = [
        "| model (weights, dtype) | ctx | Mbit/s | delay ms | shaping | store | auto picked | auto TTFT p50 ms"
        " | fastest fixed within budget (p50 ms) | auto / fastest | budget | auto's loss | F1 auto / oracle | load |",
        "|---|---:|---|---:|---|---|---|---:|---|---:|---:|---:|---|---:|",
    ]
    ratios = []
    by_model: dict[str, list[float]] = {}
    for rs in cells.values():
        auto = next((r for r in rs if r["mode"] == "auto"), None)
        fixed = [r for r in rs if r["mode"] != "auto" and r["loss"] is not None and r["loss"] <= r["max_loss"] + 1e-9]
        if auto is None or not fixed:
            continue
        best = min(fixed, key=lambda r: r["ttft_ms_median"])
        ratio = auto["ttft_ms_median"] / best["ttft_ms_median"]
        ratios.append(ratio)
        by_model.setdefault(f"{auto['model']} ({auto['weights']}, {auto['dtype']}, {auto['ctx_tokens']} tokens)", []).append(
            ratio
        )
        oracle = next((r for r in rs if r["mode"] == "oracle"), None)
        f1 = (
            "-"
            if auto["f1"] is None
            else f"{auto['f1']:.2f} / {oracle['f1']:.2f}"
            if oracle and oracle["f1"] is not None
            else f"{auto['f1']:.2f}"
        )
        picked = ", ".join(f"{k} x{v}" for k, v in auto["chosen"].items())
        best_label = mode_label(best["mode"], ",".join(f"{k}={v}" for k, v in sorted(best["options"].items()) if k != "artifact"))
        loss = "-" if auto["loss"] is None else f"{auto['loss']:.4g}"
        table.append(
            f"| {auto['model']} ({auto['weights']}, {auto['dtype']}) | {auto['ctx_tokens']} | {auto['bandwidth_mbit'] or 'unshaped'}"
            f" | {auto['delay_ms']:g} | {auto['shaping']} | {auto['store']} | {picked} | {auto['ttft_ms_median']:.1f}"
            f" | {best_label} ({best['ttft_ms_median']:.1f}) | {ratio:.2f} | {auto['max_loss']:.4g} | {loss} | {f1}"
            f" | {auto['load_avg_1m']:.1f} |"
        )
    steps = [r for r in rows if "phase" in r]
    step_lines = [
        f"phase {r['phase']} ({r['bandwidth_mbit']:g} Mbit/s, {r['model']}, {r['weights']} weights, {r['store']}): picks"
        f" {', '.join(r['picks'])} (probes: requests {r.get('probes') or '-'}; abandoned mid-stream: {r.get('abandoned') or '-'});"
        f" settled on {r['settled_on']} after {r['requests_to_adapt']} request(s){_settled_vs_grid(r, cells)};"
        f" TTFT ms {', '.join(f'{t:.0f}' for t in r['ttft_ms'])}"
        for r in steps
    ]
    met = sum(x <= 1.1 for x in ratios)
    models = "; ".join(
        f"{m}: {sum(x <= 1.1 for x in xs)} of {len(xs)} cells (median {sorted(xs)[len(xs) // 2]:.2f}x, worst {max(xs):.2f}x)"
        for m, xs in by_model.items()
    )
    adapted = [r["requests_to_adapt"] for r in steps if r["phase"] > 0]
    verdicts = []
    for prev, r in zip(steps, steps[1:]):
        if r["phase"] == 0:
            continue
        read = settled_vs_fastest(r, _warm_cell(r, cells))
        right = "not read on the grid" if read is None else f"{read[0]:.2f}x the fastest fixed candidate in the grid's warm cell"
        verdicts.append(
            f"{prev['bandwidth_mbit']:g} -> {r['bandwidth_mbit']:g} Mbit/s: settled on {r['settled_on']} after"
            f" {r['requests_to_adapt']} request(s) ({right})"
        )
    return {
        "by_model": models or "-",
        "adapted": ", ".join(str(a) for a in adapted) or "-",
        "step_verdict": "; ".join(verdicts) or "(no step run in the rows)",
        "rows": len(rows),
        "table": "\n".join(table),
        "cells": len(ratios),
        "met": met,
        "worst": f"{max(ratios):.2f}" if ratios else "-",
        "median": f"{sorted(ratios)[len(ratios) // 2]:.2f}" if ratios else "-",
        "steps": "\n".join(f"- {line}" for line in step_lines) or "- (no step run in the rows)",
        "mixed": _mixed(root),
    }


def _warm_cell(step: dict, cells: dict[tuple, list[dict]]) -> list[dict]:
    """The grid's warm, no-delay cell at the step's model, context and rate."""
    return cells.get((step["model"], step["ctx_tokens"], step["bandwidth_mbit"], 0.0, "warm"), [])


def _settled_vs_grid(step: dict, cells: dict[tuple, list[dict]]) -> str:
    read = settled_vs_fastest(step, _warm_cell(step, cells))
    return "" if read is None else f" (in the grid's warm cell at this rate: {read[0]:.2f}x the fastest fixed candidate)"


def _mixed(root: Path) -> str:
    """The mixed-workload run (`python -m bench.serving.adaptive --mixed`, bench/results/adaptive-mixed.jsonl):
    one sentence from its summary line."""
    path = root / "bench/results/adaptive-mixed.jsonl"
    summary = next((r for r in rows_of(path) if r.get("summary") == "mixed"), None) if path.exists() else None
    if summary is None:
        return "(no mixed-workload run in the rows)"
    by = ", ".join(f"{k} {v:.2f}" for k, v in summary["by_candidate"].items())
    return (
        f"{summary['requests']} requests, contexts 16-2048 tokens in random order, named and no-mode requests"
        f" interleaved (load {summary['load_avg_1m']}): the median absolute error of auto's TTFT estimate for its"
        f" choice after 10 requests is {summary['median_abs_error']:.3f} (target <= {summary['error_target']}:"
        f" {'met' if summary['error_met'] else 'not met'}); every candidate that ran in the last"
        f" {summary['window']} requests within 2x of its measured TTFT: {'met' if summary['ratio_met'] else 'not met'}"
        f" (median error by candidate: {by})"
    )


def link(root: Path = ROOT) -> dict:
    """`python -m bench.harness.netns` sample rows (bench/results/link.jsonl): what each link asked for, its
    measured rate and RTT as a client sees it."""
    rows = rows_of(root / "bench/results/link.jsonl")
    table = ["| link asked for | shaping | measured rate (Mbit/s) | RTT median (min-max), ms |", "|---|---|---|---|"]
    for r in rows:
        asked = f"{r['rate_mbit']:g} Mbit" if r["rate_mbit"] is not None else "unshaped"
        asked += f", {r['delay_ms']:g}" + (f" +/- {r['jitter_ms']:g}" if r["jitter_ms"] else "") + " ms each way"
        if r["loss_pct"]:
            asked += f", {r['loss_pct']:g}% loss"
        lost = f" ({r['loss_pct_measured']:g}% of datagrams lost)" if r.get("loss_pct_measured") is not None else ""
        table.append(
            f"| {asked} | {r['shaping']} | {r['measured_mbit']:.1f}{lost} | {r['rtt_ms']:.1f} ({r['rtt_ms_min']:.1f}-{r['rtt_ms_max']:.1f}) |"
        )
    return {"table": "\n".join(table), "rows": len(rows)}
