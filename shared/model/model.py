"""One lean Llama-family decoder (Llama, Qwen2, Qwen3; GQA; tied or untied LM head) over flat
token rows: the forward the engine runs, and the per-layer functions the codecs use.

Tokens are flat, [T] ids at [T] positions, whatever requests they belong to; attention is the
caller's (`Attend`: it gets a layer's post-RoPE q, k, v and returns the heads' output), so the same
layers run a single causal sequence (`causal`), a batch over the engine's KV pool in place
(consumer.engine.pool_forward) or anything else. Numbers follow transformers' modules op for op
(RMSNorm in float32, RoPE tables in float32 cast to the dtype) except the fused projections.
No modules, hooks or global state. Knows nothing about caches, requests or scheduling.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from shared.model import rope as rope_mod
from shared.model.config import Geometry
from shared.model.packed import Packed, PackedLayer, project
from shared.model.weights import LayerWeights, layer_weights

# (layer, q [T, H, hd], k [T, n_kv, hd], v [T, n_kv, hd]) -> [T, H, hd]; k/v post-RoPE
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm (in float32, weight applied in x's dtype), with torch's fused kernel:
    the same values bit for bit (tests/test_model_forward.py)."""
    return weight * F.rms_norm(x.to(torch.float32), (x.shape[-1],), eps=eps).to(x.dtype)


class Ops:
    """The layer's elementwise steps, as transformers' eager modules compute them (RMSNorm, the
    residual add with the next RMSNorm, SiLU(gate) * up, RoPE). The engine's forward passes a fused
    implementation (consumer.engine.fused_ops); everything else runs these."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(
        self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, weight * rmsnorm(h + delta))."""
        h = h + delta
        return h, rms_norm(h, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [T, 2n] (gate | up) -> silu(gate) * up [T, n]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return rope_mod.apply(x, cos, sin)


EAGER = Ops()


class Model:
    def __init__(
        self, geometry: Geometry, embed: torch.Tensor, layers: list[LayerWeights], norm: torch.Tensor, lm_head: torch.Tensor
    ):
        self.geometry, self.embed, self.layers, self.norm, self.lm_head = geometry, embed, layers, norm, lm_head
        self.device, self.dtype = embed.device, embed.dtype
        self.rope = rope_mod.Rope(geometry.rope, geometry.head_dim, self.device)
        self.eps = geometry.rms_norm_eps
        g = geometry
        # Qwen3: q_norm on every query head and k_norm on every key head, as one [H + n_kv, hd] weight
        self.qk_norms = [
            None
            if w.q_norm is None or w.k_norm is None
            else torch.cat([w.q_norm.expand(g.num_heads, g.head_dim), w.k_norm.expand(g.num_kv_heads, g.head_dim)])
            for w in layers
        ]

    @classmethod
    def from_hf(cls, hf: Any, share: bool = True) -> Model:
        """From a loaded transformers causal LM (shared.models.load_model reads the checkpoint);
        `share`: the fused projections replace the module's own tensors (shared.model.weights)."""
        inner = hf.model
        geometry = Geometry.of(hf.config)
        layers = [layer_weights(layer, share) for layer in inner.layers]
        lm_head = hf.get_output_embeddings().weight.detach()  # the embedding itself when tied
        return cls(geometry, inner.embed_tokens.weight.detach(), layers, inner.norm.weight.detach(), lm_head)

    # --- per-layer functions (the codecs' math) ------------------------------------------------

    def tables(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE (cos, sin) for positions pos [T] -> [T, hd] each, in the model's dtype."""
        return self.rope.tables(pos, self.dtype)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings of ids [T] -> the residual stream entering layer 0, [T, d]."""
        return F.embedding(ids, self.embed)

    def normed(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """The layer's normalized input (input_layernorm) of the residual stream h [T, d]."""
        return rms_norm(h, self.layers[layer].input_norm, self.eps)

    def qk_v(self, layer: int, normed: torch.Tensor, packed: PackedLayer | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries and keys side by side, qk [T, H + n_kv, hd] (after q/k norm where the model has
        them, before RoPE), and values v [T, n_kv, hd], from a normalized input [T, d]: one fused
        projection, and one rotation serves q and k."""
        g, w = self.geometry, self.layers[layer]
        qkv = project(normed, w.qkv, w.qkv_bias, None if packed is None else packed.qkv).view(
            normed.shape[0], g.num_heads + 2 * g.num_kv_heads, g.head_dim
        )
        qk, v = qkv[:, : g.num_heads + g.num_kv_heads], qkv[:, g.num_heads + g.num_kv_heads :]
        norm = self.qk_norms[layer]
        if norm is not None:
            qk = rms_norm(qk, norm, self.eps)
        return qk, v

    def qkv_pre_rope(self, layer: int, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, hd], k [T, n_kv, hd] (after q/k norm, before RoPE), v [T, n_kv, hd] from a
        normalized input [T, d]."""
        qk, v = self.qk_v(layer, normed)
        H = self.geometry.num_heads
        return qk[:, :H], qk[:, H:], v

    def kv_pre_rope(self, layer: int, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys before RoPE (after k_norm) and values, [T, n_kv, hd] each, from normed [T, d]
        (Patch and Reuse: only the k/v rows of the fused projection run)."""
        g, w = self.geometry, self.layers[layer]
        T = normed.shape[0]
        rows = slice(g.q_size, g.q_size + 2 * g.kv_size)
        bias = None if w.qkv_bias is None else w.qkv_bias[rows]
        k, v = F.linear(normed, w.qkv[rows], bias).split([g.kv_size, g.kv_size], dim=-1)
        k, v = k.view(T, g.num_kv_heads, g.head_dim), v.view(T, g.num_kv_heads, g.head_dim)
        if w.k_norm is not None:
            k = rms_norm(k, w.k_norm, self.eps)
        return k, v

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on x [T, heads, hd] with tables [T, hd] (keys rebuilt before RoPE: Reuse)."""
        return rope_mod.apply(x, cos, sin)

    def layer(
        self,
        layer: int,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: Attend,
        normed: torch.Tensor | None = None,
        packed: PackedLayer | None = None,
        ops: Ops = EAGER,
    ) -> torch.Tensor:
        """One decoder layer over the residual stream h [T, d] -> [T, d]; `normed`: the layer's
        normalized input when the caller has it already (`normed(layer, h)`, computed once);
        `packed`: the layer's prepacked weights (shared.model.packed; the engine's forward);
        `ops`: its elementwise steps (the engine's forward passes fused ones)."""
        w, p = self.layers[layer], packed
        T = h.shape[0]
        if normed is None:
            normed = ops.rms_norm(h, w.input_norm, self.eps)
        qk, v = self.qk_v(layer, normed, p)
        qk = ops.rope(qk, cos, sin)  # [T, H + n_kv, hd]
        H = self.geometry.num_heads
        out = attend(layer, qk[:, :H], qk[:, H:], v).reshape(T, -1)  # [T, H * hd]
        h, x = ops.add_rms_norm(h, project(out, w.o, w.o_bias, None if p is None else p.o), w.post_norm, self.eps)
        gate_up = project(x, w.gate_up, w.gate_up_bias, None if p is None else p.gate_up)
        return h + project(ops.silu_mul(gate_up), w.down, w.down_bias, None if p is None else p.down)

    # --- whole forwards --------------------------------------------------------------------------

    def hidden(
        self, ids: torch.Tensor, pos: torch.Tensor, attend: Attend, packed: Packed | None = None, ops: Ops = EAGER
    ) -> torch.Tensor:
        """The last layer's residual stream (before the final norm), [T, d], for ids [T] at pos [T]."""
        return self.stack(self.embedding(ids), pos, attend, packed, ops)  # [T, d]

    def stack(
        self, h: torch.Tensor, pos: torch.Tensor, attend: Attend, packed: Packed | None = None, ops: Ops = EAGER
    ) -> torch.Tensor:
        """Every layer over the residual stream entering layer 0, h [T, d] at pos [T] -> [T, d]
        (inputs given as embeddings: the SCD predictor's)."""
        cos, sin = self.tables(pos)
        for index in range(self.geometry.num_layers):
            h = self.layer(index, h, cos, sin, attend, packed=None if packed is None else packed.layers[index], ops=ops)
        return h

    def logits(self, h: torch.Tensor, packed: Packed | None = None, ops: Ops = EAGER) -> torch.Tensor:
        """Final norm and LM head over h [..., d] -> [..., vocab] float32."""
        x = ops.rms_norm(h, self.norm, self.eps)
        return project(x, self.lm_head, None, None if packed is None else packed.lm_head).float()

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """One sequence from position 0, no cache: logits [T, vocab] float32 (tests, checks)."""
        pos = torch.arange(ids.shape[0], device=self.device)
        return self.logits(self.hidden(ids, pos, causal))


def causal(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention of one sequence over itself from position 0: q [T, H, hd], k/v [T, n_kv, hd].
    4D inputs: CPU SDPA takes its flash kernel (as transformers' sdpa path does), 3D would not."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        is_causal=True,
        enable_gqa=q.shape[1] != k.shape[1],
    )  # [1, H, T, hd]
    return out[0].transpose(0, 1)  # [T, H, hd]


def masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Attention of new tokens q [n, H, hd] over keys/values [1, n_kv, L, hd] (a cache's tokens and
    the new ones, in the cache's layout) under a 4D mask [1, 1, n, L] (bool: True attends; float:
    added to the scores), or none (one new token: it sees every key). transformers' sdpa path for
    a forward over a filled cache, call for call (K/V repeated per query head under a mask, SDPA's
    own GQA without one), so its values are the reference's bit for bit."""
    H, kv = q.shape[1], k.shape[1]
    query = q.transpose(0, 1)[None]  # [1, H, n, hd]
    if mask is None:
        out = F.scaled_dot_product_attention(query, k, v, enable_gqa=H != kv)
    else:
        if H != kv:
            k, v = k.repeat_interleave(H // kv, dim=1), v.repeat_interleave(H // kv, dim=1)  # [1, H, L, hd]
        out = F.scaled_dot_product_attention(query, k, v, attn_mask=mask)  # [1, H, n, hd]
    return out[0].transpose(0, 1)


def of(loaded: Any) -> Model:
    """The forward for a shared.models.LoadedModel, built once per loaded model (its fused
    weights are shared with the Hugging Face modules)."""
    model = loaded.__dict__.get("_forward_model")
    if model is None:
        with torch.inference_mode(False), torch.no_grad():  # plain tensors: autograd may run through them (predictor training)
            model = loaded.__dict__["_forward_model"] = Model.from_hf(loaded.model)
    return model
