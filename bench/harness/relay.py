"""A userspace TCP relay that delays both directions of every connection: the delay and jitter of
a link on a kernel without netem (bench.harness.netns starts one inside the consumer's namespace), and,
where there is no tc at all (no root, a sandboxed kernel), its rate.

    client --> [listen] relay [connect] --> target        one target connection per client

Each direction reads chunks of bytes and releases each chunk `delay_ms` (+/- `jitter_ms`,
uniform, seeded) after it arrived, never before the chunk ahead of it: byte order is kept, and a
one-way delay d each way gives an RTT of about 2d, as netem on both egresses would. With a rate
(`rate_mbit` > 0) a chunk first waits for the link: it is sent when the chunk ahead of it on the
same direction of the link (every connection's, shared, as on one wire) has gone, takes its size
at the rate, and its delay starts when it has gone: store-and-forward in chunks of at most CHUNK
bytes (a 256 KiB chunk is 21 ms at 100 Mbit/s, about a tbf bucket's burst). A half-close
travels in order behind the data; a reset from one end resets the other. Backpressure: a
direction stops reading while `max_queue_bytes` wait for release (so at most that plus one chunk
is held per direction), and writes wait for the receiver to drain.

What it is not: a packet-level emulator. It splits each TCP connection in two, so the kernel's
congestion control on either leg never sees the delay (slow start over a long path is not
modelled); what runs above TCP (HTTP/2 flow-control windows, request/response round trips) does.
Knows nothing about namespaces, tc or the services.

`python -m bench.harness.relay --listen HOST:PORT --target HOST:PORT [--delay-ms D] [--jitter-ms J] [--rate-mbit R]`
prints one JSON line {"listen": "HOST:PORT"} once it accepts, then reads JSON lines on stdin
({"delay_ms": D, "jitter_ms": J, "rate_mbit": R}) and answers each with what it applied and when
(time.monotonic, the same clock in every process); exits when stdin closes or on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import random
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

CHUNK = 256 * 1024  # bytes read at once per direction
MAX_QUEUE_BYTES = 8 << 20  # per direction of a connection: 1 Gbit/s x 64 ms in flight
ROOT = Path(__file__).resolve().parents[2]

_EOF = b""  # queue markers: the source half-closed / reset
_RESET = None


@dataclass(frozen=True)
class Delay:
    """One-way delay of each direction; every chunk gets delay_ms + uniform(-jitter_ms, jitter_ms)
    after it has gone over the link at rate_mbit (0: no rate limit)."""
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    rate_mbit: float = 0.0

    def __post_init__(self) -> None:
        if self.delay_ms < 0 or self.jitter_ms < 0 or self.rate_mbit < 0:
            raise ValueError(f"delay, jitter and rate must be >= 0: {self}")


def sent_at(arrived: float, link_free: float, nbytes: int, rate_mbit: float) -> float:
    """When a chunk of nbytes that arrived at `arrived` has gone over a link free from `link_free`
    at rate_mbit (`arrived` itself without a rate)."""
    if rate_mbit <= 0:
        return arrived
    return max(arrived, link_free) + nbytes * 8 / (rate_mbit * 1e6)


def release_at(arrived: float, previous: float, delay: Delay, rng: random.Random) -> float:
    """When a chunk that arrived at `arrived` (seconds) leaves: after its delay (+/- jitter, never
    below zero) and never before `previous`, the release of the chunk ahead of it."""
    offset_ms = delay.delay_ms + (rng.uniform(-delay.jitter_ms, delay.jitter_ms) if delay.jitter_ms else 0.0)
    return max(arrived + max(0.0, offset_ms) / 1e3, previous)


def parse_address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"not HOST:PORT: {text!r}")
    return host, int(port)


class _Direction:
    """One direction of one connection: (release time, chunk) in arrival order, and their bytes."""

    def __init__(self, relay: Relay, way: str, rng: random.Random):
        self.relay, self.way, self.rng = relay, way, rng
        self.chunks: collections.deque[tuple[float, bytes | None]] = collections.deque()
        self.queued = 0  # bytes read and not yet written and drained
        self.last = 0.0
        self.arrived, self.drained = asyncio.Event(), asyncio.Event()

    def put(self, chunk: bytes | None) -> None:
        delay, now = self.relay.delay, time.monotonic()
        if delay.rate_mbit > 0:  # the link is one per direction, shared by every connection
            now = self.relay.link_free[self.way] = sent_at(now, self.relay.link_free[self.way], len(chunk or b""), delay.rate_mbit)
        self.last = release_at(now, self.last, delay, self.rng)
        self.chunks.append((self.last, chunk))
        self.queued += len(chunk or b"")
        self.relay.peak_queued = max(self.relay.peak_queued, self.queued)
        self.arrived.set()

    async def room(self) -> None:
        while self.queued >= self.relay.max_queue_bytes:
            self.drained.clear()
            await self.drained.wait()

    async def take(self) -> tuple[float, bytes | None]:
        while not self.chunks:
            self.arrived.clear()
            await self.arrived.wait()
        return self.chunks.popleft()

    def done(self, nbytes: int) -> None:
        self.queued -= nbytes
        self.drained.set()


async def _read(src: asyncio.StreamReader, direction: _Direction) -> None:
    try:
        while True:
            await direction.room()  # backpressure: the source waits in its socket buffers
            chunk = await src.read(CHUNK)
            direction.put(chunk)
            if not chunk:
                return
    except OSError:
        direction.put(_RESET)


async def _write(direction: _Direction, dst: asyncio.StreamWriter) -> str:
    """Release the direction's chunks at their times; 'eof' after a half-close, else 'reset'."""
    try:
        while True:
            at, chunk = await direction.take()
            wait = at - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if chunk is _RESET:
                return "reset"
            if chunk == _EOF:
                if dst.can_write_eof():
                    dst.write_eof()
                return "eof"
            dst.write(chunk)
            await dst.drain()
            direction.done(len(chunk))
    except OSError:
        return "reset"


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with RST (SO_LINGER 0), as the kernel does for a reset connection."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()


def _no_delay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class Relay:
    """The relay in this process's event loop: `await start(host, port)`, `set(...)`, `await close()`."""

    def __init__(self, target: str, delay: Delay = Delay(), seed: int = 0, max_queue_bytes: int = MAX_QUEUE_BYTES):
        self.target = parse_address(target)
        self.delay, self.seed, self.max_queue_bytes = delay, seed, max_queue_bytes
        self.peak_queued = 0  # most bytes one direction has held: <= max_queue_bytes + CHUNK
        self.connections = 0
        self.link_free = {"up": 0.0, "down": 0.0}  # when each direction's link is free (rate_mbit > 0)
        self._ids = itertools.count()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen; returns the HOST:PORT clients connect to."""
        self._server = await asyncio.start_server(self._serve, host, port, limit=CHUNK, backlog=1024)
        bound_host, bound_port = self._server.sockets[0].getsockname()[:2]
        return f"{bound_host}:{bound_port}"

    def set(self, delay: Delay) -> dict:
        """New delay/jitter/rate for every chunk that arrives from now on; returns it and when."""
        self.delay = delay
        return {"applied": asdict(delay), "at": time.monotonic()}

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.connections += 1
        try:
            await self._relay(client_r, client_w)
        except asyncio.CancelledError:
            pass  # close(): asyncio's streams log a connection task that ends cancelled
        finally:
            self._tasks.discard(task)

    async def _relay(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            target_r, target_w = await asyncio.open_connection(*self.target, limit=CHUNK)
        except OSError:
            _reset(client_w)  # the target refused: the client sees a reset, as it would directly
            return
        except asyncio.CancelledError:
            _reset(client_w)
            raise
        n = next(self._ids)
        up = _Direction(self, "up", random.Random(f"{self.seed}:{n}:up"))
        down = _Direction(self, "down", random.Random(f"{self.seed}:{n}:down"))
        readers = [asyncio.create_task(_read(client_r, up)), asyncio.create_task(_read(target_r, down))]
        writers = {asyncio.create_task(_write(up, target_w)), asyncio.create_task(_write(down, client_w))}
        outcome = "reset"  # unless both directions deliver their half-close
        try:
            for w in (client_w, target_w):
                _no_delay(w)
            pending = writers
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if any(t.result() == "reset" for t in done):
                    break
            else:
                outcome = "eof"
        finally:
            for t in (*readers, *writers):
                t.cancel()
            for w in (client_w, target_w):
                if outcome == "reset":
                    _reset(w)
                else:
                    w.close()
            await asyncio.wait([*readers, *writers])


class RelayProcess:
    """A relay run as `python -m bench.harness.relay` under `prefix` (e.g. `ip netns exec NS`); its
    control channel is the child's stdin/stdout. `close()` ends it."""

    def __init__(self, listen: str, target: str, delay: Delay = Delay(), seed: int = 0,
                 prefix: Sequence[str] = (), max_queue_bytes: int = MAX_QUEUE_BYTES):
        cmd = [*prefix, sys.executable, "-m", "bench.harness.relay", "--listen", listen, "--target", target,
               "--delay-ms", f"{delay.delay_ms:g}", "--jitter-ms", f"{delay.jitter_ms:g}", "--rate-mbit", f"{delay.rate_mbit:g}", "--seed", str(seed),
               "--max-queue-bytes", str(max_queue_bytes)]
        self.process = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        self.target, self.delay = target, delay
        line = self._reply()
        self.address: str = line["listen"]

    @property
    def pid(self) -> int:
        return self.process.pid

    def _reply(self) -> dict:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            self.process.wait()
            raise RuntimeError(f"relay to {self.target} exited with {self.process.returncode} (its stderr is above)")
        reply = json.loads(line)
        if "error" in reply:
            raise ValueError(f"relay: {reply['error']}")
        return reply

    def set(self, delay: Delay) -> dict:
        """Change delay/jitter without a restart; {"applied": {...}, "at": monotonic seconds}."""
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(asdict(delay)) + "\n")
        self.process.stdin.flush()
        reply = self._reply()
        self.delay = delay
        return reply

    def close(self, timeout_s: float = 5.0) -> int:
        if self.process.poll() is None:
            try:
                assert self.process.stdin is not None
                self.process.stdin.close()  # the relay exits when its control channel closes
                self.process.wait(timeout_s)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()
        return self.process.returncode


async def _control(relay: Relay, stop: asyncio.Event) -> None:
    """JSON lines on stdin -> relay.set; one JSON reply line each; stdin closed -> stop."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    try:
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    except ValueError:  # stdin is a regular file: no control channel, run until a signal
        return
    async for line in reader:
        try:
            fields = json.loads(line)
            reply = relay.set(Delay(*(float(fields.get(k, 0.0)) for k in ("delay_ms", "jitter_ms", "rate_mbit"))))
        except (ValueError, TypeError, AttributeError) as exc:
            reply = {"error": str(exc)}
        print(json.dumps(reply), flush=True)
    stop.set()


async def _run(args: argparse.Namespace) -> None:
    relay = Relay(args.target, Delay(args.delay_ms, args.jitter_ms, args.rate_mbit), args.seed, args.max_queue_bytes)
    host, port = parse_address(args.listen)
    print(json.dumps({"listen": await relay.start(host, port)}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, stop.set)
    control = asyncio.create_task(_control(relay, stop))
    await stop.wait()
    control.cancel()
    await relay.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.harness.relay", description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", required=True, help="HOST:PORT to accept on (port 0: any free port)")
    parser.add_argument("--target", required=True, help="HOST:PORT every connection is forwarded to")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay, each direction")
    parser.add_argument("--jitter-ms", type=float, default=0.0, help="+/- uniform around --delay-ms")
    parser.add_argument("--rate-mbit", type=float, default=0.0, help="each direction's rate, Mbit/s (0: no limit)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-queue-bytes", type=int, default=MAX_QUEUE_BYTES)
    asyncio.run(_run(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
