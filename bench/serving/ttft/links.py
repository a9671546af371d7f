"""Where the TTFT benchmark's bytes travel: loopback, loopback paced by a userspace relay, or the
tc-shaped veth link of bench.harness.netns.

Owns the link kinds the measurement loop talks to (`Loopback`, `Relayed`, `Shaped`: hosts, command
prefixes for the services, shaping a rate, measuring the sustained rate, the shaper's burst)
and the outer process that builds the shaped link and re-runs the benchmark inside the
consumer's namespace (`run_inside_link`). Knows nothing about modes, rows or services.
"""

from __future__ import annotations

import signal
import subprocess
import sys

from bench.harness import netns, services
from bench.harness.workloads import note

# The sustained rate is measured over a transfer this long (seconds at the nominal rate): long
# enough that the shaper's burst is a small part of it.
SUSTAINED_PROBE_S = 4.0


class Loopback:
    """No shaping: services and client on 127.0.0.1."""
    kind = "loopback"
    relay = None
    producer_host = consumer_host = "127.0.0.1"
    producer_prefix: list[str] = []
    consumer_prefix: list[str] = []

    def shape(self, rate_mbit: float | None) -> dict:
        return {"kind": "loopback", "rate_mbit": None, "delay_ms": None}

    def measure(self, rate_mbit: float | None) -> float:
        """Sustained Mbit/s of a plain TCP stream on loopback (64 MiB)."""
        return netns.measure_throughput(64 << 20, "127.0.0.1")

    def burst_bytes(self, rate_mbit: float | None) -> int:
        return 0

    def producer_target(self, address: str) -> str:
        return address

    def close(self) -> None:
        return None


class Relayed(Loopback):
    """Loopback, the consumer's path to the producer through a userspace relay that paces it at
    rate_mbit (bench.harness.relay): a rate where tc cannot be used (no root, a sandboxed kernel). The
    relay's pacing is per chunk of bytes, not per packet: its label says so."""

    kind = "relay"

    def __init__(self, rate_mbit: float, delay_ms: float = 0.0):
        self.rate_mbit, self.delay_ms = rate_mbit, delay_ms
        self.relay = None

    def label(self) -> str:
        delay = f" + {self.delay_ms:g} ms" if self.delay_ms else ""
        return f"relay {self.rate_mbit:g} Mbit{delay} (userspace pacing, no tc)"

    def producer_target(self, address: str) -> str:
        from bench.harness.relay import Delay, RelayProcess

        self.relay = RelayProcess("127.0.0.1:0", address, Delay(self.delay_ms, 0.0, self.rate_mbit))
        return self.relay.address

    def close(self) -> None:
        if self.relay is not None:
            self.relay.close()
            self.relay = None


class Shaped:
    """The link built by the outer process; this process runs in the consumer's namespace."""

    def __init__(self, netem: bool, delay_ms: float, names: netns.LinkNames | None = None):
        names = names or netns.LinkNames()
        self.names, self.netem, self.delay_ms = names, netem, delay_ms
        self.kind = "netem" if netem else "tbf"
        self.producer_host, self.consumer_host = names.producer_ip, names.consumer_ip
        self.producer_prefix = names.exec_prefix(names.producer_ns)
        self.consumer_prefix = names.exec_prefix(names.consumer_ns)

    def shape(self, rate_mbit: float | None) -> dict:
        return netns.shape(self.names, rate_mbit, self.delay_ms, self.netem)

    def measure(self, rate_mbit: float | None) -> float:
        """Sustained producer -> consumer Mbit/s over ~SUSTAINED_PROBE_S of traffic."""
        return netns.measure_link(self.names, rate_mbit, seconds=SUSTAINED_PROBE_S)

    def burst_bytes(self, rate_mbit: float | None) -> int:
        """Bytes the shaper lets through above the rate at once (tbf bucket; netem has none)."""
        return netns.tbf_burst_bytes(rate_mbit) if rate_mbit is not None and not self.netem else 0

    relay = None  # bench.harness.relay.RelayProcess on the consumer's path, when it delays the link

    def producer_target(self, address: str) -> str:
        """What the consumer dials for a producer at `address`: the producer itself, or (a delay on
        a kernel without netem) a relay started here, in the consumer's namespace, that holds each
        direction's bytes for delay_ms (bench.harness.relay)."""
        if self.netem or self.delay_ms <= 0:
            return address
        from bench.harness.relay import Delay, RelayProcess

        self.relay = RelayProcess(f"{self.names.consumer_ip}:0", address, Delay(self.delay_ms, 0.0))
        return self.relay.address

    def close(self) -> None:
        if self.relay is not None:
            self.relay.close()
            self.relay = None


def run_inside_link(argv: list[str], delay_ms: float, module: str = "bench.serving.ttft") -> int:
    """Root namespace: build the link, run `python -m MODULE ARGV` inside the consumer's
    namespace, remove the link when it ends (also on failure, Ctrl-C, SIGTERM); its exit code."""
    problems = netns.missing_requirements()
    if problems:
        print(f"{module}: cannot build the shaped link: " + "; ".join(problems), file=sys.stderr)
        return 2
    with netns.Link(delay_ms=delay_ms, log=note) as link:
        cmd = [*link.names.exec_prefix(link.names.consumer_ns), sys.executable, "-m", module, *argv,
               "--inside-link", "netem" if link.netem else "tbf"]
        inner = subprocess.Popen(cmd, cwd=services.ROOT)
        try:
            return inner.wait()
        except BaseException:
            # Ctrl-C reached the inner process too; SIGTERM did not: interrupt it, let it stop its services
            if inner.poll() is None:
                inner.send_signal(signal.SIGINT)
                try:
                    inner.wait(60)
                except subprocess.TimeoutExpired:
                    inner.kill()
                    inner.wait()
            raise
