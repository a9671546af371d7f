"""The peer benchmarks' workloads (bench.peer.vs_vllm, bench.peer.breakdown): their flags, cells and
prompts, this project's services asked over gRPC in oracle mode, and the JSON-lines writer both use.
Measures nothing by itself."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import TextIO

from bench.harness import services
from bench.harness.provenance import host_fields, weights_of
from consumer.api.client import ConsumerClient, prompt
from real import tasks

Prompts = list[tuple[list[int], list[int]]]  # (context ids, question ids) per request


def add_args(parser: argparse.ArgumentParser, out: Path, threads_help: str) -> None:
    """The flags both peer benchmarks take: model, dtype, threads, the workloads' shapes, repetitions."""
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help=threads_help)
    parser.add_argument("--ttft-ctx", type=int, default=2048)
    parser.add_argument("--decode-ctx", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--streams", default="1,32")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument(
        "--stream-interval",
        default="1",
        help="the consumer's --stream-interval: tokens per message after the first (1: each alone); "
        "bench.peer.vs_vllm takes a comma list and runs a consumer per value side by side",
    )
    parser.add_argument("--out", type=Path, default=out)


def row_fields(args: argparse.Namespace) -> dict:
    """What every row of a run of this project's services alone says it ran on: the model, its
    weights and dtype, the torch threads, the code and the host."""
    return {
        "model": args.model,
        "weights": weights_of(args.model),
        "dtype": args.dtype,
        "torch_threads": args.threads,
        "stream_interval": intervals(args)[0],
        "code": services.code_version(),
        **host_fields(),
    }


def intervals(args: argparse.Namespace) -> list[int]:
    """The stream intervals asked (--stream-interval, a comma list), each >= 1."""
    values = [int(s) for s in str(args.stream_interval).split(",")]
    if not values or min(values) < 1:
        raise SystemExit(f"--stream-interval: {args.stream_interval!r} must be integers >= 1")
    return values


def streams(args: argparse.Namespace) -> list[int]:
    return [int(s) for s in args.streams.split(",")]


def cells(args: argparse.Namespace) -> list[tuple[str, int, int, int]]:
    """(workload, streams, context tokens, max new tokens): one TTFT cell, then a decode cell per --streams."""
    return [("ttft", 1, args.ttft_ctx, 1)] + [("decode", n, args.decode_ctx, args.decode_tokens) for n in streams(args)]


def service_args(args: argparse.Namespace, max_batch: int, interval: int | None = None) -> tuple[list[str], list[str]]:
    """The producer's and the consumer's flags: the model at the dtype and threads asked, prefix caches off,
    and no idle probe (the consumer's background transfer after 60 s idle, a 64- or 512-token prefill
    on the producer: it ran while the other engine or the in-process layers were being timed), the
    stream interval asked (`interval`, else the first of --stream-interval)."""
    ours = ["--model", args.model, "--dtype", args.dtype, "--torch-threads", str(args.threads)]
    consumer = [*ours, *services.NO_PREFIX_CACHE, "--max-batch", str(max_batch), "--probe-idle-s", "0"]
    return ours, [*consumer, "--stream-interval", str(interval or intervals(args)[0])]


def prompts(tok, ctx: int, n: int, first: int) -> Prompts:
    return [(e.context_ids, e.question_ids) for e in tasks.examples(tok, "test", n, ctx, first=first)]


async def _generate(address: str, batch: Prompts, max_tokens: int, stop: list[int]) -> tuple[float, list[list[int]]]:
    async with ConsumerClient(address) as client:
        start = time.perf_counter()
        answers = await asyncio.gather(*(
            client.generate(mode="oracle", context=prompt(ids=c), question=prompt(ids=q), max_new_tokens=max_tokens,
                            stop_token_ids=stop)
            for c, q in batch
        ))  # fmt: skip
        return time.perf_counter() - start, [a.ids for a in answers]


def ours(address: str, batch: Prompts, max_tokens: int, stop: list[int]) -> tuple[float, list[list[int]]]:
    """(wall s, generated ids per prompt): every prompt at once, oracle mode, through gRPC."""
    return asyncio.run(_generate(address, batch, max_tokens, stop))


class Rows:
    """JSON lines, each the run's common fields and its own, to stdout and `out` (flushed per line)."""

    def __init__(self, out: TextIO, common: dict):
        self.out, self.common = out, common

    def emit(self, row: dict) -> None:
        line = json.dumps({**self.common, **row})
        print(line, flush=True)
        self.out.write(line + "\n")
        self.out.flush()
