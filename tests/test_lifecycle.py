"""The request lifecycle under abuse: slots and counters come back on every path (cancel storms,
cancels during the header, tiny deadlines), admission limits answer RESOURCE_EXHAUSTED naming the
limit, client input is checked before it costs anything, a stalled reader never holds up other
prefills, and draining lets admitted calls finish while an open health Watch holds nothing.
"""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.pb import common_pb2, consumer_pb2, producer_pb2
from tests.conftest import prompt, running_pair

CONTEXT = "The producer reads a long context and the consumer writes the answer. " * 10


async def settled(pair, timeout_s: float = 10.0) -> producer_pb2.ProducerStats:
    """Producer counters once every call has settled (they must balance)."""
    until = time.monotonic() + timeout_s
    while True:
        stats = (await pair.producer_stub.Describe(producer_pb2.ProducerServiceDescribeRequest())).stats
        outcomes = stats.prefills_completed + stats.prefills_cancelled + stats.prefills_failed
        idle = pair.producer.servicer.admission.inflight == 0 and pair.consumer.servicer.admission.inflight == 0
        if (idle and outcomes == stats.prefills_started) or time.monotonic() > until:
            return stats
        await asyncio.sleep(0.05)


async def test_a_cancel_storm_returns_every_slot_and_the_counters_balance():
    async with running_pair("tiny-llama", producer_kw={"max_inflight": 4}, consumer_kw={"max_inflight": 64}) as pair:
        rng = random.Random(0)

        async def one(i: int):
            mode = ["raw", "quant", "recompute", "oracle"][i % 4]
            call = pair.stub.Generate(consumer_pb2.GenerateRequest(
                context=prompt(CONTEXT * (1 + i % 3)), question=prompt(" q"), max_new_tokens=8,
                transfer=common_pb2.CodecSpec(name=mode)), timeout=rng.choice([0.05, 0.3, 30]))
            try:
                async with asyncio.timeout(rng.uniform(0, 0.4)):
                    async for _ in call:
                        pass
            except (TimeoutError, grpc.aio.AioRpcError):
                call.cancel()

        for _ in range(3):
            await asyncio.gather(*(one(i) for i in range(24)))
        stats = await settled(pair)
        assert pair.producer.servicer.admission.inflight == 0
        assert pair.consumer.servicer.admission.inflight == 0
        assert stats.prefills_started == stats.prefills_completed + stats.prefills_cancelled + stats.prefills_failed
        assert stats.prefills_failed == 0, stats  # a cancel is counted as a cancel
        ids, _, _ = await pair.generate(context=prompt(CONTEXT), question=prompt(" q"), max_new_tokens=4)
        assert ids


async def test_cancels_during_the_header_never_leak_a_producer_slot():
    async with running_pair("tiny-llama", producer_kw={"max_inflight": 2}) as pair:
        request = producer_pb2.PrefillRequest(token_ids=list(range(5, 200)), codec=common_pb2.CodecSpec(name="raw"))
        for _ in range(10):  # 5x max_inflight
            call = pair.producer_stub.Prefill(request, timeout=30)
            await call.initial_metadata()
            call.cancel()
        stats = await settled(pair)
        assert pair.producer.servicer.admission.inflight == 0
        assert stats.prefills_started == stats.prefills_completed + stats.prefills_cancelled + stats.prefills_failed
        messages = [m async for m in pair.producer_stub.Prefill(request, timeout=30)]
        assert messages[-1].WhichOneof("kind") == "trailer"


async def test_admission_limit_is_resource_exhausted_naming_it():
    async with running_pair("tiny-llama", consumer_kw={"max_inflight": 1}) as pair:
        slow = pair.stub.Generate(consumer_pb2.GenerateRequest(context=prompt(CONTEXT * 4), question=prompt(" q"), max_new_tokens=64,
                                                               transfer=common_pb2.CodecSpec(name="oracle")), timeout=60)
        first = await slow.read()  # admitted and answering
        assert first.WhichOneof("kind") == "token"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pair.generate(context=prompt(CONTEXT), question=prompt(" q"), max_new_tokens=2)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_inflight 1" in err.value.details()
        slow.cancel()


@pytest.mark.parametrize("request_id, named", [
    ("bad\nid", "request_id: must be 1..128 printable ASCII"),
    ("é", "request_id: must be 1..128 printable ASCII"),
    ("x" * 65536, "got 65536 characters"),
])
async def test_request_ids_are_checked_on_both_services(pair_llama, request_id, named):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await pair_llama.generate(request_id=request_id, context=prompt(CONTEXT), question=prompt(" q"), max_new_tokens=2)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and named in err.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in pair_llama.producer_stub.Prefill(producer_pb2.PrefillRequest(request_id=request_id, token_ids=[5, 6]),
                                                        timeout=10):
            pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and named in err.value.details()


async def test_a_huge_text_is_refused_before_tokenizing_and_health_stays_responsive(pair_llama):
    """A text over max_text_bytes is refused naming its field, before tokenizing; a message over the
    port's receive limit (two such texts and the other fields, shared.grpc_server) is refused by
    grpc before it is held whole."""
    limit = pair_llama.consumer.config.request_bytes_limit
    for text, code, details in (
        ("word " * 300_000, grpc.StatusCode.INVALID_ARGUMENT, "context.text: 1500000 bytes > limit max_text_bytes 1048576"),
        ("word " * (1 << 20), grpc.StatusCode.RESOURCE_EXHAUSTED, f"vs. {limit})"),  # 5 MiB
    ):
        started = time.perf_counter()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pair_llama.generate(context=prompt(text), question=prompt(" q"), max_new_tokens=2)
        assert err.value.code() == code
        assert details in err.value.details()
        assert time.perf_counter() - started < 2.0  # refused without tokenizing megabytes
    async with grpc.aio.insecure_channel(pair_llama.consumer.address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_a_stalled_reader_does_not_hold_up_other_prefills():
    """One caller reads its Prefill stream and then stops reading; the producer's forward for it
    still completes (into that request's buffer) and other prefills run meanwhile."""
    async with running_pair("tiny-llama", producer_kw={"max_chunk_bytes": 1024}) as pair:
        long_ids = list(range(5, 380)) * 10  # 3750 tokens: megabytes of raw K/V, far above gRPC's flow-control window
        stalled = pair.producer_stub.Prefill(producer_pb2.PrefillRequest(token_ids=long_ids, codec=common_pb2.CodecSpec(name="raw")),
                                             timeout=120)
        assert (await stalled.read()).WhichOneof("kind") == "header"
        await asyncio.sleep(1.0)  # the stalled stream's window fills; the old design blocked the compute thread here
        started = time.perf_counter()
        ids, _, stats = await pair.generate(context=prompt(CONTEXT), question=prompt(" q"), max_new_tokens=2,
                                            transfer=common_pb2.CodecSpec(name="raw"))
        took = time.perf_counter() - started
        assert stats.generated_tokens >= 1 and took < 20, took
        stalled.cancel()
        stats = await settled(pair)
        assert stats.prefills_started == stats.prefills_completed + stats.prefills_cancelled + stats.prefills_failed


async def test_drain_lets_admitted_calls_finish_refuses_new_ones_and_a_watch_holds_nothing():
    async with running_pair("tiny-llama") as pair:
        request = consumer_pb2.GenerateRequest(context=prompt(CONTEXT), question=prompt(" q"), max_new_tokens=48,
                                               transfer=common_pb2.CodecSpec(name="oracle"), stop_token_ids=[0])
        running = pair.stub.Generate(request, timeout=60)
        assert (await running.read()).WhichOneof("kind") == "token"
        channel = grpc.aio.insecure_channel(pair.consumer.address)
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=60)
        await watch.read()
        stop = asyncio.ensure_future(pair.consumer.stop(20.0))
        await asyncio.sleep(0.05)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pair.generate(context=prompt(CONTEXT), question=prompt(" q"), max_new_tokens=2)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        rest = []
        while (message := await running.read()) != grpc.aio.EOF:
            rest.append(message)
        assert rest[-1].WhichOneof("kind") == "stats" and rest[-1].stats.generated_tokens == 48
        started = time.perf_counter()
        await stop
        assert time.perf_counter() - started < 5.0  # not the 20 s grace: the open Watch did not hold the drain
        watch.cancel()
        await channel.close()


async def test_a_lost_cancel_of_the_liveness_watchdog_does_not_hold_the_stop(monkeypatch):
    """Python 3.11 can lose a cancel that races with an awaited future completing (seen with
    asyncio.wait_for); the liveness loop (shared.grpc_server) must still end and the server's stop
    return. Simulated: every cancel of the watchdog's sleep is lost."""
    from producer.server import ProducerServer
    from shared import grpc_server
    from shared.config import ProducerConfig

    real_wait_for, real_sleep = asyncio.wait_for, asyncio.sleep
    watched: list[float] = []  # the watchdog's sleeps that went through the losing patch

    async def losing_sleep(delay, *args):
        task = asyncio.current_task()
        if task is None or "_watchdog" not in task.get_coro().__qualname__:
            return await real_sleep(delay, *args)  # only the watchdog's sleep loses its cancels: a global
            # patch also swallowed the cancels of other tasks' sleeps and could hold the test's teardown
        watched.append(delay)
        try:
            return await real_sleep(delay, *args)
        except asyncio.CancelledError:
            return None

    monkeypatch.setattr(grpc_server.asyncio, "sleep", losing_sleep)
    server = ProducerServer(ProducerConfig(port=0, model="tiny-llama", drain_grace_s=0.1, liveness_interval_s=0.01))
    await server.start()
    await server.load()
    await real_sleep(0.3)  # the watchdog is running, mostly inside its sleep
    started = time.perf_counter()
    await real_wait_for(server.stop(), 20)  # stop() itself must return
    assert time.perf_counter() - started < 5.0
    assert watched  # the patch reached the watchdog
