"""The one bridge between torch tensors and the scd.v1 wire types.

Owns: element-type mapping, splitting a payload tensor into CRC32C-checked `LayerChunk`s
(`payload_to_responses`, `payload_to_pb`) and reassembling them (`PayloadAssembler`, `payload_from_pb`). It knows
nothing about codecs, models or transport.
"""

from __future__ import annotations

from dataclasses import dataclass

import google_crc32c
import torch

from shared.errors import DataLoss
from shared.pb import common_pb2, producer_pb2

DEFAULT_MAX_CHUNK_BYTES = 4 << 20  # 4 MiB, the wire contract's ceiling

_TO_PB = {
    torch.float32: common_pb2.ELEMENT_TYPE_FLOAT32,
    torch.float16: common_pb2.ELEMENT_TYPE_FLOAT16,
    torch.bfloat16: common_pb2.ELEMENT_TYPE_BFLOAT16,
    torch.int8: common_pb2.ELEMENT_TYPE_INT8,
    torch.uint8: common_pb2.ELEMENT_TYPE_UINT8,
    torch.int32: common_pb2.ELEMENT_TYPE_INT32,
}
_FROM_PB: dict[int, torch.dtype] = {v: k for k, v in _TO_PB.items()}


def dtype_to_pb(dtype: torch.dtype) -> int:
    try:
        return _TO_PB[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} has no wire element type") from None


def dtype_from_pb(value: int) -> torch.dtype:
    try:
        return _FROM_PB[value]
    except KeyError:
        raise DataLoss(f"chunk.dtype: unknown element type {value}") from None


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """Little-endian row-major bytes of `tensor` (copied to CPU and made contiguous if needed)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data.cast("B")


def payload_to_responses(layer: int, kind: str, tensor: torch.Tensor, max_chunk_bytes: int) -> list[producer_pb2.PrefillResponse]:
    """Split one payload into chunks of at most `max_chunk_bytes` bytes each, built directly as
    the stream's `PrefillResponse` messages: the producer sends (and its store replays) these
    objects as they are, so a chunk's bytes are copied once into its message, never again."""
    data = tensor_bytes(tensor)
    total = len(data)
    count = max(1, -(-total // max_chunk_bytes))
    dtype = dtype_to_pb(tensor.dtype)
    shape = list(tensor.shape)
    out = []
    for index in range(count):
        piece = data[index * max_chunk_bytes : (index + 1) * max_chunk_bytes].tobytes()
        response = producer_pb2.PrefillResponse()
        chunk = response.chunk  # a reference into the response, not a copy
        chunk.layer, chunk.kind, chunk.chunk_index, chunk.chunk_count = layer, kind, index, count
        chunk.dtype, chunk.payload_bytes, chunk.crc32c = dtype, total, google_crc32c.value(piece)
        chunk.shape.extend(shape)
        chunk.data = piece
        out.append(response)
    return out


def payload_to_pb(layer: int, kind: str, tensor: torch.Tensor, max_chunk_bytes: int) -> list[producer_pb2.LayerChunk]:
    """The chunks alone (tests and tools)."""
    return [r.chunk for r in payload_to_responses(layer, kind, tensor, max_chunk_bytes)]


@dataclass
class _Partial:
    dtype: int
    shape: tuple[int, ...]
    count: int
    total: int
    buffer: bytearray


class PayloadAssembler:
    """Collects the chunks of one stream and returns each payload once it is complete.

    Checks every chunk's CRC32C and its consistency with the first chunk of its payload; any
    mismatch raises DataLoss naming the layer, payload kind and chunk index.
    """

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self._open: dict[tuple[int, str], _Partial] = {}

    def add(self, chunk: producer_pb2.LayerChunk) -> tuple[int, str, torch.Tensor] | None:
        where = f"layer {chunk.layer}, payload '{chunk.kind}', chunk {chunk.chunk_index}/{chunk.chunk_count}"
        if chunk.layer >= self.num_layers:
            raise DataLoss(f"{where}: layer index out of range (num_layers={self.num_layers})")
        if google_crc32c.value(chunk.data) != chunk.crc32c:
            raise DataLoss(f"{where}: CRC32C mismatch")
        key = (chunk.layer, chunk.kind)
        part = self._open.get(key)
        if part is None:
            if chunk.chunk_index != 0:
                raise DataLoss(f"{where}: first chunk seen is not chunk 0")
            part = _Partial(chunk.dtype, tuple(chunk.shape), chunk.chunk_count, chunk.payload_bytes, bytearray())
            self._open[key] = part
        elif (chunk.dtype, tuple(chunk.shape), chunk.chunk_count) != (part.dtype, part.shape, part.count):
            raise DataLoss(f"{where}: dtype/shape/count differ from chunk 0")
        part.buffer += chunk.data
        if chunk.chunk_index != part.count - 1:
            return None
        del self._open[key]
        if len(part.buffer) != part.total:
            raise DataLoss(f"{where}: got {len(part.buffer)} bytes, header says {part.total}")
        return chunk.layer, chunk.kind, payload_from_bytes(part.buffer, part.dtype, part.shape, where)

    def pending(self) -> list[tuple[int, str]]:
        """Payloads started but not finished (non-empty at stream end means data loss)."""
        return sorted(self._open)


def payload_from_bytes(buffer: bytearray, dtype_pb: int, shape: tuple[int, ...], where: str = "") -> torch.Tensor:
    dtype = dtype_from_pb(dtype_pb)
    flat = torch.frombuffer(buffer, dtype=torch.uint8) if buffer else torch.empty(0, dtype=torch.uint8)
    try:
        return flat.view(dtype).reshape(shape)
    except RuntimeError as exc:
        raise DataLoss(f"{where}: bytes do not form {dtype} {list(shape)}: {exc}") from None


def payload_from_pb(chunks: list[producer_pb2.LayerChunk]) -> torch.Tensor:
    """Reassemble one payload from all its chunks (convenience for tests and tools)."""
    assembler = PayloadAssembler(num_layers=max(c.layer for c in chunks) + 1)
    result = None
    for chunk in chunks:
        result = assembler.add(chunk)
    if result is None:
        raise DataLoss("payload incomplete")
    return result[2]
