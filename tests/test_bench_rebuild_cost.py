"""bench.micro.rebuild_cost: the trained pair's batched SCD rebuild, run as a command from the repo root
(the code it measures); one row with the schedule it rebuilt and a positive CPU per request."""

from __future__ import annotations

import json
import subprocess
import sys

from bench.harness.services import ROOT


def test_a_small_batch_rebuilds_and_writes_its_row(tmp_path):
    out = tmp_path / "rebuild.jsonl"
    done = subprocess.run([sys.executable, "-m", "bench.micro.rebuild_cost", "--batch", "3", "--ctx", "40", "--reps", "2",
                           "--label", "test", "--keep", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row == json.loads(done.stdout.strip().splitlines()[-1])
    assert row["label"] == "test" and row["batch"] == 3 and row["ctx_tokens"] == 40 and row["cpu_ms_per_request"] > 0
    assert row["schedule"] and row["weights"] == "trained"
