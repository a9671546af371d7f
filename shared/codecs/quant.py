"""`quant`: the producer's K/V quantized KIVI-style to int8, int4 or int2 (shared.quantize), rebuilt on
the consumer in its own dtype. A baseline for SCD at a fixed ~2x / ~4x / ~8x (plus scales) saving
over 16-bit KV. `quant_schema` is reused by SCD's quantized action.

Options: `bits` "8" | "4" | "2" (default "8"); `group_size` a power of two in 8..128 (default "32"):
tokens per key group (per channel) and channels per value group (per token).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

import torch

from shared import finite, quantize
from shared.codecs.base import (
    CacheDecoder,
    Capture,
    Codec,
    EncodeRequest,
    LayerEncoder,
    LayerJob,
    LayerState,
    PayloadSpec,
    Schema,
    StreamInfo,
    register,
)
from shared.codecs.raw import KVDecoder
from shared.errors import DataLoss


def parse_bits(value: str) -> int:
    if value not in ("8", "4", "2"):
        raise ValueError("must be '8', '4' or '2'")
    return int(value)


def parse_group_size(value: str) -> int:
    try:
        size = int(value)
    except ValueError:
        raise ValueError("must be an integer power of two in 8..128") from None
    if not 8 <= size <= 128 or size & (size - 1):
        raise ValueError("must be a power of two in 8..128")
    return size


def quant_schema(kv_shape: tuple[int, int, int], bits: int, group_size: int) -> Schema:
    """The six payloads of one quantized layer for K/V of kv_shape [n_kv, T, hd]."""
    return {
        name: PayloadSpec(torch.uint8 if name.endswith("codes") else torch.float16, shape)
        for name, shape in quantize.payload_shapes(kv_shape, bits, group_size).items()
    }


def decode_quant(
    layer: int,
    payloads: dict[str, torch.Tensor],
    kv_shape: tuple[int, int, int],
    bits: int,
    group_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (keys, values) [n_kv, T, hd] on device; DataLoss when a scale or min is not finite.
    The scales are checked where they are decoded (one host sync): on a GPU, a check on the CPU
    was most of the 7B shape's rebuild (bench.serving.ttft --profile-dir on an H200)."""
    on_device = {name: payloads[name].to(device) for name in quantize.PAYLOADS}
    names = ("k_scale", "k_min", "v_scale", "v_min")
    for name, ok in zip(names, finite.finite_each([on_device[name] for name in names])):
        if not ok:
            raise DataLoss(f"layer {layer}: payload '{name}' holds non-finite values")
    return quantize.decode_kv(on_device, bits, group_size, kv_shape)


SCALES = ("k_scale", "v_scale")


def check_payload(layer: int, name: str, payload: torch.Tensor) -> None:
    """DataLoss for a quantized payload no encoder makes: a negative scale (quantize._quantize's
    are >= 0: max - min, rounded up). Checked as the payload completes, before the layer is
    handed over. A zero or tiny scale with any codes is not refused: it decodes to what some
    valid encoding of those values would (a lie the stream's format cannot show; the audit's part)."""
    if name in SCALES:
        refuse_negative_scales(layer, name, payload)


def refuse_negative_scales(layer: int, name: str, payload: torch.Tensor) -> None:
    """DataLoss naming the payload when a scale is negative: every encoder's scales are >= 0
    (quant's here, SCD's int8 rows')."""
    if bool((payload < 0).any()):
        raise DataLoss(f"layer {layer}: payload '{name}' holds negative scales (an encoder's are >= 0)")


def quant_layout(group_size: int) -> dict[str, tuple[int, int]]:
    """Token axes of the quantized payloads: codes and value scales per token, key scales per
    group of group_size tokens (chunks cut only at multiples of group_size)."""
    return {
        "k_codes": (1, 1),
        "k_scale": (1, group_size),
        "k_min": (1, group_size),
        "v_codes": (1, 1),
        "v_scale": (1, 1),
        "v_min": (1, 1),
    }


class QuantEncoder(LayerEncoder):
    captures = Capture.KV
    per_token = True  # per token within a key group: chunks cut at group multiples (chunk_layouts)

    def __init__(self, bits: int, group_size: int):
        self.bits = bits
        self.group_size = group_size

    def encode(self, state: LayerState) -> dict[str, torch.Tensor]:
        return quantize.encode_kv(*state.kv(), self.bits, self.group_size)  # see shared.quantize

    def token_layout(self, layer: int) -> dict[str, tuple[int, int]] | None:
        return quant_layout(self.group_size)


class QuantDecoder(KVDecoder):
    def __init__(self, codec: Codec, stream: StreamInfo):
        super().__init__(codec, stream)
        self.bits = parse_bits(stream.options["bits"])
        self.group_size = parse_group_size(stream.options["group_size"])

    def expected(self, layer: int) -> Schema:
        return quant_schema(self.kv_shape, self.bits, self.group_size)

    def check(self, layer: int, name: str, payload: torch.Tensor) -> None:
        check_payload(layer, name, payload)

    def add_layer(self, layer: int, payloads: dict[str, torch.Tensor]) -> None:
        keys, values = decode_quant(layer, payloads, self.kv_shape, self.bits, self.group_size, self.loaded.device)
        self.store(layer, keys, values)  # float32 [n_kv, T, hd] -> consumer dtype

    def batch_key(self, layer: int) -> Hashable | None:
        """Requests at the same bits and group size dequantize a layer together, joined along
        tokens, when each one's key groups end with its tokens (T a multiple of the group size:
        no group would straddle two requests)."""
        if self.kv_shape[1] % self.group_size:
            return None
        return (id(self.loaded), layer, self.bits, self.group_size)

    @classmethod
    def add_layer_batch(cls, jobs: Sequence[LayerJob]) -> list[BaseException | None]:
        """One dequantization over the requests' payloads joined along tokens, split back and
        stored per request (a non-finite scale fails the joined call: add_layers then retries
        request by request)."""
        decoders: list[QuantDecoder] = [job.decoder for job in jobs]  # type: ignore[misc]
        first, layer = decoders[0], jobs[0].layer
        sizes = [d.kv_shape[1] for d in decoders]
        joined = {name: torch.cat([job.payloads[name] for job in jobs], dim=1) for name in quantize.PAYLOADS}
        shape = (first.kv_shape[0], sum(sizes), first.kv_shape[2])
        keys, values = decode_quant(layer, joined, shape, first.bits, first.group_size, first.loaded.device)
        split = zip(decoders, keys.split(sizes, dim=1), values.split(sizes, dim=1))
        return KVDecoder.store_many([(d, layer, k, v) for d, k, v in split])

    def richer_options(self) -> dict[str, str] | None:
        return {**self.stream.options, "bits": "8"} if self.bits < 8 else None


@register
class QuantCodec(Codec):
    name = "quant"
    keep_heads = "either"
    description = "KIVI-style int8/int4 K/V: keys per channel, values per token, fp16 scales (options bits, group_size)"
    option_parsers = {"bits": ("8", parse_bits), "group_size": ("32", parse_group_size)}

    def encoder(self, options: Mapping[str, str], request: EncodeRequest) -> LayerEncoder:
        return QuantEncoder(parse_bits(options["bits"]), parse_group_size(options["group_size"]))

    def decoder(self, stream: StreamInfo) -> CacheDecoder:
        return QuantDecoder(self, stream)
