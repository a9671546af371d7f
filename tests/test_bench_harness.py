"""The TTFT benchmark harness (bench.serving.ttft, bench.harness.netns, bench.serving.ttft.plot, bench.figures.projection): parsing,
statistics, the efficiency lower bound, interleaving order, link cleanup, and a loopback smoke run
of the real harness with tiny models."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from bench.figures import projection
from bench.harness import netns
from bench.harness.services import ROOT
from bench.serving.ttft import cli, grid, plot, report

KEYS = ["model", "shaping", "bandwidth_mbit", "ctx_tokens", "mode", "schedule", "store", "ttft_ms_median",
        "ttft_ms_min", "ttft_ms_max", "runs", "bytes", "efficiency", "ttft_lower_bound_ms", "load_avg_1m",
        "load_avg_1m_max", "cores", "load_above_cores"]


# --- tc and throughput parsing -------------------------------------------------------------

def test_parse_rate_mbit():
    assert netns.parse_rate_mbit("10Mbit") == 10.0
    assert netns.parse_rate_mbit("10000Kbit") == 10.0
    assert netns.parse_rate_mbit("1Gbit") == 1000.0
    assert netns.parse_rate_mbit("800bit") == pytest.approx(0.0008)
    with pytest.raises(ValueError):
        netns.parse_rate_mbit("fast")


def test_parse_qdisc_from_real_tc_output():
    tbf = "qdisc tbf 8007: root refcnt 3 rate 10Mbit burst 64Kb lat 100ms \n"
    assert netns.parse_qdisc(tbf) == {"kind": "tbf", "rate_mbit": 10.0, "delay_ms": None}
    netem = "qdisc netem 8001: root refcnt 2 limit 100000 delay 5ms rate 100Mbit\n"
    assert netns.parse_qdisc(netem) == {"kind": "netem", "rate_mbit": 100.0, "delay_ms": 5.0}
    assert netns.parse_qdisc("qdisc noqueue 0: root refcnt 2 \n")["kind"] == "noqueue"
    with pytest.raises(ValueError):
        netns.parse_qdisc("qdisc ingress ffff: parent ffff:fff1\n")


def test_throughput_and_probe_size():
    assert netns.parse_throughput('{"bytes": 1250000, "seconds": 1.0}') == pytest.approx(10.0)
    with pytest.raises(ValueError):
        netns.parse_throughput('{"bytes": 0, "seconds": 0.0}')
    assert netns.probe_bytes(10) == 2_500_000  # 2 s at 10 Mbit
    assert netns.probe_bytes(0.1) == 1 << 20  # at least 1 MiB
    assert netns.probe_bytes(None) == netns.probe_bytes(1e9) == 256 << 20  # capped


def test_tbf_bucket_fits_gso_packets():
    args = netns.tbf_args(10)
    assert args[:3] == ["tbf", "rate", "10mbit"] and int(args[args.index("burst") + 1]) == netns.tbf_burst_bytes(10)
    assert netns.tbf_burst_bytes(10) == 64 * 1024
    assert int(netns.tbf_args(10_000)[4]) == netns.tbf_burst_bytes(10_000) == int(10_000e6 / 8 * 0.005)


def test_loopback_throughput_measurement():
    assert netns.measure_throughput(8 << 20, "127.0.0.1") > 10  # Mbit/s; any machine does far more


# --- command line and statistics -----------------------------------------------------------

def test_parse_mode():
    assert grid.parse_mode("raw") == grid.Mode("raw")
    quant = grid.parse_mode("quant:bits=4,group_size=32")
    assert quant.options == (("bits", "4"), ("group_size", "32")) and quant.schedule == "bits=4,group_size=32"
    scd = grid.parse_mode("scd:schedule=r16-p2")
    assert scd.schedule == "r16-p2" and scd.label == "scd(r16-p2)"
    for bad in ("quant:bits", ":bits=4"):
        with pytest.raises(Exception):
            grid.parse_mode(bad)


def test_parse_bandwidth():
    assert grid.parse_bandwidth("10") == 10.0
    assert grid.parse_bandwidth("100mbit") == 100.0
    assert grid.parse_bandwidth("1gbit") == grid.parse_bandwidth("1G") == 1000.0
    assert grid.parse_bandwidth("unshaped") is None
    for bad in ("fast", "0", "-5"):
        with pytest.raises(Exception):
            grid.parse_bandwidth(bad)


def test_cli_presets_and_explicit_flags():
    parse = lambda *a: grid.resolve(cli.build_parser().parse_args(list(a)))  # noqa: E731
    quick = parse("--quick", "--model-scale", "tiny")
    assert (quick.runs, quick.warmup, quick.stores) == (2, 1, ["cold"])
    assert grid.grid_for("tiny", quick) == ([100], [256])
    explicit = parse("--quick", "--runs", "7", "--contexts", "512", "--bandwidths", "10", "unshaped")
    assert explicit.runs == 7 and explicit.contexts == [512] and explicit.bandwidths == [10.0, None]
    full = parse("--modes", "raw", "oracle", "quant:bits=8")
    assert full.runs == 5 and full.warmup == 1 and full.stores == ["cold", "warm"]
    assert grid.grid_for("trained", full) == full.grids["trained"] and full.grids["trained"][1] == [512, 2048, 4096]
    assert grid.grid_for("qwen05b", full) == full.grids["qwen05b"]  # each scale its own grid
    assert grid.grid_for("qwen05b", explicit) == ([10.0, None], [512])
    assert [m.name for m in full.modes] == ["oracle", "raw", "quant"]  # oracle first
    assert grid.grid_for("trained", parse("--no-shaping", "--bandwidths", "10"))[0] == [None]
    with pytest.raises(SystemExit):
        parse("--runs", "0")


def test_summarize():
    assert report.summarize([3.0, 1.0, 2.0, 10.0]) == {"median": 2.5, "min": 1.0, "max": 10.0}
    assert report.summarize([4.0]) == {"median": 4.0, "min": 4.0, "max": 4.0}
    with pytest.raises(ValueError):
        report.summarize([])


def test_ttft_lower_bound():
    bound = report.ttft_lower_bound_ms
    # wire-bound: 1.25 MB over 10 Mbit = 1000 ms > 300 ms compute; + 20 ms question prefill
    assert bound(300.0, 50.0, 1_250_000, 10.0, 0, 20.0) == pytest.approx(1020.0)
    # the shaper's burst leaves the rate early: 1.25 MB - 62.5 kB at 10 Mbit = 950 ms
    assert bound(300.0, 50.0, 1_250_000, 10.0, 62_500, 20.0) == pytest.approx(970.0)
    # compute-bound: the forward takes longer than the wire; a payload under the burst costs no wire time
    assert bound(2000.0, 50.0, 1_250_000, 10.0, 0, 20.0) == pytest.approx(2020.0)
    assert bound(0.0, 0.0, 1000, 10.0, 65_536, 5.0) == pytest.approx(5.0)
    # warm store hit: no producer compute, the wire alone
    assert bound(0.0, 0.0, 125_000, 100.0, 0, 0.0) == pytest.approx(10.0)
    # forward and encode overlap (layer l encoded while l + 1 computes): the longer one, not the sum,
    # which exceeded measured TTFTs on a GPU (raw cold, 2048 tokens: 63.5 + 57.0 + 36.3 > 116.8 ms)
    assert bound(63.5, 57.0, 1000, 40_000.0, 0, 36.3) == pytest.approx(99.8)
    assert bound(10.0, 80.0, 1000, 40_000.0, 0, 5.0) == pytest.approx(85.0)


def test_efficiency_check_names_the_failing_row():
    ok = {"model": "m", "mode": "raw", "schedule": None, "store": "cold", "ctx_tokens": 512, "bandwidth_mbit": 10,
          "efficiency": 1.04, "ttft_lower_bound_ms": 104.0, "ttft_ms_median": 100.0}
    assert report.check([ok, {**ok, "mode": "oracle", "efficiency": None}]) == []
    failures = report.check([ok, {**ok, "store": "warm", "efficiency": 1.2}])
    assert len(failures) == 1 and "raw(None) warm ctx 512 10 Mbit: efficiency 1.2 > 1.05" in failures[0]


def test_rotation_runs_every_mode_once_per_repetition():
    modes = ["oracle", "raw", "quant"]
    orders = [grid.rotation(modes, rep) for rep in range(-1, 3)]
    assert orders == [["quant", "oracle", "raw"], ["oracle", "raw", "quant"], ["raw", "quant", "oracle"],
                      ["quant", "oracle", "raw"]]
    assert all(sorted(o) == sorted(modes) for o in orders)
    # each mode takes each position once over len(modes) repetitions: drift falls on all alike
    assert [[o.index(m) for o in orders[1:]] for m in modes] == [[0, 2, 1], [1, 0, 2], [2, 1, 0]]
    assert grid.rotation([], 3) == []


def _row(mode, bw, ttft_ms, schedule=None, store="cold"):
    return {"model": "m", "shaping": "tbf", "bandwidth_mbit": bw, "ctx_tokens": 512, "mode": mode, "schedule": schedule,
            "store": store, "ttft_ms_median": ttft_ms, "ttft_ms_min": ttft_ms, "ttft_ms_max": ttft_ms, "runs": 5,
            "bytes": 1000, "pipeline_efficiency": None, "rebuild_ms": 1.0, "raw_kv_bytes": 4000, "link_mbit": 9.5}


def test_markdown_table_ratios_and_crossovers(tmp_path):
    rows = [_row("oracle", None, 100.0), _row("cached", None, 5.0, store="warm"), _row("raw", 10, 400.0),
            _row("raw", 100, 50.0), _row("raw", 10, 300.0, store="warm"), _row("quant", 10, 80.0, "bits=8"),
            {**_row("quant", 100, 20.0, "bits=8"), "load_above_cores": True}]
    text = plot.markdown(rows)
    assert "| oracle cold (no link) | 100 (1.00) | 100 (1.00) |" in text
    assert "| cached warm (context cached in the consumer: question prefill only) | 5 (0.05) | 5 (0.05) |" in text
    assert "| raw cold | 400 (4.00) | 50 (0.50) |" in text
    assert "| raw warm | 300 (3.00) | - |" in text
    assert "| quant(bits=8) cold | 80 (0.80) | 20* (0.20) |" in text and "`*`: measured with the 1-minute load" in text
    assert "raw cold from 100 Mbit" in text and "quant(bits=8) cold from 10 Mbit" in text
    assert "cached" not in text.split("Fastest:")[1]  # a reference, not a competitor
    rows[1] = {**rows[1], "derived": True, "formula": "ttft_ms - rebuild_ms"}
    assert "| cached warm (derived, not measured: the oracle's TTFT minus its context prefill) |" in plot.markdown(rows)
    plot.plot(rows, tmp_path / "t.png")
    assert (tmp_path / "t.png").stat().st_size > 1000


def test_projection_formula():
    a = projection.Assumptions()
    assert a.kv_bytes_per_token == 57344
    assert projection.prefill_ms(a, 8192) > 2 * projection.prefill_ms(a, 4096)  # attention is quadratic
    cross = projection.crossover_gbps(a, 4096, 0.25, 0.0)
    oracle = projection.prefill_ms(a, 4096 + a.question_tokens)
    assert projection.project(a, 4096, 0.25, 0.0, cross, "warm") == pytest.approx(oracle)
    assert projection.crossover_gbps(a, 4096, 0.25, 1.5) is None  # rebuilding costs more than prefill
    r, c = projection.measured_modes([_row("oracle", None, 100.0), _row("quant", 10, 80.0, "bits=8")], None)["quant(bits=8)"]
    assert (r, c) == (0.25, 0.01)


# --- link cleanup (root + iproute2 only) ---------------------------------------------------

TEST_NAMES = netns.LinkNames("scd-test-p", "scd-test-c", "scdt-p", "scdt-c", "10.99.1.1", "10.99.1.2")


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"), reason="needs root, ip and tc")
def test_link_create_shape_and_idempotent_cleanup():
    ns = lambda: subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout  # noqa: E731
    # a crashed run's leftover: a veth end still in the root namespace
    netns.sh(["ip", "link", "add", TEST_NAMES.producer_dev, "type", "veth", "peer", "name", TEST_NAMES.consumer_dev])
    with netns.Link(TEST_NAMES, log=lambda m: None) as link:
        assert "scd-test-p" in ns() and "scd-test-c" in ns()
        assert link.shape(50)["rate_mbit"] == 50.0
        assert 10 < link.measure(50) < 60
    assert "scd-test" not in ns()
    assert netns.cleanup(TEST_NAMES) == []  # idempotent: nothing left to remove
    netns.create(TEST_NAMES)
    netns.create(TEST_NAMES)  # create clears leftovers of the same names first
    assert sorted(netns.cleanup(TEST_NAMES)) == ["netns scd-test-c", "netns scd-test-p"]
    assert subprocess.run(["ip", "link", "show", TEST_NAMES.producer_dev], capture_output=True).returncode != 0


def test_shaped_mode_refuses_clearly_without_root(monkeypatch, capsys):
    monkeypatch.setattr(netns, "missing_requirements", lambda: ["not root (test)"])
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--quick", "--model-scale", "tiny"])
    assert exit_info.value.code == 2 and "not root (test)" in capsys.readouterr().err


# --- smoke run of the real harness on loopback ---------------------------------------------

@pytest.mark.timeout(180)
def test_smoke_loopback_run(tmp_path):
    out = tmp_path / "ttft.jsonl"
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "bench.serving.ttft", "--no-shaping", "--quick", "--model-scale", "tiny",
                           "--producer-model", "tiny-llama", "--modes", "raw", "oracle", "--contexts", "64",
                           "--warmup", "1", "--runs", "2", "--no-plot", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=170)
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [json.loads(line) for line in done.stdout.splitlines()] == rows
    assert [(r["mode"], r["store"], r["ctx_tokens"], r["runs"]) for r in rows] == [
        ("oracle", "cold", 64, 2), ("cached", "warm", 64, 2), ("raw", "cold", 64, 2)], done.stderr[-3000:]
    for row in rows:
        assert list(row)[: len(KEYS)] == KEYS
        assert row["ttft_ms_min"] <= row["ttft_ms_median"] <= row["ttft_ms_max"]
        assert row["order"] == "interleaved" and row["cores"] == os.cpu_count() and row["load_avg_1m"] >= 0
    oracle, cached, raw = rows
    assert cached["ttft_ms_median"] < oracle["ttft_ms_median"] and cached["efficiency"] is None
    assert {r["weights"] for r in rows} == {"random"}  # tiny-llama: what the rows ran on
    assert cached["derived"] is True and "rebuild_ms" in cached["formula"] and "derived" not in raw
    assert raw["shaping"] == "loopback" and raw["bytes"] == raw["raw_kv_bytes"] > 0
    assert 0 < raw["efficiency"] <= report.EFFICIENCY_LIMIT and raw["link_mbit"] > 10
    assert raw["ttft_lower_bound_ms"] <= raw["ttft_ms_median"] * report.EFFICIENCY_LIMIT
    print(f"smoke run took {elapsed:.1f}s")


def test_checkout_prefix_runs_the_command_in_that_checkout(tmp_path):
    """--baseline DIR: a service of another checkout starts in DIR (its `python -m` imports DIR's code),
    whatever the path's spaces or quotes."""
    from bench.harness import services

    odd = tmp_path / "a 'baseline' dir"
    odd.mkdir()
    out = subprocess.run([*services.checkout_prefix(odd), sys.executable, "-c", "import os; print(os.getcwd())"],
                         capture_output=True, text=True, check=True, timeout=60)  # fmt: skip
    assert out.stdout.strip() == str(odd)
