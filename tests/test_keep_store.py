"""Keep transfers from the producer's store (real producers, tiny-llama, float32): a repeated
(context, codec config, resolved keep selection) is replayed with the cold stream's bytes, in both
stores (the chunk store: one entry under shared.chunks.kept_key; the whole-context store:
store_key with the selection); another selection, codec config or context never hits, a whole
transfer never gets a kept stream nor the other way round; a small budget evicts kept entries;
cancelled calls give back their pins, slots and flights; the disk tier replays a kept stream
after a restart and refuses it to a producer of another dtype."""

from __future__ import annotations

import asyncio

import pytest

from calibration.distill import distill
from shared import keep_wire
from shared.codecs.kept import KeepRequest
from shared.models import load_model
from shared.pb import common_pb2, producer_pb2
from tests import test_single_flight as single_flight
from tests.test_prefill_engine import contexts, held
from tests.test_scd import heldout, random_corpus

RAW = common_pb2.CodecSpec(name="raw")
QUANT8 = common_pb2.CodecSpec(name="quant", options={"bits": "8"})
KEEP = "h2o:0.3:window=8"
STORES = {"chunked": {"chunk_tokens": 64}, "whole": {"chunk_tokens": 0}}


def request(ids: list[int], keep: str = KEEP, spec: common_pb2.CodecSpec = RAW) -> producer_pb2.PrefillRequest:
    fields = {"keep": keep_wire.to_pb(KeepRequest.parse(keep))} if keep else {}
    return producer_pb2.PrefillRequest(token_ids=ids, codec=spec, **fields)


async def stream(stub, ids: list[int], keep: str = KEEP, spec: common_pb2.CodecSpec = RAW):
    """(header, every chunk message serialized in stream order, trailer) of one Prefill."""
    header, sent, trailer = None, [], None
    async for m in stub.Prefill(request(ids, keep, spec), timeout=60):
        kind = m.WhichOneof("kind")
        if kind == "header":
            header = m.header
        elif kind == "chunk":
            sent.append(m.chunk.SerializeToString())
        else:
            trailer = m.trailer
    return header, sent, trailer


async def cold(calls: list[tuple[list[int], str, common_pb2.CodecSpec]], **kw) -> list:
    """Each call's stream from a producer without a store: what a replay must equal."""
    async with single_flight.producer(store_bytes=0, **kw) as (_, stub):
        return [await stream(stub, *call) for call in calls]


async def settled(server) -> None:
    """Every call's slot, flight, unsent bytes and pin given back."""
    servicer = server.servicer
    store = servicer.chunks
    await single_flight.until(lambda: servicer.admission.inflight == 0 and not servicer.flights.running)
    assert servicer.flights.unsent.total == 0
    if store is not None:
        assert store.pinned_evicted_bytes == 0 and not store._pins
        assert store.nbytes == sum(e.nbytes for e in store.entries.values()) <= store.budget_bytes


@pytest.mark.parametrize("store", list(STORES))
async def test_a_repeated_kept_request_is_replayed_with_the_cold_bytes(store):
    ids = contexts(2 * 64 + 40, seed=71)[0]
    calls = [(ids, KEEP, RAW), (ids, "snapkv:24:sinks=2,window=8,heads=shared", QUANT8)]
    want = await cold(calls)
    async with single_flight.producer(**STORES[store]) as (server, stub):
        for (header, sent, trailer), call in zip(want, calls):
            first = await stream(stub, *call)
            again = await stream(stub, *call)
            assert not first[2].store_hit and first[2].computed_tokens == len(ids)
            assert again[2].store_hit and again[2].reused_tokens == len(ids) and again[2].computed_tokens == 0
            for got in (first, again):
                assert got[0].keep == header.keep and got[0].kept_tokens == header.kept_tokens < len(ids)
                assert got[1] == sent and got[2].payload_bytes == trailer.payload_bytes  # byte for byte, in order
        described = await stub.Describe(producer_pb2.ProducerServiceDescribeRequest(), timeout=5)
        assert described.stats.store_hits == 2 and described.stats.prefill_tokens_reused == 2 * len(ids)
        await settled(server)


@pytest.mark.parametrize("store", list(STORES))
async def test_another_selection_codec_config_or_context_never_hits(store):
    ids = contexts(2 * 64 + 40, seed=72)[0]
    changed = ids[:-1] + [ids[-1] % 300 + 3]  # the last token differs: the observation window's end
    others = [
        (ids, "h2o:0.4:window=8", RAW),  # budget
        (ids, "knorm:0.3:window=8", RAW),  # policy
        (ids, "h2o:0.3:window=16", RAW),  # options
        (ids, "h2o:0.3:window=8,heads=shared", RAW),  # heads
        (ids, KEEP, QUANT8),  # codec
        (ids, KEEP, common_pb2.CodecSpec(name="quant", options={"bits": "4"})),  # codec options
        (changed, KEEP, RAW),  # context
        (ids[:-8], KEEP, RAW),  # a prefix of the context
    ]
    want = await cold(others)
    async with single_flight.producer(**STORES[store]) as (server, stub):
        await stream(stub, ids)  # stored
        assert (await stream(stub, ids))[2].store_hit
        for call, (header, sent, _) in zip(others, want):
            got_header, got, trailer = await stream(stub, *call)
            assert not trailer.store_hit and trailer.reused_tokens == 0, call[1:]
            assert got_header.kept_tokens == header.kept_tokens and got == sent, call[1:]
        await settled(server)


@pytest.mark.parametrize("store", list(STORES))
async def test_budgets_whose_text_was_the_same_never_share_an_entry(store):
    """Fraction 1.0 and the count 1 printed alike ("1"), as 0.5 and 0.4999999 did ("0.5"): the second
    request was answered from the first one's stream (a consumer refused it: DATA_LOSS)."""
    ids = contexts(2 * 64 + 40, seed=73)[0]
    for first, second in (("h2o:1.0:window=8", "h2o:1:window=8"), ("h2o:0.5:window=8", "h2o:0.4999999:window=8")):
        (want,) = await cold([(ids, second, RAW)])
        async with single_flight.producer(**STORES[store]) as (server, stub):
            await stream(stub, ids, first)  # stored
            header, sent, trailer = await stream(stub, ids, second)
            assert not trailer.store_hit and header.kept_tokens == want[0].kept_tokens and sent == want[1], (first, second)
            await settled(server)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> str:
    model = load_model("tiny-llama", "float32", "cpu")
    art = distill(model, model, random_corpus(12, 96, 0), heldout(3, 1), corpus_name="random", generations=1, log=lambda m: None)
    path = tmp_path_factory.mktemp("artifacts")
    art.save(path / "tiny.safetensors")
    return str(path)


@pytest.mark.parametrize("store, codec", [("chunked", "raw"), ("chunked", "scd"), ("whole", "raw")])
async def test_a_whole_transfer_never_gets_a_kept_stream_nor_the_other_way_round(store, codec, request):
    """raw keeps the producer's K/V per chunk, scd its payloads (under the codec's root, as a kept
    entry is): neither's stored chunks serve a kept stream, nor a kept entry their stream."""
    kw = {"artifacts": request.getfixturevalue("artifacts")} if codec == "scd" else {}
    spec = common_pb2.CodecSpec(name=codec)
    whole_first, kept_first = contexts(2 * 64 + 40, 2 * 64 + 40, seed=73)
    want = await cold([(ids, keep, spec) for ids in (whole_first, kept_first) for keep in (KEEP, "")], **kw)
    (kept_a, whole_a, kept_b, whole_b) = (sent for _, sent, _ in want)
    async with single_flight.producer(**STORES[store], **kw) as (server, stub):
        await stream(stub, whole_first, "", spec)  # the whole transfer stored first
        header, got, trailer = await stream(stub, whole_first, KEEP, spec)
        assert not trailer.store_hit and trailer.reused_tokens == 0 and header.kept_tokens and got == kept_a
        _, got, trailer = await stream(stub, whole_first, "", spec)
        assert trailer.store_hit and got == whole_a  # its own stream still is
        await stream(stub, kept_first, KEEP, spec)  # the kept transfer stored first
        header, got, trailer = await stream(stub, kept_first, "", spec)
        assert not trailer.store_hit and trailer.reused_tokens == 0 and not header.kept_tokens and got == whole_b
        _, got, trailer = await stream(stub, kept_first, KEEP, spec)
        assert trailer.store_hit and got == kept_b
        await settled(server)


async def test_a_small_budget_evicts_kept_entries_and_cancelled_calls_give_everything_back():
    a, b = contexts(2 * 64 + 40, 2 * 64 + 30, seed=75)
    (_, sent_a, trailer_a), (_, sent_b, trailer_b) = await cold([(a, KEEP, RAW), (b, KEEP, RAW)])
    budget = max(trailer_a.payload_bytes, trailer_b.payload_bytes) * 3 // 2  # one kept entry, not two
    async with single_flight.producer(chunk_tokens=64, store_bytes=budget) as (server, stub):
        store = server.servicer.chunks
        await stream(stub, a)
        assert len(store.entries) == 1 and store.nbytes == trailer_a.payload_bytes
        assert (await stream(stub, a))[2].store_hit
        await stream(stub, b)  # evicts a's entry
        assert store.evictions == 1 and len(store.entries) == 1 and store.nbytes == trailer_b.payload_bytes
        _, got, trailer = await stream(stub, a)  # prefilled again, stored again (evicting b's)
        assert not trailer.store_hit and got == sent_a and store.evictions == 2
        await settled(server)

        # a replay cancelled while it waits for the encode thread lets go of its entry
        call = stub.Prefill(request(a), timeout=30)
        with held(server.servicer.encode.executor):
            assert (await call.read()).WhichOneof("kind") == "header"
            await single_flight.until(lambda: store.hits == 2 and bool(store._pins))
            store.clear()  # evicted while the replay holds it: counted until the replay lets go
            assert store.pinned_evicted_bytes == trailer_a.payload_bytes and store.nbytes == 0
            call.cancel()
            await single_flight.until(lambda: not store._pins)
        await settled(server)
        assert store.pinned_evicted_bytes == 0

        # a kept forward cancelled while it waits for the compute thread stores nothing
        with held(server.executor):
            call = stub.Prefill(request(b), timeout=30)
            assert (await call.read()).WhichOneof("kind") == "header"
            await single_flight.until(lambda: len(server.servicer.flights.running) == 1)
            call.cancel()
            await single_flight.until(lambda: not server.servicer.flights.running)
        await settled(server)
        await asyncio.sleep(0.1)
        assert not store.entries
        _, got, trailer = await stream(stub, b)
        assert not trailer.store_hit and got == sent_b
        await settled(server)


async def test_the_disk_tier_replays_a_kept_stream_after_a_restart_and_never_to_another_dtype(tmp_path):
    ids = contexts(2 * 64 + 40, seed=76)[0]
    ((_, sent, _),) = await cold([(ids, KEEP, RAW)])
    disk = {"chunk_tokens": 64, "store_disk_dir": str(tmp_path / "chunks")}
    async with single_flight.producer(**disk) as (server, stub):
        await stream(stub, ids)
        server.servicer.chunks.disk.flush()
    assert len(list((tmp_path / "chunks").glob("*.safetensors"))) == 1  # one entry: the whole kept stream
    async with single_flight.producer(**disk) as (server, stub):  # restarted: RAM empty, the disk tier serves
        _, got, trailer = await stream(stub, ids)
        assert trailer.store_hit and trailer.computed_tokens == 0 and got == sent  # its payloads in their order
        assert server.servicer.chunks.disk.index.hits == 1
        _, _, trailer = await stream(stub, ids, "h2o:0.4:window=8")
        assert not trailer.store_hit
        await settled(server)
    async with single_flight.producer(dtype="bfloat16", **disk) as (server, stub):  # another dtype: another key
        header, _, trailer = await stream(stub, ids)
        assert not trailer.store_hit and header.kv_dtype == "bfloat16"
        assert server.servicer.chunks.disk.index.hits == 0
        await settled(server)
