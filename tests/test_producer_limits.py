"""A Prefill's own limits through the real producer (issue 44 items 4-6): a deadline of its own
(default and maximum), a write that waits too long for its reader, a byte budget for what a
caller has not read (per call and in all), cancelled prefills that leave the compute queue at
once, and the request id on every error status and log line. On 2cf1243: no deadline (a caller
without one held its slot and stream forever), no write or byte bound, 200 cancelled calls left
200 jobs queued, and INTERNAL said `request_id=`."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import structlog

from producer.prefill import PrefillEngine
from shared import codecs as codec_lib
from shared import logs
from shared.errors import ResourceExhausted
from shared.models import load_model
from shared.pb import common_pb2, consumer_pb2, producer_pb2, producer_pb2_grpc
from tests import test_single_flight as single_flight
from tests.test_prefill_engine import contexts, held

RAW = common_pb2.CodecSpec(name="raw")
BIG = contexts(1200, seed=131)[0]  # raw, tiny-llama: 1.2 MB of payloads, 300 KB a layer
# a caller that stops reading: without BDP probing its HTTP/2 window stays at 64 KiB, so the
# producer's writes wait after ~128 KiB (with it, ~6 MiB disappear into growing windows first)
STOPPED_READER = [("grpc.http2.bdp_probe", 0), ("grpc.max_receive_message_length", 8 << 20)]


@contextlib.asynccontextmanager
async def producer(**kw):
    """(server, stub, stub of a channel whose reader can stop)."""
    async with single_flight.producer(**{"chunk_tokens": 0, "store_bytes": 0, **kw}) as (server, stub):
        async with grpc.aio.insecure_channel(server.address, options=STOPPED_READER) as channel:
            yield server, stub, producer_pb2_grpc.ProducerServiceStub(channel)


def request(ids, **fields) -> producer_pb2.PrefillRequest:
    return producer_pb2.PrefillRequest(token_ids=ids, codec=RAW, **fields)


async def drain(call) -> grpc.aio.AioRpcError | None:
    """Read a call to its end (with read(): a call already read from that way may go on); its error."""
    try:
        while await call.read() != grpc.aio.EOF:
            pass
    except grpc.aio.AioRpcError as exc:
        return exc
    return None


# -- item 5: cancelled prefills leave the compute queue ---------------------------------------------
async def test_cancelled_prefills_leave_the_compute_queue_at_once():
    """Twenty calls with 0.3 s deadlines behind a busy compute thread: each frees its slot and its
    queued job (token ids, continuation) when its deadline passes, not at the next take."""
    async with producer(max_inflight=64) as (server, stub, _):
        engine = server.servicer.engine
        with held(server.executor):
            calls = [drain(stub.Prefill(request(ids), timeout=0.3)) for ids in contexts(*[400] * 20, seed=5)]
            errors = await asyncio.gather(*calls)
            assert {e.code() for e in errors} == {grpc.StatusCode.DEADLINE_EXCEEDED}
            await single_flight.until(lambda: server.servicer.admission.inflight == 0)
            assert len(engine.waiting) == 0  # before: 20 jobs, 8000 token ids, nobody waiting for them
        assert server.servicer.outcomes.cancelled == 20
        served = await single_flight.read_all(stub.Prefill(request(BIG[:50]), timeout=30))
        assert served[-1].WhichOneof("kind") == "trailer"


async def test_the_compute_queue_is_bounded():
    """The engine refuses a prefill past max_waiting (the servicer sets max_inflight: a queue of
    admitted calls only); a closed one leaves at once."""
    loaded = load_model("tiny-llama", "float32", "cpu")
    encoder = codec_lib.create_codecs(loaded)["raw"].encoder({}, codec_lib.EncodeRequest(2, ""))
    executor = ThreadPoolExecutor(1)
    engine = PrefillEngine(loaded, executor, max_waiting=2)
    with held(executor):
        streams = [engine.stream([5, 6], encoder, lambda layer, payloads: payloads) for _ in range(3)]
        waits = [asyncio.ensure_future(s.__anext__()) for s in streams[:2]]
        await single_flight.until(lambda: len(engine.waiting) == 2)
        with pytest.raises(ResourceExhausted, match="prefills waiting for the forward: 2 >= 2"):
            await streams[2].__anext__()
        for wait, stream in zip(waits, streams):
            wait.cancel()
            await asyncio.gather(wait, return_exceptions=True)
            await stream.aclose()
        assert len(engine.waiting) == 0
    executor.shutdown()


# -- item 4: deadlines, a reader that stops, unsent bytes ---------------------------------------------
async def test_a_call_without_a_deadline_gets_the_producers_default_and_none_exceeds_its_maximum():
    async with producer(default_timeout_s=0.5, max_timeout_s=1.0) as (server, stub, _):
        with held(server.executor):  # the forward never starts: only the deadline ends the calls
            began = time.monotonic()
            none, long = await asyncio.gather(
                drain(stub.Prefill(request(BIG[:100]))),  # no deadline: 0.5 s
                drain(stub.Prefill(request(BIG[:200]), timeout=60)),  # 60 s asked: 1 s
            )
            took = time.monotonic() - began
            assert none.code() == long.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "--default-timeout-s" in none.details() and "0.5 s" in none.details()
            assert "1 s" in long.details() and took < 5
            await single_flight.until(lambda: server.servicer.admission.inflight == 0)
            assert len(server.servicer.engine.waiting) == 0


async def test_a_reader_that_stops_frees_its_slot_and_stream_after_the_write_idle_timeout():
    async with producer(write_idle_timeout_s=0.5, max_inflight=1) as (server, stub, stopped):
        call = stopped.Prefill(request(BIG), timeout=120)
        assert (await call.read()).WhichOneof("kind") == "header"  # then the caller reads no more
        # before: the slot and the whole stream held until the caller's deadline (none: forever)
        await single_flight.until(lambda: server.servicer.admission.inflight == 0, timeout_s=60)
        assert server.servicer.flights.unsent.total == 0 and not server.servicer.flights.running
        # the slot is back: the next caller (max_inflight 1) is served
        assert (await single_flight.read_all(stub.Prefill(request(BIG[:64]), timeout=30)))[-1].WhichOneof("kind") == "trailer"
        err = await drain(call)
        assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "--write-idle-timeout-s" in err.details()


async def test_a_caller_that_falls_behind_fails_alone_and_its_unread_bytes_are_freed():
    """--max-request-unsent-bytes 500 KiB, no idle limit: a caller that stops reading (1.2 MB) is failed
    (RESOURCE_EXHAUSTED when it reads on) with its buffer emptied; a caller reading along beside it
    gets its whole stream."""
    limit = 500 << 10
    async with producer(max_request_unsent_bytes=limit, write_idle_timeout_s=0) as (server, stub, stopped):
        unsent = server.servicer.flights.unsent
        slow = stopped.Prefill(request(BIG), timeout=120)
        assert (await slow.read()).WhichOneof("kind") == "header"
        fast = await single_flight.read_all(stub.Prefill(request(contexts(1000, seed=9)[0]), timeout=120))
        assert fast[-1].WhichOneof("kind") == "trailer"
        await single_flight.until(lambda: unsent.failed == 1, timeout_s=60)
        assert unsent.total == 0 and not unsent.subscribers
        err = await drain(slow)
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "fell behind" in err.details()
        assert f"--max-request-unsent-bytes {limit}" in err.details()


async def test_past_the_total_the_caller_furthest_behind_fails():
    async with producer(max_unsent_bytes=600 << 10, write_idle_timeout_s=0) as (server, stub, stopped):
        unsent = server.servicer.flights.unsent
        calls = [stopped.Prefill(request(ids), timeout=120) for ids in contexts(1200, 100, seed=17)]
        for call in calls:
            assert (await call.read()).WhichOneof("kind") == "header"
        await single_flight.until(lambda: unsent.failed == 1, timeout_s=60)
        small = await drain(calls[1])  # the smaller stream fits: read whole
        big = await drain(calls[0])
        assert small is None and big.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert unsent.total == 0


# -- item 6: the request id on every error ---------------------------------------------------------------
async def test_every_error_status_and_log_line_names_the_request_id():
    async with producer() as (server, stub, _):
        logs.configure("tests", "INFO")  # rpc.error is an INFO line
        with structlog.testing.capture_logs() as lines:
            bad = producer_pb2.PrefillRequest(token_ids=[5, 6], codec=common_pb2.CodecSpec(name="nope"))
            call = stub.Prefill(bad, metadata=(("x-request-id", "rid-bad"),))
            err = await drain(call)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert dict(await call.trailing_metadata())["x-request-id"] == "rid-bad"

            async def broken(*args, **kwargs):
                raise RuntimeError("a bug")

            server.servicer.sources.open = broken  # an unexpected failure inside the call
            call = stub.Prefill(request([5, 6], request_id="rid-6"), timeout=10)
            err = await drain(call)
        assert err.code() == grpc.StatusCode.INTERNAL and err.details() == "internal error (request_id=rid-6)"
        assert dict(await call.trailing_metadata())["x-request-id"] == "rid-6"
        internal = [x for x in lines if x["event"] == "rpc.internal_error"]
        refused = [x for x in lines if x["event"] == "rpc.error"]
        assert [x["request_id"] for x in internal] == ["rid-6"] and [x["request_id"] for x in refused] == ["rid-bad"]
    logs.configure("tests", os.environ.get("SCD_TEST_LOG_LEVEL", "WARNING"))


async def test_the_consumers_internal_errors_name_the_request_id_too():
    from tests.conftest import prompt, running_pair

    async with running_pair("tiny-llama") as pair:

        async def broken(*args, **kwargs):
            raise RuntimeError("a bug")

        pair.consumer.servicer.jobs.build = broken
        call = pair.stub.Generate(
            consumer_pb2.GenerateRequest(request_id="rid-c", context=prompt(ids=[5, 6]), question=prompt(ids=[7])), timeout=30
        )
        err = await drain(call)
        assert err.code() == grpc.StatusCode.INTERNAL and err.details() == "internal error (request_id=rid-c)"
        assert dict(await call.trailing_metadata())["x-request-id"] == "rid-c"


async def test_deadlines_that_end_calls_mid_write_are_counted_as_such_and_never_as_internal_errors():
    """Hundreds of calls whose deadlines (10-120 ms) pass anywhere in their stream, some mid-write:
    the watch closing the call's stream never meets the handler resuming or closing it too (before:
    ~1 in 300 logged "asynchronous generator is already running" as an internal error, a second abort
    raised, and /metrics counted a cancelled call as UNKNOWN); every code is one a caller can see."""
    import random

    from tests.test_metrics import scrape

    rng = random.Random(1)
    ctxs = contexts(*[rng.randrange(300, 1500) for _ in range(6)], seed=4)
    async with single_flight.producer(chunk_tokens=64, store_bytes=1 << 30, metrics_port=0) as (server, stub):

        async def one() -> None:
            spec = rng.choice([RAW, common_pb2.CodecSpec(name="quant", options={"bits": "8"})])
            call = stub.Prefill(producer_pb2.PrefillRequest(token_ids=rng.choice(ctxs), codec=spec), timeout=rng.uniform(0.01, 0.12))
            error = await drain(call)
            assert error is None or error.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED), error

        for _ in range(80):
            await asyncio.gather(*[one() for _ in range(3)])
        await single_flight.until(lambda: server.servicer.admission.inflight == 0)
        samples = await asyncio.to_thread(scrape, server.server.metrics_port)
    codes = {dict(k[1])["code"] for k in samples if k[0] == "scd_rpc_total" and dict(k[1]).get("method") == "Prefill"}
    assert codes <= {"OK", "DEADLINE_EXCEEDED", "CANCELLED"}, codes
