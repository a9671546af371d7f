"""`python -m bench.peer.breakdown` (`make bench-breakdown`): where this project's time goes in the peer
benchmark's workloads (bench.peer.vs_vllm), layer by layer, on the same prompts, interleaved.

Three layers, each a superset of the one before:
- `forward`: the engine's own forward (consumer.engine.pool_forward.PoolRunner) in this process,
  no scheduler: each prompt (context + question) prefilled in the engine's default chunks (CHUNK), then
  one decode forward per new token over every stream at once, fed the tokens the services
  generated (teacher-forced: the same number of steps, whatever the sampler would pick);
- `engine`: the batch engine (consumer.engine.batch.BatchEngine) on its thread in this process:
  chunked prefill, continuous batching, greedy sampling, stop checks, each stream allowed the number
  of tokens the services generated for it;
- `services`: the producer and consumer as real processes, asked over gRPC in oracle mode
  (exactly what bench.peer.vs_vllm times).
So `engine - forward` is scheduling and sampling, `services - engine` the services' path (gRPC,
the frontend, admission, the prefix-cache bookkeeping, the engine thread sharing its process).

Workloads as the peer benchmark's: `ttft` (one prompt of `--ttft-ctx` context tokens, one new
token) and `decode` (`--streams` prompts of `--decode-ctx` context tokens at once, up to
`--decode-tokens` new tokens, the chat turn's end stops). Each repetition runs the services first
(their answers fix the other layers' token counts), then the two in-process layers in alternating
order, on new prompts. One JSON line per sample (layer, workload, streams, rep, wall_s, tokens,
load), then per workload a summary: medians per layer and their differences; appended (each row
names its torch threads) to `--out`, default bench/results/peer_breakdown.jsonl.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import torch

from bench.harness import services
from bench.peer import workloads
from consumer.engine import prefill_budget
from consumer.engine.batch import BatchEngine, Task
from consumer.engine.decoding import Sampler, Sampling
from consumer.engine.kv_pool import KVPool
from consumer.engine.pool_forward import PoolRunner
from consumer.engine.rows import Row
from real import tasks
from shared import torch_threads
from shared.models import load_model, resolve_path

ROOT = services.ROOT
OUT = ROOT / "bench/results/peer_breakdown.jsonl"
CHUNK, BUDGET = prefill_budget.resolve(0, 0, "cpu")  # the consumer's defaults on this device
LAYERS = ("forward", "engine", "services")


def _pool(loaded, prompts: list[list[int]], new: list[int]) -> KVPool:
    tokens = sum(len(p) + n + 32 for p, n in zip(prompts, new))
    return KVPool(loaded.info, loaded.device, tokens * loaded.info.kv_bytes(1) + (1 << 20), 16)


def forward_only(loaded, prompts: list[list[int]], fed: list[list[int]]) -> float:
    """Wall s of the bare forwards, on a thread of their own as the engine's are: every prompt's
    chunks, then decode steps over the streams still going, fed `fed[i]` (the tokens the services
    generated; the last one is never fed)."""
    out: list[float] = []
    worker = threading.Thread(target=lambda: out.append(_forwards(loaded, prompts, fed)), name="forward-only")
    worker.start()
    worker.join()
    if not out:
        raise RuntimeError("the forwards failed (see the thread's traceback above)")
    return out[0]


def _forwards(loaded, prompts: list[list[int]], fed: list[list[int]]) -> float:
    pool = _pool(loaded, prompts, [len(f) for f in fed])
    runner = PoolRunner(loaded, pool)
    seqs = [pool.allocate(len(p) + len(f)) for p, f in zip(prompts, fed)]
    started = time.perf_counter()
    with torch.inference_mode():
        for seq, p in zip(seqs, prompts):
            for at in range(0, len(p), CHUNK):
                runner.forward([Row(seq, p[at : at + CHUNK], at)])
        for step in range(max(len(f) for f in fed) - 1):
            rows = [Row(seq, [f[step]], seq.length) for seq, f in zip(seqs, fed) if step < len(f) - 1]
            runner.forward(rows)
    return time.perf_counter() - started


def engine_only(loaded, prompts: list[list[int]], new: list[int], stop: list[int]) -> float:
    """Wall s of the batch engine generating greedily, every prompt added at once."""
    pool = _pool(loaded, prompts, new)
    engine = BatchEngine(loaded, pool, max_batch=max(32, len(prompts)), prefill_chunk=CHUNK, max_batch_tokens=BUDGET)
    done, left, lock = threading.Event(), [len(prompts)], threading.Lock()

    def sink(item) -> None:
        if isinstance(item, int):
            return
        with lock:
            left[0] -= 1
            if left[0] == 0:
                done.set()

    seqs = [pool.allocate(len(p) + n) for p, n in zip(prompts, new)]
    try:
        started = time.perf_counter()
        for seq, p, n in zip(seqs, prompts, new):
            engine.add(Task(seq, list(p), sink, Sampler(Sampling(), loaded.device), max(1, n), frozenset(stop)))
        if not done.wait(3600):
            raise TimeoutError("the engine did not finish")
        wall = time.perf_counter() - started
        for seq in seqs:
            engine.release(seq).result(60)
    finally:
        engine.shutdown()
    return wall


def summary(samples: list[dict], workload: str, streams: int) -> dict:
    mine = [s for s in samples if s["workload"] == workload and s["streams"] == streams]
    med = {layer: statistics.median(s["wall_s"] for s in mine if s["layer"] == layer) for layer in LAYERS}
    return {
        "kind": "summary",
        "workload": workload,
        "streams": streams,
        "runs": len(mine) // len(LAYERS),
        **{f"{layer}_s_median": round(med[layer], 3) for layer in LAYERS},
        "scheduling_s": round(med["engine"] - med["forward"], 3),
        "services_path_s": round(med["services"] - med["engine"], 3),
        "forward_share": round(med["forward"] / med["services"], 3),
        "load_avg_1m_median": round(statistics.median(s["load_avg_1m"] for s in mine), 2),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    workloads.add_args(parser, OUT, "torch threads (services and this process)")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(str(resolve_path(args.model)))
    stop = [tasks.end_id(tok)]
    # as in the consumer: the model loads on a thread that ends and this one computes on one, so
    # each layer's thread forms the process's only OpenMP team (shared.torch_threads)
    loaded = torch_threads.on_new_thread(load_model, args.model, args.dtype, "cpu")
    torch_threads.pin(1)
    common = workloads.row_fields(args)
    ours, consumer_args = workloads.service_args(args, max(32, *workloads.streams(args)))
    log_dir = ROOT / "bench/runs/peer_breakdown"
    log_dir.mkdir(parents=True, exist_ok=True)
    cells = workloads.cells(args)
    samples: list[dict] = []
    with open(args.out, "a") as out, services.running(ours, consumer_args, log_dir) as (_, consumer):
        emit = workloads.Rows(out, common).emit
        serial = 0
        for rep in range(-args.warmup, args.runs):
            for workload, n, ctx, max_tokens in cells:
                batch = workloads.prompts(tok, ctx, n, first=serial)
                serial += n
                prompts = [c + q for c, q in batch]
                # the services first (their answers fix the other layers' token counts), then the
                # in-process layers, their order alternating
                walls = {}
                walls["services"], outputs = workloads.ours(consumer.address, batch, max_tokens, stop)
                new = [len(o) for o in outputs]
                order = ("forward", "engine") if rep % 2 == 0 else ("engine", "forward")
                for layer in order:
                    walls[layer] = (
                        forward_only(loaded, prompts, outputs) if layer == "forward" else engine_only(loaded, prompts, new, stop)
                    )
                for layer in LAYERS:
                    row = {
                        "kind": "sample",
                        "layer": layer,
                        "workload": workload,
                        "streams": n,
                        "context_tokens": ctx,
                        "rep": rep,
                        "wall_s": round(walls[layer], 4),
                        "tokens": sum(new),
                        "load_avg_1m": os.getloadavg()[0],
                    }
                    if rep >= 0:
                        samples.append(row)
                        emit(row)
        for workload, n, _, _ in cells:
            emit(summary(samples, workload, n))


if __name__ == "__main__":
    sys.exit(main())
