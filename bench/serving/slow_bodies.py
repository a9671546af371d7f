"""`python -m bench.serving.slow_bodies`: the consumer's resident memory while many HTTP clients send
bodies slowly (each sends all but the last bytes of a ~2 MB body, then nothing until it hangs up).

Before a request is admitted, the HTTP port reads at most --max-inflight bodies at once and refuses
the rest with 429 (consumer/api/openai_api.py, `intake`), so RSS should level off as the number of
senders grows rather than rise with it. The producer and consumer run as real processes (the QA
pair by default); each round opens `--senders` connections at once, holds them `--hold-s` seconds,
and samples the consumer's RSS (with its children) during the hold and after the round. One JSON line
per round: senders, peak and after RSS in MB, how many got 429, the load average, the code.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import tempfile
from pathlib import Path

from bench.harness import rss_trend, services

BODY_BYTES = 2_000_000


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


async def _round(port: int, pid: int, senders: int, hold_s: float) -> dict:
    ids = b"12345," * ((BODY_BYTES - 40) // 6)
    body = b'{"prompt": [' + ids + b'1], "max_tokens": 2}'
    tasks = [asyncio.create_task(_sender(port, body, hold_s)) for _ in range(senders)]
    peak = 0
    while not all(t.done() for t in tasks):
        peak = max(peak, rss_trend.rss_kib(pid))
        await asyncio.sleep(0.5)
    refused = sum(1 for t in tasks if t.exception() is None and t.result())
    await asyncio.sleep(2.0)
    return {
        "senders": senders,
        "rss_peak_mb": peak // 1024,
        "rss_after_mb": rss_trend.rss_kib(pid) // 1024,
        "refused_429": refused,
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="checkpoints/qa-tuned", help="the consumer's model")
    parser.add_argument("--producer-model", default="checkpoints/qa-base")
    parser.add_argument("--senders", default="200,400,1000,1000,1000,2000", help="senders per round, a comma list")
    parser.add_argument("--hold-s", type=float, default=12.0)
    args = parser.parse_args(argv)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # this client's sockets (the consumer inherits it)
    consumer_args = ["--model", args.model, "--torch-threads", "1", "--http-port", str(services.free_port())]
    port = int(consumer_args[-1])
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
                    "code": services.code_version(),
                    "open_files_limit": hard,
                }
            ),
            flush=True,
        )
        for i, n in enumerate(int(s) for s in args.senders.split(",")):
            row = asyncio.run(_round(port, pid, n, args.hold_s))
            print(json.dumps({"round": i, **row, "code": services.code_version()}), flush=True)


if __name__ == "__main__":
    main()
