"""A probe forward: a few tokens run after a filled cache, each at its own position, under the
caller's 4D mask, on our own forward (shared.model). The audit's check (shared.audit) and the
anchor repair's recompute and attention mass (consumer.exact.repair) are such forwards.

The cache is read, never written: each layer attends over its K/V with the new tokens' own
appended (transformers' sdpa path over a filled cache, shared.model.masked, so the values are
what its modules computed with that mask). Knows nothing about codecs, audits or policies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from shared import model as own
from shared.models import LoadedModel

# (layer, q [k, H, hd] post-RoPE, keys [1, n_kv, T + k, hd]) -> None: what a caller reads per layer
Look = Callable[[int, torch.Tensor, torch.Tensor], None]


@torch.inference_mode()
def after_cache(
    loaded: LoadedModel,
    cache: Sequence[tuple[torch.Tensor, torch.Tensor]],
    ids: Sequence[int],
    pos: torch.Tensor,
    mask: torch.Tensor,
    look: Look | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Tokens ids [k] at positions pos [k] after `cache` (per layer (keys, values), [1, n_kv, T, hd]
    each, post-RoPE, in the model's dtype), query i seeing key j where mask [1, 1, k, T + k] says
    (float: added to the scores; bool: True attends): per layer the new tokens' (keys, values),
    [n_kv, k, hd] each; `look` sees each layer's queries and keys."""
    model = own.of(loaded)
    h = model.embedding(torch.tensor(list(ids), dtype=torch.long, device=loaded.device))  # [k, d]
    cos, sin = model.tables(pos)
    new: list[tuple[torch.Tensor, torch.Tensor]] = []

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys = torch.cat([cache[layer][0], k.transpose(0, 1)[None]], dim=2)  # [1, n_kv, T + k, hd]
        values = torch.cat([cache[layer][1], v.transpose(0, 1)[None]], dim=2)
        new.append((k.transpose(0, 1), v.transpose(0, 1)))  # [n_kv, k, hd]
        if look is not None:
            look(layer, q, keys)
        return own.masked(q, keys, values, mask)

    for index in range(model.geometry.num_layers):
        h = model.layer(index, h, cos, sin, attend)
    return new
