"""Liveness from progress: a heartbeat that a worker loop (a compute thread, an encode pool)
updates as it advances, and the test a watchdog applies to it.

A loop brackets each unit of work with `iteration()` and calls `beat()` whenever it advances
inside one (a layer done, a payload encoded). A process is stuck only when some iteration is
in progress and has not advanced for longer than the bound: an idle loop is alive, and so is a
loaded one whose queue is long but whose iterations keep moving (a heartbeat sent through the
work queue would wait behind that queue and read a busy process as hung). Thread-safe; knows
nothing about gRPC or health services (shared.grpc_server reports what `stalled_s` says).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator


class Progress:
    """The heartbeat of one worker loop (or a pool of them)."""

    def __init__(self, name: str):
        self.name = name
        self._lock = threading.Lock()
        self._active = 0  # iterations in progress now
        self._last = time.monotonic()  # last sign of progress (start, beat or end of an iteration)
        self.iterations = 0  # iterations finished since start

    @contextlib.contextmanager
    def iteration(self) -> Iterator[None]:
        with self._lock:
            self._active += 1
            self._last = time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1
                self._last = time.monotonic()
                self.iterations += 1

    def beat(self) -> None:
        """The iteration in progress advanced."""
        self._last = time.monotonic()  # a float store: atomic under the GIL

    def stalled_s(self) -> float:
        """Seconds since the last progress while an iteration is in progress; 0 when idle."""
        with self._lock:
            return time.monotonic() - self._last if self._active else 0.0


def stalled(progress: list[Progress], timeout_s: float) -> Progress | None:
    """The first loop stuck for longer than timeout_s, or None."""
    return next((p for p in progress if p.stalled_s() > timeout_s), None)
