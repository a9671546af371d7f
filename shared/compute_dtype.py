"""The compute dtype a service runs in: `--dtype auto` picks bfloat16 only where the device does it natively.

Owns: the facts about a device that decide it (`DeviceFacts`: CUDA bf16 support, the CPU's flags,
a few-millisecond bf16/float32 matmul probe), gathering them (`device_facts`), and the rule
(`choose`, a pure function of the request and the facts, so tests inject the facts). Knows nothing
about models, gRPC or codecs; `shared.models.load_model` applies the choice (weights cast at load).

The rule on a CPU: bfloat16 when the CPU has the instructions (AVX-512 BF16 or AMX-BF16 in
/proc/cpuinfo, `bf16` on Arm; unknown flags do not veto) AND the probe measures a bf16 matmul at
most `NATIVE_RATIO` times float32's time in this process. The probe decides because it sees what
torch will run: torch honours ATEN_CPU_CAPABILITY=avx2 and ONEDNN_MAX_CPU_ISA=AVX2, and with them
a CPU whose flags list avx512_bf16 runs bf16 matmuls 16-60x slower than float32 (measured on this
repository's AVX-512 BF16 host: 0.5-0.7x float32 natively, 16-66x lowered); the flags do not move.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

AUTO = "auto"
NATIVE_CPU_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86 AVX-512 BF16, Intel AMX-BF16, Arm BF16 (cpuinfo Features)
NATIVE_RATIO = 1.5  # bf16 matmul time / float32 time at most this: bf16 counts as native (natively ~0.5-0.7)
PROBE_SHAPE = (64, 256, 256)  # [M x K] @ [K x N]: ~0.1 ms in float32, ~4 ms in emulated bf16
PROBE_REPEATS = 5  # best of this many timings per dtype (a shared box's noise is one-sided)


@dataclass(frozen=True)
class DeviceFacts:
    """What decides the compute dtype on one device."""

    device_type: str  # "cuda" or "cpu"
    device_name: str = ""  # e.g. "NVIDIA H200"; "" on a CPU
    cuda_bf16: bool = False  # CUDA: bf16 is native (compute capability >= 8.0), not emulated
    cpu_flags: frozenset[str] | None = None  # CPU flags from /proc/cpuinfo; None: not readable here
    probe_ratio: float | None = None  # CPU: bf16 matmul time / float32 time in this process; None: not measured


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str  # the dtype the model computes in: one of shared.models.DTYPES
    reason: str  # one sentence: why this dtype (shown in Describe and the startup log)
    warning: str = ""  # set when an explicit dtype is much slower here than float32


def native_flags(facts: DeviceFacts) -> list[str]:
    return [f for f in NATIVE_CPU_FLAGS if facts.cpu_flags is not None and f in facts.cpu_flags]


def _probe_text(facts: DeviceFacts) -> str:
    return "not measured" if facts.probe_ratio is None else f"{facts.probe_ratio:.2f}x float32's time"


def native_bf16(facts: DeviceFacts) -> tuple[bool, str]:
    """(whether the device computes bf16 natively, in this process; the evidence in words)."""
    if facts.device_type == "cuda":
        name = facts.device_name or "cuda"
        return facts.cuda_bf16, f"{name} {'has' if facts.cuda_bf16 else 'has no'} native bfloat16"
    flags = native_flags(facts)
    probe = f"a bfloat16 matmul probe took {_probe_text(facts)}"
    if facts.cpu_flags is not None and not flags:
        return False, f"the CPU has none of {'/'.join(NATIVE_CPU_FLAGS)} ({probe})"
    has = f"the CPU has {'/'.join(flags)}" if flags else "the CPU's flags are unknown"
    if facts.probe_ratio is None:
        return False, f"{has} but {probe}"
    if facts.probe_ratio > NATIVE_RATIO:
        return False, f"{has} but {probe} (ISA lowered, e.g. ATEN_CPU_CAPABILITY or ONEDNN_MAX_CPU_ISA?)"
    return True, f"{has} and {probe}"


def choose(requested: str, facts: DeviceFacts) -> DtypeChoice:
    """The compute dtype for `--dtype requested` on a device with these facts (pure)."""
    native, why = native_bf16(facts)
    if requested == AUTO:
        dtype = "bfloat16" if native else "float32"
        return DtypeChoice(dtype, f"--dtype auto: {why}: {dtype}")
    warning = ""
    if requested == "bfloat16" and not native:
        slower = (
            f"measured {facts.probe_ratio:.1f}x slower than float32" if facts.probe_ratio else "likely much slower than float32"
        )
        warning = f"--dtype bfloat16 without native bfloat16 on this {facts.device_type}: {slower} ({why}); --dtype auto would use float32"
    return DtypeChoice(requested, f"--dtype {requested} (explicit)", warning)


def cpu_info(keys: tuple[str, ...], path: str = "/proc/cpuinfo") -> str | None:
    """The first CPU's value of the first of `keys` its entry has; None where the file is not
    readable or names none of them."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in keys:
            return value.strip()
    return None


def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str] | None:
    """The first CPU's flags (x86 `flags`, Arm `Features`); None where the file is not readable."""
    value = cpu_info(("flags", "Features"), path)
    return None if value is None else frozenset(value.split())


def probe_ratio(shape: tuple[int, int, int] = PROBE_SHAPE, repeats: int = PROBE_REPEATS) -> float:
    """bf16 / float32 time of one [M x K] @ [K x N] matmul on the CPU, best of `repeats` each
    (a few milliseconds in all; ~25 ms where bf16 is emulated). One torch thread and the two
    dtypes timed in turn: on a busy box a multi-threaded region waits for its slowest thread, and
    a stall that hit only one dtype's timings would skew the ratio."""
    m, k, n = shape
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
    pairs = {dtype: (a.to(dtype), b.to(dtype)) for dtype in (torch.float32, torch.bfloat16)}
    best = dict.fromkeys(pairs, float("inf"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for x, y in pairs.values():
            x @ y  # first call: lazy kernel selection, not timed
        for _ in range(repeats):
            for dtype, (x, y) in pairs.items():
                start = time.perf_counter()
                x @ y
                best[dtype] = min(best[dtype], time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return best[torch.bfloat16] / max(best[torch.float32], 1e-9)


def device_facts(device: torch.device) -> DeviceFacts:
    """The facts of this device, measured now (the CPU probe runs only on a CPU)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        with torch.cuda.device(index):
            bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
        return DeviceFacts("cuda", torch.cuda.get_device_name(index), cuda_bf16=bf16)
    return DeviceFacts("cpu", cpu_flags=cpu_flags(), probe_ratio=probe_ratio())


def resolve(requested: str, device: torch.device) -> DtypeChoice:
    """`choose` with this device's facts, measured only where they matter (auto, bfloat16)."""
    if requested not in (AUTO, "bfloat16"):
        return DtypeChoice(requested, f"--dtype {requested} (explicit)")
    return choose(requested, device_facts(device))
