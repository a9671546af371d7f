"""`oracle`: only token ids cross; the consumer prefills the context with its own model.

The reference every other codec is measured against. The producer is never called.
"""

from __future__ import annotations

from typing import Mapping

import torch
from transformers import DynamicCache

from shared import kv
from shared.codecs.base import CacheDecoder, Codec, LayerEncoder, StreamInfo, register
from shared.errors import InvalidArgument


class OracleDecoder(CacheDecoder):
    def __init__(self, codec: Codec):
        self.loaded = codec.model

    def add_layer(self, layer: int, payloads: dict[str, torch.Tensor]) -> None:
        raise InvalidArgument("oracle codec receives no payloads")

    def finish(self, context_ids: torch.Tensor) -> DynamicCache:
        return kv.prefill_context(self.loaded, context_ids)


@register
class OracleCodec(Codec):
    name = "oracle"
    description = "tokens only: the consumer prefills the context itself (reference quality)"
    uses_producer = False

    def encoder(self, options: Mapping[str, str], num_tokens: int) -> LayerEncoder:
        raise InvalidArgument("transfer.name: 'oracle' sends no payloads; the producer does not serve it")

    def decoder(self, stream: StreamInfo) -> CacheDecoder:
        return OracleDecoder(self)
