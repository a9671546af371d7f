"""bench.harness.netns beyond rate limits: the link spec, its label and commands (anywhere), then on a real
link (root, `ip`, `tc`; skipped elsewhere): RTT through the delay relay, a rate and a delay
changed mid-run and seen by measurements, loss applied or refused, nothing left after cleanup."""

from __future__ import annotations

import json
import os

import pytest

from bench.harness import linkprobe, netns, shaping
from bench.harness.shaping import LinkSpec

# names and addresses of our own: other tests (test_bench_harness) and benchmarks use theirs
NAMES = netns.LinkNames("scd-t22-p", "scd-t22-c", "scdt22-p", "scdt22-c", "10.99.22.1", "10.99.22.2")


# --- spec, label, commands (no root) -------------------------------------------------------

def test_spec_validates():
    assert LinkSpec().delayed is False and LinkSpec(jitter_ms=1).delayed is True
    for bad in (dict(rate_mbit=0), dict(delay_ms=-1), dict(jitter_ms=-1), dict(loss_pct=100), dict(loss_pct=-1)):
        with pytest.raises(ValueError):
            LinkSpec(**bad)


def test_label_names_what_implements_each_property():
    spec = LinkSpec(rate_mbit=100, delay_ms=20, jitter_ms=2, loss_pct=1)
    assert shaping.label(spec, netem=True, relay=False, loss_backend=None) == "netem"
    assert shaping.label(spec, netem=False, relay=True, loss_backend="nft") == \
        "tbf rate + userspace relay delay/jitter + nft loss (no netem)"
    assert shaping.label(LinkSpec(rate_mbit=10), False, False, None) == "tbf rate (no netem)"
    assert shaping.label(LinkSpec(), False, False, None) == shaping.label(LinkSpec(), True, False, None) == "none"
    assert shaping.label(LinkSpec(), False, True, None) == "userspace relay delay/jitter (no netem)"  # in the path


def test_qdisc_and_netem_args():
    spec = LinkSpec(rate_mbit=100, delay_ms=20, jitter_ms=2, loss_pct=1.5)
    assert shaping.qdisc_args(spec, netem=True) == ["netem", "delay", "20ms", "2ms", "loss", "1.5%", "rate", "100mbit",
                                                    "limit", "100000"]
    assert shaping.qdisc_args(spec, netem=False) == shaping.tbf_args(100)  # the rest is the relay's and firewall's
    assert shaping.qdisc_args(LinkSpec(delay_ms=5), netem=False) is None
    assert shaping.netem_args(None, 5) == ["netem", "delay", "5ms"]  # the older two-argument call


def test_loss_commands():
    nft = shaping.loss_commands("nft", "veth0", 2.5)
    assert nft[-1][-8:] == ["veth0", "numgen", "random", "mod", "1000000", "lt", "25000", "drop"]
    assert ["nft", "flush", "chain", "inet", "scd_bench", "arrivals"] in nft  # a change replaces the rule
    assert len(shaping.loss_commands("nft", "veth0", 0)) == len(nft) - 1  # 0 %: flushed, no rule
    ipt = shaping.loss_commands("iptables", "veth0", 2.5)
    assert ipt[0] == ["iptables", "-w", "-F", "INPUT"] and "0.025000" in ipt[1] and "statistic" in ipt[1]
    with pytest.raises(ValueError):
        shaping.loss_commands("tc", "veth0", 1)
    assert "install the nftables or iptables package" in shaping.loss_refusal(1)


def test_applied_row():
    applied = netns.Applied(LinkSpec(rate_mbit=10, delay_ms=20), "tbf rate (no netem)", ("rate_mbit",), 1.0, 1.5)
    assert applied.row() == {"rate_mbit": 10, "delay_ms": 20, "jitter_ms": 0.0, "loss_pct": 0.0,
                             "shaping": "tbf rate (no netem)", "changed": ["rate_mbit"], "applied_at": 1.5}


# --- a real link ---------------------------------------------------------------------------

@pytest.fixture
def names():
    """NAMES when namespaces can be built here (root, ip, tc, permission); else skip."""
    problems = netns.missing_requirements()
    if problems:
        pytest.skip("; ".join(problems))
    try:
        netns.create(NAMES)
    except netns.CommandError as exc:
        pytest.skip(f"cannot build network namespaces here: {exc}")
    finally:
        netns.cleanup(NAMES)
    yield NAMES
    assert netns.cleanup(NAMES) == []  # the link's own exit removed everything


def quiet(msg: str) -> None:
    pass


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_delay_rtt_and_a_mid_run_delay_change(names):
    with netns.Link(names, log=quiet, spec=LinkSpec(rate_mbit=100, delay_ms=20)) as link:
        assert link.shaping == ("netem" if link.netem else "tbf rate + userspace relay delay/jitter (no netem)")
        assert 35 <= link.probe(seconds=0.2, pings=5)["rtt_ms"] <= 80
        prefix = names.exec_prefix(names.consumer_ns)
        with linkprobe.probe_server(names.producer_ip, names.exec_prefix(names.producer_ns)) as server:
            target = link.producer_target(server)  # what a consumer would dial for a producer at `server`
            assert (target == server) == link.netem and link.producer_target(server) == target
            assert 35 <= linkprobe.probe_client(target, prefix, pings=5)["rtt_ms"] <= 80
            applied = link.change(delay_ms=5)  # the running relay takes it: no restart, same address
            assert applied.changed == ("delay_ms",) and applied.spec.delay_ms == 5 and applied.started <= applied.at
            assert 8 <= linkprobe.probe_client(target, prefix, pings=5)["rtt_ms"] <= 30
        relays = [r.pid for r in link.relays.values()]
    assert not any(alive(pid) for pid in relays)


def test_rate_change_is_seen_by_throughput(names):
    with netns.Link(names, log=quiet, spec=LinkSpec(rate_mbit=100)) as link:
        assert link.shaping == ("netem" if link.netem else "tbf rate (no netem)")
        assert link.producer_target("10.99.22.1:1") == "10.99.22.1:1"  # no delay: no relay
        fast = link.probe(seconds=0.5, pings=2)["measured_mbit"]
        applied = link.change(rate_mbit=10)
        assert applied.changed == ("rate_mbit",) and netns.root_qdisc(names)["rate_mbit"] == 10
        slow = link.probe(seconds=0.5, pings=2)["measured_mbit"]
    assert 60 < fast <= 110 and 6 < slow <= 12, (fast, slow)


def test_loss_is_applied_or_refused(names):
    spec = LinkSpec(rate_mbit=100, loss_pct=20)
    try:
        link = netns.Link(names, log=quiet, spec=spec).__enter__()
    except netns.Unsupported as exc:
        assert "loss_pct 20 needs netem" in str(exc) and "install the nftables or iptables package" in str(exc)
        return
    try:
        assert link.shaping == "netem" or link.shaping == f"tbf rate + {link.loss_backend} loss (no netem)"
        lost = linkprobe.measure_loss(names.consumer_ip, names.exec_prefix(names.consumer_ns),
                                      names.exec_prefix(names.producer_ns), count=1000)
        assert 12 <= lost <= 28, lost  # 20 % of 1000 datagrams: 6 standard deviations either way
        assert link.change(loss_pct=0).changed == ("loss_pct",)
        assert linkprobe.measure_loss(names.consumer_ip, names.exec_prefix(names.consumer_ns),
                                      names.exec_prefix(names.producer_ns), count=300) == 0
    finally:
        link.__exit__(None, None, None)


def test_loss_refused_without_netem_or_firewall(names, monkeypatch):
    monkeypatch.setattr(netns, "find_loss_backend", lambda names: None)
    monkeypatch.setattr(netns, "has_netem", lambda names: False)
    with pytest.raises(netns.Unsupported, match="loss_pct 1 needs netem"):
        with netns.Link(names, log=quiet, spec=LinkSpec(loss_pct=1)):
            pass
    with netns.Link(names, log=quiet, relay=False) as link:  # no relay: delay cannot be added later
        with pytest.raises(netns.Unsupported, match="relay=True"):
            link.change(delay_ms=10)


def test_cli_prints_label_rate_and_rtt(names, capsys):
    netns.main(["50", "--delay-ms", "10", "--seconds", "0.2"], names=names)
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
    assert [r["rate_mbit"] for r in rows] == [50, None]
    assert all(r["delay_ms"] == 10 and r["shaping"] != "none" and 15 <= r["rtt_ms"] <= 50 for r in rows)
    assert 30 < rows[0]["measured_mbit"] <= 55
