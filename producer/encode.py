"""Encoding off the forward: the producer's encode threads and each request's ordered lane on them.

The forward (on the compute thread) only hands each captured layer to its request's `Lane`;
the codec's encode, the device-to-host copy, CRC and protobuf packing run on the encode pool.
A lane runs its request's tasks one at a time, in the order they were put (layer order, then
the request's end), while different requests' lanes share the pool's threads. The forward
never waits for a lane: `put` appends and returns.

On CUDA the forward thread records an event on the compute stream after each layer (`mark`);
the lane makes a side copy stream wait on that event and encodes and copies there, so the
copy overlaps the next layers' kernels and never reads a tensor the forward has not finished.

Knows nothing about gRPC, codecs or the store: tasks are plain callables.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

import torch

from shared import liveness, torch_threads


class EncodePool:
    """The encode threads (`threads` of them) and the heartbeat they keep."""

    def __init__(self, threads: int, device: torch.device | None = None):
        # one intra-op thread each: the compute thread's team is the process's one (shared.torch_threads)
        self.executor = torch_threads.pinned_pool(threads, "producer-encode")
        self.progress = liveness.Progress("producer-encode")
        self._streams: dict[int, torch.cuda.Stream] = {}  # one side stream per encode thread
        self._streams_lock = threading.Lock()
        self.attach(device)

    def attach(self, device: torch.device | None) -> None:
        """The model's device: copy streams and events on CUDA, plain calls elsewhere."""
        self.cuda = device is not None and device.type == "cuda" and torch.cuda.is_available()

    def mark(self) -> torch.cuda.Event | None:
        """On the forward thread, after a layer: an event the copy stream waits on (None on CPU)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record()  # on the compute thread's current stream, after the layer's kernels
        return event

    def on_copy_stream(self, event: torch.cuda.Event | None, fn: Callable[[], None]) -> None:
        """Run fn on this thread's copy stream, after the forward reached `event` (CPU: just fn)."""
        if not self.cuda or event is None:
            fn()
            return
        with self._streams_lock:
            stream = self._streams.setdefault(threading.get_ident(), torch.cuda.Stream())
        # the host waits here for the forward to reach the layer, not inside fn: fn's own timer
        # (the request's encode_ms) then counts its work alone, not the wait as well (on an H200,
        # bench/results/gpu.jsonl, encode_ms read 462 ms beside a 29 ms forward; this separates them).
        event.synchronize()
        stream.wait_event(event)
        with torch.cuda.stream(stream):
            fn()  # its .to("cpu") copies are synchronous for the host: done when fn returns
        stream.synchronize()

    def lane(self) -> Lane:
        return Lane(self)

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


class Lane:
    """One request's encode tasks, run in put order, one at a time, on the pool (at most one of
    its tasks is queued or running there at once)."""

    def __init__(self, pool: EncodePool):
        self.pool = pool
        self._lock = threading.Lock()
        self._tasks: collections.deque[Callable[[], None]] = collections.deque()
        self._scheduled = False

    def put(self, task: Callable[[], None]) -> None:
        """Queue a task (from any thread); never waits for the pool."""
        with self._lock:
            self._tasks.append(task)
            if self._scheduled:
                return
            self._scheduled = True
        self._submit()

    def _run_one(self) -> None:
        """One task, then back of the pool's queue if more wait: lanes interleave layer by layer,
        so every request of a batch gets its first layer out early, not after another's last."""
        with self._lock:
            task = self._tasks.popleft()
        with self.pool.progress.iteration():
            task()  # tasks catch their own errors (the engine fails the request)
        with self._lock:
            if not self._tasks:
                self._scheduled = False
                return
        self._submit()

    def _submit(self) -> None:
        try:
            self.pool.executor.submit(self._run_one)
        except RuntimeError:  # the pool is shut down (process stopping): the request is over anyway
            pass
