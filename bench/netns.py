"""A shaped point-to-point link for benchmarks: two network namespaces joined by a veth pair.

    [ns scd-bench-p]  scdb-p 10.99.0.1/30  <== veth ==>  10.99.0.2/30 scdb-c  [ns scd-bench-c]
     producer side                                                         consumer side

Owns: creating the namespaces (loopback up in each), the veth pair and its addresses; shaping
both directions of the link with tc (netem rate+delay where the kernel has netem, else tbf, rate
only); measuring the link's throughput with a plain TCP sender/receiver pair; and removing all of
it (processes left inside the namespaces, namespaces, veths, qdiscs) idempotently, on exit, on
exceptions, SIGINT and SIGTERM, and before creating, so leftovers of a crashed run with the same
names are cleared. Needs root, `ip` and `tc`. Knows nothing about the services or the benchmark.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class LinkNames:
    producer_ns: str = "scd-bench-p"
    consumer_ns: str = "scd-bench-c"
    producer_dev: str = "scdb-p"
    consumer_dev: str = "scdb-c"
    producer_ip: str = "10.99.0.1"  # a private /30 that exists only inside these namespaces
    consumer_ip: str = "10.99.0.2"
    prefix_len: int = 30

    def exec_prefix(self, ns: str) -> list[str]:
        """Command prefix that runs a program inside namespace `ns`."""
        return ["ip", "netns", "exec", ns]

    @property
    def sides(self) -> tuple[tuple[str, str], tuple[str, str]]:
        """(namespace, device) of both ends; shaping is applied to the egress of each."""
        return (self.producer_ns, self.producer_dev), (self.consumer_ns, self.consumer_dev)


class CommandError(RuntimeError):
    pass


def sh(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    """Run a command, capture its output; raise CommandError with its stderr when check fails."""
    done = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and done.returncode != 0:
        raise CommandError(f"{' '.join(cmd)}: exit {done.returncode}: {done.stderr.strip() or done.stdout.strip()}")
    return done


def missing_requirements() -> list[str]:
    """Why a shaped link cannot be built here (empty when it can)."""
    problems = []
    if os.geteuid() != 0:
        problems.append("not root (network namespaces and tc need root; use --no-shaping for a loopback run)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            problems.append(f"`{tool}` not found (install iproute2)")
    return problems


# --- tc output and rates -------------------------------------------------------------------

_RATE_UNITS = {"bit": 1e-6, "kbit": 1e-3, "mbit": 1.0, "gbit": 1e3, "tbit": 1e6}


def parse_rate_mbit(text: str) -> float:
    """'10Mbit' / '10000Kbit' / '1Gbit' / '800bit' (tc's spelling) -> megabits per second."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?bit)\s*", text, flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"not a tc rate: {text!r}")
    return float(m.group(1)) * _RATE_UNITS[m.group(2).lower()]


def parse_qdisc(text: str) -> dict:
    """The root qdisc of `tc qdisc show dev X` output: {"kind", "rate_mbit" (or None), "delay_ms" (or None)}."""
    for line in text.splitlines():
        m = re.match(r"qdisc (\S+) \S+ root\b(.*)", line.strip())
        if not m:
            continue
        kind, rest = m.group(1), m.group(2)
        rate = re.search(r"\brate ([0-9.]+[KMGT]?bit)", rest, flags=re.IGNORECASE)
        delay = re.search(r"\bdelay ([0-9.]+)(us|ms|s)\b", rest)
        delay_ms = None
        if delay:
            delay_ms = float(delay.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[delay.group(2)]
        return {"kind": kind, "rate_mbit": parse_rate_mbit(rate.group(1)) if rate else None, "delay_ms": delay_ms}
    raise ValueError(f"no root qdisc in: {text!r}")


def tbf_burst_bytes(rate_mbit: float) -> int:
    """tbf bucket for `rate_mbit`: >= 5 ms of traffic and >= 64 KiB (so GSO-sized veth packets
    pass); a transfer can run this many bytes ahead of the rate."""
    return max(64 * 1024, int(rate_mbit * 1e6 / 8 * 0.005))


def tbf_args(rate_mbit: float) -> list[str]:
    """tbf parameters for `rate_mbit`: the bucket of tbf_burst_bytes and a queue of 100 ms (so
    TCP keeps the link busy)."""
    return ["tbf", "rate", f"{rate_mbit:g}mbit", "burst", str(tbf_burst_bytes(rate_mbit)), "latency", "100ms"]


def netem_args(rate_mbit: float | None, delay_ms: float) -> list[str]:
    args = ["netem", "delay", f"{delay_ms:g}ms"]
    if rate_mbit is not None:
        args += ["rate", f"{rate_mbit:g}mbit", "limit", "100000"]
    return args


# --- link throughput -----------------------------------------------------------------------

_RECEIVER = r"""
import json, socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept(); buf = bytearray(1 << 20); n = 0; first = None
while True:
    k = c.recv_into(buf)
    if not k: break
    if first is None: first = time.perf_counter()
    n += k
end = time.perf_counter()
print(json.dumps({"bytes": n, "seconds": end - (first or end)}), flush=True)
"""

_SENDER = r"""
import socket, sys
n = int(sys.argv[3]); chunk = b"\0" * (1 << 20)
with socket.create_connection((sys.argv[1], int(sys.argv[2]))) as s:
    while n > 0:
        s.sendall(chunk[:min(n, len(chunk))]); n -= len(chunk)
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


def measure_throughput(nbytes: int, receiver_host: str, receiver_prefix: Sequence[str] = (),
                       sender_prefix: Sequence[str] = (), timeout_s: float = 300.0) -> float:
    """Send `nbytes` over TCP from a sender (run under `sender_prefix`) to a receiver listening on
    `receiver_host` (run under `receiver_prefix`); return the measured megabits per second."""
    receiver = subprocess.Popen([*receiver_prefix, sys.executable, "-c", _RECEIVER, receiver_host],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = receiver.stdout.readline().strip()
        if not port:
            raise CommandError(f"throughput receiver did not start: {receiver.stderr.read().strip()}")
        sh([*sender_prefix, sys.executable, "-c", _SENDER, receiver_host, port, str(nbytes)])
        out, err = receiver.communicate(timeout=timeout_s)
        if receiver.returncode != 0:
            raise CommandError(f"throughput receiver failed: {err.strip()}")
        return parse_throughput(out.strip().splitlines()[-1])
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()


# --- create, shape, clean up ---------------------------------------------------------------

def _kill_namespace_processes(ns: str, grace_s: float = 10.0) -> list[int]:
    """SIGTERM (then SIGKILL) the processes left inside our namespace `ns` (a crashed earlier
    run's services); returns their pids."""
    done = sh(["ip", "netns", "pids", ns], check=False)
    pids = [int(p) for p in done.stdout.split() if p.isdigit() and int(p) != os.getpid()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return pids


def cleanup(names: LinkNames = LinkNames()) -> list[str]:
    """Remove everything `create` makes; safe to call any number of times. Returns what it removed."""
    removed = []
    existing = set(sh(["ip", "netns", "list"], check=False).stdout.split())
    for ns, dev in names.sides:
        if ns in existing:
            pids = _kill_namespace_processes(ns)
            if pids:
                removed.append(f"processes {pids} in {ns}")
            sh(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
            if sh(["ip", "netns", "del", ns], check=False).returncode == 0:
                removed.append(f"netns {ns}")
        # a veth end left in the root namespace (a run that died between `link add` and `set netns`)
        if sh(["ip", "link", "del", dev], check=False).returncode == 0:
            removed.append(f"veth {dev}")
    return removed


def create(names: LinkNames = LinkNames()) -> None:
    """Namespaces, veth pair, addresses; loopback and both veth ends up. Clears leftovers first."""
    cleanup(names)
    sh(["ip", "netns", "add", names.producer_ns])
    sh(["ip", "netns", "add", names.consumer_ns])
    sh(["ip", "link", "add", names.producer_dev, "type", "veth", "peer", "name", names.consumer_dev])
    for (ns, dev), ip in zip(names.sides, (names.producer_ip, names.consumer_ip)):
        sh(["ip", "link", "set", dev, "netns", ns])
        sh(["ip", "-n", ns, "addr", "add", f"{ip}/{names.prefix_len}", "dev", dev])
        sh(["ip", "-n", ns, "link", "set", "lo", "up"])
        sh(["ip", "-n", ns, "link", "set", dev, "up"])


def has_netem(names: LinkNames = LinkNames()) -> bool:
    """Whether this kernel has sch_netem: try to add one on the producer end (and remove it)."""
    ns, dev = names.sides[0]
    if sh(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *netem_args(None, 0)], check=False).returncode != 0:
        return False
    sh(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
    return True


def shape(names: LinkNames, rate_mbit: float | None, delay_ms: float, netem: bool) -> dict:
    """Shape the egress of both ends (rate each way; delay each way, netem only); None = unshaped.
    Returns the producer end's root qdisc as tc reports it (see parse_qdisc)."""
    for ns, dev in names.sides:
        sh(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
        if netem and (rate_mbit is not None or delay_ms > 0):
            sh(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *netem_args(rate_mbit, delay_ms)])
        elif rate_mbit is not None:
            sh(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *tbf_args(rate_mbit)])
    ns, dev = names.sides[0]
    return parse_qdisc(sh(["tc", "-n", ns, "qdisc", "show", "dev", dev]).stdout)


def measure_link(names: LinkNames, rate_mbit: float | None, seconds: float = 2.0) -> float:
    """Producer -> consumer throughput of the link as shaped now, in megabits per second, over
    about `seconds` of traffic at the nominal rate."""
    return measure_throughput(probe_bytes(rate_mbit, seconds), names.consumer_ip,
                              receiver_prefix=names.exec_prefix(names.consumer_ns),
                              sender_prefix=names.exec_prefix(names.producer_ns))


class _Terminated(BaseException):
    """SIGTERM/SIGHUP turned into an exception so `with Link()` cleans up on the way out."""


class Link:
    """`with Link() as link:` the namespaces and veth exist; on any exit they are gone.

    SIGINT raises KeyboardInterrupt as usual; SIGTERM and SIGHUP are turned into an exception
    while the link exists, so the cleanup in __exit__ runs for them too.
    """

    def __init__(self, names: LinkNames = LinkNames(), delay_ms: float = 0.0, log=lambda msg: print(f"# {msg}")):
        self.names = names
        self.delay_ms = delay_ms
        self.log = log
        self.netem = False
        self._saved: dict[int, object] = {}

    def _on_signal(self, signum, frame):
        raise _Terminated(f"signal {signum}")

    def __enter__(self) -> "Link":
        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._saved[sig] = signal.signal(sig, self._on_signal)
        try:
            create(self.names)
            self.netem = has_netem(self.names)
        except BaseException:
            self.close()
            raise
        n = self.names
        kind = "netem (rate + delay)" if self.netem else "tbf (rate only; this kernel has no netem)"
        self.log(f"link: {n.producer_ns}/{n.producer_dev} {n.producer_ip} <-> {n.consumer_ns}/{n.consumer_dev} "
                 f"{n.consumer_ip}; shaping with {kind}")
        if not self.netem and self.delay_ms > 0:
            self.log(f"link: delay {self.delay_ms} ms requested but tbf cannot delay; running without delay")
        return self

    def shape(self, rate_mbit: float | None) -> dict:
        return shape(self.names, rate_mbit, self.delay_ms if self.netem else 0.0, self.netem)

    def measure(self, rate_mbit: float | None) -> float:
        return measure_link(self.names, rate_mbit)

    def close(self) -> list[str]:
        try:
            return cleanup(self.names)
        finally:
            for sig, handler in self._saved.items():
                signal.signal(sig, handler)
            self._saved.clear()

    def __exit__(self, *exc) -> None:
        removed = self.close()
        self.log(f"link: removed {', '.join(removed) or 'nothing (already gone)'}")


def main(argv: list[str] | None = None) -> None:
    """`python -m bench.netns [--cleanup] [RATE_MBIT ...]`: build the link, shape it at each rate
    (or unshaped), print the qdisc and measured throughput, remove it. --cleanup: only remove."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("rates", nargs="*", type=float, help="rates in Mbit/s (none: unshaped only)")
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--cleanup", action="store_true")
    args = parser.parse_args(argv)
    problems = missing_requirements()
    if problems:
        sys.exit("bench.netns cannot run here: " + "; ".join(problems))
    if args.cleanup:
        print(f"# removed: {cleanup() or 'nothing'}")
        return
    try:
        with Link(delay_ms=args.delay_ms) as link:
            for rate in [*args.rates, None]:
                qdisc = link.shape(rate)
                print(json.dumps({"rate_mbit": rate, "qdisc": qdisc, "measured_mbit": round(link.measure(rate), 2)}))
    except (KeyboardInterrupt, _Terminated):
        sys.exit(130)


if __name__ == "__main__":
    main()
