"""TTFT rows: statistics of one cell's requests, the efficiency lower bound, the reference row
of a consumer that has the context cached, the benchmark's own check, and writing rows out.

Efficiency (link modes only; None for the oracle and the cached reference):

    bound_i    = max(producer_compute_i, max(0, payload_bytes_i - burst_bytes) * 8 / link_rate)
                 + question_prefill_i
    efficiency = median_i(bound_i) / median_i(ttft_i)

producer_compute_i = max(the producer's forward, its encode time) of request i (trailer `prefill_ms`,
`encode_ms`; 0 on a warm store hit): each lies inside the consumer's TTFT window, since the last
layer leaves after the forward ends and after its encode. Not their sum: layer l is encoded on
the encode pool while the forward computes layer l + 1, so the two overlap (on a GPU by most of
the forward; the sum exceeded measured TTFTs by up to 1.35x in bench/results/gpu.jsonl, whose
rows were written with it). link_rate = the sustained rate measured over a long plain
TCP transfer through the same shaping (Mbit/s); burst_bytes = what the shaper lets through
above that rate at once (the tbf bucket; 0 for netem and loopback); payload bytes carry gRPC
framing on top, so the wire takes at least this long. question_prefill_i = the consumer's tail
work: the question forward on the rebuilt cache, which starts only after the last layer
arrived. Every term is a time request i had to spend, so bound_i <= ttft_i for any correct run
and, order statistics being monotone, median(bound) <= median(ttft): efficiency <= 1. A row
above 1.05 means the bound or the measurement is wrong, and the benchmark fails (`check`).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.harness import provenance
from bench.serving.ttft.grid import CACHED, ORACLE, Mode

EFFICIENCY_LIMIT = 1.05


@dataclass
class Sample:
    """One measured request: the client's answer (tokens, text, GenerateStats), the gold answer
    (trained pair) and the machine's 1-minute load average right after it."""
    answer: object
    gold: str | None
    load_1m: float


def summarize(values: list[float]) -> dict:
    """{"median", "min", "max"} of a non-empty list."""
    if not values:
        raise ValueError("no values to summarize")
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def ttft_lower_bound_ms(producer_prefill_ms: float, producer_encode_ms: float, payload_bytes: float, link_mbit: float,
                        burst_bytes: float, question_prefill_ms: float) -> float:
    """max(producer forward, its encode, (payload - burst) / sustained link rate) + question prefill,
    in ms: forward and encode overlap, so their sum is not a bound."""
    wire_ms = max(0.0, payload_bytes - burst_bytes) * 8 / (link_mbit * 1e3)
    return max(producer_prefill_ms, producer_encode_ms, wire_ms) + question_prefill_ms


def _load(samples: list[Sample]) -> dict:
    loads = [s.load_1m for s in samples]
    cores = os.cpu_count() or 1
    return {"load_avg_1m": round(statistics.median(loads), 2), "load_avg_1m_max": round(max(loads), 2),
            "cores": cores, "load_above_cores": max(loads) > cores}


def row(model: str, dtype: str, shaping: str, bw: float | None, link_mbit: float | None, burst_bytes: int, ctx: int,
        mode: Mode, store: str, samples: list[Sample]) -> dict:
    """One JSON row of a cell (see bench.serving.ttft for the keys)."""
    stats = [s.answer.stats for s in samples]
    med = lambda xs: round(statistics.median(xs), 2)
    ttft = summarize([s.ttft_ms for s in stats])
    linked = mode.name != ORACLE and link_mbit
    payload = statistics.median([s.bytes_received for s in stats])
    bound = eff = None
    if linked:
        bound = statistics.median([ttft_lower_bound_ms(s.producer_prefill_ms, s.producer_encode_ms, s.bytes_received,
                                                       link_mbit, burst_bytes, s.question_prefill_ms) for s in stats])
        eff = round(bound / ttft["median"], 3)
    steps = [s.decode_ms / (s.generated_tokens - 1) for s in stats if s.generated_tokens > 1]
    out = {
        "model": model, "shaping": shaping, "bandwidth_mbit": bw, "ctx_tokens": ctx, "mode": mode.name,
        "schedule": mode.schedule, "store": store, "ttft_ms_median": round(ttft["median"], 2),
        "ttft_ms_min": round(ttft["min"], 2), "ttft_ms_max": round(ttft["max"], 2), "runs": len(stats),
        "bytes": int(payload), "efficiency": eff, "ttft_lower_bound_ms": round(bound, 2) if bound is not None else None,
        **_load(samples), "order": "interleaved",
        "producer_prefill_ms": med([s.producer_prefill_ms for s in stats]),
        "producer_encode_ms": med([s.producer_encode_ms for s in stats]),
        "wire_ms": round(payload * 8 / (link_mbit * 1e3), 2) if linked else 0.0,
        "transfer_ms": med([s.transfer_ms for s in stats]), "rebuild_ms": med([s.rebuild_ms for s in stats]),
        "question_prefill_ms": med([s.question_prefill_ms for s in stats]),
        "first_token_ms": med([s.ttft_ms - s.transfer_ms - s.question_prefill_ms
                               - (s.rebuild_ms if mode.name == ORACLE else 0.0) for s in stats]),
        "decode_step_ms": med(steps) if steps else None,
        "link_mbit": round(link_mbit, 2) if linked else None, "link_burst_bytes": burst_bytes if linked else None,
        "raw_kv_bytes": int(statistics.median([s.raw_kv_bytes for s in stats])), "dtype": dtype,
    }
    golds = [s.gold for s in samples]
    if any(g is not None for g in golds):
        from qa.metrics import score

        quality = score((s.answer.text.replace(" .", "").strip(), s.gold) for s in samples)
        out.update(f1=round(quality["f1"], 4), em=round(quality["em"], 4))
    return out


def cached_reference(oracle_row: dict, samples: list[Sample]) -> dict:
    """The TTFT of a consumer that has the context cached itself: from the oracle's own requests,
    TTFT minus its context prefill (rebuild_ms), i.e. question prefill + sampling + request handling."""
    stats = [s.answer.stats for s in samples]
    ttft = summarize([s.ttft_ms - s.rebuild_ms for s in stats])
    kept = {k: v for k, v in oracle_row.items() if k not in ("f1", "em")}  # no answers of its own
    return {**kept, "mode": CACHED, "schedule": None, "store": "warm",
            "ttft_ms_median": round(ttft["median"], 2), "ttft_ms_min": round(ttft["min"], 2),
            "ttft_ms_max": round(ttft["max"], 2), "rebuild_ms": 0.0,
            **provenance.derived(provenance.CACHED_FORMULA)}


def check(rows: list[dict]) -> list[str]:
    """The benchmark's own check: one message per row whose efficiency exceeds EFFICIENCY_LIMIT."""
    bad = []
    for r in rows:
        if r.get("efficiency") is not None and r["efficiency"] > EFFICIENCY_LIMIT:
            bad.append(f"{r['model']} {r['mode']}({r.get('schedule')}) {r['store']} ctx {r['ctx_tokens']} "
                       f"{r['bandwidth_mbit']} Mbit: efficiency {r['efficiency']} > {EFFICIENCY_LIMIT} "
                       f"(lower bound {r['ttft_lower_bound_ms']} ms, measured {r['ttft_ms_median']} ms)")
    return bad


class RowWriter:
    """Each row as one JSON line to stdout and to `path` (replaced, or appended to)."""

    def __init__(self, path: Path, append: bool = False):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "a" if append else "w")
        self.rows: list[dict] = []

    def __call__(self, r: dict) -> None:
        self.rows.append(r)
        line = json.dumps(r)
        print(line, flush=True)
        self.file.write(line + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def tables(rows: list[dict], png: Path) -> None:
    """The figure next to the rows and the markdown tables on stderr (bench.serving.ttft.plot)."""
    from bench.serving.ttft import plot

    plot.plot(rows, png)
    print(f"# plot -> {png}", file=sys.stderr)
    print(plot.markdown(rows), file=sys.stderr)
