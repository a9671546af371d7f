"""Paged decode attention on the CPU: the engine's decode rows (one new token each) attend over their
own blocks of the KV pool in one call per layer, all rows and KV heads together, reading the keys
where they lie (consumer/engine/kernels/decode_attention.cpp). Per-row SDPA, which it replaces on
decode rows, costs ~85 us of fixed work per call: at batch 32 that is most of a decode step.

The kernel is C++ built by torch.utils.cpp_extension (a C++ compiler and ninja: the `ninja` wheel
in the venv is found even when the venv's bin is not on PATH) into `.cache/kernels/<name>/`
(SCD_KERNEL_DIR moves it), one folder per instruction set: AVX-512 or AVX2 + FMA where the CPU has
them (`torch.backends.cpu.get_cpu_capability()`, which honours ATEN_CPU_CAPABILITY), portable code
otherwise. `make install` and `make test` build it ahead (`python -m consumer.engine.build_kernels`),
and the consumer loads it before it reports SERVING, so no request waits for a compile. Processes
building at once take turns (an OS file lock, released if a builder dies; cpp_extension's own lock
file, which a killed builder leaves behind, is cleared under it). Where it cannot be built or
loaded (no compiler, SCD_DECODE_KERNEL=0) `kernel()` returns None, `which()` says why, and the
engine keeps per-row SDPA: slower, same answers within float tolerance (tests/test_paged_attention.py
holds the kernel to float32 SDPA).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
import torch

from shared import compute_dtype
from shared.config import DECODE_ATTENTION

log = structlog.get_logger(__name__)

SOURCE = Path(__file__).with_name("kernels") / "decode_attention.cpp"
HEADER = SOURCE.with_name("vec_math.h")  # included by both kernels
CACHE = Path(__file__).resolve().parents[2] / ".cache" / "kernels"
# OpenMP: at::parallel_for runs its threads only when built with it; the simd pragmas and no errno
# let the compiler vectorize the dot products and exp
COMMON: list[str] = ["-O3", "-fopenmp", "-fno-math-errno"]
MODES = DECODE_ATTENTION  # the engine's decode attention: the kernel where it loads (auto), it or fail, per-row SDPA


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


def compiler() -> str | None:
    """The C++ compiler cpp_extension would run ($CXX, else c++), or None where there is none."""
    return shutil.which(os.environ.get("CXX", "c++"))


def build_dir(name: str) -> Path:
    """Where extension `name` is built: its own folder (a build.ninja and object per instruction set,
    so the AVX2 and AVX-512 builds never overwrite each other's)."""
    return Path(os.environ.get("SCD_KERNEL_DIR") or CACHE) / name


def _ninja_on_path() -> None:
    """cpp_extension runs `ninja --version` from PATH: where none is there, the `ninja` wheel's
    script beside this interpreter (the venv's bin, not on PATH when the venv is not activated)."""
    if shutil.which("ninja") is None:
        os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")


def build(name: str, source: Path, flags: list[str]) -> Any:
    """Extension `name` from `source` with `flags`, built into its own folder (or loaded where built).
    cpp_extension rebuilds when a source or a flag changes, not a header: the shared header's digest
    rides in the flags."""
    from torch.utils import cpp_extension

    flags = [*flags, f"-DSCD_HEADER_DIGEST={hashlib.sha256(HEADER.read_bytes()).hexdigest()[:16]}"]

    _ninja_on_path()
    folder = build_dir(name)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "build.flock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # one builder at a time; the OS releases it if the holder dies
        # cpp_extension's own baton (O_EXCL file, waited on forever): under our lock, one found is a
        # leftover of a builder that was killed mid-build
        (folder / "lock").unlink(missing_ok=True)
        return cpp_extension.load(
            name=name, sources=[str(source)], extra_cflags=flags, build_directory=str(folder), verbose=False
        )


def cause(error: Exception) -> str:
    """The line of a failed build that says why (the compiler's first error, a missing tool), not
    the command lines or ninja's closing "build stopped"."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    for line in lines:
        if ("error" in line.lower() or "not found" in line) and not line.startswith("Error building extension"):
            return line[:200]
    return (lines[-1] if lines else type(error).__name__)[:200]


@functools.cache
def _module() -> tuple[Any | None, str]:
    """(the built extension, its name) or (None, "sdpa: why"); built once per process."""
    if os.environ.get("SCD_DECODE_KERNEL", "1") == "0":
        return None, "sdpa: SCD_DECODE_KERNEL=0"
    name, flags = _flags()
    try:
        return build(name, SOURCE, flags), name
    except Exception as error:  # no compiler, no ninja, a failed build: the engine keeps per-row SDPA
        log.warning("decode_attention.unavailable", error=str(error)[-2000:], fallback="per-row SDPA")
        return None, f"sdpa: {name} not built ({cause(error)})"


def amx_env_off(switch: str) -> str:
    """Why a kernel's AMX path is off by the environment or the CPU, or "": `switch`=0 turns it off, the
    CPU must have AMX-BF16, and ONEDNN_MAX_CPU_ISA lowered below AMX (as oneDNN follows it) turns it off.
    Shared by the decode and the prefill kernels."""
    if os.environ.get(switch, "1") == "0":
        return f"{switch}=0"
    flags = compute_dtype.cpu_flags() or frozenset()
    if "amx_bf16" not in flags:
        return "the CPU has no AMX-BF16"
    lowered = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if lowered and "AMX" not in lowered and lowered != "ALL":
        return f"ONEDNN_MAX_CPU_ISA={lowered}"
    return ""


def amx_off() -> str:
    """Why the AVX-512 build's AMX items (bfloat16 rows on AMX-BF16 tiles: block_tokens a multiple of
    16, head_dim 32 or 64) are not used here, or "": amx_env_off("SCD_DECODE_AMX"), or the kernel may
    not use the tiles (cpuid, arch_prctl)."""
    off = amx_env_off("SCD_DECODE_AMX")
    if off:
        return off
    module, name = _module()
    if module is None:
        return name.removeprefix("sdpa: ")
    if not hasattr(module, "amx_supported") or not module.amx_supported():
        return f"{name} cannot use AMX tiles here"
    return ""


def variants() -> dict[str, Callable]:
    """The kernel's entries that run here, by name ("plain", and "amx" where the AMX items may run)."""
    module, _ = _module()
    if module is None:
        return {}
    out = {"plain": module.decode_attention}
    if not amx_off():
        out["amx"] = module.decode_attention_amx
    return out


@functools.cache
def _loaded() -> tuple[Callable | None, str]:
    """(the extension's entry, "kernel avx512" / "kernel avx512 amx" / ...) or (None, "sdpa: why")."""
    module, name = _module()
    if module is None:
        return None, name
    if not amx_off():
        return module.decode_attention_amx, f"kernel {name.rsplit('_', 1)[-1]} amx"
    return module.decode_attention, f"kernel {name.rsplit('_', 1)[-1]}"


# the AVX-512 and AVX2 builds' vectorized paths serve these (others: the portable per-key loop)
VECTOR_HEAD_DIMS = (32, 64, 128)
VECTOR_MAX_GROUPS = 4


def vectorized(head_dim: int, groups: int) -> bool:
    """Whether the AVX-512 and AVX2 builds run their vectorized path for this head size and GQA group
    (query heads per KV head): float32, bfloat16 and float16, head_dim 32 / 64 / 128, groups 1-4."""
    return head_dim in VECTOR_HEAD_DIMS and 1 <= groups <= VECTOR_MAX_GROUPS


def build_failed() -> bool:
    """A C++ compiler is here and the kernel was not turned off, yet it did not build (no compiler
    is not a failure: per-row SDPA is that machine's path)."""
    return kernel() is None and compiler() is not None and os.environ.get("SCD_DECODE_KERNEL") != "0"


def kernel() -> Callable | None:
    """The built extension's `decode_attention`, or None where it cannot be built (logged once)."""
    return _loaded()[0]


def which() -> str:
    """What decode rows on the CPU run here: "kernel avx512" (" amx" where its AMX items run) / "kernel avx2" / "kernel base", or
    "sdpa: why" (builds the kernel if not yet built)."""
    return _loaded()[1]


def runs(runner: object) -> str:
    """What a runner runs for its decode rows: `which()` when it holds the kernel, else "sdpa: why"
    (consumer.engine.pool_forward.PoolRunner resolves its `decode_attention` mode at construction)."""
    if getattr(runner, "decode_kernel", None) is not None:
        return which()
    pool = getattr(runner, "pool", None)
    if not hasattr(runner, "decode_kernel"):
        return f"sdpa: {type(runner).__name__} has no paged kernel"
    if pool is not None and pool.device.type != "cpu":
        return f"sdpa: the kernel runs on the CPU, the pool is on {pool.device}"
    skip = getattr(runner, "decode_skip", "")
    if skip:  # auto chose per-row SDPA; say whether the kernel is there
        return f"sdpa: {skip}; {which()}{' built' if kernel() is not None else ''}"
    return which() if kernel() is None else "sdpa: decode_attention='sdpa'"


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor, block_tokens: int
) -> torch.Tensor:
    """q [B, H, hd] (one new token per row) over k / v [n_kv, slots, hd] (one layer of the pool, flat
    slots = block * block_tokens + offset), rows' blocks `tables` [B, max_blocks] int64 and key
    counts `lengths` [B] int64 -> [B, H, hd] in q's dtype. Raises where the kernel is not built,
    and (ValueError from the kernel's checks) on a block outside the pool, a length outside its
    table or below 1, mixed dtypes, non-CPU or misshapen tensors."""
    fn = kernel()
    if fn is None:
        raise RuntimeError(f"decode_attention: the kernel is not built ({which()})")
    return fn(q.contiguous(), k, v, tables, lengths, block_tokens, q.shape[-1] ** -0.5)


if __name__ == "__main__":  # `python -m consumer.engine.paged_attention`: build this kernel now
    print(f"decode attention: {which()} ({build_dir(_flags()[0])})")
    sys.exit(1 if build_failed() else 0)
