"""The one bridge between torch tensors and the scd.v1 wire types.

Owns: element-type mapping, splitting a payload tensor into CRC32C-checked `LayerChunk`s
(`payload_to_responses`, `payload_to_pb`) and reassembling one (`payload_from_bytes`, `payload_from_pb`). It knows
nothing about codecs, models or transport.

The serving path's bytes go through shared.wire_bytes (a layer packed once into serialized
messages; a received message read without copying its payload bytes).
"""

from __future__ import annotations

import warnings

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


def payload_from_bytes(
    buffer: bytearray | memoryview | bytes, dtype_pb: int, shape: tuple[int, ...], where: str = ""
) -> torch.Tensor:
    """A tensor over `buffer`'s memory (no copy). A read-only buffer (a received message's bytes,
    which nothing else references) gives a tensor torch calls non-writable: its warning is muted."""
    dtype = dtype_from_pb(dtype_pb)
    if not len(buffer):
        flat = torch.empty(0, dtype=torch.uint8)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(buffer, dtype=torch.uint8)
    try:
        return flat.view(dtype).reshape(shape)
    except RuntimeError as exc:
        raise DataLoss(f"{where}: bytes do not form {dtype} {list(shape)}: {exc}") from None


def payload_from_pb(chunks: list[producer_pb2.LayerChunk]) -> torch.Tensor:
    """One payload from all its chunks, in order, CRC32C-checked (tests and tools). The serving
    path reassembles through the consumer's stream reader, which also checks every chunk against
    the codec's schema."""
    buffer, where = bytearray(), "payload"
    for index, chunk in enumerate(chunks):
        where = f"layer {chunk.layer}, payload '{chunk.kind}', chunk {chunk.chunk_index}/{chunk.chunk_count}"
        if chunk.chunk_index != index:
            raise DataLoss(f"{where}: expected chunk {index}" + (" (first chunk seen is not chunk 0)" if index == 0 else ""))
        if google_crc32c.value(chunk.data) != chunk.crc32c:
            raise DataLoss(f"{where}: CRC32C mismatch")
        buffer += chunk.data
    if not chunks or len(chunks) != chunks[0].chunk_count or len(buffer) != chunks[0].payload_bytes:
        raise DataLoss(f"{where}: payload incomplete")
    return payload_from_bytes(buffer, chunks[0].dtype, tuple(chunks[0].shape), where)
