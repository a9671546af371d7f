"""`python -m bench.serving.turns`: where a conversation's turns spend their time with prefix reuse on.

One conversation of bench.serving.prefix's multi-turn workload (a context growing by ~250 tokens per turn
to `--ctx-tokens`, a question each turn) through a real producer (chunk store, unbounded) and
consumer (prefix cache at its default), one turn at a time, mode raw. Per turn, from the
consumer's GenerateStats: TTFT (client side), the producer's prefill of what it computed, the
transfer, the rebuild, the question's prefill, the context tokens the consumer's prefix cache
held and the bytes received. It shows what a later turn's TTFT is made of: the new tokens'
prefill on the producer (the stream is paced by it), then the question's prefill on the consumer.

One JSON line per turn to bench/results/turns.jsonl (`--out-dir` to change).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
from pathlib import Path

import grpc

from bench.harness import services
from bench.serving.prefix import _request, multi_turn
from bench.serving.throughput import one, qa_model, qwen05b_model
from shared.pb import consumer_pb2_grpc

RESULTS = services.ROOT / "bench" / "results"


async def _turns(address: str, work, model, out, torch_threads: int) -> None:
    code = services.code_version()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = consumer_pb2_grpc.ConsumerServiceStub(channel)
        for i, req in enumerate(work.requests):
            answer = await one(stub, _request(req, "raw", None))
            stats = answer["stats"]
            assert stats is not None
            row = {
                "bench": "turns",
                "model": model.name,
                "weights": model.weights,
                "dtype": model.dtype,
                "turn": i,
                "ctx_tokens": len(req.context),
                "ttft_ms": round(answer["ttft"], 1),
                "producer_prefill_ms": round(stats.producer_prefill_ms, 1),
                "transfer_ms": round(stats.transfer_ms, 1),
                "rebuild_ms": round(stats.rebuild_ms, 1),
                "question_prefill_ms": round(stats.question_prefill_ms, 1),
                "prefix_reused_tokens": stats.prefix_reused_tokens,
                "bytes_received": stats.bytes_received,
                "torch_threads": torch_threads,
                "load_avg_1m": round(os.getloadavg()[0], 2),
                "code": code,
            }
            print(json.dumps(row), flush=True)
            out.write(json.dumps(row) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--model", default="qwen05b", choices=["qa", "qwen05b"])
    parser.add_argument("--ctx-tokens", type=int, default=2048)
    parser.add_argument("--torch-threads", type=int, default=0, help="both services' --torch-threads (0: torch's default)")
    parser.add_argument("--out-dir", default=str(RESULTS))
    args = parser.parse_args(argv)
    model = {"qa": qa_model, "qwen05b": qwen05b_model}[args.model]()
    work = multi_turn(model, 1, args.ctx_tokens)
    common = ["--dtype", model.dtype, "--log-level", "WARNING", "--torch-threads", str(args.torch_threads)]
    producer = ["--model", model.producer, *common, "--chunk-tokens", "256", "--store-bytes", str(1 << 40)]
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with (
        tempfile.TemporaryDirectory() as logs,
        services.running(producer, ["--model", model.consumer, *common], Path(logs)) as (_, consumer),
        open(out_dir / "turns.jsonl", "a") as out,
    ):
        asyncio.run(_turns(consumer.address, work, model, out, args.torch_threads))


if __name__ == "__main__":
    main()
