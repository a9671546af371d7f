"""`python -m bench.micro.prefill_attention`: the bfloat16 prefill-attention kernel
(consumer.engine.prefill_attention) against what it replaced on prefill rows, per-row SDPA with the GQA
groups folded (a chunk from 0: causal over K/V repeated per query head; a later chunk: a bottom-right
mask), on one layer's shapes of a prefill in `--chunk`-token chunks, interleaved call by call.

One JSON line per chunk (median ms of each over `--reps` calls, their ratio), then a total over the
chunks times the model's layers (attention's share of a whole prefill); appended to `--out`, default
bench/results/prefill_attention.jsonl. Random bf16 inputs of the model's geometry (attention's cost
does not depend on the values). Needs a CPU where the kernel runs (AVX-512 BF16); elsewhere it says why
and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.harness import services
from bench.harness.provenance import host_fields
from consumer.engine import prefill_attention
from shared.models import resolve_path

OUT = Path(__file__).resolve().parents[1] / "results/prefill_attention.jsonl"


def sdpa_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """What pool_forward._attend_row runs for a chunk: q [n, H, hd] over k / v [1, n_kv, L, hd]."""
    n, H, hd = q.shape
    kv = k.shape[1]
    g = H // kv
    if start == 0:
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), is_causal=True
        )
        return out[0].transpose(0, 1)
    L = start + n
    mask = (torch.arange(L)[None] <= start + torch.arange(n)[:, None]).repeat(g, 1)[None, None]
    folded = q.view(n, kv, g, hd).permute(1, 2, 0, 3).reshape(1, kv, g * n, hd)
    out = F.scaled_dot_product_attention(folded, k, v, attn_mask=mask)
    return out.view(kv, g, n, hd).permute(2, 0, 1, 3).reshape(n, H, hd)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="whose geometry (config.json) to use")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    fn = prefill_attention.kernel()
    if fn is None:
        print(f"the prefill kernel does not run here: {prefill_attention.which()}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    config = json.loads((Path(resolve_path(args.model)) / "config.json").read_text())
    H, kv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or config["hidden_size"] // H
    layers, bt = config["num_hidden_layers"], 16
    common = {
        "bench": "prefill_attention",
        "model": args.model,
        "dtype": "bfloat16",
        "heads": H,
        "kv_heads": kv,
        "head_dim": hd,
        "threads": args.threads,
        "kernel": prefill_attention.which(),  # its variant: "kernel amx" or "kernel avx512bf16"
        "code": services.code_version(),
        **host_fields(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    g = torch.Generator().manual_seed(0)
    total = {"sdpa": 0.0, "kernel": 0.0}
    with open(args.out, "a") as out:
        for start in range(0, args.tokens, args.chunk):
            n = min(args.chunk, args.tokens - start)
            L = start + n
            blocks = -(-L // bt)
            k = torch.randn(kv, blocks * bt, hd, generator=g).bfloat16()
            v = torch.randn(kv, blocks * bt, hd, generator=g).bfloat16()
            q = torch.randn(n, H, hd, generator=g).bfloat16()
            table = torch.arange(blocks)
            keys, values = k[:, :L][None], v[:, :L][None]  # one run of blocks: SDPA reads them in place
            calls = {
                "sdpa": lambda: sdpa_chunk(q, keys, values, start),  # noqa: B023  # called in this iteration
                "kernel": lambda: fn(q, k, v, table, start, bt, hd**-0.5),  # noqa: B023
            }
            times: dict[str, list[float]] = {name: [] for name in calls}
            for rep in range(args.reps + 1):  # the first warms up
                for name, call in calls.items():
                    started = time.perf_counter()
                    call()
                    if rep:
                        times[name].append(time.perf_counter() - started)
            med = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
            for name in total:
                total[name] += med[name] * layers
            row = {
                **common,
                "kind": "chunk",
                "start": start,
                "tokens": n,
                "sdpa_ms": round(med["sdpa"], 3),
                "kernel_ms": round(med["kernel"], 3),
                "kernel_vs_sdpa": round(med["kernel"] / med["sdpa"], 3),
            }
            print(json.dumps(row))
            out.write(json.dumps(row) + "\n")
        row = {
            **common,
            "kind": "total",
            "prefill_tokens": args.tokens,
            "chunk": args.chunk,
            "layers": layers,
            "sdpa_ms": round(total["sdpa"], 1),
            "kernel_ms": round(total["kernel"], 1),
            "kernel_vs_sdpa": round(total["kernel"] / total["sdpa"], 3),
            "load_avg_1m_end": round(os.getloadavg()[0], 2),
        }
        print(json.dumps(row))
        out.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
