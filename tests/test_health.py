"""Readiness vs liveness: readiness ("" and the API service name) follows the model and the
drain; liveness ("liveness") follows progress (the producer's forward and encode loops, the
consumer's batch engine), so a wedged forward or job reads NOT_SERVING there while readiness is
untouched, and SERVING again once it moves; a busy producer is not a wedged one."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared import health_service, healthcheck, liveness
from tests.conftest import running_pair

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


async def check(address: str, service: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return reply.status


def stuck_iteration(progress: liveness.Progress, seconds: float) -> None:
    with progress.iteration():
        time.sleep(seconds)


def busy_iteration(progress: liveness.Progress, seconds: float) -> None:
    """A long iteration that keeps advancing (a forward over many layers)."""
    with progress.iteration():
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            time.sleep(0.02)
            progress.beat()


async def test_liveness_follows_the_compute_thread():
    fast = dict(liveness_interval_s=0.05, liveness_timeout_s=0.3, health_port=0)
    async with running_pair("tiny-llama", producer_kw=fast, consumer_kw=fast) as pair:
        for server in (pair.producer, pair.consumer):
            probe = f"127.0.0.1:{server.server.health_port}"
            assert await check(probe, health_service.LIVENESS) == SERVING
            assert await check(probe, "") == SERVING
            if server is pair.producer:  # liveness from progress: a forward that stops advancing
                wedged = server.executor.submit(stuck_iteration, server.servicer.compute_progress, 1.5)
            else:  # the batch engine: a job that holds one iteration without progress
                wedged = server.executor.submit(time.sleep, 1.5)
            seen = []
            async with grpc.aio.insecure_channel(probe) as channel:
                watch = health_pb2_grpc.HealthStub(channel).Watch(
                    health_pb2.HealthCheckRequest(service=health_service.LIVENESS), timeout=10
                )
                async for reply in watch:
                    seen.append(reply.status)
                    if seen[-2:] == [NOT_SERVING, SERVING]:
                        break
                    if reply.status == NOT_SERVING:
                        assert await check(probe, "") == SERVING  # readiness is a different signal
            assert seen[-2:] == [NOT_SERVING, SERVING] and wedged.done()
            assert await asyncio.to_thread(healthcheck.check, probe, 3.0, health_service.LIVENESS)


async def test_producer_liveness_is_progress_not_a_place_in_the_queue():
    """A busy compute thread (a long iteration that keeps advancing, and work queued behind it)
    stays SERVING on the producer: only an iteration without progress reads as a hang."""
    from producer.server import ProducerServer
    from shared.config import ProducerConfig

    producer = ProducerServer(
        ProducerConfig(port=0, model="tiny-llama", device="cpu", drain_grace_s=0.2, health_port=0,
                       liveness_interval_s=0.05, liveness_timeout_s=0.3)
    )
    await producer.start()
    await producer.load()
    try:
        probe = f"127.0.0.1:{producer.server.health_port}"
        progress = producer.servicer.compute_progress
        busy = [producer.executor.submit(busy_iteration, progress, 0.6) for _ in range(2)]  # 1.2 s of queue
        seen = set()
        while not all(f.done() for f in busy):
            seen.add(await check(probe, health_service.LIVENESS))
            await asyncio.sleep(0.05)
        assert seen == {SERVING}
        assert liveness.stalled([progress], 0.3) is None and progress.iterations >= 2
    finally:
        await producer.stop(0)


def test_progress_reports_only_a_stuck_iteration():
    progress = liveness.Progress("loop")
    assert progress.stalled_s() == 0.0  # idle is alive
    with progress.iteration():
        time.sleep(0.05)
        assert liveness.stalled([progress], 0.01) is progress
        progress.beat()
        assert liveness.stalled([progress], 0.01) is None
    time.sleep(0.02)
    assert progress.stalled_s() == 0.0 and progress.iterations == 1


@pytest.mark.parametrize("default_mode", ["raw", ""])
async def test_consumer_not_ready_when_the_producer_is_incompatible(monkeypatch, default_mode):
    """A fixed transfer default: readiness NOT_SERVING (liveness SERVING) when the producer's
    Describe reports another api_version; the default auto stays ready (it serves by the own
    prefill) and the link's own health service says the producer is unusable. The check itself
    compares api_version and codec format versions."""
    from consumer.link import compat
    from consumer.server import ConsumerServer
    from producer.server import ProducerServer
    from shared.config import ConsumerConfig, ProducerConfig
    from shared.pb import common_pb2, producer_pb2

    producer = ProducerServer(ProducerConfig(port=0, model="tiny-llama", device="cpu", drain_grace_s=0.2))
    await producer.start()
    await producer.load()
    monkeypatch.setattr(compat, "API_VERSION", "scd.v2")
    monkeypatch.setattr(compat.mismatch, "__defaults__", ("scd.v2",))
    consumer = ConsumerServer(
        ConsumerConfig(port=0, model="tiny-llama", device="cpu", producer=producer.address, drain_grace_s=0.2,
                       default_mode=default_mode)
    )
    try:
        await consumer.start()
        await consumer.load()
        assert await check(consumer.address, health_service.LIVENESS) == SERVING
        assert await check(consumer.address, "producer-link") == NOT_SERVING
        if not default_mode:
            assert not consumer.server.not_ready and await check(consumer.address, "") == SERVING
            return
        assert "api_version 'scd.v1' != consumer 'scd.v2'" in consumer.server.not_ready
        assert await check(consumer.address, "") == NOT_SERVING
        assert await check(consumer.address, "scd.v1.ConsumerService") == NOT_SERVING
    finally:
        await consumer.stop()
        await producer.stop()

    codecs = {"raw": type("Raw", (), {"format_version": 1})()}
    reply = producer_pb2.ProducerServiceDescribeResponse(
        api_version="scd.v1", codecs=[common_pb2.CodecInfo(name="raw", format_version=2)]
    )
    assert compat.mismatch(reply, codecs, "scd.v1") == "codec 'raw': producer format_version 2 != consumer 1"
    reply.codecs[0].format_version = 1
    assert compat.mismatch(reply, codecs, "scd.v1") == ""
