"""The projections' weights prepacked for oneDNN, for the CPU forward's matrix products.

`F.linear` on the CPU re-lays out the weight on every call; at decode's small row counts that is
most of a projection's time. Packed once at start (`torch.ops.mkldnn._reorder_linear_weight`, the
layout Inductor's frozen CPU graphs use), the same products run 1.4-2.2x faster at 1-32 rows and
no slower at 512 (bench.micro.packed_linear). bfloat16: the same oneDNN kernel, bit for bit
F.linear's; float32: oneDNN instead of MKL's sgemm, within 1e-6 relative (and, unlike sgemm, a
row's result does not depend on how many rows are multiplied with it). The packed copies are a
second copy of the weights in memory (`nbytes`), so the engine's forward takes them and the
codecs' per-layer functions keep the plain ones. Knows nothing about attention or caches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

DTYPES = (torch.float32, torch.bfloat16)


@dataclass
class PackedLayer:
    qkv: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None) -> torch.Tensor:
    """x [T, in] @ weight.T + bias, through the packed weight when there is one."""
    if packed is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def why_not(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why this device and dtype cannot take packed weights, or None when they can."""
    if device.type != "cpu":
        return f"device {device} (packing is for the CPU's oneDNN)"
    if dtype not in DTYPES:
        return f"dtype {dtype}"
    if not torch.backends.mkldnn.is_available():
        return "torch built without oneDNN"
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "this CPU has no oneDNN bfloat16 support"
    return None


class Packed:
    """Every layer's qkv, o, gate_up and down and the LM head, packed (see the module doc)."""

    def __init__(self, layers: list[PackedLayer], lm_head: torch.Tensor, nbytes: int):
        self.layers, self.lm_head, self.nbytes = layers, lm_head, nbytes

    @classmethod
    def of(cls, model) -> Packed | None:
        """The packed weights of a shared.model.Model, built once per model (memoised on it), or
        None where packing does not apply or its probe disagrees with F.linear (`off_reason` says
        why)."""
        return cls._memo(model)[0]

    @classmethod
    def off_reason(cls, model) -> str | None:
        """Why `of(model)` is None, or None when it is not."""
        return cls._memo(model)[1]

    @classmethod
    def _memo(cls, model) -> tuple[Packed | None, str | None]:
        if "_packed" in model.__dict__:
            return model.__dict__["_packed"]
        reason = why_not(model.device, model.dtype)
        packed = None
        if reason is None:
            try:
                packed = cls._build(model)
                reason = _probe(model, packed)
            except RuntimeError as error:  # oneDNN refused the layout or the product (an ISA limit)
                reason = f"oneDNN: {str(error)[:300]}"
            if reason is not None:
                packed = None
        model.__dict__["_packed"] = (packed, reason)
        return packed, reason

    @classmethod
    def _build(cls, model) -> Packed:
        with torch.inference_mode():
            layers = [PackedLayer(_pack(w.qkv), _pack(w.o), _pack(w.gate_up), _pack(w.down)) for w in model.layers]
            lm_head = _pack(model.lm_head)
        nbytes = sum(w.qkv.nbytes + w.o.nbytes + w.gate_up.nbytes + w.down.nbytes for w in model.layers) + model.lm_head.nbytes
        return cls(layers, lm_head, nbytes)


def _probe(model, packed: Packed) -> str | None:
    """None when layer 0's packed qkv product agrees with F.linear's on a seeded input (bit for bit
    in bfloat16, 1e-5 relative in float32), else what differs."""
    w = model.layers[0]
    g = torch.Generator(device="cpu").manual_seed(0)
    with torch.inference_mode():
        x = torch.randn(5, w.qkv.shape[1], generator=g).to(model.dtype)
        want = F.linear(x, w.qkv, w.qkv_bias)
        got = project(x, w.qkv, w.qkv_bias, packed.layers[0].qkv)
    err = (got.float() - want.float()).abs().max().item()
    limit = 0.0 if model.dtype == torch.bfloat16 else 1e-5 * max(want.abs().max().item(), 1.0)
    return None if err <= limit else f"probe: packed qkv differs from F.linear by {err:.3g} (limit {limit:.3g})"
