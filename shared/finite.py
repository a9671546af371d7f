"""Whole-tensor value checks in one read each: finiteness by a plain sum (the exact product with
zeros only where a sum is not finite), and each tensor's largest |value| (`peaks`).

`x * 0` is 0 for every finite x and NaN for an infinity or a NaN, and a sum of zeros is 0. So a dot
product (or a matrix-vector product, per row) with a zero vector is NaN exactly when an element
is not finite. Nothing can overflow: every term is 0. On this CPU that is one BLAS pass, about 15x
faster than `torch.isfinite(x).all()`, which builds a bool tensor the size of x element by element.
bench.micro.engine_step times both on a decode step's logits; its rows are in docs/results.md. The
cost grows with the vocabulary.

Half-precision tensors are widened to float32 first: BLAS has no fast half kernel on CPU.
`finite_each` tries a plain sum per tensor first and takes the product only where a sum is not
finite (a bad value or an overflow). `peaks` is one min/max pass per tensor (NaN propagates), so
a finite but absurd value is seen as what it is, not only when it overflows something. Used by
the engine on each step's logits (`rows_finite`), by the quant codec on its scales
(`finite_each`) and by the codecs on every rebuilt layer (`peaks`, against shared.kv_bound's
limits). Knows nothing else.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

_WIDE = (torch.float32, torch.float64)


def _wide(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype in _WIDE else x.float()


def rows_finite(x: torch.Tensor) -> torch.Tensor:
    """[B, N] floating -> [B] bool: whether row b holds only finite values."""
    x = _wide(x)
    return torch.isfinite(torch.mv(x, x.new_zeros(x.shape[1])))


def _exact(x: torch.Tensor) -> bool:
    flat = _wide(x).reshape(-1)
    return bool(torch.isfinite(torch.dot(flat, flat.new_zeros(flat.numel()))))


def finite_each(tensors: Sequence[torch.Tensor]) -> list[bool]:
    """Per tensor, whether every element is finite (non-floating tensors always are); one host
    sync for all of them when they are.

    First one plain sum per tensor (one read, nothing allocated; float16 summed in float32): a sum
    is finite only if every element is, so a finite sum settles it. A sum that is not finite is
    either a bad element or finite values overflowing the dtype's range; only those tensors take
    the exact product with zeros. The product allocates a zero vector the tensor's size; one
    request's rebuilt K/V checks 2-4x faster by sums (bench.micro.engine_step's kv_check rows)."""
    floating = [i for i, t in enumerate(tensors) if t.is_floating_point()]
    flags = [True] * len(tensors)
    if floating:
        sums = torch.stack([_sum(tensors[i]) for i in floating])
        for i, ok in zip(floating, torch.isfinite(sums).tolist()):
            flags[i] = ok or _exact(tensors[i])
    return flags


def _sum(x: torch.Tensor) -> torch.Tensor:
    return x.sum(dtype=torch.float32) if x.dtype == torch.float16 else x.sum().float()


def all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every element of every tensor is finite (non-floating tensors always are)."""
    return all(finite_each(tensors))


def peaks(tensors: Sequence[torch.Tensor]) -> list[float]:
    """Per tensor, its largest |element| (0.0 when empty): NaN when it holds a NaN, inf when an
    infinity; one host sync for all. One `aminmax` pass per tensor, nothing tensor-sized
    allocated (|x| would be); `peak <= limit` is then False for NaN as for any value past the
    limit, and a caller that allows no limit (inf) checks `math.isfinite(peak)` too."""
    out = [0.0] * len(tensors)
    full = [i for i, t in enumerate(tensors) if t.numel()]
    if full:
        wide = torch.float64 if any(tensors[i].dtype == torch.float64 for i in full) else torch.float32  # exact
        ends = torch.stack([torch.stack(torch.aminmax(tensors[i])).to(wide) for i in full]).tolist()  # [n, 2]
        for i, (low, high) in zip(full, ends):
            out[i] = math.nan if math.isnan(low) or math.isnan(high) else max(-low, high)
    return out
