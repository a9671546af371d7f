"""PrefillResponse.batch (PrefillRequest.accept_batches): the producer sends the stream messages
that are ready together in one gRPC message (producer.coalesce), written by hand as protobuf
writes them (shared.wire_bytes.batch_message); a replay from the store arrives in fewer messages
than layers + 2 with the same payloads and answer; every entry of a batch is held to the stream
contract as if it had come alone, so a hostile batch fails at its first bad entry with the error
its unbatched equivalent gives; old callers get the messages they always got."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

import consumer.link.producer_client
from consumer.api.client import ConsumerClient
from consumer.link.stream_reader import Expectation, LayerPayloads, StreamReader, StreamTrailer
from producer import coalesce
from producer.coalesce import Coalesced
from producer.server import ProducerServer
from shared import wire_bytes
from shared.codecs import create_codecs
from shared.config import ProducerConfig
from shared.errors import DataLoss, ServiceError
from shared.grpc_server import GRPC_OPTIONS
from shared.models import load_model
from shared.pb import common_pb2, producer_pb2
from tests.conftest import prompt, running_pair
from tests.hostile import batch, consumer_of, copy, record

CONTEXT = "A batch carries the stream messages that are ready together in one message. " * 3
MODEL = load_model("tiny-llama", "float32", "cpu")
CODEC = create_codecs(MODEL, names=["raw"])["raw"]


def request(ids, batches: bool, layer_chunks: bool = True) -> producer_pb2.PrefillRequest:
    return producer_pb2.PrefillRequest(
        token_ids=ids, codec=common_pb2.CodecSpec(name="raw"), accept_layer_chunks=layer_chunks, accept_batches=batches
    )


@pytest.fixture(scope="module")
def streams():
    """One context's raw stream from a real producer (1 KiB chunks, whole-context store), each
    gRPC message as received bytes: cold and replayed with batches, replayed without (an old
    caller), replayed with batches but one chunk per entry; and the old caller's as protobuf
    messages (what hostile cases are cut from)."""

    async def go():
        producer = ProducerServer(
            ProducerConfig(port=0, model="tiny-llama", device="cpu", max_chunk_bytes=1024, chunk_tokens=0, drain_grace_s=0)
        )
        await producer.start()
        await producer.load()
        ids = MODEL.tokenizer(CONTEXT)["input_ids"]
        out = {}
        try:
            async with grpc.aio.insecure_channel(producer.address, options=GRPC_OPTIONS) as channel:
                prefill = channel.unary_stream(
                    "/scd.v1.ProducerService/Prefill", request_serializer=producer_pb2.PrefillRequest.SerializeToString
                )
                for name, req in [
                    ("cold", request(ids, True)),
                    ("replay", request(ids, True)),
                    ("old", request(ids, False)),
                    ("old_chunks", request(ids, False, False)),
                    ("replay_chunks", request(ids, True, False)),
                ]:
                    out[name] = [m async for m in prefill(req, timeout=60)]
            out["plain"] = await record(producer.address, ids, "raw")  # one chunk per message, no batches
        finally:
            await producer.stop(0)
        return ids, out

    return asyncio.run(go())


def reader(ids) -> StreamReader:
    return StreamReader(Expectation(len(ids), CODEC, CODEC.resolve({}), MODEL.info))


def read(ids, messages) -> tuple[dict, StreamTrailer]:
    r = reader(ids)
    events = [e for m in messages for e in r.feed(m)]
    r.end()
    assert isinstance(events[-1], StreamTrailer)
    return {e.layer: e.payloads for e in events if isinstance(e, LayerPayloads)}, events[-1]


def same_payloads(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[la].keys() == b[la].keys() and all(torch.equal(a[la][n], b[la][n]) for n in a[la]) for la in a
    )


def kinds(messages) -> list[str]:
    return [producer_pb2.PrefillResponse.FromString(m).WhichOneof("kind") for m in messages]


# --- the producer's batches ------------------------------------------------------------------


def test_batch_message_is_what_protobuf_writes(streams):
    _, s = streams
    entries = [m.SerializeToString() for m in s["plain"][:5]]
    want = producer_pb2.PrefillResponse(
        batch=producer_pb2.PrefillBatch(responses=[producer_pb2.PrefillResponse.FromString(m) for m in entries])
    )
    assert wire_bytes.batch_message(entries) == want.SerializeToString()
    kind, parsed = wire_bytes.parse_response(wire_bytes.batch_message(entries))
    assert kind == "batch" and [bytes(e) for e in parsed] == entries


def test_a_replay_arrives_in_fewer_messages_with_the_same_payloads(streams):
    ids, s = streams
    layers = MODEL.info.num_layers
    old_payloads, old_trailer = read(ids, s["old"])
    assert len(s["old"]) >= layers + 2  # header, at least one message per layer, trailer
    for name in ("replay", "replay_chunks", "cold"):
        payloads, trailer = read(ids, s[name])
        assert same_payloads(payloads, old_payloads), name
        assert trailer.payload_bytes == old_trailer.payload_bytes and trailer.messages == len(s[name])
    assert kinds(s["replay"]) == ["header", "batch"]  # everything is ready at once: one write after the header
    assert kinds(s["replay_chunks"]) == ["header", "batch"]  # one chunk per entry, for a caller without layer_chunks
    replay = read(ids, s["replay"])[1]
    assert len(s["replay"]) < layers + 2 and replay.store_hit
    # still a link sample: the batch's bytes, from the header's arrival (the batch was written right after it)
    assert replay.span_bytes == replay.payload_bytes and replay.span_ms > 0
    assert old_trailer.span_bytes < old_trailer.payload_bytes  # unbatched: the bytes after the first chunk's message
    assert kinds(s["cold"])[0] == "header" and kinds(s["cold"])[-1] in ("trailer", "batch")


def test_old_callers_get_no_batches(streams):
    _, s = streams
    assert set(kinds(s["old"])[1:-1]) == {"layer_chunks"} and set(kinds(s["old_chunks"])[1:-1]) == {"chunk"}
    assert s["old_chunks"][1:-1] == [m.SerializeToString() for m in s["plain"][1:-1]]  # header: request id; trailer: timings
    entries = [bytes(e) for e in wire_bytes.parse_response(s["replay"][1])[1]]
    assert entries == s["old"][1:-1] + [entries[-1]]  # a batch's entries are the very bytes an old caller gets


def test_batches_stay_within_one_message_bounds(streams, monkeypatch):
    """4 MiB of data (here scaled to 3 KiB) and MAX_CHUNKS_PER_MESSAGE chunks: what does not fit
    goes in the next message; the reader refuses a batch over the bound."""
    ids, s = streams
    plain = [m.SerializeToString() for m in s["plain"]]
    monkeypatch.setattr(wire_bytes, "MAX_MESSAGE_DATA", 3 * 1024 + 512)

    async def go():
        async def source():
            for m in plain[1:]:
                yield m, int(producer_pb2.PrefillResponse.FromString(m).WhichOneof("kind") == "chunk")

        coalesced = Coalesced(source())
        await asyncio.sleep(0.05)  # everything is pending: each write takes what fits
        try:
            return [m async for m in coalesced]
        finally:
            await coalesced.aclose()

    sent = asyncio.run(go())
    assert len(sent) < len(plain) - 1
    for m in sent:
        kind, value = wire_bytes.parse_response(m)
        entries = [wire_bytes.parse_response(e) for e in value] if kind == "batch" else [(kind, value)]
        assert sum(len(c.data) for k, v in entries if k == "chunk" for c in v) <= 3 * 1024
    payloads, _ = read(ids, [plain[0], *sent])
    assert same_payloads(payloads, read(ids, plain)[0])
    over = wire_bytes.batch_message(plain[1:5])  # four 1 KiB chunks
    with pytest.raises(DataLoss, match=r"batch: \d+ data bytes in one message, more than 3584 \(MAX_MESSAGE_DATA\)"):
        read(ids, [plain[0], over, *plain[5:]])


def test_coalescing_never_waits_to_fill_a_batch():
    """A message ready alone goes alone, as it is, as soon as it is asked for; what accumulated
    while it was written goes together; a failure comes after the messages before it."""

    async def go():
        gate = asyncio.Event()

        async def source():
            yield b"a", 0
            await gate.wait()
            yield b"b", 0
            yield b"c", 0
            raise RuntimeError("engine failed")

        coalesced = Coalesced(source())
        try:
            first = await asyncio.wait_for(coalesced.__anext__(), 1)
            gate.set()
            await asyncio.sleep(0.01)
            second = await coalesced.__anext__()
            with pytest.raises(RuntimeError, match="engine failed"):
                await coalesced.__anext__()
        finally:
            await coalesced.aclose()
        return first, second

    first, second = asyncio.run(go())
    assert first == b"a" and second == wire_bytes.batch_message([b"b", b"c"])


def test_the_pump_reads_ahead_at_most_one_message(monkeypatch):
    """Writes that stall hold the source back: at most LOOKAHEAD_BYTES wait to be written."""
    monkeypatch.setattr(coalesce, "LOOKAHEAD_BYTES", 1000)

    async def go():
        pulled = []

        async def source():
            for i in range(100):
                pulled.append(i)
                yield bytes(300), 0

        coalesced = coalesce.Coalesced(source())
        await asyncio.sleep(0.05)  # nothing written yet
        held = len(pulled)
        await coalesced.__anext__()
        await asyncio.sleep(0.05)
        await coalesced.aclose()
        return held, len(pulled)

    held, after = asyncio.run(go())
    assert held == 4 and 4 < after <= 8  # 4 x 300 bytes reach the bound; one write makes room for more


def test_closing_stops_the_source():
    async def go():
        closed = asyncio.Event()

        async def source():
            try:
                yield b"a", 0
                await asyncio.sleep(60)
            finally:
                closed.set()

        coalesced = Coalesced(source())
        assert await coalesced.__anext__() == b"a"
        await coalesced.aclose()
        return closed.is_set()

    assert asyncio.run(go())


# --- hostile batches: the same error as unbatched, at the first bad message -------------------


def error_of(ids, messages) -> str:
    with pytest.raises(ServiceError) as err:
        read(ids, messages)
    return f"{err.value.code}: {err.value}"


def forms(messages):
    """The protobuf messages, and the same as serialized bytes (batches written by batch_message)."""

    def serialize(m):
        if m.WhichOneof("kind") == "batch":
            return wire_bytes.batch_message([serialize(e) for e in m.batch.responses])
        return m.SerializeToString()

    return [messages, [serialize(m) for m in messages]]


def flipped(message: producer_pb2.PrefillResponse) -> producer_pb2.PrefillResponse:
    out = copy(message)
    data = bytearray(out.chunk.data)
    data[0] ^= 0x40  # CRC left as it was
    out.chunk.data = bytes(data)
    return out


def _cases(p: list) -> dict:
    """name -> (unbatched stream, the same with batches); p: header, chunk messages, trailer."""
    h, body, t = p[0], p[1:-1], p[-1]
    third = len(body) // 3
    bad = [*body[:third], flipped(body[third]), *body[third + 1 :]]
    return {
        "header twice": ([h, h, *body, t], [batch(h, h), *body, t]),
        "header twice, second in a batch": ([h, *body[:2], h, *body[2:], t], [h, batch(*body[:2], h), *body[2:], t]),
        "trailer not last": ([h, *body[:third], t, *body[third:]], [h, batch(*body[:third], t, *body[third:])]),
        "entry after the trailer": ([h, *body, t, body[0]], [h, batch(*body, t, body[0])]),
        "crc mismatch": ([h, *bad, t], [h, batch(*bad, t)]),
        "crc mismatch, then a second header": ([h, *bad, h, t], [h, batch(*bad, h, t)]),
        "layers out of order": ([h, *body[third:], *body[:third], t], [h, batch(*body[third:]), batch(*body[:third], t)]),
        "missing trailer": ([h, *body], [h, batch(*body)]),
        "empty entry": (
            [h, body[0], producer_pb2.PrefillResponse(), *body[1:], t],
            [h, batch(body[0], producer_pb2.PrefillResponse()), *body[1:], t],
        ),
        "before the header": ([body[0], h, *body[1:], t], [batch(body[0], h), *body[1:], t]),
    }


CASE_NAMES = [
    "header twice",
    "header twice, second in a batch",
    "trailer not last",
    "entry after the trailer",
    "crc mismatch",
    "crc mismatch, then a second header",
    "layers out of order",
    "missing trailer",
    "empty entry",
    "before the header",
]


@pytest.mark.parametrize("case", CASE_NAMES)
def test_a_hostile_batch_fails_as_its_unbatched_equivalent(streams, case):
    ids, s = streams
    plain, batched = _cases(s["plain"])[case]
    want = error_of(ids, plain)
    assert want.startswith(("DATA_LOSS", "FAILED_PRECONDITION"))
    for form in forms(batched):
        assert error_of(ids, form) == want, case


def test_nested_and_empty_batches_are_refused(streams):
    ids, s = streams
    p = s["plain"]
    nested = [p[0], batch(p[1], batch(p[2])), *p[3:]]
    empty = [p[0], batch(), *p[1:]]
    for form in forms(nested):
        assert error_of(ids, form) == "DATA_LOSS: batch: entry 2 is itself a batch (batches do not nest)"
    for form in forms(empty):
        assert error_of(ids, form) == "DATA_LOSS: batch: a batch with no messages"
    # a nested batch behind a bad entry: the bad entry is reported, as it came first
    bad = [p[0], batch(flipped(p[1]), batch(p[2])), *p[3:]]
    assert all(error_of(ids, form) == error_of(ids, [p[0], flipped(p[1]), *p[2:]]) for form in forms(bad))


def test_truncated_bytes_in_a_batch(streams):
    ids, s = streams
    p = [m.SerializeToString() for m in s["plain"]]
    cut = p[3][: len(p[3]) // 2]
    # an entry cut inside (the batch's framing intact): its own error, as when it came alone
    want = error_of(ids, [*p[:3], cut, *p[4:]])
    assert "DATA_LOSS" in want
    assert error_of(ids, [p[0], wire_bytes.batch_message(p[1:3] + [cut] + p[4:])]) == want
    # the message cut: refused whole, as any truncated message
    whole = wire_bytes.batch_message(p[1:-1])
    assert error_of(ids, [p[0], whole[:-10], p[-1]]).startswith("DATA_LOSS: message: field 101 says")
    # an entry whose length runs past the batch: the entries before it are read first
    last = overrun(p[1:-1])
    assert error_of(ids, [p[0], last, p[-1]]).startswith("DATA_LOSS: batch: field 100 says")
    bad = flipped(s["plain"][1]).SerializeToString()
    assert "CRC32C mismatch" in error_of(ids, [p[0], overrun([bad, *p[2:-1]]), p[-1]])


def overrun(entries: list[bytes]) -> bytes:
    """A batch of entries whose last entry's length says 10 bytes more than the batch holds."""
    tag, varint = wire_bytes._BATCH_ENTRY_TAG, wire_bytes._varint
    body = b"".join(tag + varint(len(m)) + m for m in entries[:-1]) + tag + varint(len(entries[-1]) + 10) + entries[-1]
    return wire_bytes._BATCH_TAG + varint(len(body)) + body


def test_too_many_entries_are_refused(streams, monkeypatch):
    ids, s = streams
    p = [m.SerializeToString() for m in s["plain"]]
    monkeypatch.setattr(wire_bytes, "MAX_BATCH_MESSAGES", 3)
    with pytest.raises(DataLoss, match=r"batch: more than 3 messages in one batch \(MAX_BATCH_MESSAGES\)"):
        read(ids, [p[0], wire_bytes.batch_message(p[1:])])
    monkeypatch.setattr(wire_bytes, "MAX_BATCH_MESSAGES", 4096)
    monkeypatch.setattr(wire_bytes, "MAX_CHUNKS_PER_MESSAGE", 3)
    with pytest.raises(DataLoss, match=r"batch: more than 3 chunks in one message \(MAX_CHUNKS_PER_MESSAGE\)"):
        read(ids, [p[0], wire_bytes.batch_message(p[1:])])


# --- through real services -------------------------------------------------------------------


ORACLE, RAW = common_pb2.CodecSpec(name="oracle"), common_pb2.CodecSpec(name="raw")


class CountingReader(StreamReader):
    """The consumer's stream reader, keeping each stream's gRPC message count."""

    counts: list[int] = []

    def end(self) -> None:
        super().end()
        CountingReader.counts.append(self.messages)


@pytest.mark.parametrize("chunk_tokens", [0, 16], ids=["whole-store", "chunk-store"])
async def test_round_trip_through_real_services(chunk_tokens, monkeypatch):
    """Consumer and producer as served: the same answer as the consumer's own prefill, cold and
    replayed from the producer's store (whole contexts, or chunks: their layers assembled together),
    the replay in 2 gRPC messages instead of layers + 2."""
    monkeypatch.setattr(consumer.link.producer_client, "StreamReader", CountingReader)
    CountingReader.counts = []
    async with running_pair(
        "tiny-llama", producer_kw={"chunk_tokens": chunk_tokens}, consumer_kw={"prefix_cache_bytes": 0}
    ) as pair:
        context, question = prompt(text=CONTEXT), prompt(text=" What does a batch carry?")
        own, _, _ = await pair.generate(context=context, question=question, max_new_tokens=6, transfer=ORACLE)
        answers = [await pair.generate(context=context, question=question, max_new_tokens=6, transfer=RAW) for _ in range(2)]
    assert [ids for ids, _, _ in answers] == [own, own]
    assert [stats.producer_store_hit for _, _, stats in answers] == [False, True]
    cold, replay = CountingReader.counts
    assert replay == 2 < MODEL.info.num_layers + 2  # the header, then the layers and the trailer in one batch
    assert cold <= MODEL.info.num_layers + 2


async def test_a_hostile_producer_may_send_batches():
    """A producer that batches as it likes (here: header with the first layer, the rest with the
    trailer) is read as the same stream; a nested batch from it is refused with DATA_LOSS."""
    ids = MODEL.tokenizer(CONTEXT)["input_ids"]
    producer = ProducerServer(ProducerConfig(port=0, model="tiny-llama", device="cpu", max_chunk_bytes=1024, drain_grace_s=0))
    await producer.start()
    await producer.load()
    try:
        rec = await record(producer.address, ids, "raw")
    finally:
        await producer.stop(0)
    script = {"messages": [batch(*rec[:3]), batch(*rec[3:])]}
    async with consumer_of(lambda request: script["messages"], prefix_cache_bytes=0) as (consumer_server, fake):
        client = ConsumerClient(consumer_server.address)
        try:
            question = prompt(text=" What does a batch carry?")
            own = await client.generate(mode="oracle", context=prompt(ids=ids), question=question, max_new_tokens=4)
            got = await client.generate(mode="raw", context=prompt(ids=ids), question=question, max_new_tokens=4)
            assert got.ids == own.ids and got.stats.transfer.name == "raw"
            script["messages"] = [rec[0], batch(rec[1], batch(rec[2])), *rec[3:]]
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.generate(mode="raw", context=prompt(ids=ids), question=question, max_new_tokens=4)
            assert err.value.code() == grpc.StatusCode.DATA_LOSS and "batches do not nest" in err.value.details()
        finally:
            await client.channel.close()
