"""Analytic FLOP counts for the benchmarks' cost ratios: a Llama-style decoder stack's prefill, the
cache audit, the SCD producer's learned predictors and each transfer mode's consumer-side rebuild.

Matmul FLOPs only (2 per multiply-add; norms, RoPE, softmax and the LM head left out), from a
Hugging Face config dict. The ratios they give are independent of the machine; the benchmarks
print them beside the measured milliseconds.
"""

from __future__ import annotations


def _dims(config: dict) -> tuple[int, int, int, int]:
    """(hidden, q width, kv width, MLP width) of one decoder layer."""
    d = config["hidden_size"]
    hd = config.get("head_dim") or d // config["num_attention_heads"]
    return d, config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd, config["intermediate_size"]


def layer_weight_macs(config: dict) -> int:
    """Multiply-adds per token of one decoder layer's projections (q, k, v, o, gate, up, down)."""
    d, q, kv, mlp = _dims(config)
    return d * q + 2 * d * kv + q * d + 3 * d * mlp


def prefill(config: dict, tokens: float, layers: int | None = None) -> float:
    """A causal prefill of `tokens` tokens through `layers` decoder layers (default: all)."""
    n = config["num_hidden_layers"] if layers is None else layers
    _, q, _, _ = _dims(config)
    return n * (2 * tokens * layer_weight_macs(config) + 2 * tokens * tokens * q)  # QK^T + AV, causal half


def audit(config: dict, tokens: float, positions: int) -> float:
    """The cache audit: `positions` rows through every layer over a left-padded prefix of `tokens`
    (attention over the whole prefix, not causal-halved)."""
    _, q, _, _ = _dims(config)
    return config["num_hidden_layers"] * (2 * positions * layer_weight_macs(config) + 4 * positions * tokens * q)


def predictors(predictor_config: dict, tokens: float, count: int) -> float:
    """`count` learned SCD predictors (each a small causal decoder stack) over the context."""
    return count * prefill(predictor_config, tokens)


def scd_rebuild(config: dict, tokens: float, actions: list[str]) -> float:
    """The consumer's side of an SCD schedule: Reuse `R<r>` = codes [T, r] x basis [r, kv]
    for K and V; Patch `P` / `P8` = its own K and V projections of the predicted input; raw/quant: 0."""
    d, _, kv, _ = _dims(config)
    total = 0.0
    for action in actions:
        if action.startswith("R"):
            total += 2 * tokens * int(action[1:]) * 2 * kv
        elif action in ("P", "P8"):
            total += 2 * tokens * d * 2 * kv
    return total


def uses_predictor(action: str) -> bool:
    """Whether the producer runs the layer's predictor (if it has one) for this action."""
    return action.startswith("R") or action in ("P", "P8")
