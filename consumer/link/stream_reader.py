"""The one place the consumer enforces the producer's stream contract: a state machine fed the
Prefill stream's messages in order, turning them into engine events or failing at the first
message that breaks the contract.

Contract (protos/scd/v1/producer.proto, README "Stream contract"):
- exactly one header, first, that agrees with the request: token count, the first token sent and
  the prefix key (when the consumer holds a prefix), codec name and resolved options, codec format
  version, layer count, a whitelisted kv dtype, a chunk size within the
  wire ceiling, bounded metadata; the codec's decoder accepts it (artifact of this pair, ...);
- then layers in strictly increasing order, each complete before the next; a layer carries
  exactly the payloads its decoder's schema (`CacheDecoder.expected`) names, one after the
  other, each with the schema's element type and shape, split into consecutive chunks of
  exactly `max_chunk_bytes` (the last one shorter), CRC32C-checked;
- exactly one trailer, last, whose totals match what arrived; nothing after it.
A batch (`PrefillResponse.batch`, several stream messages in one gRPC message) is read entry by
entry, each under the rules above as if it had come alone, so a bad entry fails where it is, as
its unbatched equivalent would; a batch is never nested, never empty, and its entries together
stay within one message's bounds (MAX_BATCH_MESSAGES, MAX_CHUNKS_PER_MESSAGE, MAX_MESSAGE_DATA).
Violations raise DataLoss (corrupt or inconsistent) or FailedPrecondition (incompatible),
naming the layer, payload and field. Memory is bounded by the request: a payload's buffer is
allocated from the schema (the request's token count and the codec), never from a peer's number,
and a chunk is checked before it is copied. Knows nothing about grpc: it reads a message's
serialized bytes (shared.wire_bytes: a payload's bytes are used where they arrived, or copied once
into the payload's buffer when it spans chunks; one CRC pass) or, from tests and tools, protobuf
messages.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from shared import keep_wire, wire, wire_bytes
from shared.codecs import CacheDecoder, Codec, PayloadSpec, StreamInfo
from shared.codecs.kept import KeepRequest, KeptDecoder
from shared.errors import DataLoss, FailedPrecondition, ServiceError
from shared.models import DTYPES, ModelInfo
from shared.pb import producer_pb2

MAX_METADATA_ENTRIES = 16
MAX_METADATA_CHARS = 1024  # per key or value
MIN_CHUNK_BYTES = 1024


@dataclass(frozen=True)
class Expectation:
    """What the request fixes about the stream before it starts."""

    num_tokens: int  # the request's context length
    codec: Codec
    options: Mapping[str, str]  # resolved by the consumer
    consumer: ModelInfo
    first_token: int = 0  # asked for payloads from this token on (the consumer holds the prefix)
    prefix_key: str = ""  # the key naming that prefix, sent with first_token
    cache_salt: str = ""  # the request's tenant (GenerateJob.tenant), sent as PrefillRequest.cache_salt
    keep: KeepRequest | None = None  # a keep transfer's selection, resolved for the codec (PrefillRequest.keep)


@dataclass(frozen=True)
class StreamHeader:
    stream: StreamInfo
    decoder: CacheDecoder
    chunk_tokens: int = 0  # the producer's chunk size (0: no chunked reuse there)


@dataclass(frozen=True)
class LayerPayloads:
    layer: int
    payloads: dict[str, torch.Tensor]
    nbytes: int  # wire bytes of this layer's chunks


@dataclass(frozen=True)
class StreamTrailer:
    payload_bytes: int
    prefill_ms: float
    encode_ms: float
    store_hit: bool
    reused_tokens: int = 0
    computed_tokens: int = 0
    queue_ms: float = 0.0  # the producer's wait for its forward
    # measured here, on the stream itself (consumer.auto.planner's link and round-trip estimates):
    header_ms: float = 0.0  # reader created (call start) to the header
    span_ms: float = 0.0  # first to last payload chunk (from the message before, when the first came in a batch)
    span_bytes: int = 0  # chunk bytes that arrived after the first chunk (all of a first batch's)
    messages: int = 0  # gRPC messages that carried the stream (a batch counts once)


Event = StreamHeader | LayerPayloads | StreamTrailer


@dataclass
class _Open:
    """The payload being received."""

    kind: str
    spec: PayloadSpec
    count: int
    buffer: bytearray | None  # None for a one-chunk payload: its tensor views the received bytes
    next_index: int = 0
    filled: int = 0


@dataclass
class _Layer:
    index: int
    expected: dict[str, PayloadSpec]
    done: dict[str, torch.Tensor] = field(default_factory=dict)
    nbytes: int = 0


MAX_TRAILER_MS = 86_400_000.0  # one day: a producer's timing past it is corrupt, not slow (it feeds the auto planner)


def _finite(value: float, name: str) -> float:
    if value != value or not 0 <= value <= MAX_TRAILER_MS:
        raise DataLoss(f"trailer.{name}: {value} is not a number of milliseconds in 0..{MAX_TRAILER_MS:.0f} (one day)")
    return value


class StreamReader:
    def __init__(self, expect: Expectation):
        self.expect = expect
        self.state = "header"  # header -> layers -> done
        self.decoder: CacheDecoder | None = None
        self.num_layers = 0
        self.max_chunk = 0
        self.layer: _Layer | None = None
        self.open: _Open | None = None
        self._next_layer = 0  # the lowest layer index that may start next
        self.totals = {"payload_bytes": 0, "chunk_count": 0, "payload_count": 0}
        self.opened_at = time.perf_counter()  # the client creates the reader as it starts the call
        self.header_at = self.first_chunk_at = self.last_chunk_at = 0.0
        self.span_bytes = 0
        self.messages = 0  # gRPC messages fed (a batch counts once)
        self.arrived_at = self.previous_at = self.opened_at  # this message's arrival, and the one before's
        self.in_batch = False  # the message being read is a batch
        self.first_chunk_message = 0  # the one that brought the first chunk

    # --- one message ----------------------------------------------------------------------
    def feed(self, message: producer_pb2.PrefillResponse | bytes) -> list[Event]:
        """One received message: its serialized bytes (the serving path) or a protobuf message. A
        batch's entries are read one by one, each as if it had come alone."""
        self.messages += 1
        self.previous_at, self.arrived_at = self.arrived_at, time.perf_counter()
        kind, value = self._parse(message)
        self.in_batch = kind == "batch"
        if kind != "batch":
            return self._one(kind, value)
        events: list[Event] = []
        entries = data = chunks = 0
        for entry in value:
            entries += 1
            if entries > wire_bytes.MAX_BATCH_MESSAGES:
                raise DataLoss(f"batch: more than {wire_bytes.MAX_BATCH_MESSAGES} messages in one batch (MAX_BATCH_MESSAGES)")
            kind, value = self._parse(entry)
            if kind == "batch":
                raise DataLoss(f"batch: entry {entries} is itself a batch (batches do not nest)")
            if kind in ("chunk", "layer_chunks"):
                data += sum(len(c.data) for c in value)
                chunks += len(value)
                self._check_batch_bounds(data, chunks)
            events += self._one(kind, value)
        if not entries:
            raise DataLoss("batch: a batch with no messages")
        return events

    @staticmethod
    def _parse(message: producer_pb2.PrefillResponse | bytes | memoryview) -> tuple[str, Any]:
        """(oneof kind, value): chunks as a list of ChunkViews, a batch as an iterator of entries."""
        if isinstance(message, (bytes, memoryview)):
            return wire_bytes.parse_response(message)
        kind = message.WhichOneof("kind") or ""
        if kind == "chunk":
            return kind, [wire_bytes.ChunkView.of(message.chunk)]
        if kind == "layer_chunks":
            return kind, [wire_bytes.ChunkView.of(c) for c in message.layer_chunks.chunks]
        if kind == "batch":
            return kind, iter(message.batch.responses)
        return kind, getattr(message, kind) if kind else None

    @staticmethod
    def _check_batch_bounds(data: int, chunks: int) -> None:
        if data > wire_bytes.MAX_MESSAGE_DATA:
            raise DataLoss(f"batch: {data} data bytes in one message, more than {wire_bytes.MAX_MESSAGE_DATA} (MAX_MESSAGE_DATA)")
        if chunks > wire_bytes.MAX_CHUNKS_PER_MESSAGE:
            raise DataLoss(f"batch: more than {wire_bytes.MAX_CHUNKS_PER_MESSAGE} chunks in one message (MAX_CHUNKS_PER_MESSAGE)")

    def _one(self, kind: str, value) -> list[Event]:
        """One stream message (alone, or an entry of a batch) under the contract."""
        if self.state == "done":
            raise DataLoss(f"producer sent a {kind or 'empty'} message after the trailer")
        if kind == "header":
            self.header_at = self.arrived_at
            return [self._header(value)]
        if self.state == "header":
            raise DataLoss(f"producer sent a {kind or 'empty'} message before the header")
        if kind in ("chunk", "layer_chunks"):
            chunks: list[wire_bytes.ChunkView] = value
            nbytes = sum(len(c.data) for c in chunks)
            if not chunks:
                raise DataLoss("layer_chunks: a message with no chunks")
            if kind == "layer_chunks" and any(c.layer != chunks[0].layer for c in chunks):
                raise DataLoss(
                    f"layer_chunks: chunks of layers {sorted({c.layer for c in chunks})} in one message (the contract:"
                    " consecutive chunks of one layer)"
                )
            if kind == "layer_chunks" and nbytes > wire_bytes.MAX_MESSAGE_DATA:  # a chunk's own bound is checked below
                raise DataLoss(
                    f"layer_chunks: {nbytes} data bytes in one message, more than {wire_bytes.MAX_MESSAGE_DATA} "
                    f"(MAX_MESSAGE_DATA)"
                )
            self._arrived(nbytes)
            events: list[Event] = []
            for c in chunks:
                events += self._chunk(c)
            return events
        if kind == "trailer":
            return self._trailer(value)
        raise DataLoss("producer sent a message with no header, chunk or trailer")

    def _arrived(self, nbytes: int) -> None:
        """The link timing: chunk bytes that came in gRPC messages after the first chunk's one, from
        its arrival. A batch is written as soon as the message before it was (the producer never
        waits to fill one), so when the first chunk comes in a batch the span starts at the arrival
        of the message before and counts the batch's bytes: a replay in one batch is still a link
        sample."""
        if not self.first_chunk_at:
            if self.in_batch:
                self.first_chunk_at, self.first_chunk_message = self.previous_at, self.messages - 1
            else:
                self.first_chunk_at, self.first_chunk_message = self.arrived_at, self.messages
        if self.messages > self.first_chunk_message:
            self.span_bytes += nbytes
        self.last_chunk_at = self.arrived_at

    def end(self) -> None:
        """The stream closed: it must have ended with its trailer."""
        if self.state != "done":
            where = "before its header" if self.state == "header" else f"in layer {self.layer.index if self.layer else 0}"
            raise DataLoss(f"producer stream ended without a trailer ({where})")

    # --- header ---------------------------------------------------------------------------
    def _header(self, h: producer_pb2.PrefillHeader) -> StreamHeader:
        if self.state != "header":
            raise DataLoss("producer sent a second header")
        e = self.expect
        if h.num_tokens != e.num_tokens:
            raise DataLoss(f"header.num_tokens={h.num_tokens}, the request has {e.num_tokens} context tokens")
        if h.codec.name != e.codec.name:
            raise DataLoss(f"header.codec.name={h.codec.name[:64]!r}, the request asked for {e.codec.name!r}")
        if dict(h.codec.options) != dict(e.options):
            raise DataLoss(
                f"header.codec.options={dict(list(h.codec.options.items())[:8])} differ from the request's "
                f"resolved options {dict(e.options)}"
            )
        if (h.first_token, h.prefix_key) != (e.first_token, e.prefix_key):
            raise DataLoss(
                f"header.first_token={h.first_token} / prefix_key={h.prefix_key[:16]!r}: the request asked for "
                f"first_token={e.first_token} / prefix_key={e.prefix_key[:16]!r}"
            )
        if h.codec_format_version != e.codec.format_version:
            raise FailedPrecondition(
                f"header.codec_format_version={h.codec_format_version}: codec '{e.codec.name}' here "
                f"decodes format {e.codec.format_version}"
            )
        if h.num_layers != e.consumer.num_layers:
            raise FailedPrecondition(
                f"header.num_layers={h.num_layers}, consumer model {e.consumer.model_id} has {e.consumer.num_layers} layers"
            )
        if h.kv_dtype not in DTYPES:
            raise DataLoss(f"header.kv_dtype={h.kv_dtype[:32]!r} is not one of {sorted(DTYPES)}")
        max_chunk = h.max_chunk_bytes or wire.DEFAULT_MAX_CHUNK_BYTES
        if not MIN_CHUNK_BYTES <= max_chunk <= wire.DEFAULT_MAX_CHUNK_BYTES:
            raise DataLoss(f"header.max_chunk_bytes={max_chunk} not in {MIN_CHUNK_BYTES}..{wire.DEFAULT_MAX_CHUNK_BYTES}")
        metadata = dict(h.codec_metadata)
        if len(metadata) > MAX_METADATA_ENTRIES or any(
            len(k) > MAX_METADATA_CHARS or len(v) > MAX_METADATA_CHARS for k, v in metadata.items()
        ):
            raise DataLoss(
                f"header.codec_metadata: more than {MAX_METADATA_ENTRIES} entries or an entry longer than "
                f"{MAX_METADATA_CHARS} characters"
            )
        for described, value in h.producer.ListFields():  # kept per request (and by the auto planner's memo)
            if isinstance(value, str) and len(value) > MAX_METADATA_CHARS:
                raise DataLoss(f"header.producer.{described.name}: {len(value)} characters, more than {MAX_METADATA_CHARS}")
        kept = self._kept(h)
        stream = StreamInfo(
            h.num_layers,
            h.num_tokens,
            h.kv_dtype,
            dict(h.codec.options),
            metadata,
            h.codec_format_version,
            h.producer.weight_digest,
            h.first_token,
            h.producer.identity,
            kept,
        )
        self.decoder = e.codec.decoder(stream)
        if e.keep is not None:
            self.decoder = KeptDecoder(self.decoder, stream, e.keep, e.consumer.num_kv_heads)
        self.num_layers, self.max_chunk, self.state = h.num_layers, max_chunk, "layers"
        return StreamHeader(stream, self.decoder, h.chunk_tokens)

    def _kept(self, h: producer_pb2.PrefillHeader) -> int:
        """header.keep and kept_tokens against the request's keep selection: the kept count."""
        want = self.expect.keep
        try:
            got = keep_wire.from_pb(h.keep) if h.HasField("keep") else None
        except ServiceError as exc:
            raise DataLoss(f"header.keep: {exc}") from None
        if got != want:
            asked = want.label if want is not None else "no keep set"
            raise DataLoss(f"header.keep={got.label if got is not None else 'unset'}, the request asked for {asked}")
        kept = want.kept(self.expect.num_tokens) if want is not None else 0
        if h.kept_tokens != kept:
            raise DataLoss(
                f"header.kept_tokens={h.kept_tokens}, the request's keep set holds {kept} of {self.expect.num_tokens} tokens"
            )
        return kept

    # --- chunks ---------------------------------------------------------------------------
    def _start_layer(self, index: int) -> _Layer:
        assert self.decoder is not None
        return _Layer(index, dict(self.decoder.expected(index)))

    def _close_layer(self) -> list[Event]:
        """Events for the layer in progress (complete, or an error) and the empty layers up to
        the one that starts next."""
        layer = self.layer
        if layer is None:
            return []
        missing = sorted(set(layer.expected) - set(layer.done))
        if missing:
            raise DataLoss(f"layer {layer.index}: payload(s) {missing} missing before the stream moved on")
        self.layer = None
        return [LayerPayloads(layer.index, layer.done, layer.nbytes)]

    def _advance_to(self, index: int) -> list[Event]:
        """Close the current layer and pass over layers that carry no payloads, up to `index`."""
        events = self._close_layer()
        for skipped in range(self._next_layer, index):
            expected = self._start_layer(skipped).expected
            if expected:
                raise DataLoss(f"layer {skipped}: payload(s) {sorted(expected)} missing (stream went on to layer {index})")
            events.append(LayerPayloads(skipped, {}, 0))
        self._next_layer = index
        return events

    def _chunk(self, c: wire_bytes.ChunkView) -> list[Event]:
        data = c.data
        where = f"layer {c.layer}, payload {c.kind[:64]!r}, chunk {c.chunk_index}/{c.chunk_count}"
        events: list[Event] = []
        if self.layer is None or c.layer != self.layer.index:
            if self.open is not None:
                raise DataLoss(
                    f"{where}: payload {self.open.kind!r} of layer {self.layer.index if self.layer else '?'} "
                    f"is incomplete ({self.open.next_index}/{self.open.count} chunks)"
                )
            if c.layer >= self.num_layers:
                raise DataLoss(f"{where}: layer index out of range (num_layers={self.num_layers})")
            if c.layer < self._next_layer:
                raise DataLoss(f"{where}: layers must arrive in increasing order (layer {c.layer} after {self._next_layer - 1})")
            events = self._advance_to(c.layer)
            self.layer = self._start_layer(c.layer)
            self._next_layer = c.layer + 1
        layer = self.layer
        if self.open is None:
            spec = layer.expected.get(c.kind)
            if spec is None:
                what = "a duplicate of" if c.kind in layer.done else "not one of"
                raise DataLoss(f"{where}: payload is {what} the layer's payloads {sorted(layer.expected)}")
            if c.kind in layer.done:
                raise DataLoss(f"{where}: payload sent twice")
            if c.chunk_index != 0:
                raise DataLoss(f"{where}: a payload must start at chunk 0")
            count = max(1, -(-spec.nbytes // self.max_chunk))
            self._check_spec(c, spec, count, where)
            self.open = _Open(c.kind, spec, count, bytearray(spec.nbytes) if count > 1 else None)
        part = self.open
        if c.kind != part.kind:
            raise DataLoss(f"{where}: payload {part.kind!r} is incomplete ({part.next_index}/{part.count} chunks)")
        if c.chunk_index != part.next_index:
            raise DataLoss(f"{where}: expected chunk {part.next_index} of {part.count}")
        self._check_spec(c, part.spec, part.count, where)
        want = min(self.max_chunk, part.spec.nbytes - part.filled)
        if len(data) != want:
            raise DataLoss(
                f"{where}: {len(data)} data bytes, the contract says {want} "
                f"(payload {part.spec.nbytes} bytes in chunks of {self.max_chunk})"
            )
        if wire_bytes.crc32c(data) != c.crc32c:
            raise DataLoss(f"{where}: CRC32C mismatch")
        if part.buffer is not None:
            part.buffer[part.filled : part.filled + want] = data
        part.filled += want
        part.next_index += 1
        layer.nbytes += len(data)
        self.totals["chunk_count"] += 1
        self.totals["payload_bytes"] += len(data)
        if part.next_index == part.count:
            self.open = None
            self.totals["payload_count"] += 1
            whole = part.buffer if part.buffer is not None else data  # one chunk: the received bytes themselves
            layer.done[part.kind] = wire.payload_from_bytes(whole, wire.dtype_to_pb(part.spec.dtype), part.spec.shape, where)
            assert self.decoder is not None
            self.decoder.check(layer.index, part.kind, layer.done[part.kind])  # e.g. a keep set, refused here
        return events

    @staticmethod
    def _check_spec(c: wire_bytes.ChunkView, spec: PayloadSpec, count: int, where: str) -> None:
        if c.dtype != wire.dtype_to_pb(spec.dtype):
            raise DataLoss(f"{where}: dtype {c.dtype}, the codec sends {spec.dtype} ({wire.dtype_to_pb(spec.dtype)})")
        if tuple(c.shape) != spec.shape:
            raise DataLoss(f"{where}: shape {list(c.shape)[:8]}, the codec sends {list(spec.shape)} for this request")
        if c.payload_bytes != spec.nbytes:
            raise DataLoss(f"{where}: payload_bytes={c.payload_bytes}, the schema says {spec.nbytes}")
        if c.chunk_count != count:
            raise DataLoss(
                f"{where}: chunk_count={c.chunk_count}, {spec.nbytes} bytes in chunks of the header's "
                f"max_chunk_bytes make {count}"
            )

    # --- trailer --------------------------------------------------------------------------
    def _trailer(self, t: producer_pb2.PrefillTrailer) -> list[Event]:
        if self.open is not None:
            raise DataLoss(
                f"trailer: payload {self.open.kind!r} of layer {self.layer.index if self.layer else '?'} is "
                f"incomplete ({self.open.next_index}/{self.open.count} chunks)"
            )
        events = self._advance_to(self.num_layers)
        for name, got in self.totals.items():
            if getattr(t, name) != got:
                raise DataLoss(f"trailer.{name}={getattr(t, name)}, the stream carried {got}")
        for name in ("reused_tokens", "computed_tokens"):
            if getattr(t, name) > self.expect.num_tokens:
                raise DataLoss(f"trailer.{name}={getattr(t, name)} > the context's {self.expect.num_tokens} tokens")
        if t.reused_tokens + t.computed_tokens > self.expect.num_tokens:
            raise DataLoss(
                f"trailer.reused_tokens={t.reused_tokens} + computed_tokens={t.computed_tokens} > the context's "
                f"{self.expect.num_tokens} tokens (each token is reused or computed, once)"
            )
        self.state = "done"
        events.append(
            StreamTrailer(
                t.payload_bytes,
                _finite(t.prefill_ms, "prefill_ms"),
                _finite(t.encode_ms, "encode_ms"),
                t.store_hit,
                t.reused_tokens,
                t.computed_tokens,
                _finite(t.queue_ms, "queue_ms"),
                (self.header_at - self.opened_at) * 1e3,
                (self.last_chunk_at - self.first_chunk_at) * 1e3,
                self.span_bytes,
                self.messages,
            )
        )
        return events
