"""A link as a client sees it: throughput, round-trip time and packet loss, measured with small
helper programs started under command prefixes (`ip netns exec NS`, or none on loopback).

Throughput of a plain TCP stream (`measure_throughput`: a sender pushes to a listening
receiver); a probe server that echoes or sends on request (`probe_server`) and its client
(`probe_client`: RTT of small ping-pongs, then the receive rate of a download), so the route a
consumer takes to its producer (through the delay relay when there is one) is measured end to
end; UDP datagrams counted at the far end (`measure_loss`). Knows nothing about how the link
is built or shaped.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import subprocess
import sys
from collections.abc import Iterator, Sequence

from bench.harness.shaping import CommandError, sh

# --- TCP stream throughput -----------------------------------------------------------------

# shared by the helper programs below (each runs as `python -c`, so it is pasted into each)
_STREAM = r"""
import json, socket, sys, threading, time
def receive_all(c):
    # bytes until EOF -> (count, seconds from the first byte to the last)
    buf = bytearray(1 << 20); n = 0; first = None
    while True:
        k = c.recv_into(buf)
        if not k: break
        if first is None: first = time.perf_counter()
        n += k
    end = time.perf_counter()
    return n, end - (first or end)
def send_zeros(c, n):
    chunk = b"\0" * (1 << 20)
    while n > 0:
        c.sendall(chunk[:min(n, len(chunk))]); n -= len(chunk)
def listen(host):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, 0)); s.listen(16)
    print(s.getsockname()[1], flush=True)
    return s
"""

_RECEIVER = _STREAM + r"""
c, _ = listen(sys.argv[1]).accept()
n, seconds = receive_all(c)
print(json.dumps({"bytes": n, "seconds": seconds}), flush=True)
"""

_SENDER = _STREAM + r"""
with socket.create_connection((sys.argv[1], int(sys.argv[2]))) as s:
    send_zeros(s, int(sys.argv[3]))
    s.shutdown(socket.SHUT_WR); s.recv(1)
"""


def parse_throughput(line: str) -> float:
    """The receiver's report {"bytes": N, "seconds": S} -> megabits per second (first to last byte)."""
    report = json.loads(line)
    if report["bytes"] <= 0 or report["seconds"] <= 0:
        raise ValueError(f"no throughput in receiver report: {line!r}")
    return report["bytes"] * 8 / report["seconds"] / 1e6


def probe_bytes(rate_mbit: float | None, seconds: float = 2.0) -> int:
    """How many bytes to send to measure a link of nominal `rate_mbit` for about `seconds`."""
    if rate_mbit is None:
        return 256 << 20
    return int(min(256 << 20, max(1 << 20, rate_mbit * 1e6 / 8 * seconds)))


@contextlib.contextmanager
def _listening(script: str, host: str, prefix: Sequence[str], what: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """Run helper `script` (under `prefix`), which listens on `host` and prints its port first;
    yields (process, port); kills it if it still runs when the block ends."""
    process = subprocess.Popen([*prefix, sys.executable, "-c", script, host],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = process.stdout.readline().strip()
        if not port:
            raise CommandError(f"{what} did not start: {process.stderr.read().strip()}")
        yield process, port
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


def measure_throughput(nbytes: int, receiver_host: str, receiver_prefix: Sequence[str] = (),
                       sender_prefix: Sequence[str] = (), timeout_s: float = 300.0) -> float:
    """Send `nbytes` over TCP from a sender (run under `sender_prefix`) to a receiver listening on
    `receiver_host` (run under `receiver_prefix`); return the measured megabits per second."""
    with _listening(_RECEIVER, receiver_host, receiver_prefix, "throughput receiver") as (receiver, port):
        sh([*sender_prefix, sys.executable, "-c", _SENDER, receiver_host, port, str(nbytes)])
        out, err = receiver.communicate(timeout=timeout_s)
        if receiver.returncode != 0:
            raise CommandError(f"throughput receiver failed: {err.strip()}")
        return parse_throughput(out.strip().splitlines()[-1])


# --- RTT and download rate over a route ----------------------------------------------------

# Per connection, one command line: "echo" (echo everything back) or "send N" (N bytes, then close).
_PROBE_SERVER = _STREAM + r"""
def serve(c):
    with c:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        f = c.makefile("rb"); cmd = f.readline().split()
        if cmd == [b"echo"]:
            while data := f.read1(65536):
                c.sendall(data)
        elif cmd[:1] == [b"send"]:
            send_zeros(c, int(cmd[1]))
s = listen(sys.argv[1])
while True:
    c, _ = s.accept(); threading.Thread(target=serve, args=(c,), daemon=True).start()
"""

_PROBE_CLIENT = _STREAM + r"""
host, port = sys.argv[1].rsplit(":", 1); pings, nbytes = int(sys.argv[2]), int(sys.argv[3])
rtt = []
with socket.create_connection((host, int(port))) as s:
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1); s.sendall(b"echo\n")
    for _ in range(pings + 1):  # the first one also pays the relay's connection to the server
        t = time.perf_counter(); s.sendall(b"x" * 32); got = 0
        while got < 32:
            k = len(s.recv(32 - got))
            if not k: sys.exit("probe server closed the echo connection")
            got += k
        rtt.append((time.perf_counter() - t) * 1e3)
n, seconds = 0, 0.0
if nbytes:
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"send %d\n" % nbytes)
        n, seconds = receive_all(s)
print(json.dumps({"rtt_ms": rtt[1:], "bytes": n, "seconds": seconds}), flush=True)
"""


@contextlib.contextmanager
def probe_server(host: str, prefix: Sequence[str] = ()) -> Iterator[str]:
    """A probe server listening on `host` (run under `prefix`) while the block runs; yields HOST:PORT."""
    with _listening(_PROBE_SERVER, host, prefix, "probe server") as (_, port):
        yield f"{host}:{port}"


def probe_client(target: str, prefix: Sequence[str] = (), pings: int = 10, nbytes: int = 0,
                 timeout_s: float = 300.0) -> dict:
    """From a client run under `prefix`: `pings` 32-byte ping-pongs with a probe server at
    `target`, then a download of `nbytes`. {"rtt_ms" (median), "rtt_ms_min", "rtt_ms_max",
    "measured_mbit" (first to last byte; None without a download)}."""
    done = subprocess.run([*prefix, sys.executable, "-c", _PROBE_CLIENT, target, str(pings), str(nbytes)],
                          capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise CommandError(f"probe client to {target} failed: {done.stderr.strip()}")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    rtt = report["rtt_ms"]
    if nbytes and not (report["bytes"] > 0 and report["seconds"] > 0):
        raise CommandError(f"probe client to {target}: no download measured: {report}")
    return {"rtt_ms": round(statistics.median(rtt), 2), "rtt_ms_min": round(min(rtt), 2),
            "rtt_ms_max": round(max(rtt), 2),
            "measured_mbit": round(report["bytes"] * 8 / report["seconds"] / 1e6, 2) if nbytes else None}


# --- packet loss ---------------------------------------------------------------------------

_UDP_RECEIVER = r"""
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
s.bind((sys.argv[1], 0)); print(s.getsockname()[1], flush=True)
seen = set(); s.settimeout(5.0)
try:
    while True:
        seen.add(s.recv(64)); s.settimeout(1.0)  # 1 s quiet after the last datagram: the sender is done
except socket.timeout:
    pass
print(len(seen), flush=True)
"""

_UDP_SENDER = r"""
import socket, sys, time
host, port, count, gap = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); start = time.perf_counter()
for i in range(count):
    try:
        s.sendto(b"%08d" % i, (host, port))
    except OSError:  # a full shaper queue (ENOBUFS): lost too
        pass
    time.sleep(max(0.0, start + (i + 1) * gap - time.perf_counter()))
"""


def measure_loss(receiver_host: str, receiver_prefix: Sequence[str] = (), sender_prefix: Sequence[str] = (),
                 count: int = 1000, gap_s: float = 0.0005) -> float:
    """Percent of `count` numbered UDP datagrams (one every `gap_s`, slow enough for the shaper's
    queue) that never reached the receiver."""
    with _listening(_UDP_RECEIVER, receiver_host, receiver_prefix, "UDP receiver") as (receiver, port):
        sh([*sender_prefix, sys.executable, "-c", _UDP_SENDER, receiver_host, port, str(count), str(gap_s)])
        out, err = receiver.communicate(timeout=30)
        if receiver.returncode != 0:
            raise CommandError(f"UDP receiver failed: {err.strip()}")
        return round(100.0 * (count - int(out.strip().splitlines()[-1])) / count, 2)
