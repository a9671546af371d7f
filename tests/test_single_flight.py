"""Single flight through the real producer: concurrent Prefill calls for the same context, codec
and options share one forward and one encode; each caller gets the whole stream, byte for byte
what a call alone gets; the first caller's cancel does not end the others' streams; the shared
work stops once nobody listens."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import grpc
import pytest

from producer.flight import Flights
from producer.server import ProducerServer
from shared.config import ProducerConfig
from shared.pb import common_pb2, producer_pb2, producer_pb2_grpc
from tests.test_metrics import scrape, value
from tests.test_prefill_engine import contexts, held

IDS = contexts(300, seed=7)[0]
REQUEST = producer_pb2.PrefillRequest(token_ids=IDS, codec=common_pb2.CodecSpec(name="quant", options={"bits": "8"}))


@contextlib.asynccontextmanager
async def producer(**kw) -> AsyncIterator[tuple[ProducerServer, producer_pb2_grpc.ProducerServiceStub]]:
    server = ProducerServer(ProducerConfig(**{"port": 0, "model": "tiny-llama", "device": "cpu", "drain_grace_s": 0.2, **kw}))
    await server.start()
    await server.load()
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            yield server, producer_pb2_grpc.ProducerServiceStub(channel)
    finally:
        await server.stop(0)


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def collect(subscription) -> list:
    return [x async for x in subscription]


async def read_all(call) -> list[producer_pb2.PrefillResponse]:
    return [message async for message in call]


def chunks(messages) -> list[bytes]:
    return [m.SerializeToString() for m in messages if m.WhichOneof("kind") == "chunk"]


async def test_concurrent_identical_prefills_share_one_forward():
    async with producer(store_bytes=0, metrics_port=0) as (server, stub):  # no store: every call alone prefills
        solo = await read_all(stub.Prefill(REQUEST, timeout=30))
        engine, flights = server.servicer.engine, server.servicer.flights
        rows = engine.forward_rows
        with held(server.executor):
            calls = [asyncio.ensure_future(read_all(stub.Prefill(REQUEST, timeout=30))) for _ in range(3)]
            await until(lambda: flights.shared == 2)
        streams = await asyncio.gather(*calls)
        assert engine.forward_rows - rows == 1  # one context prefilled for three calls
        for stream in streams:
            assert chunks(stream) == chunks(solo) and len(chunks(solo)) > 0
        trailers = [stream[-1].trailer for stream in streams]
        assert sorted(t.prefill_shared for t in trailers) == [False, True, True]
        assert all(t.payload_bytes == solo[-1].trailer.payload_bytes and t.prefill_batch_size == 1 for t in trailers)
        stats = (await stub.Describe(producer_pb2.ProducerServiceDescribeRequest(), timeout=5)).stats
        assert stats.prefills_shared == 2 and stats.prefills_completed == 4 and stats.prefill_forward_contexts == 2
        assert not flights.running  # forgotten once done
        samples = await asyncio.to_thread(scrape, server.server.metrics_port)
        assert value(samples, "scd_prefill_shared_total") == 2 and value(samples, "scd_prefill_forward_contexts_total") == 2
        assert value(samples, "scd_prefill_forwards_total") == 2 and value(samples, "scd_prefill_waiting") == 0


async def test_the_first_callers_cancel_leaves_the_others_streams_whole():
    async with producer(store_bytes=1 << 30) as (server, stub):
        flights, outcomes = server.servicer.flights, server.servicer.outcomes
        with held(server.executor):
            leader = stub.Prefill(REQUEST, timeout=30)
            assert (await leader.read()).WhichOneof("kind") == "header"
            await until(lambda: len(flights.running) == 1)
            follower = asyncio.ensure_future(read_all(stub.Prefill(REQUEST, timeout=30)))
            await until(lambda: flights.shared == 1)
            leader.cancel()
            await until(lambda: outcomes.cancelled == 1)
        stream = await follower
        assert stream[-1].trailer.prefill_shared and not stream[-1].trailer.store_hit
        # the shared run completed into the store: a later call replays it, and it is what a solo run sends
        again = await read_all(stub.Prefill(REQUEST, timeout=30))
        assert again[-1].trailer.store_hit and chunks(again) == chunks(stream)
    async with producer(store_bytes=0) as (_, stub):
        assert chunks(await read_all(stub.Prefill(REQUEST, timeout=30))) == chunks(stream)


async def test_the_shared_work_stops_when_every_caller_has_gone():
    async with producer() as (server, stub):
        engine, flights, outcomes = server.servicer.engine, server.servicer.flights, server.servicer.outcomes
        forwards = engine.forwards
        with held(server.executor):
            calls = [stub.Prefill(REQUEST, timeout=30) for _ in range(2)]
            for call in calls:
                await call.read()
            await until(lambda: flights.shared == 1)
            for call in calls:
                call.cancel()
            await until(lambda: outcomes.cancelled == 2 and not flights.running)
        await until(lambda: not engine.waiting and engine._scheduler is None)
        assert engine.forwards == forwards  # cancelled while it waited: never run
        assert not server.servicer.store.entries and server.servicer.store.misses == 1  # the follower is no miss


async def test_a_late_subscriber_gets_the_whole_stream_and_a_failure_reaches_everyone():
    async def source(n: int, fail: bool):
        for i in range(n):
            await asyncio.sleep(0.01)
            yield i
        if fail:
            raise ValueError("broke")
        yield "done"

    kept: list = []
    flights = Flights()
    first, joined = flights.join("k", lambda: source(5, False), lambda x: x == "done", kept.append)
    assert not joined
    got_first = [x async for x in first]
    late, joined = flights.join("k", lambda: source(5, False), lambda x: x == "done", kept.append)
    assert got_first == [0, 1, 2, 3, 4, "done"] and joined is False and len(kept) == 1  # ended: a new flight
    await late.aclose()

    # joining mid-flight: the items produced before it joined, then the live ones, like the first
    a, _ = flights.join("j", lambda: source(5, False), lambda x: x == "done", kept.append)
    await until(lambda: len(flights.running["j"].items) >= 2)
    b, joined = flights.join("j", lambda: source(5, False), lambda x: x == "done", kept.append)
    assert joined and 2 <= len(flights.running["j"].items) < 6  # it did join late, before the end
    got_a, got_b = await asyncio.gather(collect(a), collect(b))
    assert got_a == got_b == [0, 1, 2, 3, 4, "done"] and len(kept) == 2

    a, _ = flights.join("f", lambda: source(3, True), lambda x: x == "done", kept.append)
    await until(lambda: len(flights.running["f"].items) >= 2)
    b, joined = flights.join("f", lambda: source(3, True), lambda x: x == "done", kept.append)
    assert joined
    for sub in (a, b):
        got: list = []
        with pytest.raises(ValueError, match="broke"):
            async for x in sub:
                got.append(x)
        assert got == [0, 1, 2]  # every item, then the failure
    assert len(kept) == 2 and not flights.running
