"""What a shaped link is asked for and the commands that implement it: the spec (rate, delay,
jitter, loss), tc's argument lists and output (tbf, netem), the firewall rules that drop packets
where the kernel has no netem (nft `numgen random`, else iptables `statistic --mode random`), and
the label that says which mechanism implements which property. Runs commands only through `sh`;
knows nothing about namespaces (bench.harness.netns) or the relay (bench.harness.relay).
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

# --- running commands ----------------------------------------------------------------------


class CommandError(RuntimeError):
    pass


def sh(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    """Run a command, capture its output; raise CommandError with its stderr when check fails."""
    done = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and done.returncode != 0:
        raise CommandError(f"{' '.join(cmd)}: exit {done.returncode}: {done.stderr.strip() or done.stdout.strip()}")
    return done


# --- the spec ------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinkSpec:
    """What a benchmark asks of the link; every property holds for each direction alike."""
    rate_mbit: float | None = None  # None: unshaped
    delay_ms: float = 0.0  # one-way: RTT is about 2 x delay_ms
    jitter_ms: float = 0.0  # +/- uniform around delay_ms
    loss_pct: float = 0.0  # of packets, on each egress

    def __post_init__(self) -> None:
        if self.rate_mbit is not None and not self.rate_mbit > 0:
            raise ValueError(f"rate_mbit must be > 0 or None (unshaped): {self.rate_mbit}")
        if self.delay_ms < 0 or self.jitter_ms < 0:
            raise ValueError(f"delay_ms and jitter_ms must be >= 0: {self.delay_ms}, {self.jitter_ms}")
        if not 0 <= self.loss_pct < 100:
            raise ValueError(f"loss_pct must be in [0, 100): {self.loss_pct}")

    @property
    def delayed(self) -> bool:
        return self.delay_ms > 0 or self.jitter_ms > 0


def label(spec: LinkSpec, netem: bool, relay: bool, loss_backend: str | None) -> str:
    """What implements each property: "netem", or e.g. "tbf rate + userspace relay delay/jitter
    + nft loss (no netem)"; "none" when nothing shapes the link. `relay`: connections made through
    the link's producer_target cross the delay relay (named even at delay 0: it is in the path)."""
    if netem:
        return "netem" if spec.rate_mbit is not None or spec.delayed or spec.loss_pct > 0 else "none"
    parts = []
    if spec.rate_mbit is not None:
        parts.append("tbf rate")
    if relay:
        parts.append("userspace relay delay/jitter")
    if spec.loss_pct > 0:
        parts.append(f"{loss_backend} loss")
    return " + ".join(parts) + " (no netem)" if parts else "none"


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


def netem_args(rate_mbit: float | None, delay_ms: float, jitter_ms: float = 0.0, loss_pct: float = 0.0) -> list[str]:
    """netem parameters; its jitter is uniform (no distribution table) and, unlike the relay's,
    may reorder packets."""
    args = ["netem", "delay", f"{delay_ms:g}ms"]
    if jitter_ms > 0:
        args.append(f"{jitter_ms:g}ms")
    if loss_pct > 0:
        args += ["loss", f"{loss_pct:g}%"]
    if rate_mbit is not None:
        args += ["rate", f"{rate_mbit:g}mbit", "limit", "100000"]
    return args


def qdisc_args(spec: LinkSpec, netem: bool) -> list[str] | None:
    """The root qdisc of each egress for `spec` (None: no qdisc). Without netem tc shapes the
    rate only; delay/jitter are the relay's and loss the firewall's."""
    if netem and (spec.rate_mbit is not None or spec.delayed or spec.loss_pct > 0):
        return netem_args(spec.rate_mbit, spec.delay_ms, spec.jitter_ms, spec.loss_pct)
    if not netem and spec.rate_mbit is not None:
        return tbf_args(spec.rate_mbit)
    return None


# --- packet loss without netem -------------------------------------------------------------

LOSS_BACKENDS = ("nft", "iptables")  # tried in this order
_NFT_TABLE = "scd_bench"


def loss_commands(backend: str, dev: str, loss_pct: float) -> list[list[str]]:
    """Commands, run inside a namespace of ours, that drop `loss_pct` % of the packets arriving on
    `dev` at random, replacing an earlier rule (loss_pct 0: none). Dropped on arrival (the input
    hook), so the sender's TCP sees a loss on the wire; a rule on output would fail its send
    locally instead (EPERM), which TCP handles otherwise. nft resolves 1e-4 %."""
    if backend == "nft":
        chain = ["inet", _NFT_TABLE, "arrivals"]
        cmds = [["nft", "add", "table", "inet", _NFT_TABLE],
                ["nft", "add", "chain", *chain, "{ type filter hook input priority 0 ; policy accept ; }"],
                ["nft", "flush", "chain", *chain]]
        if loss_pct > 0:
            cmds.append(["nft", "add", "rule", *chain, "iifname", dev, "numgen", "random", "mod", "1000000",
                         "lt", str(round(loss_pct * 1e4)), "drop"])
        return cmds
    if backend == "iptables":  # INPUT of a namespace of ours: nothing else has rules there
        cmds = [["iptables", "-w", "-F", "INPUT"]]
        if loss_pct > 0:
            cmds.append(["iptables", "-w", "-A", "INPUT", "-i", dev, "-m", "statistic", "--mode", "random",
                         "--probability", f"{loss_pct / 100:.6f}", "-j", "DROP"])
        return cmds
    raise ValueError(f"unknown loss backend {backend!r} (one of {LOSS_BACKENDS})")


def loss_refusal(loss_pct: float) -> str:
    return (f"loss_pct {loss_pct:g} needs netem (this kernel has none) or nft/iptables with random-drop rules "
            f"inside the namespaces (neither works here: install the nftables or iptables package), or run with "
            f"loss_pct 0")
