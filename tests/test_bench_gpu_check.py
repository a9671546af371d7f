"""bench.serving.gpu_check --device cpu --quick: the GPU check's three steps (tests/test_gpu.py, in-process
prefill timing, bench.serving.ttft on loopback) end to end on tiny shapes, one JSON line each."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.harness.services import ROOT
from bench.serving.ttft import report


@pytest.mark.timeout(180)
def test_gpu_check_runs_on_cpu_quick(tmp_path):
    out = tmp_path / "gpu.jsonl"
    done = subprocess.run([sys.executable, "-m", "bench.serving.gpu_check", "--device", "cpu", "--quick", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [json.loads(line) for line in done.stdout.splitlines()] == rows
    checks = [r["check"] for r in rows]
    assert checks[:3] == ["machine", "pytest", "prefill"] and checks[-1] == "done" and rows[-1]["failed"] == []
    assert rows[1]["rc"] == 0 and "skipped" in rows[1]["summary"]  # no CUDA here: the GPU tests skip
    assert rows[2]["timer"] == "perf_counter" and rows[2]["prefill_ms"] > 0
    ttft = [r for r in rows if r["check"] == "ttft"]
    assert {r["mode"] for r in ttft} == {"oracle", "cached", "raw", "quant"}
    assert all(r["efficiency"] is None or 0 < r["efficiency"] <= report.EFFICIENCY_LIMIT for r in ttft)
