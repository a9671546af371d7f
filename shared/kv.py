"""KV-cache mechanics: per-layer capture during the producer's prefill, and building a consumer
cache layer by layer.

Owns the per-layer capture on our own forward (shared.model): the batched forward the producer
serves with, `batch_capture`, its continuation on top of a stored prefix's K/V,
`continue_capture`, and `capture_states` (batch 1, for offline tools and tests); the Hugging
Face reference the tests hold them to (`layer_capture`: forward hooks on the modules,
`prefill_context`: the modules' own forward); and `DynamicCache` assembly. Knows nothing about
codecs' payload formats, wire types or gRPC.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from shared import model as own
from shared.models import LoadedModel


class KVSink(Protocol):
    """Where a consumer's rebuilt layers are written: a DynamicCache, or the engine's KV pool
    blocks of one request (consumer.engine.kv_pool.SequenceKV). keys/values [1, n_kv, T, hd], post-RoPE."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> Any: ...


class Capture(enum.Flag):
    """What an encoder needs from each layer of the producer's forward."""

    NONE = 0
    KV = enum.auto()  # post-RoPE keys and values as stored in the cache
    NORMED = enum.auto()  # the layer's input_layernorm output
    HIDDEN = enum.auto()  # the residual stream entering the layer


@dataclass
class LayerState:
    """One decoder layer of the producer's prefill over T context tokens (one context's row)."""

    index: int
    keys: torch.Tensor | None = None  # [n_kv, T, head_dim], post-RoPE
    values: torch.Tensor | None = None  # [n_kv, T, head_dim]
    normed: torch.Tensor | None = None  # [T, hidden], input_layernorm(hidden)
    hidden: torch.Tensor | None = None  # [T, hidden], residual stream entering the layer

    def kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values); a clear error when the forward did not capture them."""
        if self.keys is None or self.values is None:
            raise ValueError(f"layer {self.index}: K/V were not captured (pass Capture.KV)")
        return self.keys, self.values


@contextmanager
def layer_capture(
    loaded: LoadedModel, cache: DynamicCache, needs: Capture, on_layer: Callable[[LayerState], None]
) -> Iterator[None]:
    """While active, calls on_layer(state) right after each decoder layer of a batch-1 forward of
    the Hugging Face modules (the reference for tests; serving captures with batch_capture).

    on_layer runs inside the forward, on its thread; raising from it aborts the forward (how a
    cancelled prefill stops at the next layer boundary).
    """
    handles = []
    pending: dict[int, LayerState] = {}
    for index, layer in enumerate(loaded.layers):

        def pre(module, args, kwargs, index=index):
            state = pending.setdefault(index, LayerState(index))
            if Capture.HIDDEN in needs:
                hidden = args[0] if args else kwargs["hidden_states"]
                state.hidden = hidden[0].detach()  # [T, d]

        def normed(module, args, output, index=index):
            pending.setdefault(index, LayerState(index)).normed = output[0].detach()  # [T, d]

        def post(module, args, kwargs, output, index=index):
            state = pending.pop(index, None) or LayerState(index)
            if Capture.KV in needs:
                keys, values = layer_kv(cache, index)
                state.keys, state.values = keys[0], values[0]  # [n_kv, T, hd] each
            on_layer(state)

        handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        if Capture.NORMED in needs:
            handles.append(layer.get_submodule("input_layernorm").register_forward_hook(normed))
        handles.append(layer.register_forward_hook(post, with_kwargs=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@torch.inference_mode()
def prefill_context(loaded: LoadedModel, ids: torch.Tensor, cache: DynamicCache | None = None) -> DynamicCache:
    """Run the Hugging Face decoder stack (no LM head) over ids [1, T], filling and returning the
    cache: the reference forward for tests and offline checks."""
    cache = cache if cache is not None else DynamicCache(config=loaded.model.config)
    loaded.model.model(input_ids=ids, cache=cache, use_cache=True)
    return cache


def empty_cache(loaded: LoadedModel) -> DynamicCache:
    return DynamicCache(config=loaded.model.config)


def layer_kv(cache: DynamicCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A filled layer's (keys, values) as the cache stores them, [B, n_kv, T, hd] each.
    transformers types `cache.layers` as a union with linear-attention layers and keys/values as
    Optional; a DynamicCache of these decoders holds DynamicLayers."""
    entry = cast(DynamicLayer, cache.layers[layer])
    assert entry.keys is not None and entry.values is not None, f"cache layer {layer} is empty"
    return entry.keys, entry.values


def put_layer(cache: KVSink, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Store one layer's K/V ([n_kv, T, hd] each, post-RoPE) into the cache."""
    cache.update(keys[None], values[None], layer)


def put_layers(items: Sequence[tuple[KVSink, int, torch.Tensor, torch.Tensor]]) -> list[BaseException | None]:
    """put_layer for several (cache, layer, keys, values): caches of a type with a batched writer
    (a static `update_many(items)` giving per item its error or None, as the KV pool's
    sequences have) written in one call per type, the others one by one. Per item, the exception
    its own write raised, or None."""
    errors: list[BaseException | None] = [None] * len(items)
    by_type: dict[type, list[int]] = {}
    for i, (cache, _, _, _) in enumerate(items):
        by_type.setdefault(type(cache), []).append(i)
    for kind, members in by_type.items():
        many = getattr(kind, "update_many", None)
        if many is not None:
            batch = [(items[i][0], items[i][1], items[i][2][None], items[i][3][None]) for i in members]
            for i, error in zip(members, many(batch)):
                errors[i] = error
            continue
        for i in members:
            try:
                put_layer(*items[i])
            except Exception as exc:
                errors[i] = exc
    return errors


def capture_states(loaded: LoadedModel, ids: list[int], needs: Capture) -> tuple[dict[int, LayerState], DynamicCache]:
    """One batch-1 forward over ids (our forward, batch_capture): every layer's LayerState (what
    `needs` asks for, on the model's device) and a cache holding the K/V that forward computed.
    The one way offline tools, tests and the producer's profile read per-layer states."""
    states: dict[int, LayerState] = {}
    cache = empty_cache(loaded)

    def keep(_: int, state: LayerState) -> None:
        put_layer(cache, state.index, *state.kv())
        if Capture.KV not in needs:
            state.keys = state.values = None
        states[state.index] = state

    batch_capture(loaded, [ids], [needs | Capture.KV], keep)
    return states, cache


def _flat(loaded: LoadedModel, rows: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Several contexts' ids side by side, [N] each row's, and their positions 0..T_row-1, [N]."""
    ids = torch.tensor([t for r in rows for t in r], dtype=torch.long, device=loaded.device)
    pos = torch.cat([torch.arange(len(r)) for r in rows]).to(loaded.device)
    return ids, pos


@torch.inference_mode()
def continue_capture(
    loaded: LoadedModel,
    prefix: Sequence[tuple[torch.Tensor, torch.Tensor]],
    ids: Sequence[int],
    needs: Capture,
    on_layer: Callable[[LayerState], None],
    active: Callable[[], bool] = lambda: True,
) -> None:
    """A batch-1 forward over ids continuing a context whose first P tokens' K/V are `prefix`
    (per layer (keys, values), [n_kv, P, hd] each, post-RoPE, as a forward over them stored
    them): positions P..P+N-1, attention over the prefix and the new tokens (our forward,
    shared.model, with the attention transformers runs over a filled cache: shared.model.masked).
    on_layer gets each layer's states over the new tokens only (keys/values [n_kv, N, hd],
    hidden/normed [N, d]). Stops before a layer when active() is false. Float32: the new tokens'
    states equal a whole-context forward's up to rounding."""
    model = own.of(loaded)
    device, dtype = loaded.device, loaded.dtype
    past = [(k[None].to(device, dtype), v[None].to(device, dtype)) for k, v in prefix]  # [1, n_kv, P, hd]
    P, N = (prefix[0][0].shape[1] if prefix else 0), len(ids)
    h = model.embedding(torch.tensor(list(ids), dtype=torch.long, device=device))  # [N, d]
    cos, sin = model.tables(torch.arange(P, P + N, device=device))
    # query i sees keys 0..P+i (None: one new token sees them all, or no prefix: plain causal)
    mask = (torch.arange(P + N, device=device)[None] <= P + torch.arange(N, device=device)[:, None])[None, None]
    new: list[tuple[torch.Tensor, torch.Tensor]] = []

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        new.append((k, v))  # [N, n_kv, hd]
        if not P:
            return own.causal(layer, q, k, v)
        keys = torch.cat([past[layer][0], k.transpose(0, 1)[None]], dim=2)  # [1, n_kv, P + N, hd]
        values = torch.cat([past[layer][1], v.transpose(0, 1)[None]], dim=2)
        return own.masked(q, keys, values, mask if N > 1 else None)

    for index in range(model.geometry.num_layers):
        if not active():
            return
        state = LayerState(index)
        normed = model.normed(index, h)
        if Capture.HIDDEN in needs:
            state.hidden = h
        if Capture.NORMED in needs:
            state.normed = normed
        h = model.layer(index, h, cos, sin, attend, normed)
        keys, values = new.pop()
        if Capture.KV in needs:
            state.keys, state.values = keys.transpose(0, 1), values.transpose(0, 1)  # [n_kv, N, hd]
        on_layer(state)


@torch.inference_mode()
def batch_capture(
    loaded: LoadedModel,
    rows: Sequence[Sequence[int]],
    needs: Sequence[Capture],
    on_layer: Callable[[int, LayerState], None],
    active: Callable[[int], bool] = lambda row: True,
) -> None:
    """One forward over several contexts at once (our forward, shared.model), each row's
    per-layer states handed to on_layer(row, state) right after the layer ran (nothing
    module-global, so nothing one request could see of another's).

    Rows are flat, side by side with no padding, each at its own positions 0..T_row-1 and
    attending causally over its own tokens alone (SDPA per row, as a batch-1 forward runs it), so
    every row's states equal a batch-1 forward's up to float rounding (the projections see other
    shapes). Before each layer, rows for which active(row) is false leave the batch (a cancelled
    request stops costing compute at the next layer boundary). State tensors are views into the
    batch's tensors, on the model's device: keys/values [n_kv, T_row, hd], hidden/normed [T_row, d].
    """
    model = own.of(loaded)
    ids, pos = _flat(loaded, rows)
    h = model.embedding(ids)  # [N, d]
    cos, sin = model.tables(pos)  # [N, hd] each
    live = list(range(len(rows)))  # batch position -> caller's row
    lengths = [len(r) for r in rows]
    taken: list[tuple[torch.Tensor, torch.Tensor]] = []

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        taken.append((k, v))  # [N, n_kv, hd]
        sizes = [lengths[row] for row in live]
        if len(sizes) == 1:
            return own.causal(layer, q, k, v)
        parts = zip(q.split(sizes), k.split(sizes), v.split(sizes))
        return torch.cat([own.causal(layer, *part) for part in parts])  # [N, H, hd]

    for index in range(model.geometry.num_layers):
        keep = [b for b, row in enumerate(live) if active(row)]
        if not keep:
            return
        if len(keep) < len(live):
            starts = [0]
            for row in live:
                starts.append(starts[-1] + lengths[row])
            tokens = torch.cat([torch.arange(starts[b], starts[b + 1]) for b in keep]).to(h.device)
            h, cos, sin = h[tokens], cos[tokens], sin[tokens]
            live = [live[b] for b in keep]
        normed = model.normed(index, h)  # [N, d]
        out = model.layer(index, h, cos, sin, attend, normed)
        keys, values = taken.pop()
        offset = 0
        for row in live:
            n, need = lengths[row], needs[row]
            state = LayerState(index)
            if Capture.KV in need:
                state.keys = keys[offset : offset + n].transpose(0, 1)  # [n_kv, T_row, hd]
                state.values = values[offset : offset + n].transpose(0, 1)
            if Capture.HIDDEN in need:
                state.hidden = h[offset : offset + n]  # [T_row, d]
            if Capture.NORMED in need:
                state.normed = normed[offset : offset + n]
            offset += n
            on_layer(row, state)
        h = out
