"""`quant`: the producer's K/V quantized KIVI-style to int8 or int4 (shared.quantize), rebuilt on
the consumer in its own dtype. A baseline for SCD at a fixed ~4x / ~8x (plus scales) saving
over 16-bit KV.

Options: `bits` "8" | "4" (default "8"); `group_size` a power of two in 8..128 (default "32"):
tokens per key group (per channel) and channels per value group (per token).
"""

from __future__ import annotations

from typing import Mapping

import torch

from shared import quantize
from shared.codecs.base import Capture, CacheDecoder, Codec, LayerEncoder, LayerState, StreamInfo, register
from shared.codecs.raw import KVDecoder
from shared.errors import DataLoss, FailedPrecondition


def parse_bits(value: str) -> int:
    if value not in ("8", "4"):
        raise ValueError("must be '8' or '4'")
    return int(value)


def parse_group_size(value: str) -> int:
    try:
        size = int(value)
    except ValueError:
        raise ValueError("must be an integer power of two in 8..128") from None
    if not 8 <= size <= 128 or size & (size - 1):
        raise ValueError("must be a power of two in 8..128")
    return size


class QuantEncoder(LayerEncoder):
    captures = Capture.KV

    def __init__(self, bits: int, group_size: int):
        self.bits = bits
        self.group_size = group_size

    def encode(self, state: LayerState) -> dict[str, torch.Tensor]:
        return quantize.encode_kv(state.keys, state.values, self.bits, self.group_size)  # see shared.quantize


class QuantDecoder(KVDecoder):
    def __init__(self, codec: Codec, stream: StreamInfo):
        super().__init__(codec, stream)
        self.bits = parse_bits(stream.options.get("bits", "8"))
        self.group_size = parse_group_size(stream.options.get("group_size", "32"))

    def add_layer(self, layer: int, payloads: dict[str, torch.Tensor]) -> None:
        missing = set(quantize.PAYLOADS) - set(payloads)
        if missing:
            raise DataLoss(f"layer {layer}: payload(s) {sorted(missing)} missing")
        device = self.loaded.device
        on_device = {name: payloads[name].to(device) for name in quantize.PAYLOADS}
        try:
            keys, values = quantize.decode_kv(on_device, self.bits, self.group_size, self.expected)
        except ValueError as exc:
            raise FailedPrecondition(f"layer {layer}: {exc} [kv_heads, tokens, head_dim]") from None
        self.store(layer, keys, values)  # float32 [n_kv, T, hd] -> consumer dtype


@register
class QuantCodec(Codec):
    name = "quant"
    description = "KIVI-style int8/int4 K/V: keys per channel, values per token, fp16 scales (options bits, group_size)"
    option_parsers = {"bits": ("8", parse_bits), "group_size": ("32", parse_group_size)}

    def encoder(self, options: Mapping[str, str], num_tokens: int) -> LayerEncoder:
        return QuantEncoder(parse_bits(options["bits"]), parse_group_size(options["group_size"]))

    def decoder(self, stream: StreamInfo) -> CacheDecoder:
        return QuantDecoder(self, stream)
