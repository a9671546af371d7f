"""`python -m bench.figures.projection`: a PROJECTION (not a measurement) of TTFT per transfer mode for a
7B-class model on one H200 at 10-400 Gbit/s, fed with the bytes per token measured by bench.serving.ttft.

Formula (all times in ms; T context tokens, q question tokens, B link Gbit/s):

    prefill P(T)  = (2 N T + 2 L d T^2) / (mfu * peak)        dense weights + causal attention FLOPs
    question Q    = 2 N / (hbm_eff * hbm)                     a short prefill is weight-read bound
    wire W_m(T,B) = T * kv_bytes_per_token * r_m * 8 / min(link_eff * B, S)
    rebuild R_m   = c_m * P(T)                                consumer compute to rebuild (patch/recompute)

    oracle        = P(T + q)                                  the consumer prefills everything itself
    mode m, warm  = max(W_m, R_m) + Q                         context already in the producer's store
    mode m, cold  = max(P(T), W_m, R_m) + Q                   producer prefill streamed layer by layer

Layers pipeline perfectly (a layer's wire time overlaps the next layer's compute), as the services
do; the pipeline fill (one layer) and the first token's argmax are ignored. r_m is the measured
ratio of payload bytes to the raw KV bytes of the benchmark model (median over the --results rows
of that mode and schedule), c_m the measured median rebuild_ms over the same context's oracle
TTFT; both can be overridden (--ratio, --rebuild-frac). The 7B geometry (Qwen2.5-7B: 28 layers,
hidden 3584, 4 KV heads x 128, bf16 -> 57,344 raw KV bytes per token) and the H200 figures
(989 TFLOP/s dense bf16, 4.8 TB/s HBM) are stated assumptions, as are mfu 0.45, hbm_eff 0.6 and
link_eff 0.9. S is the MEASURED ceiling of this implementation's gRPC stream (bench.micro.transport: raw
payload bytes through the real producer stream on loopback, best chunk size, from
bench/results/transport.jsonl): no link is faster than the Python stream that feeds it, so a
400 Gbit/s line does not carry more than S here. The crossover bandwidth at which mode m matches oracle (warm) is
B* = T kv_bytes r_m 8 / (link_eff (oracle - Q)) when R_m + Q < oracle, else never.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

from shared.labels import mode_label

RESULTS = Path(__file__).parents[1] / "results" / "ttft.jsonl"
CONTEXTS = [4096, 32768]
GBPS = [10.0, 25.0, 50.0, 100.0, 200.0, 400.0]
TRANSPORT = Path(__file__).parents[1] / "results" / "transport.jsonl"


def stream_ceiling_gbps(path: Path) -> float:
    """Best measured gRPC stream throughput (median over repetitions, best chunk size), Gbit/s."""
    if not path.exists():
        return float("inf")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return max((r["grpc_MBps"] * 8e-3 for r in rows), default=float("inf"))


@dataclass(frozen=True)
class Assumptions:
    model: str = "7B-class (Qwen2.5-7B geometry)"
    params: float = 7.6e9  # N
    layers: int = 28  # L
    hidden: int = 3584  # d
    kv_heads: int = 4
    head_dim: int = 128
    kv_element_bytes: int = 2  # bf16
    gpu: str = "1x H200"
    peak_flops: float = 989e12  # dense bf16
    mfu: float = 0.45  # prefill model-FLOPs utilization (assumed)
    hbm_bytes_s: float = 4.8e12
    hbm_eff: float = 0.6  # assumed
    link_eff: float = 0.9  # goodput / line rate (measured ~0.96 on the tbf link here)
    stream_ceiling_gbps: float = float("inf")  # measured gRPC stream throughput (bench.micro.transport), S
    question_tokens: int = 32

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_element_bytes


def prefill_ms(a: Assumptions, tokens: int) -> float:
    flops = 2 * a.params * tokens + 2 * a.layers * a.hidden * tokens ** 2
    return flops / (a.mfu * a.peak_flops) * 1e3


def question_ms(a: Assumptions) -> float:
    return 2 * a.params / (a.hbm_eff * a.hbm_bytes_s) * 1e3


def wire_ms(a: Assumptions, tokens: int, ratio: float, gbps: float) -> float:
    return tokens * a.kv_bytes_per_token * ratio * 8 / (min(a.link_eff * gbps, a.stream_ceiling_gbps) * 1e9) * 1e3


def project(a: Assumptions, tokens: int, ratio: float, rebuild_frac: float, gbps: float, store: str) -> float:
    w, r, q = wire_ms(a, tokens, ratio, gbps), rebuild_frac * prefill_ms(a, tokens), question_ms(a)
    return (max(w, r) if store == "warm" else max(prefill_ms(a, tokens), w, r)) + q


def crossover_gbps(a: Assumptions, tokens: int, ratio: float, rebuild_frac: float) -> float | None:
    oracle, q = prefill_ms(a, tokens + a.question_tokens), question_ms(a)
    if rebuild_frac * prefill_ms(a, tokens) + q >= oracle:
        return None
    needed = tokens * a.kv_bytes_per_token * ratio * 8 / ((oracle - q) * 1e-3) / 1e9  # goodput that ties the oracle
    return None if needed > a.stream_ceiling_gbps else needed / a.link_eff


def measured_modes(rows: list[dict], model: str | None) -> dict[str, tuple[float, float]]:
    """{label: (bytes ratio r_m, rebuild fraction c_m)} from bench.serving.ttft rows (one model)."""
    models = sorted({r["model"] for r in rows})
    model = model or next((m for m in models if "qwen05b" in m), models[0] if models else None)
    rows = [r for r in rows if r["model"] == model]
    oracle = {r["ctx_tokens"]: r["ttft_ms_median"] for r in rows if r["mode"] == "oracle"}
    rows = [r for r in rows if r["mode"] not in ("oracle", "cached") and r.get("raw_kv_bytes")]  # link modes only
    ratios, fracs = defaultdict(list), defaultdict(list)
    for r in rows:
        name = mode_label(r["mode"], r.get("schedule") or "")
        ratios[name].append(r["bytes"] / r["raw_kv_bytes"])
        if r["ctx_tokens"] in oracle:
            fracs[name].append(r["rebuild_ms"] / oracle[r["ctx_tokens"]])
    return {n: (statistics.median(v), statistics.median(fracs[n]) if fracs[n] else 0.0) for n, v in ratios.items()}


def _pairs(items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        key, _, value = item.rpartition("=")
        out[key] = float(value)
    return out


def project_all(a: Assumptions, modes: dict[str, tuple[float, float]], contexts: list[int],
                gbps: list[float]) -> tuple[list[dict], str]:
    """(JSON rows, markdown table) of every mode x context x bandwidth, warm and cold."""
    lines = [{"projection": True, "assumptions": {**asdict(a), "kv_bytes_per_token": a.kv_bytes_per_token},
              "modes": {n: {"bytes_ratio": round(r, 4), "rebuild_frac": round(c, 4)} for n, (r, c) in modes.items()}}]
    table = [f"**PROJECTION, not measured: {a.model} on {a.gpu}** (TTFT ms, ratio to oracle; warm store / cold store; "
             f"wire capped at the measured gRPC stream ceiling {a.stream_ceiling_gbps:.1f} Gbit/s)\n"]
    for ctx in contexts:
        oracle = prefill_ms(a, ctx + a.question_tokens)
        lines.append({"projection": True, "ctx_tokens": ctx, "mode": "oracle", "ttft_ms": round(oracle, 2)})
        table += [f"{ctx} tokens, oracle {oracle:.1f} ms\n", "| mode | " + " | ".join(f"{g:g} Gbps" for g in gbps)
                  + " | beats oracle from |", "|---" * (len(gbps) + 2) + "|"]
        for name, (ratio, frac) in sorted(modes.items()):
            cells = []
            for g in gbps:
                warm, cold = (project(a, ctx, ratio, frac, g, s) for s in ("warm", "cold"))
                for store, ms in (("warm", warm), ("cold", cold)):
                    lines.append({"projection": True, "model": a.model, "gpu": a.gpu, "bandwidth_gbps": g,
                                  "ctx_tokens": ctx, "mode": name, "store": store, "ttft_ms": round(ms, 2),
                                  "ratio_to_oracle": round(ms / oracle, 3),
                                  "bytes_per_token": round(ratio * a.kv_bytes_per_token, 1)})
                cells.append(f"{warm:.1f} ({warm / oracle:.2f}) / {cold:.1f}")
            cross = crossover_gbps(a, ctx, ratio, frac)
            table.append(f"| {name} | " + " | ".join(cells) + f" | {f'{cross:.1f} Gbps' if cross else 'never'} |")
        table.append("")
    return lines, "\n".join(table)


def from_results(results: Path = RESULTS, transport: Path | None = None, model: str | None = None,
                 mfu: float = Assumptions.mfu) -> tuple[Assumptions, dict[str, tuple[float, float]]]:
    """The assumptions (stream ceiling from `transport`) and each mode's measured (r_m, c_m)."""
    a = Assumptions(mfu=mfu, stream_ceiling_gbps=stream_ceiling_gbps(transport or TRANSPORT))
    rows = [json.loads(line) for line in results.read_text().splitlines() if line.strip()] if results.exists() else []
    return a, {"raw": (1.0, 0.0), **measured_modes(rows, model)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.figures.projection", description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=RESULTS, help="bench.serving.ttft rows to take r_m and c_m from")
    p.add_argument("--from-model", help="which model's rows (default: qwen05b-random if present)")
    p.add_argument("--ratio", nargs="*", default=[], help="MODE=R bytes ratio to raw KV, e.g. 'quant(bits=4)=0.28'")
    p.add_argument("--rebuild-frac", nargs="*", default=[], help="MODE=C consumer rebuild compute / full prefill")
    p.add_argument("--contexts", nargs="+", type=int, default=CONTEXTS)
    p.add_argument("--gbps", nargs="+", type=float, default=GBPS)
    p.add_argument("--mfu", type=float, default=Assumptions.mfu)
    p.add_argument("--transport", type=Path, default=TRANSPORT, help="bench.micro.transport rows: the stream ceiling S")
    args = p.parse_args(argv)
    a, modes = from_results(args.results, args.transport, args.from_model, args.mfu)
    for name, r in _pairs(args.ratio).items():
        modes[name] = (r, modes.get(name, (1.0, 0.0))[1])
    for name, c in _pairs(args.rebuild_frac).items():
        modes[name] = (modes.get(name, (1.0, 0.0))[0], c)
    lines, table = project_all(a, modes, args.contexts, args.gbps)
    for line in lines:
        print(json.dumps(line))
    print(table)


if __name__ == "__main__":
    main()
