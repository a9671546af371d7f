"""KV-cache mechanics on a Hugging Face decoder: per-layer capture during the producer's
prefill, and building a consumer cache layer by layer.

Owns forward hooks and `DynamicCache` assembly. Knows nothing about codecs' payload formats,
wire types or gRPC.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from shared.models import LoadedModel


class KVSink(Protocol):
    """Where a consumer's rebuilt layers are written: a DynamicCache, or the engine's KV pool
    blocks of one request (consumer.kv_pool.SequenceKV). keys/values [1, n_kv, T, hd], post-RoPE."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> Any: ...


class Capture(enum.Flag):
    """What an encoder needs from each layer of the producer's forward."""

    NONE = 0
    KV = enum.auto()  # post-RoPE keys and values as stored in the cache
    NORMED = enum.auto()  # the layer's input_layernorm output
    HIDDEN = enum.auto()  # the residual stream entering the layer


@dataclass
class LayerState:
    """One decoder layer of the producer's prefill over T context tokens (batch 1)."""

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


def capture_states(loaded: LoadedModel, ids: list[int], needs: Capture) -> tuple[dict[int, LayerState], DynamicCache]:
    """One batch-1 forward over ids: every layer's LayerState (what `needs` asks for, on the
    model's device) and the cache that forward filled. The one way offline tools, tests and
    the producer's profile read per-layer states."""
    states: dict[int, LayerState] = {}
    cache = empty_cache(loaded)
    with layer_capture(loaded, cache, needs, lambda s: states.__setitem__(s.index, s)):
        prefill_context(loaded, torch.tensor([ids], device=loaded.device), cache)
    return states, cache
