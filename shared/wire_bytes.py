"""The Prefill stream's serialized bytes on the serving path: payload bytes are never wrapped in
protobuf objects, so they are copied once on each side.

Producer: `pack_layer` serializes one layer's payloads once, as `PrefillResponse.layer_chunks`
messages (consecutive chunks, at most MAX_MESSAGE_DATA bytes of data each); a caller that did not
set `PrefillRequest.accept_layer_chunks` gets each chunk as its own `chunk` message, cut from
the same bytes (`PackedLayer.messages`). The store and single flight keep and replay these bytes.
`batch_message` joins serialized messages into one `PrefillResponse.batch` by hand (tag, length,
the bytes as they are), for callers that set `PrefillRequest.accept_batches`. The bytes are what
protobuf itself writes (fields in number order, `data` last), so any protobuf reader decodes them.

Consumer: `parse_response` reads one received message's bytes: header and trailer through
protobuf (small), chunks by hand into `ChunkView`s whose `data` is a memoryview of the received
bytes (no copy), a batch as its entries, memoryviews of the received bytes, one at a time (so a
bad entry is reported where it is, after the entries before it were read). Bytes that do not
parse raise DataLoss naming the field. Knows nothing about codecs, models or transport.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import google_crc32c
import numpy as np
import torch
from google.protobuf.message import DecodeError

from shared.errors import DataLoss
from shared.pb import producer_pb2
from shared.wire import DEFAULT_MAX_CHUNK_BYTES, dtype_to_pb, tensor_bytes

MAX_MESSAGE_DATA = DEFAULT_MAX_CHUNK_BYTES  # data bytes in one layer_chunks message (4 MiB)
MAX_SHAPE_DIMS = 16  # a chunk's shape entries read at most (a codec's payloads have a few)
MAX_CHUNKS_PER_MESSAGE = 4096  # entries of one layer_chunks message (or of one batch, all entries) read at most
MAX_BATCH_MESSAGES = 4096  # entries of one batch message read at most


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_CHUNK_TAG = _varint(2 << 3 | 2)  # PrefillResponse.chunk
_LAYER_CHUNKS_TAG = _varint(100 << 3 | 2)  # PrefillResponse.layer_chunks and LayerChunks.chunks
_DATA_TAG = _varint(9 << 3 | 2)  # LayerChunk.data
_BATCH_TAG = _varint(101 << 3 | 2)  # PrefillResponse.batch
_BATCH_ENTRY_TAG = _varint(100 << 3 | 2)  # PrefillBatch.responses


def crc32c(data: memoryview | bytes | np.ndarray) -> int:
    """CRC32C of a buffer without copying it (google_crc32c refuses memoryviews, not arrays)."""
    return google_crc32c.value(np.frombuffer(data, dtype=np.uint8) if isinstance(data, memoryview) else data)


@dataclass(frozen=True)
class PackedLayer:
    """One layer's payloads, serialized once: what the producer sends and its store replays."""

    layer: int
    batches: tuple[bytes, ...]  # serialized PrefillResponse{layer_chunks}, in stream order
    spans: tuple[tuple[int, int, int], ...]  # per chunk: (batch, start, end) of its serialized LayerChunk
    payload_count: int
    payload_bytes: int

    @property
    def chunk_count(self) -> int:
        return len(self.spans)

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.batches)

    def chunks_per_message(self, layer_chunks: bool) -> list[int]:
        """The chunk count of each message `messages(layer_chunks)` yields, in the same order."""
        if not layer_chunks:
            return [1] * len(self.spans)
        counts = [0] * len(self.batches)
        for batch, _, _ in self.spans:
            counts[batch] += 1
        return counts

    def messages(self, layer_chunks: bool) -> Iterator[bytes]:
        """The serialized messages: the batches as they are, or one `chunk` message per chunk (one
        copy each, for callers from before `layer_chunks`)."""
        if layer_chunks:
            yield from self.batches
            return
        for batch, start, end in self.spans:
            yield b"".join((_CHUNK_TAG, _varint(end - start), memoryview(self.batches[batch])[start:end]))


def pack_layer(layer: int, payloads: dict[str, torch.Tensor], max_chunk_bytes: int) -> PackedLayer:
    """Split each payload into chunks of at most `max_chunk_bytes` (the contract of
    LayerChunk), CRC each, and write them into as few layer_chunks messages as MAX_MESSAGE_DATA
    allows; each payload byte is copied once, from the tensor into its message."""
    if not payloads:  # a layer with nothing to send (recompute's) has no message, as per chunk
        return PackedLayer(layer, (), (), 0, 0)
    parts: list[list] = [[]]  # per batch: the pieces its body is joined from
    sizes = [0]  # per batch: body bytes so far
    data_in = [0]  # per batch: chunk data bytes so far
    spans: list[tuple[int, int, int]] = []
    total = 0
    for kind, tensor in payloads.items():
        data = np.frombuffer(tensor_bytes(tensor), dtype=np.uint8)
        n = len(data)
        total += n
        count = max(1, -(-n // max_chunk_bytes))
        meta = producer_pb2.LayerChunk(
            layer=layer, kind=kind, chunk_count=count, dtype=dtype_to_pb(tensor.dtype), shape=list(tensor.shape), payload_bytes=n
        )
        for index in range(count):
            piece = data[index * max_chunk_bytes : (index + 1) * max_chunk_bytes]
            meta.chunk_index, meta.crc32c = index, google_crc32c.value(piece)
            head = meta.SerializeToString()  # fields 1-8; data (9) is appended after: protobuf's own order
            tail = [_DATA_TAG, _varint(len(piece)), piece] if len(piece) else []  # proto3 omits empty bytes
            size = len(head) + sum(len(t) for t in tail)
            if data_in[-1] and data_in[-1] + len(piece) > MAX_MESSAGE_DATA:
                parts.append([])
                sizes.append(0)
                data_in.append(0)
            prefix = _LAYER_CHUNKS_TAG + _varint(size)
            start = sizes[-1] + len(prefix)
            spans.append((len(parts) - 1, start, start + size))  # offsets in the batch's body
            parts[-1] += [prefix, head, *tail]
            sizes[-1] += len(prefix) + size
            data_in[-1] += len(piece)
    outers = [_LAYER_CHUNKS_TAG + _varint(size) for size in sizes]
    batches = tuple(b"".join([outer, *body]) for outer, body in zip(outers, parts))
    placed = tuple((b, start + len(outers[b]), end + len(outers[b])) for b, start, end in spans)
    return PackedLayer(layer, batches, placed, len(payloads), total)


def batch_message(messages: Sequence[bytes]) -> bytes:
    """One serialized PrefillResponse{batch} whose entries are `messages` (serialized
    PrefillResponses, none a batch), in order: their bytes are joined as they are (one copy)."""
    body: list[bytes] = []
    for m in messages:
        body += [_BATCH_ENTRY_TAG, _varint(len(m)), m]
    size = sum(len(piece) for piece in body)
    return b"".join([_BATCH_TAG, _varint(size), *body])


# --- reading ----------------------------------------------------------------------------------


class ChunkView:
    """One LayerChunk read from received bytes; `data` is a view of them, not a copy."""

    __slots__ = ("layer", "kind", "chunk_index", "chunk_count", "dtype", "shape", "payload_bytes", "crc32c", "data")

    def __init__(self) -> None:
        self.layer = self.chunk_index = self.chunk_count = self.dtype = self.payload_bytes = self.crc32c = 0
        self.kind = ""
        self.shape: list[int] = []
        self.data: memoryview | bytes = b""

    @classmethod
    def of(cls, chunk: producer_pb2.LayerChunk) -> ChunkView:
        """From a protobuf message (tests and tools feed those)."""
        view = cls()
        view.layer, view.kind, view.chunk_index, view.chunk_count = chunk.layer, chunk.kind, chunk.chunk_index, chunk.chunk_count
        view.dtype, view.shape, view.payload_bytes, view.crc32c = (
            chunk.dtype,
            list(chunk.shape),
            chunk.payload_bytes,
            chunk.crc32c,
        )
        view.data = chunk.data  # protobuf copies a bytes field on every read: read it once
        return view


_U32, _U64 = (1 << 32) - 1, (1 << 64) - 1


def _read_varint(buf: bytes | memoryview, pos: int, end: int, where: str) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= end:
            raise DataLoss(f"{where}: truncated (a varint runs past the end)")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise DataLoss(f"{where}: a varint longer than 10 bytes")


def _fields(buf: bytes | memoryview, pos: int, end: int, where: str) -> Iterator[tuple[int, int, int, int]]:
    """(field number, wire type, value or start, end) per field of buf[pos:end]; a length-delimited
    field gives its span, a varint or fixed field its value (end = -1)."""
    while pos < end:
        key, pos = _read_varint(buf, pos, end, where)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _read_varint(buf, pos, end, where)
            yield number, wire, value, -1
        elif wire == 2:
            n, pos = _read_varint(buf, pos, end, where)
            if n > end - pos:
                raise DataLoss(f"{where}: field {number} says {n} bytes, {end - pos} remain")
            yield number, wire, pos, pos + n
            pos += n
        elif wire in (1, 5):
            width = 8 if wire == 1 else 4
            if width > end - pos:
                raise DataLoss(f"{where}: field {number} truncated")
            yield number, wire, int.from_bytes(buf[pos : pos + width], "little"), -1
            pos += width
        else:
            raise DataLoss(f"{where}: field {number} has wire type {wire} (not used by scd.v1)")


_CHUNK_WIRE = {1: 0, 2: 2, 3: 0, 4: 0, 5: 0, 6: -1, 7: 0, 8: 5, 9: 2}  # field -> wire type (-1: shape)


def _chunk(buf: bytes | memoryview, view: memoryview, pos: int, end: int) -> ChunkView:
    c = ChunkView()
    for number, wire, a, b in _fields(buf, pos, end, "chunk"):
        want = _CHUNK_WIRE.get(number)
        if want is None:
            continue  # a field from a later version: skipped, as protobuf does
        if want == -1:  # shape: packed (2) or one varint (0)
            if wire == 0:
                c.shape.append(a & _U64)
            elif wire == 2:
                p = a
                while p < b:
                    value, p = _read_varint(buf, p, b, "chunk.shape")
                    c.shape.append(value)
            else:
                raise DataLoss(f"chunk.shape: wire type {wire}")
            if len(c.shape) > MAX_SHAPE_DIMS:
                raise DataLoss(f"chunk.shape: more than {MAX_SHAPE_DIMS} dimensions")
            continue
        if wire != want:
            raise DataLoss(f"chunk field {number}: wire type {wire}, expected {want}")
        if number == 1:
            c.layer = a & _U32
        elif number == 2:
            try:
                c.kind = bytes(view[a:b]).decode()
            except UnicodeDecodeError:
                raise DataLoss("chunk.kind: not UTF-8") from None
        elif number == 3:
            c.chunk_index = a & _U32
        elif number == 4:
            c.chunk_count = a & _U32
        elif number == 5:
            c.dtype = a & _U32
        elif number == 7:
            c.payload_bytes = a & _U64
        elif number == 8:
            c.crc32c = a
        else:
            c.data = view[a:b]
    return c


_ONEOF = {1: "header", 2: "chunk", 3: "trailer", 100: "layer_chunks", 101: "batch"}


def _batch_entries(buf: bytes | memoryview, a: int, b: int) -> Iterator[memoryview]:
    """A batch's entries (serialized PrefillResponses), views of buf, read as they are asked for."""
    view = memoryview(buf)
    for number, wire, s, e in _fields(buf, a, b, "batch"):
        if number != 100:
            continue  # a field from a later version: skipped, as protobuf does
        if wire != 2:
            raise DataLoss(f"batch.responses: wire type {wire}, expected 2")
        yield view[s:e]


Parsed = tuple[str, producer_pb2.PrefillHeader | producer_pb2.PrefillTrailer | list[ChunkView] | Iterator[memoryview] | None]


def parse_response(buf: bytes | memoryview) -> Parsed:
    """One serialized PrefillResponse: ("header", header), ("trailer", trailer), ("chunk", [the
    chunk]), ("layer_chunks", [its chunks]), ("batch", its entries: an iterator of views, each
    parsed with this function when read) or ("", None) when it sets none of them. More than one of
    them is refused (protobuf would keep the last; no encoder writes that)."""
    kind, span = "", (0, 0)
    for number, wire, a, b in _fields(buf, 0, len(buf), "message"):
        name = _ONEOF.get(number)
        if name is None:
            continue
        if wire != 2:
            raise DataLoss(f"message.{name}: wire type {wire}, expected 2")
        if kind:
            raise DataLoss(f"message sets both {kind} and {name} (one of header, chunk, trailer, layer_chunks, batch)")
        kind, span = name, (a, b)
    a, b = span
    if kind in ("header", "trailer"):
        cls = producer_pb2.PrefillHeader if kind == "header" else producer_pb2.PrefillTrailer
        try:
            return kind, cls.FromString(buf[a:b])
        except DecodeError as exc:
            raise DataLoss(f"{kind}: does not parse ({exc})") from None
    if kind == "batch":
        return "batch", _batch_entries(buf, a, b)
    view = memoryview(buf)
    if kind == "chunk":
        return "chunk", [_chunk(buf, view, a, b)]
    if kind == "layer_chunks":
        chunks: list[ChunkView] = []
        for number, wire, s, e in _fields(buf, a, b, "layer_chunks"):
            if number != 100:
                continue
            if wire != 2:
                raise DataLoss(f"layer_chunks.chunks: wire type {wire}, expected 2")
            if len(chunks) == MAX_CHUNKS_PER_MESSAGE:
                raise DataLoss(f"layer_chunks: more than {MAX_CHUNKS_PER_MESSAGE} chunks in one message")
            chunks.append(_chunk(buf, view, s, e))
        return "layer_chunks", chunks
    return "", None
