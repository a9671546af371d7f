"""Round trips through the wire bridge: every element type, multi-chunk payloads, corruption."""

import pytest
import torch

from shared import wire
from shared.errors import DataLoss


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32])
def test_payload_round_trip_is_bit_exact(dtype):
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(3, 257, 16, generator=g) * 50).to(dtype)
    chunks = wire.payload_to_pb(5, "k", t, max_chunk_bytes=1000)
    assert len(chunks) == -(-t.numel() * t.element_size() // 1000) > 1
    assert all(len(c.data) <= 1000 for c in chunks)
    back = wire.payload_from_pb([c.__class__.FromString(c.SerializeToString()) for c in chunks])
    assert back.dtype == dtype and back.shape == t.shape
    assert torch.equal(back.view(torch.uint8), t.contiguous().view(torch.uint8))


def test_corrupt_chunk_names_layer_and_chunk():
    t = torch.arange(4096, dtype=torch.float32)
    chunks = wire.payload_to_pb(3, "v", t, max_chunk_bytes=4096)
    chunks[2].data = bytes([chunks[2].data[0] ^ 1]) + chunks[2].data[1:]
    with pytest.raises(DataLoss, match=r"layer 3, payload 'v', chunk 2/4: CRC32C mismatch"):
        wire.payload_from_pb(chunks)


def test_out_of_order_and_missing_chunks_are_refused():
    """(Layer ranges are the stream reader's: tests/test_hostile_producer.py, layer_out_of_range.)"""
    chunks = wire.payload_to_pb(1, "k", torch.zeros(2048), max_chunk_bytes=4096)
    with pytest.raises(DataLoss, match="not chunk 0"):
        wire.payload_from_pb(chunks[1:])
    with pytest.raises(DataLoss, match="payload incomplete"):
        wire.payload_from_pb(chunks[:1])


def test_empty_payload_round_trips():
    chunks = wire.payload_to_pb(0, "codes", torch.zeros(0, 8, dtype=torch.int8), max_chunk_bytes=1024)
    assert len(chunks) == 1
    assert wire.payload_from_pb(chunks).shape == (0, 8)
