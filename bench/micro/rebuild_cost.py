"""CPU per request of the consumer's batched SCD rebuild: `python -m bench.micro.rebuild_cost`.

The trained QA pair's artifact and default schedule; `--batch` contexts of `--ctx` random tokens
encoded by the producer's model once, then rebuilt together layer by layer as the consumer's
engine does (shared.codecs.base.add_layers over ScdDecoders: the joined decode, RoPE, the
finiteness check, the store), `--reps` times; the median process CPU per request (torch on one
thread, the services' heap setting). No gRPC, no engine thread. Run from a worktree's root, it
measures that worktree's code (the before/after of a change: the same file run in each). One
JSON line per run; `--keep` appends it to bench/results/rebuild_cost.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.getcwd())  # the code under the current directory (a worktree's) is measured

import torch


def measure(batch: int, ctx: int, reps: int) -> dict:
    from shared import kv, malloc_tuning
    from shared.codecs.base import LayerJob, StreamInfo, add_layers
    from shared.codecs.scd import ScdCodec, ScdDecoder
    from shared.models import load_model
    from shared.scd import ops
    from shared.scd.artifact import Artifact
    from shared.scd.schedule import Schedule

    malloc_tuning.tune(malloc_tuning.DEFAULT_MMAP_THRESHOLD)
    torch.set_num_threads(1)
    producer = load_model("checkpoints/qa-base", "float32", "cpu")
    consumer = load_model("checkpoints/qa-tuned", "float32", "cpu")
    art = Artifact.load(Path("artifacts/qa-base-to-tuned.safetensors")).to(consumer.device)
    schedule = Schedule.parse(art.default_entry().schedule, consumer.info.num_layers)
    codec = ScdCodec(consumer, [art])
    actions = list(schedule.actions)
    g = torch.Generator().manual_seed(0)
    contexts = [torch.randint(4, producer.info.vocab_size, (ctx,), generator=g).tolist() for _ in range(batch)]
    states = [kv.capture_states(producer, ids, kv.Capture.KV | kv.Capture.NORMED)[0] for ids in contexts]
    payloads = [
        [{n: t.cpu() for n, t in ops.encode_layer(art, layer, a, s[layer], art.geometry.quant_group).items()}
         for layer, a in enumerate(actions)]
        for s in states
    ]

    def rebuild() -> None:
        decoders = [ScdDecoder(codec, art, schedule, StreamInfo(len(actions), ctx, "float32", {})) for _ in range(batch)]
        for layer in range(len(actions)):
            errors, _ = add_layers([LayerJob(d, layer, payloads[i][layer]) for i, d in enumerate(decoders)])
            if any(errors):
                raise RuntimeError(f"layer {layer}: {errors}")

    rebuild()  # warm
    times = []
    for _ in range(reps):
        started = time.process_time()
        rebuild()
        times.append(time.process_time() - started)
    return {"bench": "rebuild_cost", "model": "qa-base->qa-tuned", "weights": "trained", "dtype": "float32",
            "schedule": str(schedule), "batch": batch, "ctx_tokens": ctx, "reps": reps,
            "cpu_ms_per_request": round(statistics.median(times) / batch * 1e3, 3), "torch_threads": 1,
            "load_avg_1m": round(os.getloadavg()[0], 2)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--label", default="", help="what the row measured (e.g. before / after)")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[2] / "bench" / "results" / "rebuild_cost.jsonl"))
    args = parser.parse_args(argv)
    from bench.harness.services import code_version

    row = {**measure(args.batch, args.ctx, args.reps), "code": code_version(Path.cwd()), "label": args.label}
    print(json.dumps(row), flush=True)
    if args.keep:
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
