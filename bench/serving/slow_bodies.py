"""`python -m bench.serving.slow_bodies`: the consumer's resident memory while many clients send
requests slowly (each sends all but the last bytes of a large request, then nothing until it hangs up).

- `--api http` (default): ~2 MB bodies to the OpenAI port. Before a request is admitted, that port
  reads at most --max-inflight bodies at once and refuses the rest with 429
  (consumer/api/openai_api.py, `intake`).
- `--api grpc`: GenerateRequest messages of `--message-bytes` (default ~2 MB, under the port's
  receive limit) to the gRPC port over raw HTTP/2, `--streams` calls per connection
  (bench.harness.slow_grpc). grpc-core holds a message until it is whole, before any handler runs;
  the bound there is the server's cap on calls in progress and its receive limit
  (shared.grpc_server, --max-calls).
- `--api metrics`: connections to the metrics port that send a request line and a header, never
  the end of the headers (shared.metrics_http: at most 16 served at once, 10 s socket timeout).
- `--api headers`: the same to the OpenAI port (at most --max-connections open, the rest answered
  503 and closed; one whose headers never end is closed at the 75 s keep-alive timeout).

Either way RSS should level off as the number of senders grows rather than rise with it. The
producer and consumer run as real processes (the QA pair by default); each round opens `--senders`
connections at once, holds them `--hold-s` seconds, and samples the consumer's RSS (with its
children) during the hold and after the round. One JSON line per round: senders, calls, peak and
after RSS in MB and thread count, the consumer's open files at peak, how many calls were refused
while held (HTTP: 429; gRPC: any status; metrics and headers: closed by the server), the load
average, the code.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import tempfile
from pathlib import Path

from bench.harness import rss_trend, services, slow_grpc

BODY_BYTES = 2_000_000
GRPC_MESSAGE_BYTES = 2_000_000  # under the consumer's default request limit (ConsumerConfig.request_bytes_limit)
GRPC_PATH = "/scd.v1.ConsumerService/Generate"


async def _sender(port: int, body: bytes, hold_s: float) -> bool:
    """One slow sender; True when the consumer answered 429 while it held its connection open."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        writer.write(head + b"Content-Length: %d\r\n\r\n" % len(body) + body[:-10])  # the last bytes never come
        await writer.drain()
        try:
            answer = await asyncio.wait_for(reader.read(64), hold_s)
        except TimeoutError:
            return False
        return answer.startswith(b"HTTP/1.1 429")
    finally:
        writer.close()


async def _endless_headers(port: int, hold_s: float, line: bytes) -> bool:
    """A connection whose request headers never end; True when the server closed it while held."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(line + b"\r\nHost: x\r\n")
        await writer.drain()
        try:
            while await asyncio.wait_for(reader.read(4096), hold_s):  # a 503 first, then the close
                pass
            return True
        except (TimeoutError, ConnectionError):
            return False
    finally:
        writer.close()


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


async def _round(port: int, pid: int, senders: int, hold_s: float, api: str, streams: int, size: int) -> dict:
    if api in ("metrics", "headers"):
        line = b"GET /metrics HTTP/1.1" if api == "metrics" else b"POST /v1/completions HTTP/1.1"
        tasks = [asyncio.create_task(_endless_headers(port, hold_s, line)) for _ in range(senders)]
    elif api == "grpc":
        tasks = [asyncio.create_task(slow_grpc.stalled_calls(port, GRPC_PATH, streams, size, hold_s)) for _ in range(senders)]
    else:
        ids = b"12345," * ((BODY_BYTES - 40) // 6)
        body = b'{"prompt": [' + ids + b'1], "max_tokens": 2}'
        tasks = [asyncio.create_task(_sender(port, body, hold_s)) for _ in range(senders)]
    peak = threads = fds = 0
    while not all(t.done() for t in tasks):
        peak, threads, fds = max(peak, rss_trend.rss_kib(pid)), max(threads, _threads(pid)), max(fds, _fds(pid))
        await asyncio.sleep(0.5)
    # a call the server refused while it was held (gRPC: one count per call of a connection)
    refused = sum(
        sum(s is not None for s in t.result()) if api == "grpc" else int(t.result()) for t in tasks if t.exception() is None
    )
    errors = [repr(t.exception())[:200] for t in tasks if t.exception() is not None]
    await asyncio.sleep(2.0)
    return {
        "api": api,
        "senders": senders,
        "calls": senders * (streams if api == "grpc" else 1),
        "message_bytes": {"grpc": size, "http": BODY_BYTES}.get(api, 0),
        "sender_errors": len(errors),
        "first_error": errors[0] if errors else "",
        "rss_peak_mb": peak // 1024,
        "rss_after_mb": rss_trend.rss_kib(pid) // 1024,
        "threads_peak": threads,
        "threads_after": _threads(pid),
        "open_files_peak": fds,
        "refused": refused,
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="checkpoints/qa-tuned", help="the consumer's model")
    parser.add_argument("--producer-model", default="checkpoints/qa-base")
    parser.add_argument("--senders", default="200,400,1000,1000,1000,2000", help="senders per round, a comma list")
    parser.add_argument("--hold-s", type=float, default=12.0)
    parser.add_argument("--api", choices=("http", "grpc", "metrics", "headers"), default="http")
    parser.add_argument("--streams", type=int, default=1, help="--api grpc: calls per HTTP/2 connection")
    parser.add_argument("--message-bytes", type=int, default=GRPC_MESSAGE_BYTES, help="--api grpc: each call's request size")
    args = parser.parse_args(argv)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # this client's sockets (the consumer inherits it)
    ports = {"http": services.free_port(), "metrics": services.free_port()}
    ports["headers"] = ports["http"]
    consumer_args = ["--model", args.model, "--torch-threads", "1", "--http-port", str(ports["http"])]
    consumer_args += ["--metrics-port", str(ports["metrics"])]
    with (
        tempfile.TemporaryDirectory() as logs,
        services.running(["--model", args.producer_model, "--torch-threads", "1"], consumer_args, Path(logs)) as (_, consumer),
    ):
        pid = consumer.process.pid
        print(
            json.dumps(
                {
                    "round": -1,
                    "senders": 0,
                    "rss_after_mb": rss_trend.rss_kib(pid) // 1024,
                    "threads_after": _threads(pid),
                    "code": services.code_version(),
                    "open_files_limit": hard,
                }
            ),
            flush=True,
        )
        for i, n in enumerate(int(s) for s in args.senders.split(",")):
            target = ports[args.api] if args.api in ports else int(consumer.address.rsplit(":", 1)[1])
            row = asyncio.run(_round(target, pid, n, args.hold_s, args.api, args.streams, args.message_bytes))
            print(json.dumps({"round": i, **row, "code": services.code_version()}), flush=True)


if __name__ == "__main__":
    main()
