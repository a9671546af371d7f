"""`python -m bench.micro.pool_attention`: decode attention over the KV pool, one layer, the ways
the engine could read it, side by side (issue 47's choice for consumer.engine.pool_forward).

Per shape (the QA pair's 4/4 heads x 32, the real pair's 9/3 x 64), dtype, batch and context, one
query per row over its `ctx` tokens in 16-token blocks, each row's blocks one run:
- `gather_sdpa_ms`: every row's blocks gathered into a rectangle (index_select, token-major pool,
  what consumer.engine.hf_reference does), one SDPA with a padding mask and enable_gqa;
- `row_token_major_ms`: SDPA per row over a view of a token-major pool ([block, token, n_kv, hd]),
  GQA groups folded into the query dimension;
- `row_head_major_ms`: the same over a head-major pool ([n_kv, block, token, hd]: one contiguous
  span per head), what the engine runs;
- `row_gqa_ms`: per row on the head-major view with enable_gqa instead of the fold;
- `flex_ms` (with `--flex`): FlexAttention compiled (torch.compile, Inductor CPU) over the whole
  pool in place with a block mask of each row's slots; `flex_compile_s` its first call,
  `flex_block_mask_ms` building the mask (once per forward in an engine).
Lower-quartile times of `--steps` calls (the machine is shared), interleaved; `max_err` is the
largest difference of any variant from the gather. JSON lines to stdout with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F

SHAPES = {"qa": (4, 4, 32), "real": (9, 3, 64)}


def _quartile_ms(times: list[float]) -> float:
    return sorted(times)[len(times) // 4] * 1e3


def measure(H: int, KV: int, hd: int, B: int, ctx: int, dtype: torch.dtype, steps: int, flex: bool) -> dict:
    Bt, g = 16, H // KV
    nblk = -(-ctx // Bt)
    NB = B * nblk + 1
    L = nblk * Bt
    tok_k, tok_v = (torch.randn(NB, Bt, KV, hd).to(dtype) for _ in range(2))  # token-major
    head_k, head_v = (t.permute(2, 0, 1, 3).contiguous() for t in (tok_k, tok_v))  # [KV, NB, Bt, hd]
    tables = torch.arange(1, NB).view(B, nblk)
    q = torch.randn(B, H, hd).to(dtype)
    scratch = [torch.empty(B * nblk, Bt, KV, hd, dtype=dtype) for _ in range(2)]
    mask = (torch.arange(L)[None] < ctx)[:, None, None].expand(B, 1, 1, L)

    def gather_sdpa():
        flat = tables.view(-1)
        torch.index_select(tok_k, 0, flat, out=scratch[0])
        torch.index_select(tok_v, 0, flat, out=scratch[1])
        k, v = (s.view(B, L, KV, hd).transpose(1, 2) for s in scratch)
        return F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask, enable_gqa=H != KV)[:, :, 0]

    def row_token_major():
        outs = []
        for r in range(B):
            span = slice(1 + r * nblk, 1 + (r + 1) * nblk)
            k, v = (t[span].view(-1, KV, hd)[:ctx].transpose(0, 1)[None] for t in (tok_k, tok_v))
            outs.append(F.scaled_dot_product_attention(q[r].view(1, KV, g, hd), k, v).view(1, H, hd))
        return torch.cat(outs)

    def row_head_major(gqa: bool = False):
        outs = []
        for r in range(B):
            span = slice(1 + r * nblk, 1 + (r + 1) * nblk)
            k, v = (t[:, span].view(1, KV, -1, hd)[:, :, :ctx] for t in (head_k, head_v))
            if gqa:
                outs.append(F.scaled_dot_product_attention(q[r][None, :, None], k, v, enable_gqa=H != KV).view(1, H, hd))
            else:
                outs.append(F.scaled_dot_product_attention(q[r].view(1, KV, g, hd), k, v).view(1, H, hd))
        return torch.cat(outs)

    fns = {
        "gather_sdpa": gather_sdpa,
        "row_token_major": row_token_major,
        "row_head_major": row_head_major,
        "row_gqa": lambda: row_head_major(True),
    }
    out: dict = {}
    if flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        S = NB * Bt
        slot_row = torch.full((S,), -1, dtype=torch.int32)
        slot_pos = torch.zeros(S, dtype=torch.int32)
        for r in range(B):
            slots = (tables[r][:, None] * Bt + torch.arange(Bt)).view(-1)[:ctx]
            slot_row[slots], slot_pos[slots] = r, torch.arange(ctx, dtype=torch.int32)

        def row_mask(b, h, q_idx, kv_idx):
            return (slot_row[kv_idx] == q_idx) & (slot_pos[kv_idx] < ctx)

        started = time.perf_counter()
        block_mask = create_block_mask(row_mask, None, None, B, S, device="cpu", BLOCK_SIZE=(16, 128))
        compiled = torch.compile(flex_attention)
        K, V = tok_k.view(S, KV, hd).transpose(0, 1)[None], tok_v.view(S, KV, hd).transpose(0, 1)[None]
        fns["flex"] = lambda: compiled(q.transpose(0, 1)[None], K, V, block_mask=block_mask, enable_gqa=H != KV)[0].transpose(
            0, 1
        )
        fns["flex"]()
        out["flex_compile_s"] = round(time.perf_counter() - started, 1)
        started = time.perf_counter()
        create_block_mask(row_mask, None, None, B, S, device="cpu", BLOCK_SIZE=(16, 128))
        out["flex_block_mask_ms"] = round((time.perf_counter() - started) * 1e3, 1)
    ref = gather_sdpa()
    out["max_err"] = float(f"{max((fn() - ref).abs().max().item() for fn in fns.values()):.3g}")
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(steps):
        for name, fn in fns.items():
            started = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - started)
    return {**{f"{name}_ms": round(_quartile_ms(ts), 3) for name, ts in times.items()}, **out}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--shapes", default="qa,real")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--ctx", default="512,2048")
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument(
        "--flex", action="store_true", help="also FlexAttention compiled over the pool (float32, tens of s to compile)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.torch_threads)
    for shape in args.shapes.split(","):
        for dtype in args.dtypes.split(","):
            for ctx in [int(c) for c in args.ctx.split(",")]:
                for batch in [int(b) for b in args.batches.split(",")]:
                    load = round(os.getloadavg()[0], 2)
                    flex = args.flex and dtype == "float32"
                    row = {
                        "bench": "pool_attention",
                        "shape": shape,
                        "dtype": dtype,
                        "batch": batch,
                        "ctx_tokens": ctx,
                        **measure(*SHAPES[shape], batch, ctx, getattr(torch, dtype), args.steps, flex),
                        "torch_threads": args.torch_threads,
                        "load_avg_1m": load,
                    }
                    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
