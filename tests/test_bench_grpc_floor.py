"""bench.micro.grpc_floor: a real gRPC server process and client process with nothing of SCD in them;
every call gets its streamed messages, CPU per call is read for both ends, bulk rows carry the
socket's figure from the same round, and --keep appends exactly the printed rows."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.harness.services import ROOT


@pytest.mark.timeout(120)
def test_small_and_bulk_calls(tmp_path):
    out = tmp_path / "floor.jsonl"
    base = [sys.executable, "-m", "bench.micro.grpc_floor", "--rounds", "1", "--seconds", "0.5", "--keep", "--out", str(out)]
    small = subprocess.run([*base, "--loops", "uvloop,asyncio", "--concurrency", "4"], cwd=ROOT,
                           capture_output=True, text=True, timeout=100)
    assert small.returncode == 0, small.stderr[-3000:]
    bulk = subprocess.run([*base, "--loops", "uvloop", "--concurrency", "1", "--bytes", str(1 << 20), "--messages", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert bulk.returncode == 0, bulk.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    printed = [json.loads(line) for text in (small.stdout, bulk.stdout) for line in text.splitlines() if line.startswith("{")]
    assert rows == printed and [r["loop"] for r in rows] == ["uvloop", "asyncio", "uvloop"]
    for r in rows:
        assert r["calls"] > 0 and r["messages_per_call"] == r["messages"]
        assert r["server_cpu_ms_per_call"] > 0 and r["client_cpu_ms_per_call"] > 0
        assert r["total_cpu_ms_per_call"] == pytest.approx(r["server_cpu_ms_per_call"] + r["client_cpu_ms_per_call"], abs=0.002)
    assert "socket_MBps" not in rows[0]
    assert rows[2]["socket_MBps"] > 0 and rows[2]["ratio"] == pytest.approx(rows[2]["MB_per_s"] / rows[2]["socket_MBps"], rel=0.01)
