"""Learned non-linear predictor of the consumer's normalized layer input, for heterogeneous pairs:
the inference side (what the producer runs while serving).

A per-token linear map from P's state cannot rebuild a layer of C whose input depends on how the
fine-tune rewired earlier attention (what C's earlier layers read at *other* positions). The
predictor is a small causal transformer, a Hugging Face `LlamaModel` with two decoder layers
(`depth`) and RoPE, run with `inputs_embeds` = P's normalized input of layer l over the context
([T, d] -> [T, d]) as a residual correction of it (untrained, it is the identity).
The producer runs it in the layer hook (shared.scd.features); the layer's ridge encoder and patch
map are fitted on its output, so Reuse codes and Patch payloads both come from it. The consumer
never runs it. Training lives offline in `calibration.predictor_training`. A frozen predictor (an
artifact's, `from_tensors`) runs on our own forward (shared.model, the same values bit for bit);
a trainable one runs the module itself, so gradients reach its weights.

Stored in the artifact as `layer.<l>.predictor.<parameter>` tensors plus the model config in
the metadata. Knows nothing about schedules, training or the wire.
"""

from __future__ import annotations

from typing import cast

import torch
from transformers import LlamaConfig, LlamaModel
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from shared import model as own
from shared.model.config import Geometry
from shared.model.weights import layer_weights

PREFIX = "predictor."


def build(config: dict) -> LlamaModel:
    """A LlamaModel used as a residual map x -> x + attn(x) + mlp(...): no final norm, and the
    attention and MLP output projections start at zero, so an untrained predictor is the
    identity (naive reuse of P's state) and training learns only the correction."""
    model = LlamaModel(LlamaConfig(**config))
    model.norm = torch.nn.Identity()  # type: ignore[assignment]  # deliberately no final norm
    for block in model.layers:
        assert isinstance(block, LlamaDecoderLayer)
        torch.nn.init.zeros_(block.self_attn.o_proj.weight)
        torch.nn.init.zeros_(block.mlp.down_proj.weight)
    model.embed_tokens.weight.requires_grad_(False)  # unused: inputs arrive as embeddings
    return model


def predict(model: LlamaModel, normed: torch.Tensor) -> torch.Tensor:
    """P's normalized layer input [T, d] -> predicted C normalized input [T, d], float32."""
    x = normed.float()
    if any(p.requires_grad for p in model.parameters()):  # training: through the module's weights
        return model(inputs_embeds=x[None]).last_hidden_state[0]
    return _forward(model).stack(x, torch.arange(x.shape[0], device=x.device), own.causal)


def _forward(model: LlamaModel) -> own.Model:
    """Our forward over a frozen predictor's layers, built once per predictor (its fused
    projections become the module's weights, as shared.model.weights shares them); no final
    norm and no head are ever applied (the embedding stands in for both)."""
    cached = model.__dict__.get("_forward_model")
    if cached is None:
        with torch.inference_mode(False), torch.no_grad():
            embed = model.embed_tokens.weight.detach()
            layers = [layer_weights(layer) for layer in model.layers]
            cached = model.__dict__["_forward_model"] = own.Model(Geometry.of(model.config), embed, layers, embed[0], embed)
    return cached


def to_tensors(layer: int, model: LlamaModel) -> dict[str, torch.Tensor]:
    return {
        f"layer.{layer}.{PREFIX}{name}": t.detach().float().cpu().contiguous()
        for name, t in model.state_dict().items()
        if not name.startswith("embed_tokens")
    }


def from_tensors(tensors: dict[str, torch.Tensor], layer: int, config: dict) -> LlamaModel | None:
    """The layer's predictor (eval mode, on its tensors' device), or None if it has none."""
    head = f"layer.{layer}.{PREFIX}"
    state = {name[len(head) :]: t for name, t in tensors.items() if name.startswith(head)}
    if not state:
        return None
    model = build(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if not m.startswith("embed_tokens")]:
        raise ValueError(f"layer {layer} predictor: missing {missing}, unexpected {unexpected}")
    device = next(iter(state.values())).device
    cast(torch.nn.Module, model).to(device)  # in place; transformers' decorated `to` stub rejects a device
    return model.eval().requires_grad_(False)
