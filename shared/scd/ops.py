"""Per-layer SCD encode (producer) and decode (consumer) for every schedule action.

The one implementation of the reconstruction math: the scd codec calls it in the services, and
the schedule search calls it to measure loss, so calibrated losses describe what is served.

Tensors of layer l in the artifact (d = hidden, D = 2·n_kv·head_dim):
  mu_x [w·d] mean of the producer features: P's windowed normalized input (features.windowed;
            w = 1: the input itself), or the layer's learned predictor output (d wide) where
            the artifact has `layer.<l>.predictor.*` tensors (shared.scd.predictor)
  encoder [w·d, D]  producer features -> coefficients in `basis`
  mu_y [D]  mean of C's pre-RoPE [k | v]       basis [D, D]    orthonormal PCA basis of y^C, by variance
  patch [w·d, d], mu_c [d]: x̂ = (features - mu_x) patch + mu_c predicts C's normalized input
                         (absent for P == C and for predictor layers: x̂ = the features)
"""

from __future__ import annotations

import torch

from shared import layers, quantize
from shared.codecs.base import PayloadSpec, Schema
from shared.codecs.quant import decode_quant, quant_layout, quant_schema
from shared.codecs.raw import KV_LAYOUT, kv_payloads
from shared.kv import LayerState
from shared.models import LoadedModel
from shared.scd.artifact import Artifact
from shared.scd.features import producer_features
from shared.scd.schedule import Action


def int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row: x [T, n] -> codes int8 [T, n], scale fp16 [T]."""
    scale = (x.abs().amax(dim=1) / 127.0).clamp_min(1e-8).to(torch.float16)
    codes = torch.round(x / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return codes, scale


def from_int8_rows(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.float() * scale.float()[:, None]


@torch.inference_mode()
def encode_layer(art: Artifact, layer: int, action: Action, state: LayerState, group_size: int = 32) -> dict[str, torch.Tensor]:
    """Producer side: payloads for one layer from its LayerState (needs normed, or keys/values)."""
    if action.kind == "raw":
        return kv_payloads(state)
    if action.kind == "quant":
        return quantize.encode_kv(*state.kv(), action.param, group_size)
    assert state.normed is not None  # the encoder asked for Capture.NORMED
    features = producer_features(state.normed.float(), art.window, art.predictor(layer))  # [T, w·d]
    x = features - art.tensor(layer, "mu_x")
    if action.kind in ("reuse", "reuse_fp16"):
        z = x @ art.tensor(layer, "encoder")[:, : action.param]  # [T, r]
        if action.kind == "reuse_fp16":
            return {"z": z.to(torch.float16)}
        codes, scale = int8_rows(z)
        return {"z": codes, "z_scale": scale}
    if action.kind == "patch":
        if f"layer.{layer}.patch" in art.tensors:
            predicted = x @ art.tensor(layer, "patch") + art.tensor(layer, "mu_c")  # [T, d]
        else:  # P == C, or a learned predictor: the features are x̂
            predicted = features
        if action.param == 8:
            codes, scale = int8_rows(predicted)
            return {"x": codes, "x_scale": scale}
        return {"x": predicted.to(torch.float16)}
    raise ValueError(action)


@torch.inference_mode()
def decode_layer(
    art: Artifact,
    layer: int,
    action: Action,
    payloads: dict[str, torch.Tensor],
    consumer: LoadedModel,
    pos: torch.Tensor,
    group_size: int = 32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Consumer side: post-RoPE (keys, values), [n_kv, T, hd] each, in the consumer's dtype."""
    device, dtype = consumer.device, consumer.dtype
    info = consumer.info
    if action.kind == "raw":
        return payloads["k"].to(device, dtype), payloads["v"].to(device, dtype)
    if action.kind == "quant":
        shape = (info.num_kv_heads, pos.shape[1], info.head_dim)
        keys, values = decode_quant(layer, payloads, shape, action.param, group_size, device)
        return keys.to(device, dtype), values.to(device, dtype)
    if action.kind == "patch":
        x = from_int8_rows(payloads["x"], payloads["x_scale"]) if action.param == 8 else payloads["x"]
        return layers.kv_from_normed(consumer, layer, x.to(device, dtype), pos)
    if action.kind in ("reuse", "reuse_fp16"):
        z = payloads["z"].float() if action.kind == "reuse_fp16" else from_int8_rows(payloads["z"], payloads["z_scale"])
        z = z.to(device)  # [T, r]
        basis = art.tensor(layer, "basis").to(device)[:, : action.param]  # [D, r]
        y = z @ basis.T + art.tensor(layer, "mu_y").to(device)  # [T, D] = [k_pre | v]
        T, half = y.shape[0], y.shape[1] // 2
        keys = y[:, :half].reshape(T, info.num_kv_heads, info.head_dim).transpose(0, 1).to(dtype)
        values = y[:, half:].reshape(T, info.num_kv_heads, info.head_dim).transpose(0, 1).to(dtype)
        return layers.rope(consumer, layer, keys, pos), values
    raise ValueError(action)


def per_token(action: Action) -> bool:
    """Whether a layer's K/V decode token by token from its payloads (Reuse codes, a Patch's
    normalized input): payloads of several requests joined along tokens decode as one."""
    return action.kind in ("reuse", "reuse_fp16", "patch")


def layer_schema(action: Action, consumer: LoadedModel, num_tokens: int, kv_dtype: torch.dtype, group_size: int = 32) -> Schema:
    """Exactly the payloads `encode_layer` sends for one layer under `action`."""
    info = consumer.info
    kv_shape = (info.num_kv_heads, num_tokens, info.head_dim)
    if action.kind == "raw":
        return {"k": PayloadSpec(kv_dtype, kv_shape), "v": PayloadSpec(kv_dtype, kv_shape)}
    if action.kind == "quant":
        return quant_schema(kv_shape, action.param, group_size)
    if action.kind == "reuse":
        return {"z": PayloadSpec(torch.int8, (num_tokens, action.param)), "z_scale": PayloadSpec(torch.float16, (num_tokens,))}
    if action.kind == "reuse_fp16":
        return {"z": PayloadSpec(torch.float16, (num_tokens, action.param))}
    if action.kind == "patch" and action.param == 8:
        return {
            "x": PayloadSpec(torch.int8, (num_tokens, info.hidden_size)),
            "x_scale": PayloadSpec(torch.float16, (num_tokens,)),
        }
    if action.kind == "patch":
        return {"x": PayloadSpec(torch.float16, (num_tokens, info.hidden_size))}
    raise ValueError(action)


def token_layout(action: Action, group_size: int = 32) -> dict[str, tuple[int, int]]:
    """The token axis (and tokens per element) of every payload `encode_layer` sends under
    `action` (codecs.base.LayerEncoder.token_layout)."""
    if action.kind == "raw":
        return dict(KV_LAYOUT)
    if action.kind == "quant":
        return quant_layout(group_size)
    if action.kind == "reuse":
        return {"z": (0, 1), "z_scale": (0, 1)}  # [T, r], [T]
    if action.kind == "reuse_fp16":
        return {"z": (0, 1)}
    if action.kind == "patch":
        return {"x": (0, 1), "x_scale": (0, 1)} if action.param == 8 else {"x": (0, 1)}  # [T, d], [T]
    raise ValueError(action)


def needs_normed(actions) -> bool:
    return any(a.kind in ("reuse", "reuse_fp16", "patch") for a in actions)


def needs_kv(actions) -> bool:
    return any(a.kind in ("raw", "quant") for a in actions)
