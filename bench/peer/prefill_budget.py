"""`python -m bench.peer.prefill_budget` (`make bench-prefill-budget`): the engine's prefill token
budget per iteration, measured on this device, settings side by side.

A setting is `prefill_chunk:max_batch_tokens` (the consumer's --prefill-chunk, tokens one request
prefills per engine iteration, and --max-batch-tokens, prefill tokens per iteration all requests
together). Every setting gets its own producer and consumer (real processes, oracle mode over gRPC,
prefix caches off), all started at once and idle but the one measured; every repetition runs each
workload on every setting, the order rotating:
- `ttft`: one request of `--ttft-ctx` context tokens, one new token: the client's wall time.
- `decode`: `--streams` requests at once of `--decode-ctx` context tokens and up to `--decode-tokens`
  new tokens: tokens generated / wall time of the batch (mostly prefill at 512 tokens: the cost of
  a setting on many prompts arriving together).
- `stall`: `--stall-streams` short requests decoding, then one request of `--ttft-ctx` tokens
  arrives: the longest gap between two tokens of the decoding streams while it prefills (what a
  bigger chunk costs the requests already running) and the arrival's TTFT.
Prompts: real.tasks test examples in the consumer's chat format, greedy, the turn's end stops them.

One JSON line per sample, then per setting and workload a summary (medians, and each setting's
ratio to the first setting's); the model, dtype, threads, host, code and load on every row. Default
out: bench/results/prefill_budget.jsonl. The consumer's defaults per device (shared.config) cite
these rows.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import time

from bench.harness import services
from bench.peer import workloads
from consumer.api.client import ConsumerClient, prompt
from real import tasks
from shared.models import resolve_path
from shared.pb import common_pb2, consumer_pb2

ROOT = services.ROOT
OUT = ROOT / "bench/results/prefill_budget.jsonl"


def parse_settings(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        chunk, _, total = item.partition(":")
        out.append((int(chunk), int(total or chunk)))
    return out


async def _stall(
    address: str, short: workloads.Prompts, long: tuple[list[int], list[int]], new: int, stop: list[int]
) -> tuple[float, float, int]:
    """(the longest gap between two tokens of the short streams while the long prompt prefills, s;
    the long prompt's TTFT, s; tokens the short streams made)."""
    async with ConsumerClient(address) as client:
        arrivals: list[list[float]] = [[] for _ in short]
        started = asyncio.Event()

        async def stream(i: int, ctx: list[int], q: list[int]) -> None:
            request = consumer_pb2.GenerateRequest(
                transfer=common_pb2.CodecSpec(name="oracle"),
                context=prompt(ids=ctx),
                question=prompt(ids=q),
                max_new_tokens=new,
                stop_token_ids=stop,
            )
            async for msg in client.stub.Generate(request, timeout=300):
                if msg.WhichOneof("kind") == "token":
                    arrivals[i].append(time.perf_counter())
                    if all(len(a) >= 4 for a in arrivals):
                        started.set()

        runs = [asyncio.create_task(stream(i, c, q)) for i, (c, q) in enumerate(short)]
        await asyncio.wait_for(started.wait(), 120)
        sent = time.perf_counter()
        answer = await client.generate(
            mode="oracle", context=prompt(ids=long[0]), question=prompt(ids=long[1]), max_new_tokens=1, stop_token_ids=stop
        )
        ttft = time.perf_counter() - sent
        done = sent + ttft
        await asyncio.gather(*runs)
        assert answer.ids
        gaps = [b - a for times in arrivals for a, b in zip(times, times[1:]) if b > sent and a < done]
        return (max(gaps) if gaps else 0.0), ttft, sum(len(a) for a in arrivals)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    workloads.add_args(parser, OUT, "torch threads of each service")
    parser.add_argument(
        "--settings",
        default="512:2048,1024:2048,2048:2048,2048:4096",
        help="prefill_chunk:max_batch_tokens, comma-separated; the first is the ratios' base",
    )
    parser.add_argument("--stall-streams", type=int, default=8)
    parser.add_argument("--stall-ctx", type=int, default=256)
    parser.add_argument("--stall-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    settings = parse_settings(args.settings)
    tok = AutoTokenizer.from_pretrained(str(resolve_path(args.model)))
    stop = [tasks.end_id(tok)]
    decode_streams = max(workloads.streams(args))
    common = workloads.row_fields(args)
    ours, consumer_args = workloads.service_args(args, max(32, decode_streams, args.stall_streams + 1))
    log_dir = ROOT / "bench/runs/prefill_budget"
    samples: list[dict] = []
    with open(args.out, "a") as out, contextlib.ExitStack() as stack:
        addresses = {}
        for chunk, total in settings:
            flags = [*consumer_args, "--prefill-chunk", str(chunk), "--max-batch-tokens", str(total)]
            _, consumer = stack.enter_context(services.running(ours, flags, log_dir / f"{chunk}-{total}"))
            addresses[(chunk, total)] = consumer.address
        emit = workloads.Rows(out, common).emit
        serial = 0
        for rep in range(-args.warmup, args.runs):
            for workload in ("ttft", "decode", "stall"):
                if workload == "ttft":
                    batch = workloads.prompts(tok, args.ttft_ctx, 1, first=serial)
                elif workload == "decode":
                    batch = workloads.prompts(tok, args.decode_ctx, decode_streams, first=serial)
                else:
                    batch = workloads.prompts(tok, args.stall_ctx, args.stall_streams, first=serial)
                    long = workloads.prompts(tok, args.ttft_ctx, 1, first=serial + args.stall_streams)[0]
                serial += len(batch) + 1
                order = settings[rep % len(settings) :] + settings[: rep % len(settings)]
                for chunk, total in order:
                    address = addresses[(chunk, total)]
                    row = {"kind": "sample", "workload": workload, "prefill_chunk": chunk, "max_batch_tokens": total, "rep": rep}
                    if workload == "ttft":
                        wall, _ = workloads.ours(address, batch, 1, stop)
                        row |= {"context_tokens": args.ttft_ctx, "ttft_ms": round(1000 * wall, 1)}
                    elif workload == "decode":
                        wall, outputs = workloads.ours(address, batch, args.decode_tokens, stop)
                        made = sum(len(o) for o in outputs)
                        row |= {
                            "streams": len(batch),
                            "context_tokens": args.decode_ctx,
                            "tokens": made,
                            "wall_s": round(wall, 3),
                            "tokens_per_s": round(made / wall, 2),
                        }
                    else:
                        gap, ttft, made = asyncio.run(_stall(address, batch, long, args.stall_tokens, stop))
                        row |= {
                            "streams": len(batch),
                            "context_tokens": args.stall_ctx,
                            "arrival_tokens": args.ttft_ctx,
                            "max_gap_ms": round(1000 * gap, 1),
                            "arrival_ttft_ms": round(1000 * ttft, 1),
                            "tokens": made,
                        }
                    row["load_avg_1m"] = round(os.getloadavg()[0], 2)
                    if rep >= 0:
                        emit(row)
                        samples.append(row)
        for workload, metric in (("ttft", "ttft_ms"), ("decode", "tokens_per_s"), ("stall", "max_gap_ms")):
            base = None
            for chunk, total in settings:
                cell = [
                    s
                    for s in samples
                    if s["workload"] == workload and (s["prefill_chunk"], s["max_batch_tokens"]) == (chunk, total)
                ]
                med = statistics.median(s[metric] for s in cell)
                base = med if base is None else base
                row = {
                    "kind": "summary",
                    "workload": workload,
                    "prefill_chunk": chunk,
                    "max_batch_tokens": total,
                    "runs": len(cell),
                    f"{metric}_median": med,
                    "vs_first": round(med / base, 3) if base else None,
                    "load_avg_1m_median": round(statistics.median(s["load_avg_1m"] for s in cell), 2),
                }
                if workload == "stall":
                    row["arrival_ttft_ms_median"] = statistics.median(s["arrival_ttft_ms"] for s in cell)
                emit(row)


if __name__ == "__main__":
    main()
