"""How large the K/V of each layer of a model can be, from the model's own weights: the limits the
codecs hold every rebuilt layer to (KVDecoder.store_many), so finite but absurd values (3e38,
1e30, anything the layer cannot produce) fail the request, whether or not they would overflow
attention. Knows nothing about codecs or the wire.

Why a valid stream stays inside. A layer's K/V are functions of its normalized input
`x = w ⊙ h / rms(h)` (Llama-style RMSNorm, weight w, width d). Whatever the hidden state h,
`u = h / rms(h)` has `||u||_2 <= sqrt(d)` (rms includes eps, so strictly less). So, per output
row j of a projection W (bias b):

    |(x W^T + b)_j| = |<u, w ⊙ W_j>| + |b_j| <= sqrt(d) * ||w ⊙ W_j||_2 + |b_j|     (Cauchy-Schwarz)

reached when h points along w ⊙ W_j. Values are these rows of W_v. Keys are rows of W_k, then
RoPE: a rotation of pairs of elements scaled by the rotary embedding's attention_scaling s, so
a post-RoPE element is at most s * sqrt(2) times the largest row bound; with a k_norm (Qwen3)
each head is RMS-normalized again, its l2 norm is at most max|w_k_norm| * sqrt(head_dim), and a
rotated element at most s times that. SCD Reuse rebuilds `y' = mu + B z` (B orthonormal, mu the
mean of the layer's [k_pre | v] over calibration): for the projection of a vector y the layer can
make, ||y'|| <= ||mu|| + ||y - mu|| <= 3R, R the bound on ||y||_2 (the l2 norm of the row bounds;
||mu|| <= R as a mean); every element of y', RoPE'd or not, is within max(s, 1) * 3R (`projected`).

Margin: every limit is MARGIN x the bound. It covers the rounding of a bf16/fp16 forward (a few
ulps of 2^-8 relative per op), the codecs' quantization (quant dequantizes inside each group's
[min, max] up to the fp16 rounding of its scale, < 0.1%; a Patch's fp16 x, < 0.1%; Reuse's int8
codes, ||z' - z|| <= sqrt(r) / 254 * ||z||, under 7% at rank 256) and a producer whose weights
are not the consumer's (raw from a fine-tuned variant, a heterogeneous pair's codes) so long as
its own bound is within the margin of the consumer's (the QA pair's two models: within 3%). The
bound is a worst case, reached by hidden states aimed at it (tests/test_kv_bound.py); on contexts
of random tokens the tiny and QA models' largest |k| and |v| sit at 13-25% of the limits.

A normalization this module cannot read (not `w ⊙ h / sqrt(mean(h^2) + eps)`, checked on the
module itself at load) gives that layer no limit (inf): its K/V are then only held to be finite.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

MARGIN = 2.0


@dataclass(frozen=True)
class LayerBound:
    """Limits on |element| of one layer's post-RoPE keys and values (MARGIN included)."""

    keys: float
    values: float
    projected: float  # any element of an SCD Reuse rebuild of this layer (module doc)


def _rms_weight(norm: Any, width: int) -> torch.Tensor | None:
    """The weight w of a `w ⊙ h / sqrt(mean(h^2) + eps)` normalization over `width`, float32,
    when the module computes exactly that on a probe; else None."""
    weight = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if not isinstance(weight, torch.Tensor) or weight.shape != (width,) or eps is None:
        return None
    w = weight.detach().float()
    g = torch.Generator().manual_seed(0)
    probe = (torch.randn(3, width, generator=g) * torch.tensor([[1.0], [1e-3], [1e3]])).to(weight.device, weight.dtype)
    with torch.no_grad():
        got = norm(probe).float()
    h = probe.float()
    want = w * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    tol = 4 * torch.finfo(weight.dtype).eps
    if not torch.allclose(got, want, rtol=tol, atol=tol * float(want.abs().max())):
        return None
    return w


def _row_bounds(proj: Any, w: torch.Tensor) -> torch.Tensor:
    """sqrt(d) * ||w ⊙ W_j||_2 + |b_j| per output row j of a Linear, float32 [out]."""
    weight = proj.weight.detach().float()  # [out, d]
    rows = math.sqrt(w.shape[0]) * (weight * w).norm(dim=1)
    if getattr(proj, "bias", None) is not None:
        rows = rows + proj.bias.detach().float().abs()
    return rows


def layer_bounds(model: Any, hidden_size: int, num_kv_heads: int, head_dim: int) -> tuple[LayerBound, ...]:
    """Per layer of a Hugging Face causal LM (`model.model.layers`, `model.model.rotary_emb`), the
    limits of the module doc, from its weights (float32, on its device)."""
    s = float(getattr(model.model.rotary_emb, "attention_scaling", 1.0))
    out = []
    for layer in model.model.layers:
        attn: Any = layer.self_attn
        w = _rms_weight(layer.input_layernorm, hidden_size)
        if w is None:
            out.append(LayerBound(math.inf, math.inf, math.inf))
            continue
        rows_k = _row_bounds(attn.k_proj, w)  # [n_kv * hd]
        rows_v = _row_bounds(attn.v_proj, w)
        keys = s * math.sqrt(2) * float(rows_k.max())
        key_norm = float(rows_k.norm())  # ||k_pre||_2 over all heads, one token
        if hasattr(attn, "k_norm"):
            w_k = _rms_weight(attn.k_norm, head_dim)
            head = math.inf if w_k is None else float(w_k.abs().max()) * math.sqrt(head_dim)
            keys, key_norm = s * head, math.sqrt(num_kv_heads) * head
        values = float(rows_v.max())
        norm = math.hypot(key_norm, float(rows_v.norm()))  # R: ||[k_pre | v]||_2, one token
        out.append(LayerBound(MARGIN * keys, MARGIN * values, MARGIN * max(s, 1.0) * 3 * norm))
    return tuple(out)


# Activations whose magnitude never exceeds their input's: |act(x)| <= |x| (SiLU, GELU, ReLU).
_CONTRACTING_ACTS = frozenset({"silu", "swish", "gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "relu"})


# Families whose residual stream starts as the embedding row itself (no multiplier).
_PLAIN_EMBEDDINGS = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def hidden_bounds(model: Any, hidden_size: int) -> tuple[float, ...]:
    """Per layer i, the most |element| of the residual stream entering layer i may reach (MARGIN
    included): what a recompute stream's `hidden` payload is held to, so a finite but absurd
    state (1e30, whose square overflows the RMSNorm into zero K/V) fails the request.

    The stream starts as a token embedding (its largest |element|) and each layer adds an
    attention and an MLP output. Attention's is o_proj of a convex combination of values, each
    element at most the layer's largest value row bound V (module doc): |o_j| <= V ||W_o,j||_1 +
    |b_j|. The MLP's input is normalized too, so gate and up rows are bounded as K/V rows are
    (g_j, u_j); an activation with |act(x)| <= |x| makes |act(gate) up|_j <= g_j u_j, and the
    output |m_i| <= sum_j |W_down,ij| g_j u_j + |b_i|. A layer this cannot read (another norm,
    activation or MLP shape), or a family not known to start from the plain embedding row, leaves
    every later layer without a limit (inf)."""
    act = str(getattr(model.config, "hidden_act", ""))
    out = []
    low, high = torch.aminmax(model.model.embed_tokens.weight.detach())  # no vocabulary-sized copy
    running = max(-float(low), float(high))
    if getattr(model.config, "model_type", "") not in _PLAIN_EMBEDDINGS:  # Gemma scales its embeddings, MiniCPM too
        running = math.inf
    for layer in model.model.layers:
        out.append(MARGIN * running)
        if not math.isfinite(running):
            continue
        attn: Any = layer.self_attn
        mlp: Any = getattr(layer, "mlp", None)
        w_in = _rms_weight(layer.input_layernorm, hidden_size)
        w_post = _rms_weight(getattr(layer, "post_attention_layernorm", None), hidden_size)
        parts = ("gate_proj", "up_proj", "down_proj")
        if w_in is None or w_post is None or act not in _CONTRACTING_ACTS or not all(hasattr(mlp, p) for p in parts):
            running = math.inf
            continue
        values = float(_row_bounds(attn.v_proj, w_in).max())
        o_proj = attn.o_proj
        attn_rows = o_proj.weight.detach().float().abs().sum(dim=1) * values
        if getattr(o_proj, "bias", None) is not None:
            attn_rows = attn_rows + o_proj.bias.detach().float().abs()
        inner = _row_bounds(mlp.gate_proj, w_post) * _row_bounds(mlp.up_proj, w_post)  # [intermediate]
        down = mlp.down_proj
        mlp_rows = down.weight.detach().float().abs() @ inner
        if getattr(down, "bias", None) is not None:
            mlp_rows = mlp_rows + down.bias.detach().float().abs()
        running += float(attn_rows.max()) + float(mlp_rows.max())
    return tuple(out)
