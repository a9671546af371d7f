"""The geometry our forward reads from a Hugging Face decoder config (Llama, Qwen2, Qwen3).

Owns the checks that refuse what the forward does not compute (sliding-window layers, an
activation other than SiLU, partial rotary dims); biases and q/k norms are read from the weights
(shared.model.weights), not from the config. Knows nothing about weights or devices.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@dataclass(frozen=True)
class Geometry:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope: dict = field(default_factory=dict)  # rope_type, rope_theta and the type's own keys
    max_position_embeddings: int = 0

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def of(cls, config) -> Geometry:
        """From a transformers config (text part); ValueError naming the field it cannot compute."""
        cfg = config.get_text_config(decoder=True)
        archs = tuple(getattr(cfg, "architectures", None) or ())
        if archs and not set(archs) & set(SUPPORTED):
            raise ValueError(f"architectures: {archs} is not one of {SUPPORTED}")
        if getattr(cfg, "use_sliding_window", False) or "sliding_attention" in (getattr(cfg, "layer_types", None) or ()):
            raise ValueError("use_sliding_window / layer_types: sliding-window attention is not supported")
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act: {cfg.hidden_act!r}, only 'silu' is supported")
        rope = dict(getattr(cfg, "rope_parameters", None) or {})
        if not rope:  # older configs: rope_theta and rope_scaling side by side
            rope = dict(getattr(cfg, "rope_scaling", None) or {})
            rope.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        rope.setdefault("rope_type", rope.pop("type", "default"))
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"rope partial_rotary_factor: {rope['partial_rotary_factor']}, only 1.0 is supported")
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        if heads % kv_heads:
            raise ValueError(f"num_key_value_heads: {kv_heads} does not divide num_attention_heads {heads}")
        return cls(
            hidden_size=cfg.hidden_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=cfg.intermediate_size,
            vocab_size=cfg.vocab_size,
            rms_norm_eps=float(cfg.rms_norm_eps),
            rope=rope,
            max_position_embeddings=getattr(cfg, "max_position_embeddings", 0) or 0,
        )
