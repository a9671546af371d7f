"""The CPU floor of a gRPC call in Python, with nothing of SCD in it: `python -m bench.micro.grpc_floor`.

A server process answers each unary request with `--messages` streamed responses of
`--bytes` each (bytes in, bytes out: no protobuf); a client process runs `--concurrency`
closed-loop callers for `--seconds`. CPU per call comes from /proc for each process (server:
all its threads, gRPC's poller included; client likewise). That is what one hop of the service
pair costs at least, per request, before any of its own work: a request crosses two such hops
(client -> consumer, consumer -> producer), so twice this floor is out of reach of any change
inside the services short of leaving gRPC's Python stack.

Variants, run interleaved round by round so the machine's load falls on each alike:
`--loops uvloop,asyncio` (the services run under uvloop). Prints one JSON line per run and a
table of medians; rows to `--out` (default bench/results/grpc_floor.jsonl) when `--keep`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc

from bench.harness.services import free_port
from bench.micro.transport import process_cpu_s, socket_run

METHOD = "/floor.Floor/Stream"
# option sets for both ends, by name (--variants): gRPC core's HTTP/2 framing and TCP reads
VARIANTS: dict[str, list[tuple[str, int]]] = {
    "default": [],
    "frames": [("grpc.http2.max_frame_size", 16 << 20)],
    "reads": [("grpc.experimental.tcp_read_chunk_size", 4 << 20), ("grpc.experimental.tcp_min_read_chunk_size", 256 << 10),
              ("grpc.experimental.tcp_max_read_chunk_size", 4 << 20)],
    "both": [("grpc.http2.max_frame_size", 16 << 20), ("grpc.experimental.tcp_read_chunk_size", 4 << 20),
             ("grpc.experimental.tcp_min_read_chunk_size", 256 << 10), ("grpc.experimental.tcp_max_read_chunk_size", 4 << 20)],
}
BIG = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
ROOT = Path(__file__).resolve().parents[2]


def _run(loop: str, coro) -> None:
    if loop == "uvloop":
        import uvloop

        uvloop.run(coro)
    else:
        asyncio.run(coro)


async def _serve(port: int, messages: int, size: int, variant: str) -> None:
    body = b"x" * size

    async def stream(request: bytes, context):
        for _ in range(messages):
            yield body

    handler = grpc.unary_stream_rpc_method_handler(stream, request_deserializer=None, response_serializer=None)
    server = grpc.aio.server(options=BIG + VARIANTS[variant])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("floor.Floor", {"Stream": handler})])
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


async def _client(port: int, concurrency: int, seconds: float, server_pid: int, variant: str) -> dict:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=BIG + VARIANTS[variant]) as channel:
        call = channel.unary_stream(METHOD, request_serializer=None, response_deserializer=None)
        received = 0

        async def one() -> None:
            nonlocal received
            async for _ in call(b"q"):
                received += 1

        for _ in range(8):  # warm the channel
            await one()
        calls = 0
        stop = time.perf_counter() + seconds

        async def caller() -> None:
            nonlocal calls
            while time.perf_counter() < stop:
                await one()
                calls += 1

        s0, c0, t0 = process_cpu_s(server_pid), process_cpu_s(os.getpid()), time.perf_counter()
        received = 0
        await asyncio.gather(*(caller() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        s1, c1 = process_cpu_s(server_pid), process_cpu_s(os.getpid())
    return {
        "calls": calls,
        "calls_per_s": round(calls / wall, 1),
        "messages_per_call": received / max(1, calls),
        "server_cpu_ms_per_call": round((s1 - s0) * 1e3 / max(1, calls), 3),
        "client_cpu_ms_per_call": round((c1 - c0) * 1e3 / max(1, calls), 3),
    }


def run_once(loop: str, variant: str, args) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "bench.micro.grpc_floor", "--role", "server", "--loop", loop, "--port", str(port),
           "--messages", str(args.messages), "--bytes", str(args.bytes), "--variant", variant]
    server = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        cmd = [sys.executable, "-m", "bench.micro.grpc_floor", "--role", "client", "--loop", loop, "--port", str(port),
               "--concurrency", str(args.concurrency), "--seconds", str(args.seconds), "--server-pid", str(server.pid), "--variant", variant]
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    finally:
        server.terminate()
        server.wait(10)
    row = json.loads(out.strip().splitlines()[-1])
    row["total_cpu_ms_per_call"] = round(row["server_cpu_ms_per_call"] + row["client_cpu_ms_per_call"], 3)
    mb = args.messages * args.bytes / 1e6
    if args.bytes >= 65536:
        row["MB_per_s"] = round(row["calls_per_s"] * mb, 1)
        row["server_cpu_ms_per_MB"] = round(row["server_cpu_ms_per_call"] / mb, 3)
        row["client_cpu_ms_per_MB"] = round(row["client_cpu_ms_per_call"] / mb, 3)
    return {"bench": "grpc_floor", "loop": loop, "variant": variant, "concurrency": args.concurrency, "messages": args.messages,
            "bytes": args.bytes, "grpcio": grpc.__version__, "load_avg_1m": round(os.getloadavg()[0], 2), **row}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", choices=("bench", "server", "client"), default="bench")
    parser.add_argument("--loop", default="uvloop")
    parser.add_argument("--loops", default="uvloop,asyncio")
    parser.add_argument("--variant", default="default")
    parser.add_argument("--variants", default="default", help=f"comma-separated option sets: {', '.join(VARIANTS)}")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--server-pid", type=int, default=0)
    parser.add_argument("--messages", type=int, default=2, help="streamed responses per call (a store replay of the QA pair: 2)")
    parser.add_argument("--bytes", type=int, default=64, help="bytes per response")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--keep", action="store_true", help="append the rows to --out")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "grpc_floor.jsonl"))
    args = parser.parse_args(argv)
    if args.role == "server":
        _run(args.loop, _serve(args.port, args.messages, args.bytes, args.variant))
        return
    if args.role == "client":
        box: list[dict] = []

        async def go() -> None:
            box.append(await _client(args.port, args.concurrency, args.seconds, args.server_pid, args.variant))

        _run(args.loop, go())
        print(json.dumps(box[0]))
        return
    rows = []
    cells = [(loop, variant) for loop in args.loops.split(",") for variant in args.variants.split(",")]
    for r in range(args.rounds):
        for loop, variant in cells if r % 2 == 0 else cells[::-1]:
            row = {**run_once(loop, variant, args), "round": r}
            if args.bytes >= 65536:  # the same bytes through a plain socket, in the same round
                mbps, _ = socket_run(max(64 << 20, int(row["MB_per_s"] * 1e6)))
                row["socket_MBps"] = round(mbps, 1)
                row["ratio"] = round(row["MB_per_s"] / mbps, 3)
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.keep:
        with open(args.out, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    big = args.bytes >= 65536
    print("| loop | options | calls/s | server CPU ms/call | client CPU ms/call | total |" + (" MB/s | socket MB/s | ratio |" if big else ""))
    print("|---|---|---:|---:|---:|---:|" + ("---:|---:|---:|" if big else ""))
    for loop, variant in cells:
        mine = [r for r in rows if r["loop"] == loop and r["variant"] == variant]
        med = {k: statistics.median(r[k] for r in mine) for k in ("calls_per_s", "server_cpu_ms_per_call",
                                                                  "client_cpu_ms_per_call", "total_cpu_ms_per_call")}
        extra = ""
        if big:
            extra = " " + " | ".join(f"{statistics.median(r[k] for r in mine)}" for k in ("MB_per_s", "socket_MBps", "ratio")) + " |"
        print(f"| {loop} | {variant} | {med['calls_per_s']:.0f} | {med['server_cpu_ms_per_call']:.3f} | "
              f"{med['client_cpu_ms_per_call']:.3f} | {med['total_cpu_ms_per_call']:.3f} |{extra}")


if __name__ == "__main__":
    main()
