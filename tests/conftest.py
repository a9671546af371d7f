"""Shared test fixtures: real producer and consumer gRPC servers in-process on free ports,
ready when their health service says SERVING."""

from __future__ import annotations

import contextlib
import os
from typing import AsyncIterator

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from consumer.api.client import ConsumerClient, prompt  # noqa: F401  (re-exported for tests)
from consumer.server import ConsumerServer
from producer.server import ProducerServer
from shared import compute_dtype, logs
from shared.config import ConsumerConfig, ProducerConfig
from shared.pb import consumer_pb2, producer_pb2_grpc

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
logs.configure("tests", os.environ.get("SCD_TEST_LOG_LEVEL", "WARNING"))

# What `--dtype auto` (the configs' default) sees in tests: a CPU without native bf16, so every
# server a test starts without naming a dtype computes in float32 on any host, as before auto
# (a host's real facts would make answers host-dependent). tests/test_compute_dtype.py injects its own.
NO_NATIVE_BF16 = compute_dtype.DeviceFacts("cpu", cpu_flags=frozenset(), probe_ratio=None)
real_device_facts = compute_dtype.device_facts


@pytest.fixture(scope="session", autouse=True)
def float32_under_auto():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compute_dtype, "device_facts", lambda device: NO_NATIVE_BF16)
        yield


async def wait_serving(address: str, timeout_s: float = 60.0, token: str = "") -> None:
    """Block until the server's overall health is SERVING (Health.Watch, no sleeps; a Watch on a
    port that asks for a token needs it: shared.security.HEALTH_CHECK)."""
    from shared import security

    async with security.aio_channel(address, token=token) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        async for reply in stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s):
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return


class Pair:
    """A running producer/consumer pair with clients of both."""

    def __init__(self, producer: ProducerServer, consumer: ConsumerServer):
        self.producer = producer
        self.consumer = consumer
        self.client = ConsumerClient(consumer.address)
        self.stub = self.client.stub
        self.producer_channel = grpc.aio.insecure_channel(producer.address)
        self.producer_stub = producer_pb2_grpc.ProducerServiceStub(self.producer_channel)

    async def generate(self, timeout: float = 120.0, **fields) -> tuple[list[int], str, consumer_pb2.GenerateStats]:
        """One Generate call; returns (token ids, text, stats)."""
        answer = await self.client.generate(timeout=timeout, **fields)
        return answer.ids, answer.text, answer.stats

    async def close(self) -> None:
        await self.client.channel.close()
        await self.producer_channel.close()


@contextlib.asynccontextmanager
async def running_pair(producer_model: str = "tiny-llama", consumer_model: str | None = None, dtype: str = "float32",
                       producer_kw: dict | None = None, consumer_kw: dict | None = None, device: str = "cpu") -> AsyncIterator[Pair]:
    """Producer and consumer servers on free loopback ports, torn down on exit."""
    producer = ProducerServer(ProducerConfig(port=0, model=producer_model, dtype=dtype, device=device, drain_grace_s=0.5,
                                             **(producer_kw or {})))
    await producer.start()
    await producer.load()
    consumer = ConsumerServer(ConsumerConfig(port=0, model=consumer_model or producer_model, dtype=dtype, device=device,
                                             producer=producer.address, drain_grace_s=0.5, **(consumer_kw or {})))
    await consumer.start()
    await consumer.load()
    await wait_serving(producer.address, token=(producer_kw or {}).get("token", ""))
    await wait_serving(consumer.address, token=(consumer_kw or {}).get("token", ""))
    pair = Pair(producer, consumer)
    try:
        yield pair
    finally:
        await pair.close()
        await consumer.stop()
        await producer.stop()


@pytest.fixture(scope="module")
async def pair_llama() -> AsyncIterator[Pair]:
    """A tiny-llama producer/consumer pair shared by one test module."""
    async with running_pair("tiny-llama") as pair:
        yield pair


async def assert_refused_by_both(pair: Pair, spec, named: str, **fields) -> None:
    """The consumer (Generate) and the producer (Prefill) both refuse `spec` with
    INVALID_ARGUMENT and a message containing `named`."""
    from shared.pb import producer_pb2

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await pair.generate(max_new_tokens=2, transfer=spec, **fields)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in err.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in pair.producer_stub.Prefill(producer_pb2.PrefillRequest(token_ids=[5, 6, 7], codec=spec), timeout=10):
            pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in err.value.details()


def perturbed_model(name: str, seed: int, scale: float, save_to=None):
    """A same-architecture stand-in for a fine-tuned variant: builtin `name` with seeded noise on
    every weight; with save_to, saved (weights + tokenizer) where a server can load it."""
    from shared.models import load_model

    loaded = load_model(name, "float32", "cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in loaded.model.parameters():
            p.add_(scale * torch.randn_like(p))
    if save_to is not None:
        loaded.model.save_pretrained(save_to)
        loaded.tokenizer.save_pretrained(save_to)
    return loaded
