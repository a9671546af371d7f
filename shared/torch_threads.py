"""How many intra-op threads torch gets in a service, and why (set once, before any forward), and
which threads form an OpenMP team (one per process: see `pin`)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


def intra_op_threads(configured: int, device: str, env: Mapping[str, str]) -> tuple[int, str]:
    """torch's intra-op threads for a service (0: torch's default, one per core) and why.

    On a GPU the model computes on the device, and what torch still does on the CPU is small
    (cutting a layer's K/V into chunks, a copy, a check over quantization scales). On an H200 box
    (16 cores, load 5-10) such ops, the producer's per-chunk clones of the 7B shape's K/V and the
    consumer's finiteness checks, took most of both services' time (bench.serving.ttft --profile-dir); our
    reading, not measured, is that each one above torch's grain size woke an OpenMP team of one
    thread per core. vLLM's GPU workers likewise set torch to one thread unless OMP_NUM_THREADS
    says otherwise."""
    from shared.models import resolve_device

    if configured:
        return configured, "--torch-threads"
    if env.get("OMP_NUM_THREADS"):
        return 0, "OMP_NUM_THREADS is set: torch follows it"
    if resolve_device(device).type == "cuda":
        return 1, "the model runs on CUDA: CPU-side ops are small, one thread each (--torch-threads N to change)"
    return 0, "the model runs on the CPU: torch's default, one thread per core"


# One OpenMP team per process. libgomp (torch's OpenMP on Linux) lets a worker spin about 3 ms
# between parallel regions only while the process holds no more OpenMP threads than CPUs; past
# that it spins 100 times and sleeps, and each region starts with a futex wake. Every thread that
# runs a parallel op keeps a team of its own until it exits: with the main thread's (the model's
# load) beside the engine thread's on 2 cores, the engine's worker slept and woke ~270 times per
# decode step (60k voluntary context switches per batch of 32 x 128 tokens; with one team ~30 in one
# process, ~250 through the services).
# So the model loads on a thread that ends (`on_new_thread`), the event loop's thread and every pool
# beside the forward (the producer's encode threads and disk writer, the loop's default executor) compute on one
# thread each (`pin(1)`, `pinned_pool`: what they run is small or runs beside the forward), and the
# thread that runs the forward (the consumer's engine, the producer's compute thread) forms the one team.
GRAIN = 32768  # torch's grain size: an elementwise op over more elements runs on the thread's team


def on_new_thread(fn: Callable[..., T], *args: Any, name: str = "scd-once") -> T:
    """fn(*args) on a thread of its own, its result or its exception; the thread, and the OpenMP
    team its parallel ops formed, end with it."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append((True, fn(*args)))
        except BaseException as exc:  # re-raised on the caller's thread
            out.append((False, exc))

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    ok, value = out[0]
    if not ok:
        raise value
    return value


def pin(threads: int) -> None:
    """The calling thread computes on `threads` intra-op threads from now on, and the count torch
    gives threads yet to compute stays as it was. torch copies its process-wide count into a thread
    at the thread's first parallel op and `torch.set_num_threads` sets both: so this sets the count,
    runs that first op here, and puts the process-wide count back from a passing thread."""
    import torch

    default = on_new_thread(torch.get_num_threads)  # a new thread reads the process-wide count
    torch.set_num_threads(threads)
    torch.zeros(2 * GRAIN).add_(1)  # this thread's first parallel op: torch's per-thread setup, now
    on_new_thread(torch.set_num_threads, default)


def name_os_thread(name: str) -> None:
    """Give the calling thread its name at the OS level too (Linux: 15 bytes; elsewhere nothing)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def pinned_pool(max_workers: int | None, thread_name_prefix: str) -> ThreadPoolExecutor:
    """A thread pool whose threads compute on one intra-op thread each (`pin(1)` as each starts):
    work beside the forward forms no OpenMP team of its own."""
    return ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=thread_name_prefix, initializer=pin, initargs=(1,))
