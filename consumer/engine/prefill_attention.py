"""Paged prefill attention in bfloat16 on CPUs with AVX-512 BF16: a row's new tokens (a prefill chunk,
verification's k + 1 tokens) attend causally over its prefix and themselves, reading the row's blocks
of the KV pool through its block table (consumer/engine/kernels/prefill_attention.cpp). SDPA's CPU
flash kernel, which it replaces on those rows, computes bfloat16 attention with float32 FMAs; the
kernel's VDPBF16PS does two bfloat16 products per float32 lane: 0.38x SDPA's attention time over a
2048-token prefill in 512-token chunks on this host (the real pair's shapes, 2 threads: 1.48 -> 0.57 s
over 30 layers, `python -m bench.micro.prefill_attention`, rows bench/results/prefill_attention.jsonl);
the whole prefill forward went 2.95 -> 1.77 s (by hand). That host had no AMX; on a CPU with AMX-BF16
SDPA's flash kernel multiplies on AMX tiles and beats that path, so there the kernel runs its AMX
variant (`amx_off()`): Q by K and the probabilities by V on AMX tiles, everything transposed so that
the online softmax runs down columns (a vector's 16 lanes are 16 query rows: no horizontal
reductions); `which()` says "kernel amx".

Built like the decode kernel (consumer.engine.paged_attention: cpp_extension into
`.cache/kernels/<name>/`, `make kernel`, loaded before SERVING), but only where it can run: torch's
CPU capability is AVX512 (ATEN_CPU_CAPABILITY lowers it) and the CPU has AVX-512 BF16. Elsewhere,
for float32 / float16 pools, head sizes other than 32, 64, 128 and with SCD_PREFILL_KERNEL=0, the
engine keeps per-row SDPA, and `which()` / the runner say why.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
import torch

from consumer.engine import paged_attention
from shared import compute_dtype
from shared.config import PREFILL_ATTENTION

log = structlog.get_logger(__name__)

SOURCE = Path(__file__).with_name("kernels") / "prefill_attention.cpp"
NAME = "scd_prefill_attention_avx512bf16"
FLAGS = [
    *paged_attention.COMMON,
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512dq",
    "-mavx512bf16",
    "-mfma",
    "-mamx-tile",
    "-mamx-bf16",  # the AMX variant's intrinsics; it runs only where amx_supported() says so
]
MODES = PREFILL_ATTENTION  # auto: the kernel where it runs, kernel: it or fail start, sdpa: per-row SDPA
HEAD_DIMS = (32, 64, 128)
NOT_BUILT = f"sdpa: {NAME} not built"


def cpu_reason() -> str:
    """Why this CPU (as torch sees it) cannot run the kernel, or ""."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "AVX512":
        return f"torch's CPU capability is {capability}, the kernel needs AVX512"
    flags = compute_dtype.cpu_flags()
    if flags is None:
        return "no /proc/cpuinfo to check for AVX-512 BF16"
    return "" if "avx512_bf16" in flags else "the CPU has no AVX-512 BF16"


def amx_reason() -> str:
    """Why `auto` leaves the kernel aside on this CPU, or "": where the CPU has AMX-BF16 and torch may
    use it, SDPA's bfloat16 flash kernel multiplies on AMX tiles and beats the kernel's VDPBF16PS path
    (an Intel Xeon with AMX, 2 threads: 2048 tokens in 512-token chunks, SDPA 709 ms, VDPBF16PS 1417 ms
    over 30 layers), so auto takes the kernel there only with its AMX variant (`amx_off()` empty:
    0.75x SDPA's time on a 2048-token chunk, 0.47x on a 512-token chunk after 1536, bench.micro.prefill_attention)."""
    flags = compute_dtype.cpu_flags() or frozenset()
    lowered = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if "amx_bf16" in flags and (not lowered or "AMX" in lowered or lowered == "ALL"):
        off = amx_off()
        if off:
            return f"auto: the CPU has AMX-BF16, where SDPA's bfloat16 path beats the kernel without AMX ({off})"
    return ""


@functools.cache
def _module() -> tuple[Any | None, str]:
    """(the built extension, "") or (None, "sdpa: why"); built once per process."""
    if os.environ.get("SCD_PREFILL_KERNEL", "1") == "0":
        return None, "sdpa: SCD_PREFILL_KERNEL=0"
    reason = cpu_reason()
    if reason:
        return None, f"sdpa: {reason}"
    try:
        module = paged_attention.build(NAME, SOURCE, FLAGS)
    except Exception as error:  # no compiler, a failed build: the engine keeps per-row SDPA
        log.warning("prefill_attention.unavailable", error=str(error)[-2000:], fallback="per-row SDPA")
        return None, f"{NOT_BUILT} ({paged_attention.cause(error)})"
    if not module.supported():  # the extension's own CPUID check agrees with /proc/cpuinfo, or nothing runs
        return None, "sdpa: the CPU reports no AVX-512 BF16 (cpuid)"
    return module, ""


def amx_off() -> str:
    """Why the kernel's AMX variant is not used here, or "": paged_attention.amx_env_off("SCD_PREFILL_AMX")
    (AMX-BF16 needed, ONEDNN_MAX_CPU_ISA followed), or the kernel may not use the tiles."""
    off = paged_attention.amx_env_off("SCD_PREFILL_AMX")
    if off:
        return off
    module, why = _module()
    if module is not None and not module.amx_supported():
        return "the kernel may not use AMX tiles here (cpuid or arch_prctl refused)"
    return why.removeprefix("sdpa: ")


def variants() -> dict[str, Callable]:
    """The kernel's variants that run on this CPU, by name ("avx512bf16", "amx"): tests check each."""
    module, _ = _module()
    if module is None:
        return {}
    out = {"avx512bf16": module.prefill_attention}
    if not amx_off():
        out["amx"] = module.prefill_attention_amx
    return out


@functools.cache
def _loaded() -> tuple[Callable | None, str]:
    """(the kernel's entry for this CPU, "kernel amx" / "kernel avx512bf16") or (None, "sdpa: why")."""
    module, why = _module()
    if module is None:
        return None, why
    if not amx_off():
        return module.prefill_attention_amx, "kernel amx"
    return module.prefill_attention, "kernel avx512bf16"


def kernel() -> Callable | None:
    """The built extension's `prefill_attention`, or None where it does not run here."""
    return _loaded()[0]


def which() -> str:
    """What prefill rows on the CPU may run here: "kernel avx512bf16", or "sdpa: why"."""
    return _loaded()[1]


def skips(dtype: torch.dtype, head_dim: int) -> str:
    """Why the kernel does not serve a pool of this dtype and head size, or ""."""
    if dtype != torch.bfloat16:
        return f"the kernel is bfloat16-only, the pool is {str(dtype).removeprefix('torch.')}"
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} not one of {HEAD_DIMS}"
    return ""


def resolve(mode: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> tuple[Callable | None, str]:
    """(the kernel for a runner's prefill rows, or None: per-row SDPA; what they run: "kernel
    avx512bf16" or "sdpa: why"). mode "kernel" raises where the kernel cannot serve this pool."""
    if mode not in MODES:
        raise ValueError(f"prefill_attention: {mode!r} is not one of {MODES}")
    if mode == "sdpa":
        return None, "sdpa: prefill_attention='sdpa'"
    reason = f"the kernel runs on the CPU, the pool is on {device}" if device.type != "cpu" else skips(dtype, head_dim)
    if not reason and mode == "auto":
        reason = amx_reason()
    fn = None if reason else kernel()
    if fn is None and not reason:
        reason = which().removeprefix("sdpa: ")
    if fn is None and mode == "kernel":
        raise ValueError(f"prefill_attention='kernel': {reason}")
    return fn, which() if fn is not None else f"sdpa: {reason}"


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, start: int, block_tokens: int
) -> torch.Tensor:
    """q [n, H, hd] (the row's new tokens, at positions start .. start + n - 1) over k / v [n_kv,
    slots, hd] (one layer of the pool, flat slots = block * block_tokens + offset) and the row's
    blocks `table` [blocks] int64, causal -> [n, H, hd] bfloat16. Raises where the kernel does not
    run here, and (ValueError / TypeError from its checks) on a block outside the pool, a table too
    short for start + n keys, a negative start, a dtype other than bfloat16, misshapen tensors."""
    fn = kernel()
    if fn is None:
        raise RuntimeError(f"prefill_attention: the kernel does not run here ({which()})")
    return fn(q.contiguous(), k, v, table, start, block_tokens, q.shape[-1] ** -0.5)
