"""This project's services beside vLLM's CPU build (`make bench-peer`, bench.peer.vs_vllm): the
summary rows of bench/results/peer_vllm.jsonl as a table, and each workload's ratio. Measures nothing."""

from __future__ import annotations

from pathlib import Path

from bench.figures.rows import RESULTS, rows_of

ROWS = "peer_vllm.jsonl"


def peer_vllm(root: Path = RESULTS.parents[1]) -> dict:
    path = root / "bench/results" / ROWS
    if not path.exists():
        unknown = dict.fromkeys(("model", "dtype", "weights", "vllm", "threads", "code"), "-")
        return {"table": "(no rows yet: make bench-peer)", "ratios": {}, "identical_32": 0.0, **unknown}
    rows = rows_of(path)
    summaries = [r for r in rows if r["kind"] == "summary"]
    lines = [
        "| workload | streams | context tokens | ours | vLLM | ours / vLLM | identical outputs | runs | load (1 min) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    ratios = {}
    for r in summaries:
        ctx = next(s["context_tokens"] for s in rows if s["kind"] == "sample" and s["workload"] == r["workload"])
        if r["workload"] == "ttft":
            ours, theirs, unit = r["ours_ttft_ms_median"], r["vllm_ttft_ms_median"], "ms TTFT"
        else:
            ours, theirs, unit = r["ours_tokens_per_s_median"], r["vllm_tokens_per_s_median"], "tokens/s"
        lines.append(
            f"| {r['workload']} | {r['streams']} | {ctx} | {ours:g} {unit} | {theirs:g} {unit} | {r['ratio_ours_vs_vllm']:.2f} | "
            f"{r['identical_outputs']:.0%} | {r['runs']} | {r['load_avg_1m_median']:.1f} |"
        )
        ratios[f"{r['workload']}@{r['streams']}"] = r["ratio_ours_vs_vllm"]
    identical = next((r["identical_outputs"] for r in summaries if (r["workload"], r["streams"]) == ("decode", 32)), 0.0)
    first = rows[0]
    return {
        "table": "\n".join(lines),
        "ratios": ratios,
        "identical_32": identical,
        "model": first["model"],
        "dtype": first["dtype"],
        "weights": first["weights"],
        "vllm": first["vllm"],
        "threads": first["threads_per_engine"],
        "code": first["code"],
    }
