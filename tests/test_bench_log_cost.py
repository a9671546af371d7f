"""bench.micro.log_cost: a real service logging setup in a fresh process per run; every line reaches
stderr in both routings (the run fails otherwise) and each row has a positive CPU per line."""

from __future__ import annotations

import json
import subprocess
import sys

from bench.harness.services import ROOT


def test_both_routings_write_every_line(tmp_path):
    out = tmp_path / "log_cost.jsonl"
    done = subprocess.run([sys.executable, "-m", "bench.micro.log_cost", "--lines", "300", "--rounds", "1", "--keep", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["variant"] for r in rows) == ["direct", "pipe"]
    assert all(r["lines"] == 300 and r["cpu_us_per_line"] > 0 for r in rows)
    assert not list(tmp_path.glob("*.tmp"))
