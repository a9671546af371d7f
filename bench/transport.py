"""`python -m bench.transport`: the gRPC transport ceiling on loopback.

For each producer `--max-chunk-bytes`, a real producer process (bench.services; all started at
once, measured one at a time) serves a wide, shallow-compute random model whose raw KV is large
(TRANSPORT: 32 layers x 2 x 256 fp32 = 64 KiB per token, 128 MiB at 2048 tokens). One cold
Prefill (raw codec) fills its context store, then `--reps` warm Prefills are timed: the store
replays the encoded chunks, so no forward and no encode run and the stream is all that is
measured. Per call:

    grpc_MBps   = payload bytes / (last chunk received - first chunk received) / 1e6

against a plain TCP socket on loopback pushing the same number of bytes (bench.netns sender
and receiver processes, 1 MiB writes, first to last byte received):

    socket_MBps = payload bytes / receive time / 1e6,   ratio = grpc_MBps / socket_MBps

(medians over the reps). The client reads the stream with a bare producer stub and touches only
`len(chunk.data)`: no CRC check, no reassembly, so the figure is the producer's send path plus
gRPC/protobuf receive, the ceiling any consumer sits under. One JSON line per chunk size to
stdout and to bench/results/transport.jsonl. `--quick`: a 256-token context and two chunk
sizes (a smoke test, < 30 s).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

from bench import netns, services
from bench.workloads import ensure_random, note

RESULTS = services.ROOT / "bench" / "results"
TRANSPORT = dict(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=32,
                 num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32768,
                 rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                 bos_token_id=1, eos_token_id=2, pad_token_id=0)
CHUNK_SIZES = [64 << 10, 1 << 20, 4 << 20]
QUICK = dict(ctx=256, chunk_sizes=[256 << 10, 4 << 20], reps=3)


async def stream_once(address: str, token_ids: list[int]) -> dict:
    """One raw-codec Prefill read to its trailer: payload bytes, first-to-last chunk seconds, store hit."""
    import grpc

    from shared.pb import common_pb2, producer_pb2, producer_pb2_grpc
    from shared.serving import GRPC_OPTIONS

    async with grpc.aio.insecure_channel(address, options=GRPC_OPTIONS) as channel:
        stub = producer_pb2_grpc.ProducerServiceStub(channel)
        request = producer_pb2.PrefillRequest(token_ids=token_ids, codec=common_pb2.CodecSpec(name="raw"))
        nbytes, first, last, hit = 0, None, None, False
        async for reply in stub.Prefill(request, timeout=600):
            if reply.HasField("chunk"):
                last = time.perf_counter()
                first = first or last
                nbytes += len(reply.chunk.data)
            elif reply.HasField("trailer"):
                hit = reply.trailer.store_hit
    if first is None or last <= first:
        raise RuntimeError(f"stream from {address} had fewer than two chunks: use a larger context")
    return {"bytes": nbytes, "seconds": last - first, "store_hit": hit}


def socket_mbps(nbytes: int) -> float:
    """MB/s of a plain TCP stream of `nbytes` on loopback (bench.netns sender/receiver)."""
    return netns.measure_throughput(nbytes, "127.0.0.1") / 8


def spawn_producer(model: str, chunk_bytes: int, ctx: int) -> services.Service:
    """A producer process on loopback with `--max-chunk-bytes chunk_bytes` (not yet healthy)."""
    port = services.free_port()
    args = ["--host", "127.0.0.1", "--port", str(port), "--model", model, "--dtype", "float32", "--device", "cpu",
            "--max-chunk-bytes", str(chunk_bytes), "--max-context-tokens", str(max(8192, ctx)), "--log-level", "WARNING"]
    return services.spawn("producer", args, f"127.0.0.1:{port}", services.ROOT / f"bench/runs/transport/{chunk_bytes}")


def measure(producer: services.Service, chunk_bytes: int, token_ids: list[int], reps: int) -> dict:
    """Fill the producer's store with one cold Prefill, time `reps` replays and as many socket pushes."""
    cold = asyncio.run(stream_once(producer.address, token_ids))
    warm = [asyncio.run(stream_once(producer.address, token_ids)) for _ in range(reps)]
    if not all(w["store_hit"] for w in warm):
        raise RuntimeError("the producer did not replay from its context store (is --store-bytes 0?)")
    nbytes = warm[0]["bytes"]
    grpc_mbps = [w["bytes"] / w["seconds"] / 1e6 for w in warm]
    sock = [socket_mbps(nbytes) for _ in range(reps)]
    g, s = statistics.median(grpc_mbps), statistics.median(sock)
    return {"grpc_MBps": round(g, 1), "socket_MBps": round(s, 1), "ratio": round(g / s, 3), "chunk_bytes": chunk_bytes,
            "payload_bytes": nbytes, "ctx_tokens": len(token_ids), "reps": reps, "grpc_MBps_max": round(max(grpc_mbps), 1),
            "socket_MBps_max": round(max(sock), 1), "cold_grpc_MBps": round(cold["bytes"] / cold["seconds"] / 1e6, 1),
            "link": "loopback", "codec": "raw", "dtype": "float32", "weights": "random"}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.transport", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ctx", type=int, help="context tokens (default 2048: 128 MiB of raw KV)")
    p.add_argument("--chunk-sizes", nargs="+", type=int, help=f"producer --max-chunk-bytes values (default {CHUNK_SIZES})")
    p.add_argument("--reps", type=int, help="warm replays timed per chunk size (default 5)")
    p.add_argument("--quick", action="store_true", help=f"smoke preset {QUICK} (explicit flags win)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="producer start-up limit")
    p.add_argument("--out", type=Path, default=RESULTS / "transport.jsonl")
    args = p.parse_args(argv)
    preset = QUICK if args.quick else {}
    ctx = args.ctx or preset.get("ctx", 2048)
    chunk_sizes = args.chunk_sizes or preset.get("chunk_sizes", CHUNK_SIZES)
    reps = args.reps or preset.get("reps", 5)
    model = str(ensure_random("transport-random", TRANSPORT, dtype="float32"))
    rng = random.Random(0)
    token_ids = [rng.randrange(4, TRANSPORT["vocab_size"]) for _ in range(ctx)]  # [T]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    producers = []  # all start together (start-up dominates a quick run); measured one at a time
    try:
        producers = [spawn_producer(model, c, ctx) for c in chunk_sizes]
        for producer in producers:
            services.wait_healthy(producer, args.timeout_s)
        with open(args.out, "w") as out:
            for chunk_bytes, producer in zip(chunk_sizes, producers):
                started = time.monotonic()
                row = measure(producer, chunk_bytes, token_ids, reps)
                note(f"chunk {chunk_bytes} B: {time.monotonic() - started:.1f}s")
                rows.append(row)
                print(json.dumps(row), flush=True)
                out.write(json.dumps(row) + "\n")
    finally:
        for producer in producers:
            services.stop(producer)
    best = max(rows, key=lambda r: r["ratio"])
    note(f"best ratio {best['ratio']} at chunk {best['chunk_bytes']} B ({best['grpc_MBps']} vs {best['socket_MBps']} MB/s) "
         f"-> {args.out}")


if __name__ == "__main__":
    sys.exit(main())
