"""Whether a process's memory levels off under repeated load: RSS per round, its slope over the
second half of the rounds, and the rule that calls it a plateau or growth; and the diff of two
heap dumps (shared.heap_trace) that says what grew.

The second half: start-up fills (caches, pools, allocator arenas, the estimates' windows) are
behind it. Two figures over it, both in % of the process's median RSS there, per round:
- `slope_pct_per_round`: the Theil-Sen slope of RSS (the median of the slopes of every pair of
  rounds), where the memory is heading; robust to one noisy reading.
- `peak_rise_pct_per_round`: how far the high-water mark (the largest RSS so far) rose from the
  middle round to the last, per round. The verdict reads this one: the consumer's RSS saws up and
  down by a bounded amount (its gather buffers are touched page by page as batches grow, then cut
  every 64 forwards: consumer.runner), and a short window on a rising edge gives a steep slope
  although the peaks repeat; memory that grows without bound makes new peaks round after round.
`levels_off`: the peak rose by at most MAX_RISE_PCT_PER_ROUND (None with fewer than MIN_ROUNDS
rounds in the second half: no verdict).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import statistics
import time
from pathlib import Path

from bench.harness import services
from shared import heap_trace

# % of RSS per round of the load test (40 requests a round at its defaults): 0.1% is ~0.5 MiB a
# round of the ~510 MiB consumer, 5 MiB of new peak over a 20-round run's second half. With
# oneDNN's kernel caches at their defaults (issue 43) the consumer's peak rose 0.41-0.74% a round
# over rounds 11-20 (7 runs); with them bounded (shared.kernel_cache) 0.0 in 7 runs of 20 rounds
MAX_RISE_PCT_PER_ROUND = 0.1
MIN_ROUNDS = 5  # second-half rounds a verdict needs (a --quick run has none)


def rss_kib(pid: int) -> int:
    """Resident KiB of a process and its children (the consumer's engine process under --engine-process)."""
    total = 0
    for p in (pid, *services.children(pid)):
        with contextlib.suppress(OSError):  # exited meanwhile
            total += heap_trace.rss_kib(p)
    return total


def theil_sen(ys: list[float]) -> float:
    """The median of (y_j - y_i) / (j - i) over every pair i < j of equally spaced points."""
    return statistics.median((ys[j] - ys[i]) / (j - i) for i in range(len(ys)) for j in range(i + 1, len(ys)))


def second_half(series: list[int]) -> list[int]:
    return series[len(series) // 2 :]


def trend(series: list[int], max_pct: float = MAX_RISE_PCT_PER_ROUND) -> dict:
    """The second half of an RSS series (KiB, one reading per round): its Theil-Sen slope, the
    rise of its high-water mark, both per round, and the verdict (module docstring)."""
    tail = second_half(series)
    if len(tail) < MIN_ROUNDS or not all(tail):
        return {"slope_kib_per_round": None, "slope_pct_per_round": None, "peak_rise_pct_per_round": None, "levels_off": None}
    slope, rss = theil_sen([float(v) for v in tail]), statistics.median(tail)
    before = series[: len(series) - len(tail)]
    peak_rise = (max(series) - max(before or tail[:1])) / len(tail)
    return {
        "slope_kib_per_round": round(slope, 1),
        "slope_pct_per_round": round(100 * slope / rss, 4),
        "peak_rise_pct_per_round": round(100 * peak_rise / rss, 4),
        "levels_off": 100 * peak_rise / rss <= max_pct,
    }


async def heap_dump(directory: Path, pid: int, n: int, timeout_s: float = 300.0) -> Path:
    """Ask a consumer started with SCD_HEAP_TRACE for its dump n (shared.heap_trace) and wait for it."""
    os.kill(pid, signal.SIGUSR2)
    path = directory / f"consumer-{pid}-{n:03d}.json"
    until = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > until:
            raise TimeoutError(f"no heap dump {path} after {timeout_s} s")
        await asyncio.sleep(0.2)
    return path


def dumps_between(first: Path, last: Path) -> list[dict]:
    """The JSON dumps of one process from `first` to `last` (their names end in the dump number)."""
    stem, lo, hi = first.stem.rsplit("-", 1)[0], int(first.stem.rsplit("-", 1)[1]), int(last.stem.rsplit("-", 1)[1])
    paths = (first.with_name(f"{stem}-{n:03d}.json") for n in range(lo, hi + 1))
    return [json.loads(p.read_text()) for p in paths if p.exists()]


def diff_dumps(first: Path, last: Path, top: int = 15) -> dict:
    """What grew between two heap dumps of one process (shared.heap_trace's JSON and snapshot):
    RSS, glibc's heap totals, object counts by type, and the allocation sites (grouped by their
    innermost frame; each with the frames that hold it) that gained the most bytes."""
    import tracemalloc

    a, b = json.loads(first.read_text()), json.loads(last.read_text())
    grew = []
    if first.with_suffix(".tracemalloc").exists():  # not with SCD_HEAP_TRACE_FRAMES=0
        old = tracemalloc.Snapshot.load(str(first.with_suffix(".tracemalloc")))
        new = tracemalloc.Snapshot.load(str(last.with_suffix(".tracemalloc")))
        grew = [s for s in new.compare_to(old, "traceback") if s.size_diff > 0][:top]
    before = {c["id"]: c["len"] for c in a.get("containers", [])}
    owners = {c["id"]: c["owner"] for d in dumps_between(first, last) for c in d.get("containers", []) if "owner" in c}
    grown = [
        {
            "owner": owners.get(c["id"], "?"),
            "type": c["type"],
            "len": c["len"],
            "grew": c["len"] - before.get(c["id"], 0),
            "new": c["id"] not in before,
        }
        for c in b.get("containers", [])
    ]
    grown = sorted((c for c in grown if c["grew"] > 0), key=lambda c: -c["grew"])[:top]
    types = {t: b["objects"].get(t, 0) - a["objects"].get(t, 0) for t in {*a["objects"], *b["objects"]}}
    return {
        "rss_kib": b["rss_kib"] - a["rss_kib"],
        "traced_kib": b["traced_kib"] - a["traced_kib"],
        "malloc_kib": {k: (b["malloc"].get(k, 0) - v) // (1 if k == "arenas" else 1024) for k, v in a["malloc"].items()},
        "containers": grown,
        "objects": dict(sorted(((t, n) for t, n in types.items() if n), key=lambda kv: -abs(kv[1]))[:top]),
        "sites": [
            {
                "kib": round(s.size_diff / 1024, 1),
                "count": s.count_diff,
                "frames": [f"{f.filename.rsplit('site-packages/', 1)[-1]}:{f.lineno}" for f in s.traceback][:6],
            }
            for s in grew
        ],
    }
