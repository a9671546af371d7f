"""`raw`: the producer's post-RoPE K/V, byte for byte in the producer's dtype.

With a different consumer model of the same architecture this is "naive reuse": the consumer
attends over the producer's cache as if it were its own. Also owns what every K/V-carrying
codec shares: the raw K/V payloads and their schema (`kv_payloads`, `kv_schema`, reused by
SCD's raw action) and `KVDecoder`, which assembles the consumer's cache layer by layer and
refuses K/V that are not finite or past what the consumer's own layer can produce
(shared.kv_bound: a limit from its weights, so 3e38 or 1e30 fail whether or not they overflow).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence

import torch

from shared import finite, kv, kv_bound
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
from shared.errors import DataLoss, FailedPrecondition
from shared.models import LoadedModel


def kv_payloads(state: LayerState) -> dict[str, torch.Tensor]:
    keys, values = state.kv()  # the encoder asked for Capture.KV
    return {"k": keys, "v": values}  # [n_kv, T, hd] each, post-RoPE, producer dtype


def kv_schema(model: LoadedModel, stream: StreamInfo) -> Schema:
    info = model.info
    spec = PayloadSpec(stream.kv_torch_dtype, (info.num_kv_heads, stream.sent_tokens, info.head_dim))
    return {"k": spec, "v": spec}


KV_LAYOUT = {"k": (1, 1), "v": (1, 1)}  # [n_kv, T, hd]: tokens on axis 1


class RawEncoder(LayerEncoder):
    captures = Capture.KV
    per_token = True
    computes = False

    def encode(self, state: LayerState) -> dict[str, torch.Tensor]:
        return kv_payloads(state)

    def token_layout(self, layer: int) -> dict[str, tuple[int, int]] | None:
        return dict(KV_LAYOUT)


class KVDecoder(CacheDecoder):
    """Puts each layer's K/V into a cache of the consumer model (shared by KV-carrying codecs)."""

    def __init__(self, codec: Codec, stream: StreamInfo):
        self.loaded = codec.model
        self.stream = stream
        self.cache: kv.KVSink | None = None  # bind()'s target, or a DynamicCache of its own made at the first layer
        self.received: set[int] = set()
        info = codec.model.info
        if stream.num_layers != info.num_layers:
            raise FailedPrecondition(
                f"producer stream has {stream.num_layers} layers, consumer model {info.model_id} has {info.num_layers}"
            )
        self.kv_shape = (info.num_kv_heads, stream.sent_tokens, info.head_dim)

    def limits(self, layer: int) -> tuple[float, float]:
        """The most |element| of this layer's rebuilt (keys, values) may reach: what the consumer's
        own layer can produce (shared.kv_bound, margin included)."""
        bound = self.loaded.kv_bounds[layer]
        return bound.keys, bound.values

    def store(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Keep one layer's rebuilt K/V ([n_kv, T, hd] each) in the consumer's dtype; DataLoss
        when a value is not finite or past `limits` (a corrupt payload must never reach attention)."""
        error = KVDecoder.store_many([(self, layer, keys, values)])[0]
        if error is not None:
            raise error

    @staticmethod
    def store_many(items: Sequence[tuple[KVDecoder, int, torch.Tensor, torch.Tensor]]) -> list[BaseException | None]:
        """store() of several requests' layers (decoder, layer, keys, values): one check of every
        tensor's peak |value| against its decoder's `limits` (shared.finite.peaks, one host sync;
        NaN and inf fail it too) and the writes batched where the caches allow
        (shared.kv.put_layers). Per item, its own error or None: one request's bad values never
        keep another's from its cache."""
        errors: list[BaseException | None] = [None] * len(items)
        ready: list[tuple[int, KVDecoder, int, torch.Tensor, torch.Tensor]] = []
        for i, (d, layer, keys, values) in enumerate(items):
            keys, values = keys.to(d.loaded.device, d.loaded.dtype), values.to(d.loaded.device, d.loaded.dtype)
            for name, t in (("keys", keys), ("values", values)):
                if tuple(t.shape) != d.kv_shape:
                    errors[i] = DataLoss(f"layer {layer}: rebuilt {name} {list(t.shape)}, expected {list(d.kv_shape)}")
                    break
            else:
                ready.append((i, d, layer, keys, values))
        peaks = finite.peaks([t for _, _, _, keys, values in ready for t in (keys, values)])
        kept = []
        for n, (i, d, layer, keys, values) in enumerate(ready):
            refused = _out_of_bounds(layer, zip(("keys", "values"), peaks[2 * n : 2 * n + 2], d.limits(layer)))
            if refused is None:
                kept.append((i, d, layer, keys, values))
            errors[i] = refused
        ready = kept
        for _, d, _, _, _ in ready:
            if d.cache is None:
                d.cache = kv.empty_cache(d.loaded)
        written = kv.put_layers([(d.cache, layer, keys, values) for _, d, layer, keys, values in ready])  # type: ignore[misc]
        for (i, d, layer, _, _), error in zip(ready, written):
            if error is None:
                d.received.add(layer)
            errors[i] = error
        return errors

    def bind(self, target: kv.KVSink) -> None:
        self.cache = target

    def finish(self) -> kv.KVSink:
        missing = sorted(set(range(self.stream.num_layers)) - self.received)
        if missing:
            raise DataLoss(f"stream ended without layers {missing}")
        assert self.cache is not None  # every layer was stored
        return self.cache


def _out_of_bounds(layer: int, checks) -> DataLoss | None:
    """The first (name, peak, limit) whose peak is not finite or past its limit, as DataLoss."""
    for name, peak, limit in checks:
        error = past_limit(f"layer {layer}: rebuilt {name}", peak, limit, f"the most this consumer's layer {layer} can produce")
        if error is not None:
            return error
    return None


def past_limit(subject: str, peak: float, limit: float, meaning: str, bound: str = "shared.kv_bound") -> DataLoss | None:
    """DataLoss naming `subject` when its peak |value| is not finite or past `limit` (what `meaning`
    says it is: MARGIN x a bound from the consumer's weights, `bound`); None when inside."""
    if not math.isfinite(peak):
        return DataLoss(f"{subject} hold non-finite values (corrupt payload)")
    if peak > limit:
        return DataLoss(
            f"{subject} reach |{peak:.4g}|, past {limit:.4g}, {meaning} ({kv_bound.MARGIN:g}x the bound from its "
            f"weights, {bound}; corrupt payload)"
        )
    return None


class RawDecoder(KVDecoder):
    def expected(self, layer: int) -> Schema:
        return kv_schema(self.loaded, self.stream)

    def add_layer(self, layer: int, payloads: dict[str, torch.Tensor]) -> None:
        self.store(layer, payloads["k"], payloads["v"])

    def batch_key(self, layer: int) -> Hashable | None:
        """Raw layers of requests on the same model are stored together (store_many)."""
        return (id(self.loaded), layer)

    @classmethod
    def add_layer_batch(cls, jobs: Sequence[LayerJob]) -> list[BaseException | None]:
        return KVDecoder.store_many([(job.decoder, job.layer, job.payloads["k"], job.payloads["v"]) for job in jobs])  # type: ignore[misc]


@register
class RawCodec(Codec):
    name = "raw"
    description = "producer's K/V bytes in its dtype (naive reuse when the models differ)"
    keep_heads = "either"

    def encoder(self, options: Mapping[str, str], request: EncodeRequest) -> LayerEncoder:
        return RawEncoder()

    def decoder(self, stream: StreamInfo) -> CacheDecoder:
        return RawDecoder(self, stream)
