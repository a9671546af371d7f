"""The engine forward's elementwise steps fused into one pass each on the CPU: RMSNorm, the residual
add with the next RMSNorm, SiLU(gate) * up and RoPE (consumer/engine/kernels/fused_ops.cpp, AVX-512
or AVX2 + FMA). Eager torch runs each as several kernels (a bfloat16 RMSNorm: a cast, the norm's five,
a cast, a multiply), each with its own dispatch; at a decode step's 32 rows that dispatch is most of
their cost, at a 512-token chunk the extra passes over memory are. Same roundings as transformers'
eager modules (bfloat16 results rounded per op); the reductions' order differs, so a bfloat16 value
may differ by one unit in the last place: the tests hold the engine to the reference by tolerance and
greedy margins, as they do for every kernel.

Built like the attention kernels (consumer.engine.paged_attention.build, `make kernel`) for torch's
CPU capability: AVX512 (with AVX-512 BF16 where the CPU has it: bfloat16 rounding in one
instruction, "fused avx512 bf16") or AVX2 (8 lanes, "fused avx2": AMD and Intel CPUs without AVX-512,
and ATEN_CPU_CAPABILITY=avx2); elsewhere, for other dtypes or devices and with SCD_FUSED_OPS=0, the
forward runs shared.model's eager ops, and `which()` says why. Knows nothing about layers or caches.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import structlog
import torch

from consumer.engine import paged_attention
from shared import compute_dtype
from shared.model.model import EAGER, Ops

log = structlog.get_logger(__name__)

SOURCE = Path(__file__).with_name("kernels") / "fused_ops.cpp"
NAME = "scd_fused_ops_avx512"
FLAGS = [*paged_attention.COMMON, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"]
# CPUs without AVX-512 (torch's capability AVX2): 8 lanes, the same steps and roundings
NAME_AVX2, FLAGS_AVX2 = "scd_fused_ops_avx2", [*paged_attention.COMMON, "-mavx2", "-mfma", "-mf16c"]
# CPUs with AVX-512 BF16: a build of its own that rounds to bfloat16 with the conversion instruction
# (same results, 0.7-0.75x the time of each step at a 2k-token chunk)
NAME_BF16, FLAGS_BF16 = f"{NAME}bf16", [*FLAGS, "-mavx512bf16"]
DTYPES = (torch.float32, torch.bfloat16)
NOT_BUILT = "eager: the fused ops' extension not built"


class Fused(Ops):
    """shared.model's Ops through the extension (float32 and bfloat16 CPU tensors). A norm whose
    weight is not in the activations' dtype (a checkpoint that keeps its norms in float32) runs the
    eager op, whose type promotion the extension does not reproduce."""

    def __init__(self, module: Any):
        self.module = module

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if weight.dtype != x.dtype:
            return EAGER.rms_norm(x, weight, eps)
        return self.module.rms_norm(x.contiguous(), weight, eps)

    def add_rms_norm(
        self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if weight.dtype != h.dtype:
            return EAGER.add_rms_norm(h, delta, weight, eps)
        total, normed = self.module.add_rms_norm(h.contiguous(), delta.contiguous(), weight, eps)
        return total, normed

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.module.silu_mul(gate_up.contiguous())

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self.module.rope(x, cos.contiguous(), sin.contiguous())


@functools.cache
def _loaded() -> tuple[Fused | None, str]:
    if os.environ.get("SCD_FUSED_OPS", "1") == "0":
        return None, "eager: SCD_FUSED_OPS=0"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "AVX512":
        bf16 = "avx512_bf16" in (compute_dtype.cpu_flags() or frozenset())
        name, flags, runs = (NAME_BF16, FLAGS_BF16, "fused avx512 bf16") if bf16 else (NAME, FLAGS, "fused avx512")
    elif capability == "AVX2":
        name, flags, runs = NAME_AVX2, FLAGS_AVX2, "fused avx2"
    else:
        return None, f"eager: torch's CPU capability is {capability}, the fused ops need AVX512 or AVX2"
    try:
        module = paged_attention.build(name, SOURCE, flags)
    except Exception as error:  # no compiler, a failed build: the forward keeps the eager ops
        log.warning("fused_ops.unavailable", error=str(error)[-2000:], fallback="eager ops")
        return None, f"{NOT_BUILT} ({name}: {paged_attention.cause(error)})"
    return Fused(module), runs


def which() -> str:
    """What the forward's elementwise steps run here: "fused avx512 bf16", "fused avx512", "fused avx2" or "eager: why"
    (builds it if not built)."""
    return _loaded()[1]


def resolve(enabled: bool, device: torch.device, dtype: torch.dtype) -> tuple[Ops, str]:
    """(the ops for a runner's forward, what they are: "fused avx512[ bf16]", "fused avx2" or "eager: why")."""
    if not enabled:
        return EAGER, "eager: --fused-ops false"
    if device.type != "cpu":
        return EAGER, f"eager: the fused ops run on the CPU, the pool is on {device}"
    if dtype not in DTYPES:
        return EAGER, f"eager: the fused ops take float32 and bfloat16, the model is {str(dtype).removeprefix('torch.')}"
    fused, runs = _loaded()
    return (fused, runs) if fused is not None else (EAGER, runs)
