"""How many intra-op threads torch gets in a service, and why (set once, before any forward)."""

from __future__ import annotations

from collections.abc import Mapping


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
