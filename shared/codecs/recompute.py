"""`recompute`: DroidSpeak-style selective layer recompute. The producer sends its raw K/V for
every layer outside a contiguous span [start, end) and, at layer `start`, the residual stream
entering that layer (`hidden`, [T, d], producer dtype); layers start+1..end-1 send nothing. The
consumer runs its OWN decoder layers start..end-1 over that hidden state (shared.layers.run_layers)
to make its own K/V for the span, while later layers are still in flight.

With C == P this is exact (the span is recomputed from the true hidden state). With a fine-tuned
C it replaces the producer's K/V on the span with C's, which is where C's and P's states
diverge most when the span is chosen by profiling (calibration.recompute_profile.profile_span).

Options `start`, `end` (integers, 0 <= start < end <= num_layers), or "auto" (default) for
`default_span`: the middle quarter of the layers, width = max(1, round(L / 4)) with halves
rounded up, start = (L - width) // 2; e.g. L=4 -> [1, 2), L=24 -> [9, 15), L=28 -> [10, 17).
One "auto" beside a number keeps the default width next to that number.
`resolve` turns "auto" into numbers on the consumer, so the producer, the stream header and the
stats all carry the concrete span.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from shared import finite, layers
from shared.codecs.base import (
    CacheDecoder,
    Capture,
    Codec,
    EncodeRequest,
    LayerEncoder,
    LayerState,
    PayloadSpec,
    Schema,
    StreamInfo,
    register,
)
from shared.codecs.raw import KV_LAYOUT, KVDecoder, kv_payloads, kv_schema, past_limit
from shared.errors import DataLoss, InvalidArgument


def parse_layer(value: str) -> str:
    if value != "auto":
        try:
            index = int(value)
        except ValueError:
            raise ValueError("must be a layer index or 'auto'") from None
        if index < 0:
            raise ValueError("must be >= 0")
    return value


def default_span(num_layers: int) -> tuple[int, int]:
    """The middle ~25% of the layers (see module doc)."""
    width = max(1, (num_layers + 2) // 4)
    start = (num_layers - width) // 2
    return start, start + width


def span(options: Mapping[str, str], num_layers: int, model_id: str) -> tuple[int, int]:
    """The span [start, end) the options name for a model of num_layers layers; InvalidArgument
    naming the option and the limit when it does not fit."""
    auto_start, auto_end = default_span(num_layers)
    width = auto_end - auto_start
    raw_start, raw_end = options.get("start", "auto"), options.get("end", "auto")
    where = f"for codec 'recompute' on model {model_id} with num_layers={num_layers}"
    for key, value in (("start", raw_start), ("end", raw_end)):
        try:
            parse_layer(value)
        except ValueError as exc:
            raise InvalidArgument(f"transfer.options[{key!r}]={value!r} {where}: {exc}") from None
    if raw_start == "auto" and raw_end == "auto":
        start, end = auto_start, auto_end
    elif raw_end == "auto":  # the default width from the given start
        start = int(raw_start)
        end = min(start + width, num_layers)
    elif raw_start == "auto":  # the default width up to the given end
        end = int(raw_end)
        start = max(0, end - width)
    else:
        start, end = int(raw_start), int(raw_end)
    # a given value is checked against the limit; a derived one always fits
    if raw_start != "auto" and not 0 <= start < num_layers:
        raise InvalidArgument(f"transfer.options['start']={raw_start!r} {where}: must be in 0..{num_layers - 1}")
    if not start < end <= num_layers:
        raise InvalidArgument(
            f"transfer.options['end']={raw_end!r} {where}: must be in {start + 1}..{num_layers}"
            f" (start={start} < end <= num_layers)"
        )
    return start, end


class RecomputeEncoder(LayerEncoder):
    captures = Capture.KV | Capture.HIDDEN
    per_token = True  # the hidden state entering a layer is the token's own (the forward made it causal)

    def __init__(self, start: int, end: int):
        self.start, self.end = start, end

    def encode(self, state: LayerState) -> dict[str, torch.Tensor]:
        if state.index == self.start:
            assert state.hidden is not None  # the encoder asked for Capture.HIDDEN
            return {"hidden": state.hidden}  # [T, d], residual stream entering layer `start`
        if self.start < state.index < self.end:
            return {}  # the consumer recomputes it
        return kv_payloads(state)

    def token_layout(self, layer: int) -> dict[str, tuple[int, int]] | None:
        if layer == self.start:
            return {"hidden": (0, 1)}  # [T, d]
        if self.start < layer < self.end:
            return {}
        return dict(KV_LAYOUT)


class RecomputeDecoder(KVDecoder):
    def __init__(self, codec: Codec, stream: StreamInfo):
        super().__init__(codec, stream)
        if stream.first_token:
            raise DataLoss(f"header.first_token={stream.first_token}: recompute streams are sent whole")
        info = codec.model.info
        self.start, self.end = span(stream.options, info.num_layers, info.model_id)

    def expected(self, layer: int) -> Schema:
        if layer == self.start:  # the residual stream entering the span, in the producer's dtype
            return {"hidden": PayloadSpec(self.stream.kv_torch_dtype, (self.stream.num_tokens, self.loaded.info.hidden_size))}
        if self.start < layer < self.end:
            return {}  # recomputed here
        return kv_schema(self.loaded, self.stream)

    def add_layer(self, layer: int, payloads: dict[str, torch.Tensor]) -> None:
        if layer == self.start:
            hidden = payloads["hidden"].to(self.loaded.device)
            self.check_hidden(layer, hidden)
            span_kv = layers.run_layers(self.loaded, hidden, self.start, self.end)
            for offset, (keys, values) in enumerate(span_kv):
                self.store(self.start + offset, keys, values)  # the consumer's own K/V for the span
        elif not self.start < layer < self.end:
            self.store(layer, payloads["k"], payloads["v"])

    def check_hidden(self, layer: int, hidden: torch.Tensor) -> None:
        """DataLoss unless `hidden` is finite and within what a residual stream entering `layer` can
        hold (shared.kv_bound.hidden_bounds): a finite but absurd state (1e30) would overflow the
        layer's RMSNorm into zero K/V that pass every K/V limit."""
        (peak,) = finite.peaks([hidden])
        meaning = f"the most a residual stream entering this consumer's layer {layer} can hold"
        error = past_limit(
            f"layer {layer}: payload 'hidden' values",
            peak,
            self.loaded.hidden_bounds[layer],
            meaning,
            "shared.kv_bound.hidden_bounds",
        )
        if error is not None:
            raise error


@register
class RecomputeCodec(Codec):
    name = "recompute"
    description = (
        "DroidSpeak-style: producer K/V outside a layer span, the consumer recomputes the span from a"
        " hidden state (options start, end)"
    )
    option_parsers = {"start": ("auto", parse_layer), "end": ("auto", parse_layer)}
    partial_streams = False  # the span's layers are recomputed over the whole context (RecomputeDecoder)

    def resolve(self, options: Mapping[str, str]) -> dict[str, str]:
        resolved = super().resolve(options)
        info = self.model.info
        start, end = span(resolved, info.num_layers, info.model_id)
        return {"start": str(start), "end": str(end)}

    def compute_start(self, options: Mapping[str, str]) -> tuple[float, float]:
        """The span's layers run once the hidden state at `start` arrived: after the K/V of the
        layers before it and the hidden state itself (same dtype, so the byte share is in elements)."""
        info = self.model.info
        start, end = span(options, info.num_layers, info.model_id)
        kv = 2 * info.num_kv_heads * info.head_dim  # per token per layer
        before = start * kv + info.hidden_size
        total = (info.num_layers - (end - start)) * kv + info.hidden_size
        return before / total, (start + 1) / info.num_layers

    def encoder(self, options: Mapping[str, str], request: EncodeRequest) -> LayerEncoder:
        info = self.model.info
        return RecomputeEncoder(*span(options, info.num_layers, info.model_id))

    def decoder(self, stream: StreamInfo) -> CacheDecoder:
        return RecomputeDecoder(self, stream)
