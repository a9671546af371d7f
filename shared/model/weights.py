"""The forward's weights, per layer, with fused projections: [q | k | v] in one matrix and
[gate | up] in another, taken from a loaded Hugging Face model.

With `share` (the default) the fused tensors are the only copy: the Hugging Face module's
q/k/v and gate/up parameters are re-pointed at views of them (same values, same digests), so the
reference modules and this forward hold one set of weights between them. Biases (Qwen2's q/k/v,
any o_proj or MLP bias) and q/k norms (Qwen3) are whatever the checkpoint has. Knows nothing
about attention or caches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [d]
    qkv: torch.Tensor  # [q_size + 2 * kv_size, d]
    qkv_bias: torch.Tensor | None  # [q_size + 2 * kv_size] (Qwen2)
    q_norm: torch.Tensor | None  # [hd] (Qwen3)
    k_norm: torch.Tensor | None  # [hd]
    o: torch.Tensor  # [d, q_size]
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor  # [d]
    gate_up: torch.Tensor  # [2 * intermediate, d]
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor  # [d, intermediate]
    down_bias: torch.Tensor | None


def _bias(linear) -> torch.Tensor | None:
    return None if linear.bias is None else linear.bias.detach()


def _fuse(linears: list[Any], share: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for several nn.Linear over the same input; with `share`, each
    Linear's parameters become views of the fused tensors (no second copy)."""
    weight = torch.cat([m.weight.detach() for m in linears])
    biases = [m.bias for m in linears]
    if any(b is not None for b in biases) and not all(b is not None for b in biases):
        raise ValueError("q/k/v or gate/up projections: some have a bias and some do not")
    bias = torch.cat([b.detach() for b in biases]) if biases[0] is not None else None
    if share:
        start = 0
        for m in linears:
            rows = m.weight.shape[0]
            m.weight.data = weight[start : start + rows]
            if bias is not None:
                m.bias.data = bias[start : start + rows]
            start += rows
    return weight, bias


def layer_weights(layer: Any, share: bool = True) -> LayerWeights:
    """A Hugging Face decoder layer's weights in our layout."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv, qkv_bias = _fuse([attn.q_proj, attn.k_proj, attn.v_proj], share)
    gate_up, gate_up_bias = _fuse([mlp.gate_proj, mlp.up_proj], share)
    q_norm = getattr(attn, "q_norm", None)
    k_norm = getattr(attn, "k_norm", None)
    return LayerWeights(
        input_norm=layer.input_layernorm.weight.detach(),
        qkv=qkv,
        qkv_bias=qkv_bias,
        q_norm=None if q_norm is None else q_norm.weight.detach(),
        k_norm=None if k_norm is None else k_norm.weight.detach(),
        o=attn.o_proj.weight.detach(),
        o_bias=_bias(attn.o_proj),
        post_norm=layer.post_attention_layernorm.weight.detach(),
        gate_up=gate_up,
        gate_up_bias=gate_up_bias,
        down=mlp.down_proj.weight.detach(),
        down_bias=_bias(mlp.down_proj),
    )
