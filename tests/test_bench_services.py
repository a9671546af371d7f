"""bench.harness.services: a benchmark killed with SIGTERM stops the producer and consumer it started
(no orphaned services holding ports and CPU)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from bench.harness.services import ROOT

SCRIPT = """
import time
from bench.harness import services
with services.running(["--model", "tiny-llama"], ["--model", "tiny-llama"], log_dir=services.ROOT / "bench/runs/sigterm") as (p, c):
    print("UP", p.process.pid, c.process.pid, flush=True)
    for _ in range(1200):  # a benchmark's main thread keeps running Python code; one long sleep would not
        time.sleep(0.1)    # wake for a SIGTERM the kernel delivered to one of grpc's threads
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie waiting for its parent counts as gone
        return f.read().split()[2] != "Z"


def test_sigterm_stops_the_services_it_started():
    bench = subprocess.Popen([sys.executable, "-c", SCRIPT], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        line = bench.stdout.readline()
        assert line.startswith("UP"), line
        pids = [int(x) for x in line.split()[1:]]
        assert all(alive(pid) for pid in pids)
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=60) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 30
        while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(alive(pid) for pid in pids)
    finally:
        bench.kill()
