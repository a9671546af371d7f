"""KV-cache mechanics on a Hugging Face decoder: per-layer capture during the producer's
prefill, and building a consumer cache layer by layer.

Owns the per-layer capture (forward hooks at batch 1 for offline tools and tests,
`layer_capture`/`capture_states`; the hook-free batched forward the producer serves with,
`batch_capture`, and its continuation on top of a stored prefix's K/V, `continue_capture`) and
`DynamicCache` assembly. Knows nothing about codecs' payload formats,
wire types or gRPC.
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
    """While active, calls on_layer(state) right after each decoder layer of a batch-1 forward.

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
    """Run the decoder stack (no LM head) over ids [1, T], filling and returning the cache."""
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
    """One batch-1 forward over ids: every layer's LayerState (what `needs` asks for, on the
    model's device) and the cache that forward filled. The one way offline tools, tests and
    the producer's profile read per-layer states."""
    states: dict[int, LayerState] = {}
    cache = empty_cache(loaded)
    with layer_capture(loaded, cache, needs, lambda s: states.__setitem__(s.index, s)):
        prefill_context(loaded, torch.tensor([ids], device=loaded.device), cache)
    return states, cache


class _LayerTap:
    """A cache stand-in for one forward without reuse: `update` hands the layer's post-RoPE K/V
    back unchanged and keeps them until the next layer's (no per-layer concatenation, nothing
    kept across layers)."""

    keys: torch.Tensor
    values: torch.Tensor

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.keys, self.values = keys, values  # [B, n_kv, T, hd] each
        return keys, values


def _layer_masks(loaded: LoadedModel, h: torch.Tensor, pos: torch.Tensor, cache: DynamicCache | None = None) -> list[object]:
    """Each layer's causal mask as the model's own forward builds it with no padding mask (None
    where sdpa's is_causal suffices); over cache's past tokens too when given."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    config = loaded.model.config
    kinds = getattr(config, "layer_types", None) or ["full_attention"] * len(loaded.layers)
    made = {
        "full_attention": create_causal_mask(config=config, inputs_embeds=h, attention_mask=None, cache=cache, position_ids=pos)
    }
    if "sliding_attention" in kinds:
        made["sliding_attention"] = create_sliding_window_causal_mask(
            config=config, inputs_embeds=h, attention_mask=None, cache=cache, position_ids=pos
        )
    return [made[kind] for kind in kinds]


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
    them): positions P..P+N-1, attention over the prefix and the new tokens, as the model's own
    forward with a filled cache runs it. on_layer gets each layer's states over the new tokens
    only (keys/values [n_kv, N, hd], hidden/normed [N, d]). Stops before a layer when active()
    is false. Float32: the new tokens' states equal a whole-context forward's up to rounding."""
    model = loaded.model.model
    cache = empty_cache(loaded)
    for index, (keys, values) in enumerate(prefix):
        cache.update(keys[None].to(loaded.device, loaded.dtype), values[None].to(loaded.device, loaded.dtype), index)
    past = prefix[0][0].shape[1] if prefix else 0
    h = model.embed_tokens(torch.tensor([list(ids)], dtype=torch.long, device=loaded.device))  # [1, N, d]
    pos = torch.arange(past, past + len(ids), device=h.device)[None]  # [1, N]
    emb = model.rotary_emb(h, position_ids=pos)
    masks = _layer_masks(loaded, h, pos, cache)
    for index, layer in enumerate(loaded.layers):
        if not active():
            return
        state = LayerState(index)
        if Capture.HIDDEN in needs:
            state.hidden = h[0]  # [N, d]
        if Capture.NORMED in needs:
            state.normed = cast(Any, layer).input_layernorm(h)[0]  # [N, d]
        h = layer(h, attention_mask=masks[index], position_ids=pos, cache=cache, use_cache=True, position_embeddings=emb)
        if Capture.KV in needs:
            keys, values = layer_kv(cache, index)  # [1, n_kv, P + N, hd]
            state.keys, state.values = keys[0, :, past:], values[0, :, past:]  # [n_kv, N, hd]
        on_layer(state)


@torch.inference_mode()
def batch_capture(
    loaded: LoadedModel,
    rows: Sequence[Sequence[int]],
    needs: Sequence[Capture],
    on_layer: Callable[[int, LayerState], None],
    active: Callable[[int], bool] = lambda row: True,
) -> None:
    """One forward over several contexts at once, each row's per-layer states handed to
    on_layer(row, state) right after the layer ran, without hooks (nothing module-global, so
    nothing one request could see of another's).

    Runs the decoder stack itself: embed -> rotary -> each layer -> (no final norm, no LM head).
    Rows are right-padded to the longest: with causal attention a real position only attends
    to positions before it, all real, and positions are 0..T-1 as at batch 1, so every row's
    states over its own tokens equal a batch-1 forward's up to float rounding (the matmuls see
    other shapes); no padding mask is needed and sdpa takes its is_causal path as at batch 1.
    Before each layer, rows for which active(row) is false leave the batch (a cancelled
    request stops costing compute at the next layer boundary) and the padded length shrinks to
    the longest row left. State tensors are views into the batch's tensors, on the model's
    device: keys/values [n_kv, T_row, hd], hidden/normed [T_row, d].
    """
    model = loaded.model.model
    lengths = [len(r) for r in rows]
    width = max(lengths)
    ids = torch.zeros((len(rows), width), dtype=torch.long)  # [B, T], right-padded with id 0
    for b, r in enumerate(rows):
        ids[b, : len(r)] = torch.tensor(list(r), dtype=torch.long)
    h = model.embed_tokens(ids.to(loaded.device))  # [B, T, d]
    live = list(range(len(rows)))  # batch position -> caller's row
    masks: list[object] = []
    emb: tuple[torch.Tensor, torch.Tensor] | None = None
    pos = torch.empty(0)
    for index, layer in enumerate(loaded.layers):
        keep = [b for b, row in enumerate(live) if active(row)]
        if not keep:
            return
        if len(keep) < len(live) or emb is None:
            if len(keep) < len(live):
                live = [live[b] for b in keep]
                width = max(lengths[row] for row in live)
                h = h[keep, :width]  # [B', T', d]
            pos = torch.arange(width, device=h.device)[None]  # [1, T]
            emb = model.rotary_emb(h, position_ids=pos)  # (cos, sin), [1, T, hd] each
            masks = _layer_masks(loaded, h, pos)
        tap = _LayerTap()
        wanted = Capture.NONE
        for row in live:
            wanted |= needs[row]
        normed = cast(Any, layer).input_layernorm(h) if Capture.NORMED in wanted else None  # [B, T, d], as the layer computes it
        out = layer(h, attention_mask=masks[index], position_ids=pos, cache=tap, use_cache=True, position_embeddings=emb)
        for b, row in enumerate(live):
            n, need = lengths[row], needs[row]
            state = LayerState(index)
            if Capture.KV in need:
                state.keys, state.values = tap.keys[b, :, :n], tap.values[b, :, :n]  # [n_kv, T_row, hd]
            if Capture.HIDDEN in need:
                state.hidden = h[b, :n]  # [T_row, d]
            if normed is not None and Capture.NORMED in need:
                state.normed = normed[b, :n]  # [T_row, d]
            on_layer(row, state)
        h = out
