"""Where a service's CPU goes, for bench.serving.throughput: per-thread CPU from /proc (exact), and the
consumer's event-loop thread split into stages by a sampling profiler (py-spy, when installed:
`pip install py-spy`; it reads the process's memory from outside, `--nonblocking`, so the service
itself runs no extra code; it is not a dependency of the project).

The stages of the loop thread, by the innermost frame of each sample that names one (a sample in
the stream reader that is logging counts as logging):
- `logging_metrics`: structlog / logging / shared.logs / shared.metrics / prometheus_client;
- `stream_parsing`: the stream reader and the wire checks (consumer.link.stream_reader, shared.wire);
- `rebuild_dispatch`: handing layers to the engine (consumer.request.transfer, the engine's submit);
- `answer_streaming`: engine events to Generate messages (consumer.request.engine_stream, the detokenizer,
  the pipeline's answer loop, the servicer's message building);
- `grpc`: gRPC's Python frames (grpc.aio calls, reads, writes) and the producer client;
- `loop_native`: no Python frame below the event loop's run: uvloop's C loop and gRPC's Cython core
  (message (de)serialization and sends of every call, completion-queue callbacks), and waiting
  for the interpreter lock the engine thread holds (`SCD_STAGES_NATIVE=1` samples C frames too,
  pausing the process per sample: `pthread_cond_timedwait` under `_ensure_handle_data` is that wait);
- `request_setup`: validation, tokenization hand-off, auto, prefix keys, admission;
- `other`: the event loop's own scheduling and anything else.
A stage's CPU ms = the loop thread's CPU ms (from /proc) x its share of the loop's samples.
Threads: `engine` (the batch engine's thread, named consumer-engine, plus the engine process
under --engine-process) and `other_threads` (gRPC's poller, tokenizer, torch workers).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

STAGES = (
    "grpc",
    "loop_native",
    "stream_parsing",
    "rebuild_dispatch",
    "answer_streaming",
    "logging_metrics",
    "request_setup",
    "other",
)
RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "logging_metrics",
        (
            "structlog/",
            "logging/",
            "shared/logs.py",
            "shared/metrics.py",
            "prometheus_client/",
            "shared/core_log.py",
            "shared/tracing.py",
            "opentelemetry/",
        ),
    ),
    ("stream_parsing", ("consumer/link/stream_reader.py", "shared/wire.py")),
    ("rebuild_dispatch", ("consumer/request/transfer.py", "submit_grouped (consumer/engine/batch.py", "submit (consumer/engine/batch.py")),
    (
        "answer_streaming",
        (
            "consumer/request/engine_stream.py",
            "consumer/engine/decoding.py",
            "_answer (consumer/pipeline/pipeline.py",
            "consumer/api/messages.py",
            "Generate (consumer/api/servicer.py",
            "tokenizers/",
            "tokenization_utils",
        ),
    ),
    ("grpc", ("grpc/", "consumer/link/producer_client.py", "shared/handlers.py")),
    (
        "request_setup",
        (
            "consumer/api/job_builder.py",
            "consumer/auto/chooser.py",
            "consumer/link/prefix_keys.py",
            "shared/chunks.py",
            "consumer/engine/kv_admission.py",
            "consumer/auto/producer_memory.py",
            "consumer/auto/planner.py",
            "consumer/pipeline/learning.py",
            "consumer/pipeline/pipeline.py",
            "consumer/api/servicer.py",
        ),
    ),
)
LOOP_THREAD = "MainThread"
ENGINE_THREAD = "consumer-engine"


def py_spy() -> str | None:
    """The py-spy executable beside this interpreter or on PATH (None: no stage split)."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def thread_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) per thread id of a process (threads that exited are gone)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def thread_names(pid: int) -> dict[int, str]:
    """The OS name of each thread (the engine names its own: consumer.engine.batch)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(task.name)] = (task / "comm").read_text().strip()
        except OSError:
            pass
    return out


def stage_of(stack: str) -> str:
    """A sample's stage: the innermost frame (the stack's last) a rule names."""
    frames = stack.split(";")
    if frames and frames[-1].startswith("Runner.run (asyncio/runners.py"):
        return "loop_native"
    for frame in reversed(frames):
        for stage, needles in RULES:
            if any(n in frame for n in needles):
                return stage
    return "other"


def parse_raw(text: str) -> tuple[dict[str, int], dict[str, int]]:
    """py-spy's raw output (`--threads`: each stack starts `thread (tid): name`) -> (samples per
    stage of the loop thread, samples per thread name)."""
    stages = dict.fromkeys(STAGES, 0)
    threads: dict[str, int] = {}
    for name, rest, count in _stacks(text):
        threads[name] = threads.get(name, 0) + count
        if name == LOOP_THREAD:
            stages[stage_of(rest)] += count
    return stages, threads


def _stacks(text: str) -> Iterator[tuple[str, str, int]]:
    """py-spy raw lines (`--threads`) -> (thread name, its frames 'f (file:line);...', samples)."""
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        head, _, rest = stack.partition(";")
        yield (head.split(": ", 1)[1] if ": " in head else head), rest, int(count)


class Sampler:
    """py-spy recording one process while a cell runs (a no-op when py-spy is absent)."""

    def __init__(self, pid: int, out: Path, rate: int = 200):
        self.pid, self.out, self.rate = pid, out, rate
        self.proc: subprocess.Popen | None = None
        # SCD_STAGES_NATIVE=1: C frames too (uvloop, gRPC's Cython core), pausing the process per sample
        native = os.environ.get("SCD_STAGES_NATIVE") == "1"
        self.mode = ["--native"] if native else ["--nonblocking"]

    def __enter__(self) -> Sampler:
        exe = py_spy()
        if exe is not None:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.out.unlink(missing_ok=True)
            self.proc = subprocess.Popen(
                [
                    exe,
                    "record",
                    "--pid",
                    str(self.pid),
                    "--rate",
                    str(self.rate),
                    "--format",
                    "raw",
                    "--threads",
                    *self.mode,
                    "-o",
                    str(self.out),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def stages(self) -> tuple[dict[str, int], dict[str, int]] | None:
        if self.proc is None or not self.out.exists():
            return None
        return parse_raw(self.out.read_text())


def split_ms(loop_ms: float, samples: dict[str, int]) -> dict[str, float]:
    """The loop thread's CPU ms spread over its stages by their share of its samples."""
    total = sum(samples.values())
    return {s: (loop_ms * n / total if total else 0.0) for s, n in samples.items()}


PROJECT = ("(producer/", "(consumer/", "(shared/")


def _func(frame: str) -> str:
    """'f (path/file.py:123)' -> 'f (path/file.py)'."""
    return frame.rsplit(":", 1)[0] + ")" if ":" in frame else frame


def top(text: str, n: int = 12) -> dict[str, dict]:
    """py-spy raw stacks -> per thread name (busiest first): its samples, its n project functions
    (producer/, consumer/, shared/) with the most samples in which they appear (inclusive,
    counted once per stack) and its n innermost frames with the most samples (self)."""
    threads: dict[str, dict] = {}
    for name, rest, count in _stacks(text):
        t = threads.setdefault(name, {"samples": 0, "inclusive": {}, "self": {}})
        t["samples"] += count
        raw = [f for f in rest.split(";") if f]
        for func in {_func(f) for f in raw if any(p in f for p in PROJECT)}:
            t["inclusive"][func] = t["inclusive"].get(func, 0) + count
        if raw:  # the innermost frame with its line
            t["self"][raw[-1]] = t["self"].get(raw[-1], 0) + count
    for t in threads.values():
        for kind in ("inclusive", "self"):
            t[kind] = sorted(t[kind].items(), key=lambda kv: -kv[1])[:n]
    return dict(sorted(threads.items(), key=lambda kv: -kv[1]["samples"]))


def main(argv: list[str] | None = None) -> None:
    """`python -m bench.harness.cpu_stages FILE...`: each recorded file's busiest threads, with their
    project functions (inclusive) and innermost frames (self) by samples."""
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--top", type=int, default=10, help="functions per thread and kind")
    p.add_argument("--threads", type=int, default=4, help="threads per file")
    args = p.parse_args(argv)
    for path in args.files:
        print(f"== {path.name}")
        for name, t in list(top(path.read_text(), args.top).items())[: args.threads]:
            print(f"  thread {name}: {t['samples']} samples")
            for kind in ("inclusive", "self"):
                for func, count in t[kind]:
                    print(f"    {kind[:4]} {count:6d}  {func}")


if __name__ == "__main__":
    main()
