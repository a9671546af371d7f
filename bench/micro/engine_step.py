"""`python -m bench.micro.engine_step`: the batch engine's decode forward against the bare model's, alone.

bench.serving.throughput's ceiling is the bare Hugging Face decode step (DynamicCache) at batch = streams;
its rows compare the whole service with it. This isolates the engine's own part: one decode step
of `consumer.engine.hf_reference.Runner` over the KV pool (ragged rows, per-row masks, the block gather into
scratch buffers, in-place writes) against one step of the model with a DynamicCache of the same
batch and context, both in this process, interleaved round by round, median of `--steps` steps.
No gRPC, no scheduler, no other process: what is left between a service row and the ceiling is
not the forward.

One JSON line per (batch, round) to bench/results/engine_step.jsonl (`--out-dir` to change):
model, weights, dtype, device, batch, ctx_tokens, engine_step_ms, bare_step_ms, gather_ms (the per-step
block gather alone, every layer, K and V), logits_check_ms and logits_isfinite_ms (the engine's
check of a step's [batch, vocab] logits for non-finite rows, shared.finite, against
`torch.isfinite(...).all(dim=1)`), vocab, torch_threads, load_avg_1m, code.
Per round and `--kv-check-ctx` context, one line to kv_check.jsonl: the codecs' check of one
request's rebuilt K/V (kv_check_ms: each tensor's peak |value| by shared.finite.peaks against the
consumer layer's limits, shared.kv_bound, as KVDecoder.store_many does it), against the finiteness
check it replaced (kv_check_sums_ms, shared.finite.finite_each: a sum per tensor, the product with
zeros only where a sum is not finite) and the product with zeros alone (kv_check_product_ms).
Rows before the limits (no kv_check_sums_ms) timed finite_each as kv_check_ms.

`--compare`: the new step against the old, side by side (issue 47): per model (`--models`, comma
separated: checkpoint paths or registry short names), context (`--ctx`, comma separated) and batch,
one decode step of our own forward over the pool in place (consumer.engine.pool_forward,
`pool_step_ms`: as the engine runs it, decode rows through the paged kernel and prepacked weights
where they apply, `decode_attention` / `packed_weights` say which), of the same forward with per-row
SDPA and plain weights (`pool_plain_step_ms`, the forward before those two), of the Hugging Face runner over gathered blocks (consumer.engine.hf_reference,
`runner_step_ms`) and of the bare Hugging Face model with a DynamicCache (`bare_step_ms`),
interleaved step by step (pool, plain, runner, bare, pool, ...), medians of `--steps`. Every row holds
the model's own K/V of one seeded random-token context (prefilled once, copied to every row, to
both pools and to the DynamicCache), so the three steps start from one state and the row checks
that the pool step's logits equal the runner's (`logits_max_diff`, and `logits_max_abs` for scale). One JSON line per (model, ctx, batch, round) to stdout and
bench/results/engine_forward.jsonl, with the load average at its start and end. With `--prefill`, also
rows "engine_prefill": one prefill forward per PREFILLS shape (a chunk from 0, a chunk after a
prefix, four chunks, four chunks beside eight decode rows), ours against the runner, median of 3.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from bench.harness import services
from bench.harness.provenance import host_fields

RESULTS = services.ROOT / "bench" / "results"


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()  # a step's kernels done: wall time, not launch time


def _median_ms(fn, steps: int) -> float:
    times = []
    for _ in range(steps + 2):  # the first two warm up
        _sync()
        started = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - started)
    return statistics.median(times[2:]) * 1e3


def measure(loaded, batch: int, ctx: int, steps: int) -> dict:
    """One interleaved pair of timings at this batch and context."""
    from transformers import DynamicCache

    from consumer.engine.hf_reference import Runner
    from consumer.engine.kv_pool import KVPool
    from consumer.engine.rows import Row
    from shared.finite import rows_finite

    vocab = loaded.info.vocab_size
    pool = KVPool(loaded.info, loaded.device, batch * (ctx + steps + 40) * loaded.info.kv_bytes(1), 16)
    runner = Runner(loaded, pool)
    seqs = [pool.allocate(ctx + steps + 8) for _ in range(batch)]
    ids = torch.randint(4, vocab, (batch, ctx), device=loaded.device)
    with torch.inference_mode():
        for seq, row in zip(seqs, ids.tolist()):
            runner.forward([Row(seq, row, 0)])

        def engine_step() -> None:
            runner.forward([Row(seq, [7], seq.length) for seq in seqs])

        engine_ms = _median_ms(engine_step, steps)
        cache = DynamicCache(config=loaded.model.config)
        loaded.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        step = torch.full((batch, 1), 7, device=loaded.device)
        bare_ms = _median_ms(lambda: loaded.model(input_ids=step, cache=cache, use_cache=True, logits_to_keep=1), steps)
        flat = torch.stack([seq.table[: -(-ctx // 16)] for seq in seqs]).view(-1)

        def gather() -> None:
            for layer in range(loaded.info.num_layers):
                for buf in (pool.k, pool.v):
                    buf[layer].index_select(0, flat)

        gather_ms = _median_ms(gather, steps)
        # the engine's check of each step's logits for non-finite rows, against torch's isfinite
        logits = torch.randn(batch, vocab, device=loaded.device)
        finite_ms = _median_ms(lambda: rows_finite(logits).tolist(), steps)
        isfinite_ms = _median_ms(lambda: torch.isfinite(logits).all(dim=1).tolist(), steps)
    return {
        "engine_step_ms": round(engine_ms, 3),
        "bare_step_ms": round(bare_ms, 3),
        "gather_ms": round(gather_ms, 3),
        "vocab": vocab,
        "logits_check_ms": round(finite_ms, 3),
        "logits_isfinite_ms": round(isfinite_ms, 3),
    }


def kv_check(loaded, ctx: int, steps: int) -> dict:
    """The codecs' check of one request's rebuilt context K/V (every layer, keys and values, as
    KVDecoder.store_many checks them: peaks against the layer's limits, one host sync) against the
    finiteness check by sums it replaced (shared.finite.finite_each) and the product with zeros
    over each tensor (shared.finite._exact), interleaved in one round."""
    from shared import finite

    info = loaded.info
    tensors = [
        torch.randn(1, info.num_kv_heads, ctx, info.head_dim, device=loaded.device).to(loaded.dtype)
        for _ in range(2 * info.num_layers)
    ]
    limits = [limit for bound in loaded.kv_bounds for limit in (bound.keys, bound.values)]

    def bounded() -> bool:
        return all(peak <= limit for peak, limit in zip(finite.peaks(tensors), limits))

    assert bounded()  # noise of unit scale is inside every layer's limits: the timed path is the passing one
    check_ms = _median_ms(bounded, steps)
    sums_ms = _median_ms(lambda: finite.finite_each(tensors), steps)
    product_ms = _median_ms(lambda: [finite._exact(t) for t in tensors], steps)
    return {
        "tensors": len(tensors),
        "kv_bytes": sum(t.nbytes for t in tensors),
        "kv_check_ms": round(check_ms, 3),
        "kv_check_sums_ms": round(sums_ms, 3),
        "kv_check_product_ms": round(product_ms, 3),
    }


def _filled_pools(loaded, batch: int, ctx: int, steps: int):
    """Two pools (head-major, token-major) with the same tables and the same random K/V over `ctx` tokens per row, and a
    DynamicCache holding the same K/V: the three steps start from one state."""
    from transformers import DynamicCache

    from consumer.engine.kv_pool import KVPool, SequenceKV
    from consumer.engine.pool_forward import PoolRunner
    from consumer.engine.rows import Row

    info = loaded.info
    reserve = ctx + steps + 8
    budget = batch * (reserve + 16) * info.kv_bytes(1)
    # ours reads the head-major pool; the runner gets the token-major one it was built for (main's)
    pools = [KVPool(info, loaded.device, budget, 16, head_major=major) for major in (True, False, True)]
    seqs: list[list[SequenceKV]] = []
    for pool in pools:
        held = [pool.allocate(reserve) for _ in range(batch)]
        seqs.append([seq for seq in held if seq is not None])
        assert len(seqs[-1]) == batch, "the pool is sized for every row"
    g = torch.Generator().manual_seed(0)
    context = torch.randint(4, info.vocab_size, (ctx,), generator=g).tolist()
    first = seqs[0][0]
    prefill = PoolRunner(loaded, pools[0])
    with torch.inference_mode():
        for start in range(0, ctx, 512):  # the model's own K/V of one context, chunk by chunk
            prefill.forward([Row(first, context[start : start + 512], start)])
    used = -(-ctx // 16)
    for seq in seqs[0][1:]:  # every row holds the same context
        pools[0].copy_blocks(first.blocks[:used], seq.blocks[:used])
    for other in (1, 2):  # the same blocks hold the same K/V in every pool
        assert all(a.blocks == b.blocks for a, b in zip(seqs[0], seqs[other]))
        pools[other].k.copy_(pools[0].k)
        pools[other].v.copy_(pools[0].v)
    for seq in seqs[0] + seqs[1] + seqs[2]:
        seq.length = ctx
    cache = DynamicCache(config=loaded.model.config)
    table = torch.stack([seq.table[:used] for seq in seqs[0]])  # [B, used]
    for layer in range(info.num_layers):
        kv = [
            buf[layer][table].reshape(batch, used * 16, info.num_kv_heads, info.head_dim)[:, :ctx].transpose(1, 2)
            for buf in (pools[0].k, pools[0].v)
        ]  # [B, n_kv, ctx, hd]
        cache.update(kv[0].contiguous(), kv[1].contiguous(), layer)
    return pools, seqs, cache


def compare(loaded, batch: int, ctx: int, steps: int) -> dict:
    """One interleaved round: pool step, runner step, bare step, repeated; medians in ms."""
    from consumer.engine import paged_attention
    from consumer.engine.hf_reference import Runner
    from consumer.engine.pool_forward import PoolRunner
    from consumer.engine.rows import Row

    pools, seqs, cache = _filled_pools(loaded, batch, ctx, steps)
    new, old = PoolRunner(loaded, pools[0]), Runner(loaded, pools[1])
    plain = PoolRunner(loaded, pools[2], decode_attention="sdpa", packed=False)
    step_ids = torch.full((batch, 1), 7, device=loaded.device)
    times: dict[str, list[float]] = {"pool": [], "plain": [], "runner": [], "bare": []}
    diff = scale = 0.0
    with torch.inference_mode():
        fns = {
            "pool": lambda: new.forward([Row(seq, [7], seq.length) for seq in seqs[0]]),
            "plain": lambda: plain.forward([Row(seq, [7], seq.length) for seq in seqs[2]]),
            "runner": lambda: old.forward([Row(seq, [7], seq.length) for seq in seqs[1]]),
            "bare": lambda: loaded.model(input_ids=step_ids, cache=cache, use_cache=True, logits_to_keep=1).logits,
        }
        for _ in range(steps + 2):  # the first two warm up
            out = {}
            for name, fn in fns.items():
                _sync()
                started = time.perf_counter()
                out[name] = fn()
                _sync()
                times[name].append(time.perf_counter() - started)
            diff = max(diff, (out["pool"] - out["runner"]).abs().max().item())
            scale = out["runner"].abs().max().item()
    med = {name: statistics.median(ts[2:]) * 1e3 for name, ts in times.items()}
    return {
        "pool_step_ms": round(med["pool"], 3),
        "pool_plain_step_ms": round(med["plain"], 3),
        "runner_step_ms": round(med["runner"], 3),
        "bare_step_ms": round(med["bare"], 3),
        "pool_vs_runner": round(med["pool"] / med["runner"], 3),
        "pool_vs_plain": round(med["pool"] / med["plain"], 3),
        "pool_vs_bare": round(med["pool"] / med["bare"], 3),
        "decode_attention": "kernel" if new.decode_kernel is not None else "sdpa",
        "decode_runs": paged_attention.runs(new),  # which kernel: "kernel avx512 amx", "kernel avx512", "sdpa: why"
        "packed_weights": new.packed is not None,
        "logits_max_diff": float(f"{diff:.3g}"),
        "logits_max_abs": float(f"{scale:.3g}"),
        "gathered_rows": new.gathered_rows,
    }


# one prefill forward: (tokens already in the row, new tokens) per row
PREFILLS = {
    "512_from_0": [(0, 512)],
    "512_after_1536": [(1536, 512)],
    "4x128_from_0": [(0, 128)] * 4,
    "4x128_after_512_with_8_decode": [(512, 128)] * 4 + [(1024, 1)] * 8,
}


def compare_prefill(loaded, rows: list[tuple[int, int]], reps: int) -> dict:
    """One prefill forward of these rows, ours (head-major pool) and the HF runner's (token-major),
    alternating, each on fresh pools whose rows were prefilled to their start; medians in ms."""
    from consumer.engine.hf_reference import Runner
    from consumer.engine.kv_pool import KVPool
    from consumer.engine.pool_forward import PoolRunner
    from consumer.engine.rows import Row

    info = loaded.info
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(4, info.vocab_size, (start + n,), generator=g).tolist() for start, n in rows]
    times: dict[str, list[float]] = {"pool": [], "runner": []}
    runs = ""
    for _ in range(reps):
        for name, runner_type, head_major in (("pool", PoolRunner, True), ("runner", Runner, False)):
            pool = KVPool(info, loaded.device, sum(s + n + 16 for s, n in rows) * info.kv_bytes(1) + (1 << 20), 16, head_major)
            runner = runner_type(loaded, pool)
            runs = getattr(runner, "prefill_runs", runs)
            seqs = [pool.allocate(start + n) for start, n in rows]
            with torch.inference_mode():
                for seq, (start, _), ids in zip(seqs, rows, tokens):
                    for at in range(0, start, 512):
                        runner.forward([Row(seq, ids[at : min(start, at + 512)], at)])
                batch = [Row(seq, ids[start:], start) for seq, (start, _), ids in zip(seqs, rows, tokens)]
                _sync()
                started = time.perf_counter()
                runner.forward(batch)
                _sync()
                times[name].append(time.perf_counter() - started)
    med = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
    return {
        "pool_prefill_ms": round(med["pool"], 3),
        "runner_prefill_ms": round(med["runner"], 3),
        "pool_vs_runner": round(med["pool"] / med["runner"], 3),
        "prefill_runs": runs,  # our prefill rows: "kernel amx", "kernel avx512bf16" or "sdpa: why"
    }


def _measured(measure) -> tuple[dict, float, float]:
    """(measure()'s row fields, the 1-minute load average before it and after it)."""
    before = round(os.getloadavg()[0], 2)
    result = measure()
    return result, before, round(os.getloadavg()[0], 2)


def main_compare(args) -> None:
    from shared.models import load_model

    code = services.code_version()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "engine_forward.jsonl", "a") as out:

        def emit(bench: str, model: str, loaded, shape: dict, round_: int, measured: tuple[dict, float, float]) -> None:
            result, load_before, load_after = measured
            row = {
                "bench": bench,
                "model": Path(model).name,
                "dtype": args.dtype,
                "device": str(loaded.device),
                **shape,
                "round": round_,
                **result,
                "torch_threads": args.torch_threads or torch.get_num_threads(),
                "load_avg_1m": load_before,
                "load_avg_1m_end": load_after,
                "code": code,
                **host_fields(),
            }
            print(json.dumps(row), flush=True)
            out.write(json.dumps(row) + "\n")

        for model in [m for m in args.models.split(",") if m]:
            path = services.ROOT / model
            loaded = load_model(str(path) if path.exists() else model, args.dtype, args.device)
            for round_ in range(args.rounds):
                for ctx in [int(c) for c in str(args.ctx).split(",") if c]:
                    for batch in [int(b) for b in args.batches.split(",") if b]:
                        measured = _measured(lambda: compare(loaded, batch, ctx, args.steps))  # noqa: B023  # called here
                        emit("engine_forward", model, loaded, {"batch": batch, "ctx_tokens": ctx}, round_, measured)
                for name, rows in PREFILLS.items() if args.prefill else ():
                    measured = _measured(lambda: compare_prefill(loaded, rows, 3))  # noqa: B023  # called here
                    emit("engine_prefill", model, loaded, {"prefill": name}, round_, measured)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--model", default="checkpoints/qa-tuned")
    parser.add_argument("--weights", default="trained", help="what the rows say the weights are")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batches", default="1,8,32", help="comma-separated; empty: the K/V check alone")
    parser.add_argument("--ctx", default="512", help="context tokens (--compare: comma-separated)")
    parser.add_argument("--compare", action="store_true", help="new pool step vs HF runner vs bare HF (engine_forward.jsonl)")
    parser.add_argument("--models", default="checkpoints/qa-tuned,smollm2-135m", help="--compare: comma-separated models")
    parser.add_argument("--prefill", action="store_true", help="--compare: also one prefill forward per PREFILLS shape")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--torch-threads", type=int, default=0, help="0: torch's default")
    parser.add_argument(
        "--device", default="cpu", help="cpu, cuda or auto (cuda when present); CUDA steps are timed to their end"
    )
    parser.add_argument("--out-dir", default=str(RESULTS))
    parser.add_argument(
        "--kv-check-ctx",
        default="512,2048,8192",
        help="contexts at which a request's rebuilt K/V check is timed (rows to kv_check.jsonl); empty: none",
    )
    args = parser.parse_args(argv)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    from shared import malloc_tuning
    from shared.models import load_model

    malloc_tuning.tune(malloc_tuning.DEFAULT_MMAP_THRESHOLD)  # the services' heap setting (--malloc-mmap-threshold)
    if args.compare:
        main_compare(args)
        return
    args.ctx = int(args.ctx)

    loaded = load_model(str(services.ROOT / args.model), args.dtype, args.device)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    code = services.code_version()
    with open(out_dir / "engine_step.jsonl", "a") as out:
        for round_ in range(args.rounds):
            for batch in [int(b) for b in args.batches.split(",") if b]:
                row = {
                    "bench": "engine_step",
                    "model": Path(args.model).name,
                    "weights": args.weights,
                    "dtype": args.dtype,
                    "device": str(loaded.device),
                    "batch": batch,
                    "ctx_tokens": args.ctx,
                    "round": round_,
                    **measure(loaded, batch, args.ctx, args.steps),
                    "torch_threads": args.torch_threads or torch.get_num_threads(),
                    "load_avg_1m": round(os.getloadavg()[0], 2),
                    "code": code,
                }
                print(json.dumps(row), flush=True)
                out.write(json.dumps(row) + "\n")
            with open(out_dir / "kv_check.jsonl", "a") as checks:
                for ctx in [int(c) for c in args.kv_check_ctx.split(",") if c]:
                    row = {
                        "bench": "kv_check",
                        "model": Path(args.model).name,
                        "weights": args.weights,
                        "dtype": args.dtype,
                        "device": str(loaded.device),
                        "ctx_tokens": ctx,
                        "round": round_,
                        **kv_check(loaded, ctx, args.steps),
                        "torch_threads": args.torch_threads or torch.get_num_threads(),
                        "load_avg_1m": round(os.getloadavg()[0], 2),
                        "code": code,
                    }
                    print(json.dumps(row), flush=True)
                    checks.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
