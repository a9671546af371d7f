"""The serving path's serialized stream (shared.wire_bytes): what the producer packs is what protobuf
writes, old callers get one chunk per message and new ones a layer's chunks per message from the
same bytes, the consumer's reader takes one-chunk payloads from the received bytes in place, and
bytes that break the format or the batch bound are refused naming the field and the limit."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
import torch

from consumer.link.stream_reader import Expectation, LayerPayloads, StreamReader, StreamTrailer
from producer.server import ProducerServer
from shared import wire, wire_bytes
from shared.codecs import create_codecs
from shared.config import ProducerConfig
from shared.errors import DataLoss
from shared.grpc_server import GRPC_OPTIONS
from shared.models import load_model
from shared.pb import common_pb2, producer_pb2

PAYLOADS = {"k": torch.randn(2, 37, 16), "v": torch.randn(2, 37, 16), "codes": torch.zeros(0, 8, dtype=torch.int8)}


@pytest.mark.parametrize("max_chunk", [1024, 4096, 1 << 20])
def test_packed_layer_is_what_protobuf_writes(max_chunk):
    packed = wire_bytes.pack_layer(7, PAYLOADS, max_chunk)
    legacy = list(packed.messages(layer_chunks=False))
    want = [r.SerializeToString() for kind, t in PAYLOADS.items() for r in wire.payload_to_responses(7, kind, t, max_chunk)]
    assert legacy == want  # an old consumer reads exactly what it read before
    batched = [producer_pb2.PrefillResponse.FromString(b) for b in packed.messages(layer_chunks=True)]
    assert [m.WhichOneof("kind") for m in batched] == ["layer_chunks"] * len(batched)
    assert [c for m in batched for c in m.layer_chunks.chunks] == [producer_pb2.PrefillResponse.FromString(b).chunk for b in want]
    assert packed.chunk_count == len(want) and packed.payload_count == 3
    assert packed.payload_bytes == sum(t.numel() * t.element_size() for t in PAYLOADS.values())


def test_batches_hold_at_most_max_message_data():
    big = {"k": torch.zeros(3 << 20, dtype=torch.uint8), "v": torch.zeros(3 << 20, dtype=torch.uint8)}
    packed = wire_bytes.pack_layer(0, big, 1 << 20)
    assert len(packed.batches) == 2  # 4 chunks of 1 MiB each, then 2
    for batch in packed.batches:
        kind, chunks = wire_bytes.parse_response(batch)
        assert kind == "layer_chunks" and sum(len(c.data) for c in chunks) <= wire_bytes.MAX_MESSAGE_DATA


def test_parsed_chunks_view_the_received_bytes():
    batch = wire_bytes.pack_layer(2, PAYLOADS, 1 << 20).batches[0]
    kind, chunks = wire_bytes.parse_response(batch)
    start = np.frombuffer(batch, dtype=np.uint8).ctypes.data
    for c in chunks:
        if len(c.data):
            at = np.frombuffer(c.data, dtype=np.uint8).ctypes.data
            assert start <= at < start + len(batch)  # a view, not a copy
    assert [(c.layer, c.kind, c.chunk_count) for c in chunks] == [(2, "k", 1), (2, "v", 1), (2, "codes", 1)]


@pytest.mark.parametrize(
    ("data", "text"),
    [
        (b"\x12\x05\x08\x01", "field 2 says 5 bytes, 2 remain"),
        (b"\x12\x01\x88", "chunk: truncated"),
        (b"\x0f", "wire type 7"),
        (b"\x12\x00\x1a\x00", "sets both chunk and trailer"),
        (b"\x12\x03\x12\x01\xff", "chunk.kind: not UTF-8"),
        (b"\x12\x02\x48\x01", "chunk field 9: wire type 0"),
        (b"\x0a\x02\x08\xff", "header: does not parse"),
        (b"\x12\x13\x32\x11" + bytes(range(1, 18)), "more than 16 dimensions"),
    ],
)
def test_malformed_bytes_name_the_field(data, text):
    with pytest.raises(DataLoss, match=text):
        wire_bytes.parse_response(data)


@pytest.fixture(scope="module")
def producer_streams():
    """A real producer (1 KiB chunks), one context's raw stream read as bytes, with and without
    accept_layer_chunks."""
    model = load_model("tiny-llama", "float32", "cpu")

    async def go():
        producer = ProducerServer(ProducerConfig(port=0, model="tiny-llama", device="cpu", max_chunk_bytes=1024, drain_grace_s=0))
        await producer.start()
        await producer.load()
        ids = model.tokenizer("The producer streams each layer's payloads to the consumer. " * 4)["input_ids"]
        out = {}
        try:
            async with grpc.aio.insecure_channel(producer.address, options=GRPC_OPTIONS) as channel:
                prefill = channel.unary_stream(
                    "/scd.v1.ProducerService/Prefill", request_serializer=producer_pb2.PrefillRequest.SerializeToString
                )
                for accept in (False, True, False):  # the second False: a replay from the store
                    request = producer_pb2.PrefillRequest(
                        token_ids=ids, codec=common_pb2.CodecSpec(name="raw"), accept_layer_chunks=accept
                    )
                    out.setdefault(accept, []).append([m async for m in prefill(request, timeout=60)])
        finally:
            await producer.stop(0)
        return ids, out

    ids, streams = asyncio.run(go())
    return model, ids, streams


def read(model, ids, messages):
    codec = create_codecs(model, names=["raw"])["raw"]
    reader = StreamReader(Expectation(len(ids), codec, codec.resolve({}), model.info))
    events = [e for m in messages for e in reader.feed(m)]
    reader.end()
    return {e.layer: e.payloads for e in events if isinstance(e, LayerPayloads)}, events[-1]


def test_old_and_new_callers_get_the_same_payloads(producer_streams):
    model, ids, streams = producer_streams
    old, new = streams[False][0], streams[True][0]
    kinds = {m: producer_pb2.PrefillResponse.FromString(m).WhichOneof("kind") for m in old + new}
    assert {kinds[m] for m in old[1:-1]} == {"chunk"} and {kinds[m] for m in new[1:-1]} == {"layer_chunks"}
    assert len(new) < len(old)  # a layer's K and V (and their chunks) travel together
    assert streams[False][1][1:-1] == old[1:-1]  # a store replay sends the very same payload bytes
    got_old, trailer_old = read(model, ids, old)
    got_new, trailer_new = read(model, ids, new)
    assert isinstance(trailer_new, StreamTrailer) and isinstance(trailer_old, StreamTrailer)
    assert trailer_new.payload_bytes == trailer_old.payload_bytes > 0
    assert sorted(got_old) == sorted(got_new) == list(range(model.info.num_layers))
    for layer, payloads in got_old.items():
        for name, tensor in payloads.items():
            assert torch.equal(got_new[layer][name], tensor)
    # the protobuf form of the same stream reads the same (tests and tools feed messages)
    as_messages, _ = read(model, ids, [producer_pb2.PrefillResponse.FromString(m) for m in new])
    assert all(torch.equal(as_messages[la][n], t) for la, p in got_new.items() for n, t in p.items())


def test_a_layer_chunks_message_over_the_bound_is_refused(producer_streams, monkeypatch):
    model, ids, streams = producer_streams
    new = streams[True][0]
    monkeypatch.setattr(wire_bytes, "MAX_MESSAGE_DATA", 1500)  # the real 4 MiB bound, scaled to 1 KiB chunks
    with pytest.raises(DataLoss, match=r"layer_chunks: \d+ data bytes in one message, more than 1500 \(MAX_MESSAGE_DATA\)"):
        read(model, ids, new)
    empty = producer_pb2.PrefillResponse(layer_chunks=producer_pb2.LayerChunks()).SerializeToString()
    with pytest.raises(DataLoss, match="no header, chunk or trailer|no chunks"):
        read(model, ids, [new[0], empty])


@pytest.mark.parametrize(
    ("data", "text"),
    [
        (b"\xaa\x06\x03\xa0\x06\x01", "batch.responses: wire type 0, expected 2"),
        (b"\xaa\x06\x03\xa2\x06\x05", "batch: field 100 says 5 bytes, 0 remain"),
        (b"\xaa\x06\x01\xa2", "batch: truncated"),
    ],
)
def test_malformed_batch_bytes_name_the_field(data, text):
    """A batch's entries are read when asked for: its framing is refused there, naming the field."""
    kind, entries = wire_bytes.parse_response(data)
    assert kind == "batch"
    with pytest.raises(DataLoss, match=text):
        list(entries)


def test_a_batch_holds_the_entries_bytes_as_they_are():
    entries = [m for m in wire_bytes.pack_layer(1, PAYLOADS, 1024).messages(layer_chunks=True)]
    joined = wire_bytes.batch_message(entries)
    decoded = producer_pb2.PrefillResponse.FromString(joined)  # any protobuf reader decodes it
    assert [m.SerializeToString() for m in decoded.batch.responses] == entries
    kind, views = wire_bytes.parse_response(joined)
    start = np.frombuffer(joined, dtype=np.uint8).ctypes.data
    for view, entry in zip(views, entries, strict=True):
        assert bytes(view) == entry and np.frombuffer(view, dtype=np.uint8).ctypes.data >= start  # views, no copies
        _, chunks = wire_bytes.parse_response(view)
        assert [bytes(c.data) for c in chunks] == [bytes(c.data) for c in wire_bytes.parse_response(entry)[1]]


def test_a_layer_with_no_payloads_has_no_message():
    """Recompute sends some layers with nothing in them: no layer_chunks message (an empty one is
    refused by the reader), as one message per chunk sent none."""
    from shared.wire_bytes import pack_layer

    packed = pack_layer(3, {}, 1 << 20)
    assert packed.batches == () and packed.chunk_count == 0
