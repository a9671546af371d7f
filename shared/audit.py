"""Cache audit: a serving-time signal that a rebuilt cache left the regime its codec was
calibrated for.

An exact cache is a fixed point of the consumer's own forward: at any context position p, running
the consumer's layers on token p over the cache's prefix [0, p) reproduces the cache's own K/V
at p, layer by layer. A diverged cache is not: the K/V the consumer computes there differ from
the ones the codec rebuilt. The audit checks k positions (always the last ones, where the
question attends most, plus a seeded spread) in ONE forward: the k tokens as one row after the
cache, with a 4D attention mask under which query i sees only the keys [0, p_i) and its own,
at position p_i; the cache is shared, never copied per position, so the cost is about one
decode step of k tokens, not k prefills.

The reference's layer 0 is exact: its K/V depend on the token ids alone, so the audit computes
them itself instead of attending over the rebuilt layer 0 (a low-rank Reuse layer 0 would
otherwise put a fixed error floor under every later layer's reference, hiding divergence).

Error of layer l = max over the checked positions of ||[k|v]_own - [k|v]_rebuilt|| / ||[k|v]_own||
(post-RoPE keys, values; float32). Knows nothing about codecs, policies or the wire.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from shared import kv, layers, probe
from shared.model import of as forward_of
from shared.models import LoadedModel


@dataclass(frozen=True)
class AuditReport:
    positions: tuple[int, ...]
    layer_errors: tuple[float, ...]  # per layer, max over positions
    ms: float

    @property
    def max_error(self) -> float:
        return max(self.layer_errors, default=0.0)


def positions(num_tokens: int, k: int, seed: int = 0) -> tuple[int, ...]:
    """k distinct positions in [1, T): the last ceil(k/2), the rest spread at random (seeded)."""
    candidates = list(range(1, num_tokens))
    k = min(k, len(candidates))
    last = candidates[len(candidates) - (k + 1) // 2 :]
    rest = [p for p in candidates if p not in last]
    return tuple(sorted(last + random.Random(seed).sample(rest, k - len(last))))


def relative_error(own: torch.Tensor, rebuilt: torch.Tensor) -> torch.Tensor:
    """Per row (dim 0): ||own - rebuilt|| / ||own|| over the rest of the dims, float32 [N]."""
    own, rebuilt = own.float().flatten(1), rebuilt.float().flatten(1)
    return (own - rebuilt).norm(dim=1) / own.norm(dim=1).clamp_min(1e-6)


@torch.inference_mode()
def exact_first_layer(loaded: LoadedModel, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 0's exact K/V over ids ([1, n_kv, len(ids), hd] each): they depend on the token ids
    alone (embedding -> input_layernorm -> k/v projections -> RoPE), no attention, no MLP."""
    model = forward_of(loaded)
    normed = model.normed(0, model.embedding(torch.tensor(ids, device=loaded.device)))  # [T, d]
    keys, values = layers.kv_from_normed(loaded, 0, normed, layers.positions(loaded, len(ids)))
    return keys[None], values[None]


@torch.inference_mode()
def audit(loaded: LoadedModel, context_ids: list[int], cache: DynamicCache, checked: tuple[int, ...]) -> AuditReport:
    """Check `cache` (the rebuilt context cache, batch 1, T = len(context_ids)) at `checked`."""
    started = time.perf_counter()
    num_layers, device, T = loaded.info.num_layers, loaded.device, len(context_ids)
    if not checked:
        return AuditReport((), tuple(0.0 for _ in range(num_layers)), 0.0)
    k = len(checked)
    exact0 = exact_first_layer(loaded, context_ids)  # the reference's layer 0: exact, from token ids
    base = [exact0 if layer == 0 else kv.layer_kv(cache, layer) for layer in range(num_layers)]  # [1, n_kv, T, hd]
    base = [(keys.to(loaded.dtype), values.to(loaded.dtype)) for keys, values in base]
    # the k checked tokens as one row after the cache: query i sees keys [0, p_i) and its own new key
    mask = torch.full((1, 1, k, T + k), torch.finfo(loaded.dtype).min, dtype=loaded.dtype, device=device)
    for i, p in enumerate(checked):
        mask[0, 0, i, :p] = 0
        mask[0, 0, i, T + i] = 0
    where = torch.tensor(checked, device=device)
    new = probe.after_cache(loaded, base, [context_ids[p] for p in checked], where, mask)  # [n_kv, k, hd] each
    errors = []
    for layer in range(num_layers):
        own_kv = torch.cat(new[layer], -1).float().transpose(0, 1)  # [k, n_kv, 2hd]
        keys, values = kv.layer_kv(cache, layer)
        rebuilt = torch.cat([keys[0][:, where], values[0][:, where]], -1).float().transpose(0, 1)
        errors.append(float(relative_error(own_kv, rebuilt).max()))
    return AuditReport(tuple(checked), tuple(errors), (time.perf_counter() - started) * 1e3)
