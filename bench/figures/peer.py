"""This project's services beside vLLM's CPU build (`make bench-peer`, bench.peer.vs_vllm): the
summary rows of bench/results/peer_vllm.jsonl as a table, and each workload's ratio; beside them where
our time goes (bench.peer.breakdown's layers, bench.micro.compile_step's torch.compile rows). Measures nothing."""

from __future__ import annotations

from pathlib import Path

from bench.figures.rows import RESULTS, rows_of

ROWS = "peer_vllm.jsonl"


def host(row: dict) -> str:
    """The CPU a row ran on (bench.harness.provenance.host_fields), or "not recorded" for rows before it."""
    return f"{row['cpu']} ({row['cpu_bf16']})" if "cpu" in row else "not recorded"


def medians(summary: dict) -> tuple[float, float, str]:
    """A summary row's (our median, vLLM's median, unit): TTFT in ms, or decode tokens/s."""
    if summary["workload"] == "ttft":
        return summary["ours_ttft_ms_median"], summary["vllm_ttft_ms_median"], "ms TTFT"
    return summary["ours_tokens_per_s_median"], summary["vllm_tokens_per_s_median"], "tokens/s"


def interval(row: dict) -> int:
    """The consumer's stream interval in a row (rows before the column: 1, the default then)."""
    return int(row.get("stream_interval", 1))


def peer_vllm(root: Path = RESULTS.parents[1]) -> dict:
    path = root / "bench/results" / ROWS
    if not path.exists():
        unknown = dict.fromkeys(("model", "dtype", "weights", "vllm", "threads", "code"), "-")
        return {"table": "(no rows yet: make bench-peer)", "ratios": {}, "identical_32": 0.0, **unknown}
    rows = rows_of(path)
    summaries = [r for r in rows if r["kind"] == "summary"]
    lines = [
        "| code | host | workload | streams | context tokens | our stream interval | ours | vLLM | ours / vLLM | identical outputs | runs | load (1 min) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ratios, codes = {}, {}
    for r in summaries:
        ctx = next(s["context_tokens"] for s in rows if s["kind"] == "sample" and s["workload"] == r["workload"])
        ours, theirs, unit = medians(r)
        lines.append(
            f"| {r['code']} | {host(r)} | {r['workload']} | {r['streams']} | {ctx} | {interval(r)} | {ours:g} {unit} | {theirs:g} {unit} | {r['ratio_ours_vs_vllm']:.2f} | "
            f"{r['identical_outputs']:.0%} | {r['runs']} | {r['load_avg_1m_median']:.1f} |"
        )
        if r.get("build", "head") != "head":  # a --baseline checkout's rows: in the table, not the verdict
            continue
        # token by token under the plain key; another interval's under its own
        suffix = "" if interval(r) == 1 else f"/interval{interval(r)}"
        ratios[f"{r['workload']}@{r['streams']}{suffix}"] = r["ratio_ours_vs_vllm"]
        codes[f"{r['workload']}@{r['streams']}{suffix}"] = r["code"]
    # the latest run's (rows are appended run after run; the table shows every run, its code named)
    identical = next(
        (r["identical_outputs"] for r in reversed(summaries) if (r["workload"], r["streams"]) == ("decode", 32)), 0.0
    )
    first = rows[-1]
    ttft, decode32 = ratios.get("ttft@1", float("inf")), ratios.get("decode@32", 0.0)
    verdict = (
        f"TTFT at 2048 tokens {ttft:.2f}x vLLM's (target <= 1.0x: {'met' if ttft <= 1.0 else 'missed'}), "
        f"tokens/s at 32 streams {decode32:.2f}x streaming every token (target >= 1.0x: {'met' if decode32 >= 1.0 else 'missed'})"
    )
    # another interval's ratio only where it was measured at the latest run's code
    grouped = sorted(k for k in ratios if k.startswith("decode@32/interval") and codes[k] == first["code"])
    for key in grouped:
        n, value = key.split("interval")[1], ratios[key]
        verdict += f", {value:.2f}x with {n} tokens per message after the first ({'met' if value >= 1.0 else 'missed'})"
    return {
        "table": "\n".join(lines),
        "verdict": verdict,
        "latest_spread": _spread(rows),
        "host_state": _host_state(summaries),
        "ratios": ratios,
        "identical_32": identical,
        "model": first["model"],
        "dtype": first["dtype"],
        "weights": first["weights"],
        "vllm": first["vllm"],
        "threads": first["threads_per_engine"],
        "code": first["code"],
    }


def _host_state(summaries: list[dict]) -> str:
    """How fast the host ran in the latest run, read from vLLM's own 32-stream rate against its best
    run in these rows (the same model and threads): the rows cannot tell otherwise."""
    peer = [r for r in summaries if (r["workload"], r["streams"]) == ("decode", 32) and r.get("build") != "baseline"]
    if not peer:
        return "no run yet"
    latest = peer[-1]
    same = [r["vllm_tokens_per_s_median"] for r in peer if (r["model"], r["threads_per_engine"]) == (latest["model"], latest["threads_per_engine"])]
    share = latest["vllm_tokens_per_s_median"] / max(same)
    slowed = "a slowed host" if share < 0.8 else "a host at about its best speed"
    return f"{slowed}: vLLM's 32-stream rate {share:.0%} of its best run in these rows"


def _spread(rows: list[dict]) -> str:
    """The latest run's reps at 32 streams, token by token: our tokens/s over vLLM's rep by rep, and
    vLLM's own rate (the host's state: a slowed host shows in it)."""
    latest: list[dict] = []
    for r in reversed(rows):  # the samples just before the last block of summaries
        if r["kind"] == "summary":
            if latest:
                break
            continue
        latest.append(r)
    cell = [r for r in latest if (r["workload"], r["streams"]) == ("decode", 32) and r.get("build") != "baseline"]
    rate = {(r["engine"], r["rep"]): r["tokens"] / r["wall_s"] for r in cell if r["engine"] == "vllm" or interval(r) == 1}
    reps = sorted(rep for engine, rep in rate if engine == "vllm" and ("scd-services", rep) in rate)
    if not reps:
        return "no samples"
    ratios = [rate["scd-services", rep] / rate["vllm", rep] for rep in reps]
    peer = [rate["vllm", rep] for rep in reps]
    return (f"rep by rep at 32 streams {min(ratios):.2f}-{max(ratios):.2f}x vLLM's ({len(reps)} reps), vLLM's own rate"
            f" {min(peer):.0f}-{max(peer):.0f} tokens/s")


HOSTS = "peer_vllm_hosts.jsonl"


def peer_hosts(root: Path = RESULTS.parents[1]) -> dict:
    """`bench.peer.vs_vllm --out bench/results/peer_vllm_hosts.jsonl`: runs on hosts other than the one
    whose series peer_vllm.jsonl holds (another CPU, another dtype), one table row per summary, each
    naming its host, dtype and code, and per host and dtype the latest run's three ratios."""
    path = root / "bench/results" / HOSTS
    if not path.exists():
        return {"table": "(no runs on other hosts yet)", "latest": "none"}
    rows = rows_of(path)
    summaries = [r for r in rows if r["kind"] == "summary" and r.get("build", "head") == "head"]
    lines = [
        "| code | host | dtype | workload | streams | ours | vLLM | ours / vLLM | identical outputs | runs | load (1 min) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    latest: dict[tuple[str, str], dict[str, str]] = {}
    for r in summaries:
        ours, theirs, unit = medians(r)
        lines.append(
            f"| {r['code']} | {host(r)} | {r['dtype']} | {r['workload']} | {r['streams']} | {ours:g} {unit} | {theirs:g} {unit} | "
            f"{r['ratio_ours_vs_vllm']:.2f} | {r['identical_outputs']:.0%} | {r['runs']} | {r['load_avg_1m_median']:.1f} |"
        )
        cell = "our TTFT at 2048 tokens" if r["workload"] == "ttft" else f"our tokens/s at {r['streams']} stream(s)"
        group = latest.setdefault((host(r), r["dtype"]), {})
        group[cell] = f"{r['ratio_ours_vs_vllm']:.2f}x vLLM's"
        group["run"] = f"code {r['code']}, {r['runs']} runs"
    text = "; ".join(
        f"{h}, {d} ({cells.pop('run')}): " + ", ".join(f"{c} {v}" for c, v in cells.items()) for (h, d), cells in latest.items()
    )
    return {"table": "\n".join(lines), "latest": text}


AB = "peer_vllm_ab.jsonl"


def peer_ab(root: Path = RESULTS.parents[1]) -> dict:
    """A before / after run (`bench.peer.vs_vllm --baseline DIR`): per decode / TTFT cell, both
    builds' medians and ratios to vLLM's in that run, the per-rep tokens/s at 32 streams, and the
    host's state (vLLM's own 32-stream rate)."""
    path = root / "bench/results" / AB
    if not path.exists():
        return {"text": "(no before / after run yet)"}
    rows = rows_of(path)
    summary = {(r["build"], r["workload"], r["streams"]): r for r in rows if r["kind"] == "summary"}
    samples = [r for r in rows if r["kind"] == "sample" and (r["workload"], r["streams"]) == ("decode", 32)]
    per_rep = {b: [round(s["tokens"] / s["wall_s"], 1) for s in samples if s.get("build") == b] for b in ("head", "baseline")}
    peer = [round(s["tokens"] / s["wall_s"], 1) for s in samples if s["engine"] == "vllm"]
    head, base = summary["head", "decode", 32], summary["baseline", "decode", 32]
    cells = []
    for workload, streams in (("ttft", 1), ("decode", 1), ("decode", 32)):
        h, b = summary["head", workload, streams], summary["baseline", workload, streams]
        cells.append(f"{workload} at {streams} stream(s) {b['ratio_ours_vs_vllm']:.2f}x -> {h['ratio_ours_vs_vllm']:.2f}x vLLM's")
    return {
        "text": (
            f"code {base['code']} (before) and {head['code']} (after), {head['runs']} reps: " + "; ".join(cells)
            + f". At 32 streams after / before {head['ours_tokens_per_s_median'] / base['ours_tokens_per_s_median']:.2f}x"
            f" in medians ({head['ours_tokens_per_s_median']:g} against {base['ours_tokens_per_s_median']:g} tokens/s;"
            f" per rep after {per_rep['head']}, before {per_rep['baseline']}); vLLM's own rate in that run {min(peer):g}-{max(peer):g} tokens/s"
        ),
    }


BREAKDOWN = "peer_breakdown.jsonl"


def peer_breakdown(root: Path = RESULTS.parents[1]) -> dict:
    """bench.peer.breakdown's summaries (`make bench-breakdown`): the peer workloads' wall time by
    layer (our forward alone, the batch engine in-process, the services over gRPC), per thread count."""
    path = root / "bench/results" / BREAKDOWN
    if not path.exists():
        return {"table": "(no rows yet: make bench-breakdown)", "share_min": 0.0, "code": "-"}
    rows = rows_of(path)
    summaries = [r for r in rows if r["kind"] == "summary"]
    lines = [
        "| code | torch threads | workload | streams | forward alone (s) | engine (s) | services (s) | forward / services | runs | load (1 min) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summaries:
        lines.append(
            f"| {r['code']} | {r['torch_threads']} | {r['workload']} | {r['streams']} | {r['forward_s_median']:.2f} | {r['engine_s_median']:.2f} | "
            f"{r['services_s_median']:.2f} | {r['forward_share']:.2f} | {r['runs']} | {r['load_avg_1m_median']:.1f} |"
        )
    return {
        "table": "\n".join(lines),
        "share_min": min(r["forward_share"] for r in summaries),
        "ttft_forward_s": {r["torch_threads"]: r["forward_s_median"] for r in summaries if r["workload"] == "ttft"},
        "code": ", ".join(sorted({r["code"] for r in summaries})),
    }


COMPILE = "compile_step.jsonl"


def compile_step(root: Path = RESULTS.parents[1]) -> dict:
    """bench.micro.compile_step's rows: torch.compile against eager on the forward's attention-free pieces."""
    path = root / "bench/results" / COMPILE
    if not path.exists():
        return {"table": "(no rows yet: python -m bench.micro.compile_step)", "best": 1.0}
    rows = rows_of(path)
    lines = [
        "| piece | tokens | eager (ms, 30 layers) | compiled (ms) | compiled / eager | compile (s) | max rel. diff | threads | load |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['piece']} | {r['tokens']} | {r['eager_ms']:.1f} | {r['compiled_ms']:.1f} | {r['compiled_vs_eager']:.2f} | "
            f"{r['compile_s']:.1f} | {r['max_rel_diff']:.1g} | {r['torch_threads']} | {r['load_avg_1m']:.1f} |"
        )
    return {
        "table": "\n".join(lines),
        "best": min(r["compiled_vs_eager"] for r in rows),
        "model": rows[0]["model"],
        "dtype": rows[0]["dtype"],
    }


BUDGET = "prefill_budget.jsonl"


def prefill_budget(root: Path = RESULTS.parents[1]) -> dict:
    """bench.peer.prefill_budget's summaries (`make bench-prefill-budget`): per run (its code) and
    setting, TTFT at 2k, 32 streams' tokens/s and the running streams' longest gap while a 2k prompt
    arrives, each with its ratio to the run's first setting."""
    path = root / "bench/results" / BUDGET
    if not path.exists():
        return {"table": "(no rows yet: make bench-prefill-budget)", "code": "-"}
    rows = [r for r in rows_of(path) if r["kind"] == "summary"]
    cells: dict[tuple[str, int, int], dict] = {}
    for r in rows:
        cells.setdefault((r["code"], r["prefill_chunk"], r["max_batch_tokens"]), {"host": host(r), "runs": r["runs"]})[
            r["workload"]
        ] = r
    lines = [
        "| code | host | prefill_chunk : max_batch_tokens | TTFT at 2k (ms) | 32 streams (tokens/s) | longest gap while a 2k prompt arrives (ms) | its TTFT (ms) | runs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (code, chunk, total), c in cells.items():
        t, d, s = c["ttft"], c["decode"], c["stall"]
        lines.append(
            f"| {code} | {c['host']} | {chunk} : {total} | {t['ttft_ms_median']:g} ({t['vs_first']:.2f}x) | "
            f"{d['tokens_per_s_median']:g} ({d['vs_first']:.2f}x) | {s['max_gap_ms_median']:g} ({s['vs_first']:.2f}x) | "
            f"{s['arrival_ttft_ms_median']:g} | {c['runs']} |"
        )
    return {"table": "\n".join(lines), "code": rows[-1]["code"], "model": rows[-1]["model"], "dtype": rows[-1]["dtype"]}
