"""bench.micro.transport --quick: real producer processes on loopback, the raw codec's stream against a
plain TCP socket; one JSON line per chunk size, the same lines in the output file."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from bench.harness.services import ROOT
from bench.micro import transport

KEYS = {"grpc_MBps", "socket_MBps", "ratio", "chunk_bytes"}


@pytest.mark.timeout(150)
def test_quick_transport_run(tmp_path):
    out = tmp_path / "transport.jsonl"
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "bench.micro.transport", "--quick", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=140)
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [json.loads(line) for line in done.stdout.splitlines()] == rows
    assert [r["chunk_bytes"] for r in rows] == transport.QUICK["chunk_sizes"]
    tokens = transport.QUICK["ctx"]
    kv_bytes = tokens * transport.TRANSPORT["num_hidden_layers"] * 2 * transport.TRANSPORT["hidden_size"] * 4  # fp32
    for r in rows:
        assert KEYS <= set(r) and r["payload_bytes"] == kv_bytes and r["ctx_tokens"] == tokens
        assert r["grpc_MBps"] > 0 and r["socket_MBps"] > 0
        assert r["weights"] == "random"  # what the row ran on
        assert r["ratio"] == pytest.approx(r["grpc_MBps"] / r["socket_MBps"], rel=0.02)
    assert "best ratio" in done.stderr
    print(f"bench.micro.transport --quick took {elapsed:.1f}s")
