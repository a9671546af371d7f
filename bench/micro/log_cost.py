"""CPU per service log line: `python -m bench.micro.log_cost`.

A fresh process per run sets up logging as a service does (shared.core_log.install, then
shared.logs.configure at INFO, stderr to a file), writes `--lines` request-sized INFO lines and
reads its own CPU (every thread: the core-log reader's too) after the reader has drained.
Variants, interleaved round by round:
- `direct`: as the services run, Python's stderr is the real stderr (fd 2 stays piped for gRPC
  core's own lines);
- `pipe`: Python's stderr put back on fd 2 after install, so each line also crosses the core-log
  pipe and its reader thread (the routing before the services wrote directly).
One JSON line per run; `--keep` appends them to bench/results/log_cost.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_CHILD = """
import os, resource, sys
from shared import core_log, logs
core = core_log.install("consumer")
if {pipe}:
    sys.stderr = open(2, "w", buffering=1, closefd=False)
logs.configure("consumer", "INFO")
log = logs.get("consumer.bench")
before = resource.getrusage(resource.RUSAGE_SELF)
for _ in range({lines}):
    log.info("generate.done", mode="raw", ttft_ms=12.34, tokens=3, bytes=1048576, total_ms=20.1, request_id="0123456789abcdef")
core.close()
after = resource.getrusage(resource.RUSAGE_SELF)
cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
print(cpu, file=sys.__stdout__)
"""


def run_once(variant: str, lines: int, sink: Path) -> dict:
    with open(sink, "w") as err:
        out = subprocess.run([sys.executable, "-c", _CHILD.format(pipe=variant == "pipe", lines=lines)], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=err, text=True, check=True,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"}).stdout
    written = sum(1 for _ in open(sink))
    if written != lines:
        raise RuntimeError(f"{variant}: {written} of {lines} lines reached stderr")
    return {"bench": "log_cost", "variant": variant, "lines": lines, "cpu_us_per_line": round(float(out) / lines * 1e6, 2),
            "load_avg_1m": round(os.getloadavg()[0], 2)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "log_cost.jsonl"))
    args = parser.parse_args(argv)
    from bench.harness.services import code_version

    code = code_version()
    rows = []
    sink = Path(args.out).with_suffix(".stderr.tmp")
    try:
        for r in range(args.rounds):
            for variant in ("direct", "pipe") if r % 2 == 0 else ("pipe", "direct"):
                row = {**run_once(variant, args.lines, sink), "round": r, "code": code}
                print(json.dumps(row), flush=True)
                rows.append(row)
    finally:
        sink.unlink(missing_ok=True)
    if args.keep:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    for variant in ("direct", "pipe"):
        print(f"{variant}: {statistics.median(r['cpu_us_per_line'] for r in rows if r['variant'] == variant):.1f} us CPU per line")


if __name__ == "__main__":
    main()
