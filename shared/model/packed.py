"""The projections' weights prepacked for oneDNN, for the CPU forward's matrix products.

`F.linear` on the CPU re-lays out the weight on every call; at decode's small row counts that is
most of a projection's time. Packed once at start (`torch.ops.mkldnn._reorder_linear_weight`, the
layout Inductor's frozen CPU graphs use), the same products run 1.4-2.2x faster at 1-32 rows and
no slower at 512 (measured by hand: 3072 x 576 bf16, 2 threads; the engine-step rows show the
effect on whole steps). Projections under MIN_ELEMENTS stay plain: on tiny models oneDNN's per-call
work costs more than it saves. bfloat16: the same oneDNN kernel, bit for bit
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
# weights with fewer elements stay plain: oneDNN's per-call work outweighs the re-layout it saves
# (the 2-layer QA pair, hidden 128: a float32 batch-1 step 0.87 -> 1.21 ms packed; the real pair's
# smallest projection, 576 x 576 = 332k, gains)
MIN_ELEMENTS = 1 << 18


@dataclass
class PackedLayer:  # None: that projection stays plain (below MIN_ELEMENTS)
    qkv: torch.Tensor | None
    o: torch.Tensor | None
    gate_up: torch.Tensor | None
    down: torch.Tensor | None


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None) -> torch.Tensor:
    """x [T, in] @ weight.T + bias, through the packed weight when there is one."""
    if packed is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _pack(weight: torch.Tensor) -> torch.Tensor | None:
    return torch.ops.mkldnn._reorder_linear_weight(weight, None) if weight.numel() >= MIN_ELEMENTS else None


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

    def __init__(self, layers: list[PackedLayer], lm_head: torch.Tensor | None, nbytes: int):
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
                reason = _probe(model, packed) if packed.nbytes else f"every projection has fewer than {MIN_ELEMENTS} elements"
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
        plain = [w for layer in model.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [model.lm_head]
        nbytes = sum(w.nbytes for w in plain if w.numel() >= MIN_ELEMENTS)
        return cls(layers, lm_head, nbytes)


def _probe(model, packed: Packed) -> str | None:
    """None when the largest packed product of layer 0 (gate_up, else qkv) agrees with F.linear's on a
    seeded input (bit for bit in bfloat16, 1e-5 relative in float32), else what differs."""
    w, p = model.layers[0], packed.layers[0]
    weight, bias, fast = (w.gate_up, w.gate_up_bias, p.gate_up) if p.gate_up is not None else (w.qkv, w.qkv_bias, p.qkv)
    if fast is None:
        return None  # layer 0 has nothing packed (the LM head may be): nothing to probe here
    g = torch.Generator(device="cpu").manual_seed(0)
    with torch.inference_mode():
        x = torch.randn(5, weight.shape[1], generator=g).to(model.dtype)
        want = F.linear(x, weight, bias)
        got = project(x, weight, bias, fast)
    err = (got.float() - want.float()).abs().max().item()
    limit = 0.0 if model.dtype == torch.bfloat16 else 1e-5 * max(want.abs().max().item(), 1.0)
    return None if err <= limit else f"probe: a packed product differs from F.linear by {err:.3g} (limit {limit:.3g})"
