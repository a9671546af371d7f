"""The GPU check's figures (bench/results/gpu.jsonl, written by `make gpu-check` on a lent GPU
machine): the machine, the CUDA test run, the in-process prefill floor and the loopback TTFT grid
as a table with its breakdown, and the cells the first run (bench/results/gpu-first.jsonl) named
beside the latest run. Computes from the committed rows only; measures nothing."""

from __future__ import annotations

from pathlib import Path

from bench.rows import RESULTS, rows_of

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


COMPARED = [  # (model, ctx, mode, store): the cells the first run's reading named
    ("qwen05b-random", 8192, "raw", "cold"),
    ("qwen05b-random", 8192, "quant(bits=8)", "cold"),
    ("qwen05b-random", 8192, "quant(bits=8)", "warm"),
    ("qwen05b-random", 8192, "oracle", "cold"),
    ("qwen7b-random", 2048, "raw", "cold"),
    ("qwen7b-random", 2048, "quant(bits=8)", "cold"),
]


def _runs_table(first: list[dict], second: list[dict]) -> str:
    """The named cells in both runs: TTFT, producer encode and consumer rebuild, first -> second."""
    out = (
        "| cell (random weights, bf16) | TTFT p50 ms | producer encode ms | rebuild ms |\n"
        "| --- | ---: | ---: | ---: |\n"
    )
    for model, ctx, mode, store in COMPARED:
        a, b = _pick(first, model, ctx, mode, store), _pick(second, model, ctx, mode, store)
        cells = [f"{a[k]:.0f} -> {b[k]:.0f}" for k in ("ttft_ms_median", "producer_encode_ms", "rebuild_ms")]
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
    first_path = path.with_name("gpu-first.jsonl")  # the first run, before the producer's fixes
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
    return {
        "ran": True,
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
        "runs_table": _runs_table(_ttft_rows(first_path), ttft) if first_path.exists() else "(one run only)",
        "summary": f"the GPU check's two runs on {machine['gpu']} (docs/results.md#gpu-check-make-gpu-check)",
    }
