"""`python -m bench.micro.compile_step`: does torch.compile (Inductor, CPU) pay on our forward's pieces?

Issue 47 asks to keep torch.compile only where it measures faster, with its compile time stated.
The engine's decode and prefill forwards (shared.model) are per layer: the fused QKV projection
with RoPE, attention over the pool (its own measurements: bench.micro.pool_attention, including
compiled FlexAttention), the output projection, and the MLP (norm, fused gate-up, SiLU x up, down).
This times the two attention-free pieces of every layer of a real checkpoint, eager against
`torch.compile(dynamic=True)`, interleaved, at the token counts of a decode step at batch 1 and 32
and of a 512-token prefill chunk, and states each compile's wall time (the first call's).

One JSON line per (piece, tokens) to stdout and bench/results/compile_step.jsonl: model, dtype,
threads, tokens, eager_ms and compiled_ms (medians over every layer, summed), ratio, compile_s,
max_rel_diff (compiled vs eager on one layer's output, relative to its largest value), load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.harness import services
from shared import model as own
from shared.model import rope
from shared.model.model import rms_norm
from shared.models import load_model

OUT = services.ROOT / "bench/results/compile_step.jsonl"


def mlp(h: torch.Tensor, post: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, eps: float) -> torch.Tensor:
    """The layer's second half: h + down(silu(gate) * up) of the post-attention norm."""
    gate, up = F.linear(rms_norm(h, post, eps), gate_up).chunk(2, dim=-1)
    return h + F.linear(F.silu(gate) * up, down)


def qkv_rope(h, norm, qkv, cos, sin, eps: float, qk_heads: int, head_dim: int) -> torch.Tensor:
    """The layer's first piece: the input norm, the fused projection, RoPE on q and k (v as is)."""
    x = F.linear(rms_norm(h, norm, eps), qkv).view(h.shape[0], -1, head_dim)
    return torch.cat([rope.apply(x[:, :qk_heads], cos, sin), x[:, qk_heads:]], dim=1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", default="1,32,512")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--torch-threads", type=int, default=0)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    loaded = load_model(args.model, args.dtype, "cpu")
    m = own.of(loaded)
    g = m.geometry
    qk_heads = g.num_heads + g.num_kv_heads
    code = services.code_version()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as out, torch.inference_mode():
        for tokens in [int(t) for t in args.tokens.split(",")]:
            h = torch.randn(tokens, g.hidden_size, dtype=m.dtype) * 0.5
            cos, sin = m.tables(torch.arange(tokens) + 500)
            pieces = {
                "mlp": (mlp, lambda fn, w, h=h: fn(h, w.post_norm, w.gate_up, w.down, m.eps)),
                "qkv_rope": (
                    qkv_rope,
                    lambda fn, w, h=h, cos=cos, sin=sin: fn(h, w.input_norm, w.qkv, cos, sin, m.eps, qk_heads, g.head_dim),
                ),
            }
            for piece, (fn, call) in pieces.items():
                compiled = torch.compile(fn, dynamic=True)
                started = time.perf_counter()
                call(compiled, m.layers[0])
                compile_s = time.perf_counter() - started
                eager_out, compiled_out = call(fn, m.layers[0]).float(), call(compiled, m.layers[0]).float()
                rel = float((eager_out - compiled_out).abs().max() / eager_out.abs().max())
                times: dict[str, list[float]] = {"eager": [], "compiled": []}
                for rep in range(args.repeats + 1):
                    for name, f in (("eager", fn), ("compiled", compiled))[:: 1 if rep % 2 else -1]:
                        started = time.perf_counter()
                        for w in m.layers:
                            call(f, w)
                        if rep:  # the first round warms up
                            times[name].append(time.perf_counter() - started)
                eager, comp = (statistics.median(times[k]) * 1e3 for k in ("eager", "compiled"))
                row = {
                    "bench": "compile_step",
                    "model": args.model,
                    "dtype": args.dtype,
                    "piece": piece,
                    "tokens": tokens,
                    "layers": g.num_layers,
                    "eager_ms": round(eager, 3),
                    "compiled_ms": round(comp, 3),
                    "compiled_vs_eager": round(comp / eager, 3),
                    "compile_s": round(compile_s, 1),
                    "max_rel_diff": float(f"{rel:.3g}"),
                    "torch_threads": torch.get_num_threads(),
                    "load_avg_1m": round(os.getloadavg()[0], 2),
                    "code": code,
                }
                print(json.dumps(row), flush=True)
                out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
