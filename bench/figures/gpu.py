"""The GPU check's figures (bench/results/gpu.jsonl, written by `make gpu-check` on a lent GPU
machine): the machine, the CUDA test run, the in-process prefill floor and the loopback TTFT grid
as a table with its breakdown, and the cells the first run named in every run, oldest first
(bench/results/gpu-first.jsonl, gpu-second.jsonl, then the latest gpu.jsonl). Computes from the committed rows only; measures nothing."""

from __future__ import annotations

from pathlib import Path

from bench.figures.rows import RESULTS, rows_of

HEADER = (
    "| model (weights, dtype) | ctx | mode | store | TTFT p50 ms | producer prefill | encode | transfer | rebuild | "
    "question prefill | MB on the wire |\n| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n"
)


def _mode(row: dict) -> str:
    return row["mode"] + (f"({row['schedule']})" if row.get("schedule") else "")


def _ttft_table(rows: list[dict]) -> str:
    out = HEADER
    for r in sorted(rows, key=lambda r: (r["model"], r["ctx_tokens"], r["store"], _mode(r))):
        out += (
            f"| {r['model']} ({r['weights']}, {r['dtype']}) | {r['ctx_tokens']} | {_mode(r)} | {r['store']} | "
            f"{r['ttft_ms_median']:.0f} | {r['producer_prefill_ms']:.0f} | {r['producer_encode_ms']:.0f} | "
            f"{r['transfer_ms']:.0f} | {r['rebuild_ms']:.0f} | {r['question_prefill_ms']:.0f} | {r['bytes'] / 1e6:.0f} |\n"
        )
    return out.rstrip("\n")


def _pick(rows: list[dict], model: str, ctx: int, mode: str, store: str) -> dict:
    return next(r for r in rows if r["model"] == model and r["ctx_tokens"] == ctx and _mode(r) == mode and r["store"] == store)


PREFILL_CHUNK = 512  # the consumer's default --prefill-chunk, which bench.serving.ttft's services run with

COMPARED = [  # (model, ctx, mode, store): the cells the first run's reading named
    ("qwen05b-random", 8192, "raw", "cold"),
    ("qwen05b-random", 8192, "quant(bits=8)", "cold"),
    ("qwen05b-random", 8192, "quant(bits=8)", "warm"),
    ("qwen05b-random", 8192, "oracle", "cold"),
    ("qwen7b-random", 2048, "raw", "cold"),
    ("qwen7b-random", 2048, "quant(bits=8)", "cold"),
]


def _runs_table(runs: list[list[dict]]) -> str:
    """The named cells in every run, oldest first: TTFT, producer encode, consumer rebuild and the
    machine's load average during the cell, a -> b -> c."""
    out = (
        "| cell (random weights, bf16) | TTFT p50 ms | producer encode ms | rebuild ms | load (1 min) |\n"
        "| --- | ---: | ---: | ---: | ---: |\n"
    )
    for model, ctx, mode, store in COMPARED:
        picked = [_pick(rows, model, ctx, mode, store) for rows in runs]
        cells = [" -> ".join(f"{r[k]:.0f}" for r in picked) for k in ("ttft_ms_median", "producer_encode_ms", "rebuild_ms")]
        cells.append(" -> ".join(f"{r['load_avg_1m']:.1f}" for r in picked))
        out += f"| {model} {ctx} {mode} {store} | " + " | ".join(cells) + " |\n"
    return out.rstrip("\n")


def _ttft_rows(path: Path) -> list[dict]:
    return [r for r in rows_of(path) if r["check"] == "ttft" and not r.get("derived")]


def gpu(root: Path | None = None) -> dict:
    """{ran, machine, pytest, prefill, table, raw_cold_8k, ...}; `ran` False when no rows exist."""
    path = (root / "bench/results" if root else RESULTS) / "gpu.jsonl"
    if not path.exists():
        return {"ran": False, "summary": "the GPU check is scripted but has not run on a GPU"}
    rows = rows_of(path)
    earlier = [path.with_name(n) for n in ("gpu-first.jsonl", "gpu-second.jsonl")]  # oldest first
    earlier = [p for p in earlier if p.exists()]
    machine = next(r for r in rows if r["check"] == "machine")
    test = next(r for r in rows if r["check"] == "pytest")
    prefill = [r for r in rows if r["check"] == "prefill"]
    ttft = [r for r in rows if r["check"] == "ttft" and not r.get("derived")]
    where = f"{machine['gpu']}, torch {machine['torch']}" + (
        f", transformers {machine['transformers']}" if machine.get("transformers") else ""
    )
    q05 = "qwen05b-random"
    raw_cold = _pick(ttft, q05, 8192, "raw", "cold")
    oracle_cold = _pick(ttft, q05, 8192, "oracle", "cold")
    q8_cold, q8_warm = _pick(ttft, q05, 8192, "quant(bits=8)", "cold"), _pick(ttft, q05, 8192, "quant(bits=8)", "warm")
    floor_8k = next(r["prefill_ms"] for r in prefill if Path(r["model"]).name == q05 and r["ctx_tokens"] == 8192)
    q8_7b = _pick(ttft, "qwen7b-random", 2048, "quant(bits=8)", "cold")
    steps = [r["decode_step_ms"] for r in ttft if r.get("decode_step_ms")]
    chunks_8k = -(-8192 // PREFILL_CHUNK)
    return {
        "ran": True,
        "decode_lo": min(steps),
        "decode_hi": max(steps),
        "oracle_chunks_8k": chunks_8k,
        "oracle_per_chunk_8k": oracle_cold["rebuild_ms"] / chunks_8k,
        "oracle_over_floor_8k": oracle_cold["rebuild_ms"] / floor_8k,
        "floor_8k": floor_8k,
        "quant8_cold_7b": q8_7b,
        "where": where,
        "pytest": f"tests/test_gpu.py: {test['summary']}",
        "prefill": "; ".join(
            f"{Path(r['model']).name} {r['ctx_tokens']} tokens {r['prefill_ms']:.1f} ms" for r in prefill
        ),
        "table": _ttft_table(ttft),
        "raw_cold_8k": raw_cold,
        "oracle_cold_8k": oracle_cold,
        "raw_encode_share": raw_cold["producer_encode_ms"] / raw_cold["ttft_ms_median"],
        "quant8_warm_over_cold": q8_warm["ttft_ms_median"] / q8_cold["ttft_ms_median"],
        "quant8_cold_8k": q8_cold,
        "quant8_warm_8k": q8_warm,
        "runs_table": _runs_table([*map(_ttft_rows, earlier), ttft]) if earlier else "(one run only)",
        "runs": len(earlier) + 1,
        "summary": f"the GPU check's {len(earlier) + 1} runs on {machine['gpu']} (docs/results.md#gpu-check-make-gpu-check)",
    }
