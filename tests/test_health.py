"""Readiness vs liveness: readiness ("" and the API service name) follows the model and the
drain; liveness ("liveness") follows the compute thread's heartbeat, so a wedged compute thread
reads NOT_SERVING there while readiness is untouched, and SERVING again once it answers."""

from __future__ import annotations

import asyncio
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared import healthcheck, serving
from tests.conftest import running_pair

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


async def check(address: str, service: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return reply.status


async def test_liveness_follows_the_compute_thread():
    fast = dict(liveness_interval_s=0.05, liveness_timeout_s=0.3, health_port=0)
    async with running_pair("tiny-llama", producer_kw=fast, consumer_kw=fast) as pair:
        for server in (pair.producer, pair.consumer):
            probe = f"127.0.0.1:{server.server.health_port}"
            assert await check(probe, serving.LIVENESS) == SERVING
            assert await check(probe, "") == SERVING
            wedged = server.executor.submit(time.sleep, 1.5)  # the compute thread stops answering
            seen = []
            async with grpc.aio.insecure_channel(probe) as channel:
                watch = health_pb2_grpc.HealthStub(channel).Watch(
                    health_pb2.HealthCheckRequest(service=serving.LIVENESS), timeout=10
                )
                async for reply in watch:
                    seen.append(reply.status)
                    if seen[-2:] == [NOT_SERVING, SERVING]:
                        break
                    if reply.status == NOT_SERVING:
                        assert await check(probe, "") == SERVING  # readiness is a different signal
            assert seen[-2:] == [NOT_SERVING, SERVING] and wedged.done()
            assert await asyncio.to_thread(healthcheck.check, probe, 3.0, serving.LIVENESS)
