"""`python -m bench.micro.transport`: the gRPC transport ceiling on loopback, in bytes/s and CPU per MB.

For each producer `--max-chunk-bytes`, a real producer process (bench.harness.services; all started at
once, measured one at a time) serves a wide, shallow-compute random model whose raw KV is large
(TRANSPORT: 32 layers x 2 x 256 fp32 = 64 KiB per token, 128 MiB at 2048 tokens). One cold
Prefill (raw codec) fills its context store, then `--reps` warm Prefills per reader are timed
(interleaved): the store replays the encoded layers, so no forward and no encode run and the
stream is all that is measured. Two readers of the same stream:

- bare: a raw-bytes call that only counts the received messages (no parse, no CRC): the
  producer's send path plus gRPC receive, the ceiling any consumer sits under;
- consumer: the consumer's own path (consumer.link.producer_client + consumer.link.stream_reader: parse,
  contract checks, CRC, the payload tensors), as a Generate's transfer reads it.

    grpc_MBps     = payload bytes / (last payload message - first payload message) / 1e6   (bare)
    consumer_MBps = the same, first to last chunk as the stream reader saw them             (consumer)

against a plain TCP socket on loopback pushing the same number of bytes (bench.harness.netns sender
and receiver processes, 1 MiB writes, first to last byte received):

    socket_MBps = payload bytes / receive time / 1e6,   ratio = grpc_MBps / socket_MBps

(medians over the reps), and CPU per MB of payload (1 MB = 1e6 bytes; totals over the reps):
producer process (/proc utime + stime: 10 ms ticks), the reading process (process CPU time, its
gRPC threads included; the call's connection setup too) and the socket's sender + receiver
processes together, less their start-up (a 1 MiB push's CPU, socket_start_cpu_ms). One JSON line per chunk size to stdout and to bench/results/transport.jsonl,
with the load average. `--quick`: a 256-token context and two chunk sizes (a smoke test).
`--malloc-mmap-threshold` (default: the services' default) applies to the producer and to this
reading process, as in the services (shared.malloc_tuning); 0 is glibc's own behaviour; every row
records it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import statistics
import sys
import time
from pathlib import Path

from bench.harness import netns, services
from bench.harness.workloads import ensure_random, note
from shared import malloc_tuning

RESULTS = services.ROOT / "bench" / "results"
TRANSPORT = dict(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=32,
                 num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32768,
                 rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                 bos_token_id=1, eos_token_id=2, pad_token_id=0)
CHUNK_SIZES = [64 << 10, 256 << 10, 1 << 20, 4 << 20]
QUICK = dict(ctx=256, chunk_sizes=[256 << 10, 4 << 20], reps=3)
TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S  # utime, stime: fields 14 and 15 of stat


def prefill_request(token_ids: list[int]):
    from shared.pb import common_pb2, producer_pb2

    request = producer_pb2.PrefillRequest(token_ids=token_ids, codec=common_pb2.CodecSpec(name="raw"))
    if "accept_layer_chunks" in producer_pb2.PrefillRequest.DESCRIPTOR.fields_by_name:
        request.accept_layer_chunks = True
    return request


async def bare_once(address: str, token_ids: list[int], pid: int) -> dict:
    """One raw-codec Prefill read as bytes to its trailer, nothing parsed but the trailer."""
    import grpc

    from shared.grpc_server import GRPC_OPTIONS
    from shared.pb import producer_pb2

    async with grpc.aio.insecure_channel(address, options=GRPC_OPTIONS) as channel:
        prefill = channel.unary_stream("/scd.v1.ProducerService/Prefill", request_serializer=producer_pb2.PrefillRequest.SerializeToString,
                                       response_deserializer=None)
        cpu, pcpu = time.process_time(), process_cpu_s(pid)
        stamps, last = [], b""
        async for message in prefill(prefill_request(token_ids), timeout=600):
            stamps.append(time.perf_counter())
            last = message
        cpu, pcpu = time.process_time() - cpu, process_cpu_s(pid) - pcpu
    trailer = producer_pb2.PrefillResponse.FromString(last).trailer
    if len(stamps) < 4 or stamps[-2] <= stamps[1]:
        raise RuntimeError(f"stream from {address} had fewer than two payload messages: use a larger context")
    return {"bytes": trailer.payload_bytes, "seconds": stamps[-2] - stamps[1], "store_hit": trailer.store_hit,
            "cpu_s": cpu, "producer_cpu_s": pcpu}


async def consumer_once(address: str, token_ids: list[int], pid: int, expect) -> dict:
    """One raw-codec Prefill through the consumer's producer client and stream reader."""
    from consumer.link.producer_client import ProducerClient
    from consumer.link.stream_reader import StreamTrailer

    client = ProducerClient(address)
    try:
        cpu, pcpu = time.process_time(), process_cpu_s(pid)
        trailer = None
        async for event in client.open("bench-transport", token_ids, expect, 600.0):
            if isinstance(event, StreamTrailer):
                trailer = event
        cpu, pcpu = time.process_time() - cpu, process_cpu_s(pid) - pcpu
    finally:
        await client.close()
    assert trailer is not None
    return {"bytes": trailer.payload_bytes, "seconds": trailer.span_ms / 1e3, "store_hit": trailer.store_hit,
            "cpu_s": cpu, "producer_cpu_s": pcpu}


def expectation(model: str, ctx: int):
    """What the consumer's reader expects of a raw stream of `ctx` tokens from this model."""
    from consumer.link.stream_reader import Expectation
    from shared import codecs as codec_lib
    from shared.models import load_model

    loaded = load_model(model, "float32", "cpu")
    codec = codec_lib.create_codecs(loaded, names=["raw"])["raw"]
    return Expectation(ctx, codec, codec.resolve({}), loaded.info)


def socket_run(nbytes: int) -> tuple[float, float]:
    """(MB/s, sender + receiver CPU seconds) of a plain TCP stream of `nbytes` on loopback."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    mbps = netns.measure_throughput(nbytes, "127.0.0.1") / 8
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return mbps, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def spawn_producer(model: str, chunk_bytes: int, ctx: int, malloc_threshold: int) -> services.Service:
    """A producer process on loopback with `--max-chunk-bytes chunk_bytes` (not yet healthy)."""
    port = services.free_port()
    args = ["--host", "127.0.0.1", "--port", str(port), "--model", model, "--dtype", "float32", "--device", "cpu",
            "--max-chunk-bytes", str(chunk_bytes), "--max-context-tokens", str(max(8192, ctx)), "--log-level", "WARNING",
            "--malloc-mmap-threshold", str(malloc_threshold)]
    return services.spawn("producer", args, f"127.0.0.1:{port}", services.ROOT / f"bench/runs/transport/{chunk_bytes}")


def measure(producer: services.Service, chunk_bytes: int, token_ids: list[int], reps: int, expect) -> dict:
    """Fill the producer's store with one cold Prefill, then `reps` rounds of (bare read, consumer
    read, socket push)."""
    pid = producer.process.pid
    cold = asyncio.run(bare_once(producer.address, token_ids, pid))
    bare, cons, sock = [], [], []
    for _ in range(reps):
        bare.append(asyncio.run(bare_once(producer.address, token_ids, pid)))
        cons.append(asyncio.run(consumer_once(producer.address, token_ids, pid, expect)))
        sock.append(socket_run(bare[-1]["bytes"]))
    _, start_cpu = socket_run(1 << 20)  # the two processes' start and a 1 MiB push: taken off the socket's CPU
    if not all(w["store_hit"] for w in bare + cons):
        raise RuntimeError("the producer did not replay from its context store (is --store-bytes 0?)")
    nbytes = bare[0]["bytes"]
    mb = nbytes * reps / 1e6

    def per_mb(runs: list[dict], key: str) -> float:
        return round(sum(r[key] for r in runs) * 1e3 / mb, 3)

    grpc_mbps = [w["bytes"] / w["seconds"] / 1e6 for w in bare]
    cons_mbps = [w["bytes"] / w["seconds"] / 1e6 for w in cons]
    sock_mbps = [s for s, _ in sock]
    g, c, s = statistics.median(grpc_mbps), statistics.median(cons_mbps), statistics.median(sock_mbps)
    return {"grpc_MBps": round(g, 1), "socket_MBps": round(s, 1), "ratio": round(g / s, 3),
            "consumer_MBps": round(c, 1), "consumer_ratio": round(c / s, 3), "chunk_bytes": chunk_bytes,
            "producer_cpu_ms_per_MB": per_mb(bare, "producer_cpu_s"), "client_cpu_ms_per_MB": per_mb(bare, "cpu_s"),
            "consumer_producer_cpu_ms_per_MB": per_mb(cons, "producer_cpu_s"), "consumer_cpu_ms_per_MB": per_mb(cons, "cpu_s"),
            "socket_cpu_ms_per_MB": round(max(0.0, sum(cpu for _, cpu in sock) - reps * start_cpu) * 1e3 / (mb - reps * 1.048576), 3),
            "socket_start_cpu_ms": round(start_cpu * 1e3, 1),
            "payload_bytes": nbytes, "ctx_tokens": len(token_ids), "reps": reps, "grpc_MBps_max": round(max(grpc_mbps), 1),
            "consumer_MBps_max": round(max(cons_mbps), 1), "socket_MBps_max": round(max(sock_mbps), 1),
            "cold_grpc_MBps": round(cold["bytes"] / cold["seconds"] / 1e6, 1), "loadavg_1m": round(os.getloadavg()[0], 2),
            "link": "loopback", "codec": "raw", "dtype": "float32", "weights": "random"}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.micro.transport", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ctx", type=int, help="context tokens (default 2048: 128 MiB of raw KV)")
    p.add_argument("--chunk-sizes", nargs="+", type=int, help=f"producer --max-chunk-bytes values (default {CHUNK_SIZES})")
    p.add_argument("--reps", type=int, help="warm replays timed per chunk size (default 5)")
    p.add_argument("--quick", action="store_true", help=f"smoke preset {QUICK} (explicit flags win)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="producer start-up limit")
    p.add_argument("--out", type=Path, default=RESULTS / "transport.jsonl")
    p.add_argument("--malloc-mmap-threshold", type=int, default=malloc_tuning.DEFAULT_MMAP_THRESHOLD,
                   help="the services' flag, for the producer and this reading process (0: glibc's defaults)")
    args = p.parse_args(argv)
    note(f"malloc: {malloc_tuning.tune(args.malloc_mmap_threshold)}")
    preset = QUICK if args.quick else {}
    ctx = args.ctx or preset.get("ctx", 2048)
    chunk_sizes = args.chunk_sizes or preset.get("chunk_sizes", CHUNK_SIZES)
    reps = args.reps or preset.get("reps", 5)
    model = str(ensure_random("transport-random", TRANSPORT, dtype="float32"))
    rng = random.Random(0)
    token_ids = [rng.randrange(4, TRANSPORT["vocab_size"]) for _ in range(ctx)]  # [T]
    expect = expectation(model, ctx)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    code = services.code_version()
    producers = []  # all start together (start-up dominates a quick run); measured one at a time
    try:
        producers = [spawn_producer(model, c, ctx, args.malloc_mmap_threshold) for c in chunk_sizes]
        for producer in producers:
            services.wait_healthy(producer, args.timeout_s)
        with open(args.out, "w") as out:
            for chunk_bytes, producer in zip(chunk_sizes, producers):
                started = time.monotonic()
                row = {**measure(producer, chunk_bytes, token_ids, reps, expect), "malloc_mmap_threshold": args.malloc_mmap_threshold,
                       "code": code}
                note(f"chunk {chunk_bytes} B: {time.monotonic() - started:.1f}s")
                rows.append(row)
                print(json.dumps(row), flush=True)
                out.write(json.dumps(row) + "\n")
    finally:
        for producer in producers:
            services.stop(producer)
    best = max(rows, key=lambda r: r["ratio"])
    note(f"best ratio {best['ratio']} at chunk {best['chunk_bytes']} B ({best['grpc_MBps']} vs {best['socket_MBps']} MB/s; "
         f"consumer {best['consumer_MBps']} MB/s, {best['consumer_cpu_ms_per_MB']} CPU ms/MB) -> {args.out}")


if __name__ == "__main__":
    sys.exit(main())
