"""Paged decode attention on the CPU: the engine's decode rows (one new token each) attend over their
own blocks of the KV pool in one call per layer, all rows and KV heads together, reading the keys
where they lie (consumer/engine/kernels/decode_attention.cpp). Per-row SDPA, which it replaces on
decode rows, costs ~85 us of fixed work per call: at batch 32 that is most of a decode step.

The kernel is C++ built on first use by torch.utils.cpp_extension into `.cache/kernels/` (g++ and
ninja; `make install` builds it ahead so no request waits), once per instruction set: AVX2 + FMA
where the CPU has them (`torch.backends.cpu.get_cpu_capability()`, which honours
ATEN_CPU_CAPABILITY), portable code otherwise. Where it cannot be built or loaded (no compiler, a
GPU pool) `kernel()` returns None and the engine keeps per-row SDPA: slower, same answers within
float tolerance (tests/test_paged_attention.py checks the kernel against SDPA).
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import structlog
import torch

log = structlog.get_logger(__name__)

SOURCE = Path(__file__).with_name("kernels") / "decode_attention.cpp"
BUILD = Path(__file__).resolve().parents[2] / ".cache" / "kernels"
# OpenMP: at::parallel_for runs its threads only when built with it; the simd pragmas and no errno
# let the compiler vectorize the dot products and exp
COMMON = ["-O3", "-fopenmp", "-fno-math-errno"]
MODES = ("auto", "kernel", "sdpa")  # the engine's decode attention: the kernel where it loads, or per-row SDPA


def _flags() -> tuple[str, list[str]]:
    """The extension's name and compiler flags for this CPU's instruction set."""
    capability = torch.backends.cpu.get_cpu_capability()  # "AVX512", "AVX2", "DEFAULT", ...
    if capability == "AVX512":
        return "scd_decode_attention_avx512", [
            *COMMON,
            "-mavx512f",
            "-mavx512bw",
            "-mavx512vl",
            "-mfma",
            "-mprefer-vector-width=512",
        ]
    if capability == "AVX2":
        return "scd_decode_attention_avx2", [*COMMON, "-mavx2", "-mfma", "-mf16c"]
    return "scd_decode_attention_base", COMMON


@functools.cache
def kernel():
    """The built extension's `decode_attention`, or None where it cannot be built (logged once)."""
    if os.environ.get("SCD_DECODE_KERNEL", "1") == "0":
        return None
    name, flags = _flags()
    try:
        from torch.utils import cpp_extension

        BUILD.mkdir(parents=True, exist_ok=True)
        module = cpp_extension.load(
            name=name, sources=[str(SOURCE)], extra_cflags=flags, build_directory=str(BUILD), verbose=False
        )
    except Exception as error:  # no compiler, no ninja, a failed build: the engine keeps per-row SDPA
        log.warning("decode_attention.unavailable", error=str(error)[:500], fallback="per-row SDPA")
        return None
    return module.decode_attention


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor, block_tokens: int
) -> torch.Tensor:
    """q [B, H, hd] (one new token per row) over k / v [n_kv, slots, hd] (one layer of the pool, flat
    slots = block * block_tokens + offset), rows' blocks `tables` [B, max_blocks] int64 and key
    counts `lengths` [B] int64 -> [B, H, hd] in q's dtype. Raises where the kernel is not built."""
    fn = kernel()
    if fn is None:
        raise RuntimeError("decode_attention: the kernel is not built (see the log)")
    return fn(q.contiguous(), k, v, tables, lengths, block_tokens, q.shape[-1] ** -0.5)


if __name__ == "__main__":  # `python -m consumer.engine.paged_attention`: build it now (make install)
    built = kernel()
    print(f"decode attention kernel: {'built' if built is not None else 'NOT built (per-row SDPA)'} ({_flags()[0]})")
    sys.exit(0)
