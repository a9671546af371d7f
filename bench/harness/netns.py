"""A shaped point-to-point link for benchmarks: two network namespaces joined by a veth pair.

    [ns scd-bench-p]  scdb-p 10.99.0.1/30  <== veth ==>  10.99.0.2/30 scdb-c  [ns scd-bench-c]
     producer side                                                         consumer side
                                                          [relay 10.99.0.2:N] (no netem, delay)

Owns: creating the namespaces (loopback up in each), the veth pair and its addresses; shaping
both directions of the link to a LinkSpec (rate, delay, jitter, loss; bench.harness.shaping) and
changing it mid-run: with netem where the kernel has it, else tbf for the rate, a userspace
relay in the consumer's namespace for delay and jitter (bench.harness.relay; only connections made to
`Link.producer_target(...)` cross it) and random-drop firewall rules for loss; measuring the
link as a client sees it (bench.harness.linkprobe); and removing all of it (relays and other processes
left inside the namespaces, namespaces, veths, qdiscs) idempotently, on exit, on exceptions,
SIGINT and SIGTERM, and before creating, so leftovers of a crashed run with the same names are
cleared. Needs root, `ip` and `tc`. Knows nothing about the services or the benchmark.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass, fields, replace

from bench.harness.linkprobe import measure_loss, measure_throughput, parse_throughput, probe_bytes, probe_client, probe_server
from bench.harness.relay import Delay, RelayProcess
from bench.harness.shaping import (
    LOSS_BACKENDS,
    CommandError,
    LinkSpec,
    label,
    loss_commands,
    loss_refusal,
    netem_args,
    parse_qdisc,
    parse_rate_mbit,
    qdisc_args,
    sh,
    tbf_args,
    tbf_burst_bytes,
)

# the public names, with those that moved to bench.harness.shaping and bench.harness.linkprobe: callers
# (bench.serving.ttft, bench.micro.transport, tests) still reach them here
__all__ = ["Applied", "CommandError", "Link", "LinkNames", "LinkSpec", "Unsupported", "change_qdisc", "cleanup",
           "create", "find_loss_backend", "has_netem", "measure_link", "measure_throughput", "missing_requirements",
           "netem_args", "parse_qdisc", "parse_rate_mbit", "parse_throughput", "probe_bytes", "root_qdisc", "set_loss",
           "sh", "shape", "tbf_args", "tbf_burst_bytes"]


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


def missing_requirements() -> list[str]:
    """Why a shaped link cannot be built here (empty when it can)."""
    problems = []
    if os.geteuid() != 0:
        problems.append("not root (network namespaces and tc need root; use --no-shaping for a loopback run)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            problems.append(f"`{tool}` not found (install iproute2)")
    return problems


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


def root_qdisc(names: LinkNames = LinkNames()) -> dict:
    """The producer end's root qdisc as tc reports it (see parse_qdisc)."""
    ns, dev = names.sides[0]
    return parse_qdisc(sh(["tc", "-n", ns, "qdisc", "show", "dev", dev]).stdout)


def shape(names: LinkNames, rate_mbit: float | None, delay_ms: float, netem: bool, jitter_ms: float = 0.0,
          loss_pct: float = 0.0) -> dict:
    """Shape the egress of both ends afresh (delete, add): rate each way; delay, jitter and loss
    each way with netem only (without it: Link); None = unshaped. Returns root_qdisc."""
    args = qdisc_args(LinkSpec(rate_mbit, delay_ms, jitter_ms, loss_pct), netem)
    for ns, dev in names.sides:
        sh(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
        if args is not None:
            sh(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *args])
    return root_qdisc(names)


def change_qdisc(names: LinkNames, spec: LinkSpec, netem: bool) -> None:
    """Bring both egresses to `spec` in place: `tc qdisc change` where the root qdisc is of that
    kind already (its queue stays), else `replace`; delete it when `spec` needs none."""
    args = qdisc_args(spec, netem)
    for ns, dev in names.sides:
        if args is None:
            sh(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
            continue
        kind = parse_qdisc(sh(["tc", "-n", ns, "qdisc", "show", "dev", dev]).stdout)["kind"]
        sh(["tc", "-n", ns, "qdisc", "change" if kind == args[0] else "replace", "dev", dev, "root", *args])


def set_loss(names: LinkNames, backend: str, loss_pct: float) -> None:
    """Random-drop rules where each end receives (no netem): `loss_pct` % of packets each way."""
    for ns, dev in names.sides:
        for cmd in loss_commands(backend, dev, loss_pct):
            sh([*names.exec_prefix(ns), *cmd])


def find_loss_backend(names: LinkNames = LinkNames()) -> str | None:
    """The first of LOSS_BACKENDS whose rules install in both namespaces (at 0 %), else None."""
    for backend in LOSS_BACKENDS:
        if shutil.which(backend) is None:
            continue
        try:
            set_loss(names, backend, 0.0)
        except CommandError:
            continue
        return backend
    return None


def measure_link(names: LinkNames, rate_mbit: float | None, seconds: float = 2.0) -> float:
    """Producer -> consumer throughput of the link as shaped now, in megabits per second, over
    about `seconds` of traffic at the nominal rate (direct: no relay)."""
    return measure_throughput(probe_bytes(rate_mbit, seconds), names.consumer_ip,
                              receiver_prefix=names.exec_prefix(names.consumer_ns),
                              sender_prefix=names.exec_prefix(names.producer_ns))


class Unsupported(ValueError):
    """A link property this machine cannot implement (loss without netem or firewall, ...)."""


@dataclass(frozen=True)
class Applied:
    """What Link.change put in force: the whole spec, what implements it, what changed, when."""
    spec: LinkSpec
    shaping: str
    changed: tuple[str, ...]
    started: float  # time.monotonic() before the first command
    at: float  # time.monotonic() once all of it is in force (tc done, every relay acknowledged)

    def row(self) -> dict:
        """The fields a benchmark copies into its rows."""
        return {**asdict(self.spec), "shaping": self.shaping, "changed": list(self.changed), "applied_at": self.at}


class _Terminated(BaseException):
    """SIGTERM/SIGHUP turned into an exception so `with Link()` cleans up on the way out."""


class Link:
    """`with Link(spec=LinkSpec(...)) as link:` the namespaces and veth exist, shaped to `spec`;
    on any exit they are gone, relays included.

    A consumer in the consumer's namespace dials `link.producer_target(producer_address)`. On a
    kernel without netem that is a relay (bench.harness.relay) when `relay` is True, or None (the
    default) and the spec at entry has delay or jitter; relay=True lets a run add delay later,
    relay=False refuses delay. `link.shaping` says what implements what; `change(...)` alters
    any property mid-run; `probe()` measures the route as a client sees it.

    SIGINT raises KeyboardInterrupt as usual; SIGTERM and SIGHUP are turned into an exception
    while the link exists, so the cleanup in __exit__ runs for them too. `delay_ms=` is the
    older spelling of spec=LinkSpec(delay_ms=...).
    """

    def __init__(self, names: LinkNames = LinkNames(), delay_ms: float = 0.0, log=lambda msg: print(f"# {msg}"),
                 spec: LinkSpec | None = None, relay: bool | None = None, seed: int = 0):
        self.names, self.log, self.seed = names, log, seed
        self.spec = spec if spec is not None else LinkSpec(delay_ms=delay_ms)
        self.netem = False
        self.relay = False  # whether producer_target puts a relay in the path: decided on entry
        self.loss_backend: str | None = None  # "nft" / "iptables" once loss is asked for (no netem)
        self.relays: dict[str, RelayProcess] = {}  # producer address -> its relay
        self._relay_wanted = relay
        self._saved: dict[int, object] = {}

    @property
    def delay_ms(self) -> float:
        return self.spec.delay_ms

    @property
    def shaping(self) -> str:
        """What implements each property now, e.g. "tbf rate + userspace relay delay/jitter (no netem)"."""
        return label(self.spec, self.netem, self.relay, self.loss_backend)

    def _on_signal(self, signum, frame):
        raise _Terminated(f"signal {signum}")

    def __enter__(self) -> Link:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._saved[sig] = signal.signal(sig, self._on_signal)
        try:
            create(self.names)
            self.netem = has_netem(self.names)
            wanted = self.spec.delayed if self._relay_wanted is None else self._relay_wanted
            self.relay = wanted and not self.netem
            self._check(self.spec)
            change_qdisc(self.names, self.spec, self.netem)
            if self.spec.loss_pct > 0 and not self.netem:
                set_loss(self.names, self.loss_backend, self.spec.loss_pct)
        except BaseException:
            self.close()
            raise
        n = self.names
        self.log(f"link: {n.producer_ns}/{n.producer_dev} {n.producer_ip} <-> {n.consumer_ns}/{n.consumer_dev} "
                 f"{n.consumer_ip}; {self.spec}; shaping: {self.shaping}")
        if self.relay:
            self.log(f"link: delay/jitter by a userspace relay in {n.consumer_ns}: only connections to "
                     f"link.producer_target(...) are delayed, direct ones to {n.producer_ip} are not")
        return self

    def _check(self, spec: LinkSpec) -> None:
        """Refuse what this link cannot do, before anything changes; the first loss asked for
        without netem picks the firewall backend."""
        if spec.delayed and not self.netem and not self.relay:
            raise Unsupported("delay/jitter without netem need the userspace relay, and this link has none (built "
                              "with relay=False, or without delay: pass relay=True to add delay mid-run)")
        if spec.loss_pct > 0 and not self.netem and self.loss_backend is None:
            self.loss_backend = find_loss_backend(self.names)
            if self.loss_backend is None:
                raise Unsupported(loss_refusal(spec.loss_pct))

    def change(self, **changes: float | None) -> Applied:
        """Set any of rate_mbit, delay_ms, jitter_ms, loss_pct now, the others staying, without
        dropping connections: `tc qdisc change` for the rate (netem: for all four), the relays'
        control channel for their delay and jitter, the firewall rules for loss."""
        new = replace(self.spec, **changes)  # unknown names: TypeError; bad values: ValueError
        self._check(new)
        old, started = self.spec, time.monotonic()
        if qdisc_args(new, self.netem) != qdisc_args(old, self.netem):
            change_qdisc(self.names, new, self.netem)
        if not self.netem and new.loss_pct != old.loss_pct:
            set_loss(self.names, self.loss_backend, new.loss_pct)
        if self.relay and (new.delay_ms, new.jitter_ms) != (old.delay_ms, old.jitter_ms):
            for relay in self.relays.values():
                relay.set(Delay(new.delay_ms, new.jitter_ms))
        self.spec = new
        changed = tuple(f.name for f in fields(LinkSpec) if getattr(new, f.name) != getattr(old, f.name))
        return Applied(new, self.shaping, changed, started, time.monotonic())

    def shape(self, rate_mbit: float | None) -> dict:
        """Set the rate (change(rate_mbit=...)); returns root_qdisc."""
        self.change(rate_mbit=rate_mbit)
        return root_qdisc(self.names)

    def _spawn_relay(self, address: str) -> RelayProcess:
        n = self.names
        return RelayProcess(f"{n.consumer_ip}:0", address, Delay(self.spec.delay_ms, self.spec.jitter_ms),
                            seed=self.seed + len(self.relays), prefix=n.exec_prefix(n.consumer_ns))

    def producer_target(self, address: str) -> str:
        """The HOST:PORT a consumer in the consumer's namespace dials for a producer listening on
        `address` in the producer's namespace: a relay's (one per address, kept until close) when
        this link delays through relays, else `address` itself."""
        if not self.relay:
            return address
        if address not in self.relays:
            self.relays[address] = self._spawn_relay(address)
        return self.relays[address].address

    def measure(self, rate_mbit: float | None) -> float:
        """Producer -> consumer Mbit/s straight across the veth (no relay); see probe()."""
        return measure_link(self.names, rate_mbit)

    def probe(self, seconds: float = 1.0, pings: int = 10) -> dict:
        """The link as a client in the consumer's namespace sees it, over the route
        producer_target gives: RTT of `pings` ping-pongs (rtt_ms median, min, max) and the
        producer -> consumer download rate (measured_mbit) over about `seconds` at the nominal
        rate; with loss_pct > 0, the percent of UDP datagrams lost across the veth."""
        n, spec = self.names, self.spec
        nbytes = probe_bytes(spec.rate_mbit, seconds) if spec.rate_mbit is not None else 64 << 20
        with probe_server(n.producer_ip, n.exec_prefix(n.producer_ns)) as server:
            relay = self._spawn_relay(server) if self.relay else None
            try:
                result = probe_client(relay.address if relay else server, n.exec_prefix(n.consumer_ns), pings, nbytes)
            finally:
                if relay is not None:
                    relay.close()
        loss = None
        if spec.loss_pct > 0:  # ~50-byte datagrams at no more than half the rate: the shaper drops none
            gap_s = max(0.0005, 800 / (spec.rate_mbit * 1e6)) if spec.rate_mbit else 0.0005
            loss = measure_loss(n.consumer_ip, n.exec_prefix(n.consumer_ns), n.exec_prefix(n.producer_ns), gap_s=gap_s)
        return {**result, "loss_pct_measured": loss}

    def close(self) -> list[str]:
        try:
            for relay in self.relays.values():
                relay.close()
            self.relays.clear()
            return cleanup(self.names)
        finally:
            for sig, handler in self._saved.items():
                signal.signal(sig, handler)
            self._saved.clear()

    def __exit__(self, *exc) -> None:
        removed = self.close()
        self.log(f"link: removed {', '.join(removed) or 'nothing (already gone)'}")


def main(argv: list[str] | None = None, names: LinkNames = LinkNames()) -> None:
    """`python -m bench.harness.netns [RATE_MBIT ...] [--delay-ms D] [--jitter-ms J] [--loss-pct P]`: build
    the link, change it to each rate in turn (then unshaped), print one JSON line per rate: the
    spec, what implements it (shaping), the qdisc, and the link as a client sees it (download
    rate, RTT; lost datagrams with --loss-pct). --cleanup: only remove."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("rates", nargs="*", type=float, help="rates in Mbit/s (none: unshaped only)")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way, each direction")
    parser.add_argument("--jitter-ms", type=float, default=0.0, help="+/- uniform around --delay-ms")
    parser.add_argument("--loss-pct", type=float, default=0.0, help="percent of packets dropped, each direction")
    parser.add_argument("--seconds", type=float, default=1.0, help="download length at the nominal rate")
    parser.add_argument("--seed", type=int, default=0, help="the relay's jitter")
    parser.add_argument("--cleanup", action="store_true")
    args = parser.parse_args(argv)
    problems = missing_requirements()
    if problems:
        sys.exit("bench.harness.netns cannot run here: " + "; ".join(problems))
    if args.cleanup:
        print(f"# removed: {cleanup(names) or 'nothing'}")
        return
    try:
        spec = LinkSpec(delay_ms=args.delay_ms, jitter_ms=args.jitter_ms, loss_pct=args.loss_pct)
        with Link(names, spec=spec, seed=args.seed) as link:
            for rate in [*args.rates, None]:
                applied = link.change(rate_mbit=rate)
                row = {**applied.row(), "qdisc": root_qdisc(link.names), **link.probe(seconds=args.seconds)}
                print(json.dumps(row), flush=True)
    except ValueError as exc:  # Unsupported, or a spec out of range
        sys.exit(f"bench.harness.netns: {exc}")
    except (KeyboardInterrupt, _Terminated):
        sys.exit(130)


if __name__ == "__main__":
    main()
