"""`raw`: the producer's post-RoPE K/V, byte for byte in the producer's dtype.

With a different consumer model of the same architecture this is "naive reuse": the consumer
attends over the producer's cache as if it were its own.
"""

from __future__ import annotations

from typing import Mapping

import torch
from transformers import DynamicCache

from shared import kv
from shared.codecs.base import Capture, CacheDecoder, Codec, LayerEncoder, LayerState, StreamInfo, register
from shared.errors import DataLoss, FailedPrecondition


class RawEncoder(LayerEncoder):
    captures = Capture.KV

    def encode(self, state: LayerState) -> dict[str, torch.Tensor]:
        return {"k": state.keys, "v": state.values}  # [n_kv, T, hd] each


class KVDecoder(CacheDecoder):
    """Puts each layer's K/V into a cache of the consumer model (shared by KV-carrying codecs)."""

    def __init__(self, codec: Codec, stream: StreamInfo):
        self.loaded = codec.model
        self.stream = stream
        self.cache = kv.empty_cache(codec.model)
        self.received: set[int] = set()
        info = codec.model.info
        if stream.num_layers != info.num_layers:
            raise FailedPrecondition(
                f"producer stream has {stream.num_layers} layers, consumer model {info.model_id} has {info.num_layers}"
            )
        self.expected = (info.num_kv_heads, stream.num_tokens, info.head_dim)

    def check(self, layer: int, name: str, tensor: torch.Tensor) -> None:
        if tuple(tensor.shape) != self.expected:
            raise FailedPrecondition(
                f"layer {layer} payload '{name}' has shape {list(tensor.shape)}, consumer expects {list(self.expected)}"
                " [kv_heads, tokens, head_dim]"
            )

    def store(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        device, dtype = self.loaded.device, self.loaded.dtype
        kv.put_layer(self.cache, layer, keys.to(device, dtype), values.to(device, dtype))
        self.received.add(layer)

    def add_layer(self, layer: int, payloads: dict[str, torch.Tensor]) -> None:
        missing = {"k", "v"} - set(payloads)
        if missing:
            raise DataLoss(f"layer {layer}: payload(s) {sorted(missing)} missing")
        for name in ("k", "v"):
            self.check(layer, name, payloads[name])
        self.store(layer, payloads["k"], payloads["v"])

    def finish(self, context_ids: torch.Tensor) -> DynamicCache:
        missing = sorted(set(range(self.stream.num_layers)) - self.received)
        if missing:
            raise DataLoss(f"stream ended without layers {missing}")
        return self.cache


@register
class RawCodec(Codec):
    name = "raw"
    description = "producer's K/V bytes in its dtype (naive reuse when the models differ)"

    def encoder(self, options: Mapping[str, str], num_tokens: int) -> LayerEncoder:
        return RawEncoder()

    def decoder(self, stream: StreamInfo) -> CacheDecoder:
        return KVDecoder(self, stream)
