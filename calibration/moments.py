"""Calibration moments and fits: stream a corpus through producer P and consumer C, accumulate
per-layer first and second moments (never the activations themselves), and fit the Reuse
bases/encoders and Patch predictors of an SCD artifact.

Fits per layer l (x^P, x^C: normalized layer inputs; y^C = C's pre-RoPE [k | v]):
- basis: eigenvectors of cov(y^C), by decreasing variance; mu_y = mean(y^C);
- encoder: ridge regression of (y^C - mu_y) on (x^P - mu_x), expressed in the basis. When P and
  C are the same weights and K has no k_norm, the exact map W_kv^T is used instead;
- patch: ridge regression of x^C on x^P (identity when P == C, then not stored).
Where a layer has a learned predictor (calibration.predictor_training), its output (an estimate of x^C)
replaces x^P, and the layer is then fitted like P == C: exact W_kv encoder, identity patch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm
from transformers import DynamicCache

from shared import kv, layers
from shared.models import LoadedModel
from shared.scd.features import producer_features


@dataclass
class LayerMoments:
    """Running sums in float64: n tokens, means and cross-products."""

    n: int = 0
    sums: dict[str, torch.Tensor] = field(default_factory=dict)

    def add(self, name: str, value: torch.Tensor) -> None:
        if name in self.sums:
            self.sums[name] += value
        else:
            self.sums[name] = value.clone()

    def update(self, xp: torch.Tensor, xc: torch.Tensor, y: torch.Tensor) -> None:
        xp, xc, y = xp.double(), xc.double(), y.double()  # [T, d], [T, d], [T, D]
        self.n += xp.shape[0]
        self.add("xp", xp.sum(0))
        self.add("xc", xc.sum(0))
        self.add("y", y.sum(0))
        self.add("xpxp", xp.T @ xp)
        self.add("xpy", xp.T @ y)
        self.add("yy", y.T @ y)
        self.add("xpxc", xp.T @ xc)

    def mean(self, name: str) -> torch.Tensor:
        return self.sums[name] / self.n

    def cov(self, a: str, b: str, ab: str) -> torch.Tensor:
        return self.sums[ab] / self.n - torch.outer(self.mean(a), self.mean(b))


def normed_inputs_and_cache(loaded: LoadedModel, ids: list[int]) -> tuple[list[torch.Tensor], DynamicCache]:
    """One forward over ids: every layer's normalized input (list of [T, d] on CPU, float32)
    and the cache that forward filled."""
    states, cache = kv.capture_states(loaded, ids, kv.Capture.NORMED)
    out = []
    for i in range(loaded.info.num_layers):
        normed = states[i].normed
        assert normed is not None  # Capture.NORMED fills every layer
        out.append(normed.float().cpu())
    return out, cache


def normed_inputs(loaded: LoadedModel, ids: list[int]) -> list[torch.Tensor]:
    """Every layer's normalized input over ids: list of [T, d] on CPU, float32."""
    return normed_inputs_and_cache(loaded, ids)[0]


@torch.no_grad()
def kv_targets(consumer: LoadedModel, layer: int, normed: torch.Tensor) -> torch.Tensor:
    """C's pre-RoPE [k | v] for its normalized input: [T, 2 * n_kv * hd], float32 on CPU."""
    keys, values = layers.kv_pre_rope(consumer, layer, normed.to(consumer.device, consumer.dtype))
    T = normed.shape[0]
    return torch.cat([keys.transpose(0, 1).reshape(T, -1), values.transpose(0, 1).reshape(T, -1)], dim=1).float().cpu()


def collect(
    producer: LoadedModel,
    consumer: LoadedModel,
    corpus: Iterable[list[int]],
    total: int | None = None,
    window: int = 1,
    predictors: dict | None = None,
) -> list[LayerMoments]:
    """Per-layer moments over the corpus; `predictors` maps layer -> learned predictor."""
    same = producer.info.weight_digest == consumer.info.weight_digest
    predictors = predictors or {}
    moments = [LayerMoments() for _ in range(consumer.info.num_layers)]
    for ids in tqdm(corpus, total=total, desc="calibrate", unit="seq"):
        xps = normed_inputs(producer, ids)
        xcs = xps if same else normed_inputs(consumer, ids)
        for layer, (xp, xc) in enumerate(zip(xps, xcs)):
            features = producer_features(xp.to(producer.device), window, predictors.get(layer)).cpu()
            moments[layer].update(features, xc, kv_targets(consumer, layer, xc))
    return moments


def ridge(cxx: torch.Tensor, cxy: torch.Tensor, rel: float) -> torch.Tensor:
    lam = rel * torch.trace(cxx) / cxx.shape[0]
    return torch.linalg.solve(cxx + lam * torch.eye(cxx.shape[0], dtype=cxx.dtype), cxy)


def exact_kv_map(consumer: LoadedModel, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(W [d, D], b [D]) with y = x W + b, when K/V are linear in x (no k_norm); else None."""
    attn: Any = consumer.layers[layer].self_attn  # LlamaAttention or the like
    if hasattr(attn, "k_norm"):
        return None
    weight = torch.cat([attn.k_proj.weight, attn.v_proj.weight]).double().cpu().T
    bias = torch.zeros(weight.shape[1], dtype=torch.float64)
    if attn.k_proj.bias is not None:
        bias = torch.cat([attn.k_proj.bias, attn.v_proj.bias]).double().cpu()
    return weight, bias


def fit(
    moments: list[LayerMoments],
    consumer: LoadedModel,
    same: bool,
    ridge_rel: float = 1e-3,
    predicted: frozenset[int] = frozenset(),
) -> dict[str, torch.Tensor]:
    """Per-layer tensors. `same` (P == C) and the `predicted` layers (features = a learned
    predictor's estimate of C's normalized input) use C's own K/V map: the exact W_kv where K/V
    are linear in the input (ridge otherwise) and an identity patch (not stored)."""
    tensors = {}
    for layer, m in enumerate(moments):
        mu_x, mu_y, mu_c = m.mean("xp"), m.mean("y"), m.mean("xc")
        cxx = m.cov("xp", "xp", "xpxp")
        own = same or layer in predicted  # the features already live in C's input space
        exact = exact_kv_map(consumer, layer) if own and cxx.shape[0] == consumer.info.hidden_size else None
        if exact is not None:
            weight, bias = exact
            full = weight  # [d, D]: y - mu_y = (x - mu_x) W exactly
            mu_y = mu_x @ weight + bias
        else:
            full = ridge(cxx, m.cov("xp", "y", "xpy"), ridge_rel)  # [d, D]
        cyy = m.cov("y", "y", "yy")
        eigvals, eigvecs = torch.linalg.eigh(cyy)
        basis = eigvecs[:, torch.argsort(eigvals, descending=True)]  # [D, D]
        # a deterministic sign per basis vector (eigh's signs are arbitrary)
        basis = basis * torch.sign(basis[basis.abs().argmax(0), torch.arange(basis.shape[1])])[None]
        fitted = {"mu_x": mu_x, "mu_y": mu_y, "basis": basis, "encoder": full @ basis}
        if not own:  # the patch map is the identity, not stored
            fitted.update(patch=ridge(cxx, m.cov("xp", "xc", "xpxc"), ridge_rel), mu_c=mu_c)  # [d, d], [d]
        for name, value in fitted.items():
            tensors[f"layer.{layer}.{name}"] = value.float().contiguous()
    return tensors


def corpus_digest(corpus: Iterable[list[int]]) -> str:
    digest = hashlib.sha256()
    for ids in corpus:
        digest.update(torch.tensor(ids, dtype=torch.int64).numpy().tobytes())
        digest.update(b"|")
    return digest.hexdigest()
