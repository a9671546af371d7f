"""What a gRPC API port holds before admission (shared.grpc_server): grpc-core reads a call's whole
request message before any handler (and so any admission count) sees it. Two bounds make that
memory at most max_calls x the request limit: the server's cap on calls in progress (past it,
RESOURCE_EXHAUSTED before the request is read) and a receive limit sized from the service's own
request limits. Before them a stalled 8 MiB message per call was held for every call a peer opened
(bench.serving.slow_bodies --api grpc: 200 stalled calls, consumer RSS 530 -> 2233 MB). And the
port holds at most --max-connections connections."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.harness import slow_grpc
from shared.config import ConsumerConfig, ProducerConfig
from shared.pb import common_pb2, consumer_pb2, producer_pb2, producer_pb2_grpc
from tests import test_single_flight as single_flight

PREFILL = "/scd.v1.ProducerService/Prefill"
RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


def _port(server) -> int:
    return int(server.address.rsplit(":", 1)[1])


async def _eventually(attempt, timeout_s: float = 20.0):
    """`attempt()` until it returns something true (a peer's hang-up frees its calls' slots in a
    moment, not at once)."""
    deadline = time.monotonic() + timeout_s
    while not (result := await attempt()):
        assert time.monotonic() < deadline, "not within the deadline"
        await asyncio.sleep(0.1)
    return result


async def test_stalled_calls_past_max_calls_are_refused_unread_and_their_slots_come_back():
    """Seven calls stall mid-message on a port with --max-calls 4: four are held, three refused at
    once. After the peer hangs up, four stalled calls are held again and a whole request is served."""
    async with single_flight.producer(max_calls=4, store_bytes=0, chunk_tokens=0) as (server, stub):
        statuses = await slow_grpc.stalled_calls(_port(server), PREFILL, calls=7, size=50_000, hold_s=2.0)
        assert sorted(statuses, key=str) == [RESOURCE_EXHAUSTED] * 3 + [None] * 4, statuses

        async def all_four_held() -> bool:
            return await slow_grpc.stalled_calls(_port(server), PREFILL, calls=4, size=50_000, hold_s=0.5) == [None] * 4

        await _eventually(all_four_held)
        request = producer_pb2.PrefillRequest(token_ids=list(range(5, 40)), codec=common_pb2.CodecSpec(name="raw"))

        async def served():
            try:
                return await single_flight.read_all(stub.Prefill(request, timeout=30))
            except grpc.aio.AioRpcError as exc:
                assert exc.details() == "Concurrent RPC limit exceeded!", exc  # only the cap, briefly
                return None

        assert (await _eventually(served))[-1].WhichOneof("kind") == "trailer"
        assert server.servicer.admission.inflight == 0


async def test_a_request_past_the_receive_limit_is_refused_and_one_a_little_over_names_its_field():
    async with single_flight.producer(max_context_tokens=100) as (server, stub):
        limit = server.config.request_bytes_limit
        huge = producer_pb2.PrefillRequest(token_ids=[1 << 31] * 20_000)  # 100 kB > 66 kB
        assert huge.ByteSize() > limit
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await single_flight.read_all(stub.Prefill(huge, timeout=10))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert str(limit) in refused.value.details()  # grpc: "... larger than max (N vs. limit)"
        over = producer_pb2.PrefillRequest(token_ids=[1 << 31] * 150, codec=common_pb2.CodecSpec(name="raw"))
        with pytest.raises(grpc.aio.AioRpcError) as named:
            await single_flight.read_all(stub.Prefill(over, timeout=10))
        assert named.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "token_ids: length 150 not in 1..100" in named.value.details()


@pytest.mark.parametrize("context_tokens", [1, 8192, 131072])
def test_the_receive_limits_take_the_largest_allowed_requests(context_tokens):
    """Every field at its own limit (ids at their widest encoding) still fits each port's limit."""
    widest = (1 << 32) - 1
    producer = ProducerConfig(max_context_tokens=context_tokens)
    prefill = producer_pb2.PrefillRequest(
        request_id="r" * 128,
        token_ids=[widest] * context_tokens,
        codec=common_pb2.CodecSpec(name="scd", options={"layers": "x" * 512}),
        consumer_weight_digest="d" * 64,
        first_token=widest,
        prefix_key="k" * 256,
        cache_salt="s" * 256,
        keep=common_pb2.KeepSpec(policy="distill", fraction=0.25, weights="w" * 16),
    )
    assert prefill.ByteSize() <= producer.request_bytes_limit
    consumer = ConsumerConfig(max_context_tokens=context_tokens)
    texts = consumer_pb2.GenerateRequest(
        request_id="r" * 128,
        context=consumer_pb2.Prompt(text="\u00e9" * (consumer.max_text_bytes // 2)),
        question=consumer_pb2.Prompt(text="q" * consumer.max_text_bytes),
        stop_token_ids=[widest] * 64,
        max_new_tokens=consumer.max_new_tokens,
    )
    ids = consumer_pb2.GenerateRequest(
        context=consumer_pb2.Prompt(token_ids=consumer_pb2.TokenIds(ids=[widest] * context_tokens)),
        question=consumer_pb2.Prompt(token_ids=consumer_pb2.TokenIds(ids=[widest] * consumer.max_question_tokens)),
    )
    assert max(texts.ByteSize(), ids.ByteSize()) <= consumer.request_bytes_limit
    # the HTTP port by the same rule: a prompt of token ids as JSON (six digits: any vocabulary
    # under a million; wider ids are refused anyway) fits its body limit
    body = json.dumps({"model": "m", "prompt": [999_999] * (context_tokens + consumer.max_question_tokens)})
    assert len(body) <= consumer.http_body_limit
    assert (
        len(json.dumps({"prompt": "\u00e9" * consumer.max_text_bytes})) > consumer.http_body_limit > 2 * consumer.max_text_bytes
    )


def test_max_calls_defaults_to_the_admission_limit_plus_room():
    assert ProducerConfig(max_inflight=32).calls_limit == 96
    assert ConsumerConfig(max_inflight=64, max_calls=10).calls_limit == 10
    with pytest.raises(ValueError, match="max_calls"):
        ProducerConfig(max_calls=-1).validate()


async def test_a_compressed_request_is_held_to_the_limit_once_decompressed():
    """A gzip request of ~2 kB that inflates to 2 MB (a decompression bomb) is refused by its
    decompressed size, not held."""
    async with single_flight.producer() as (server, _):
        async with grpc.aio.insecure_channel(server.address, compression=grpc.Compression.Gzip) as channel:
            stub = producer_pb2_grpc.ProducerServiceStub(channel)
            bomb = producer_pb2.PrefillRequest(token_ids=[1] * 2_000_000)
            assert bomb.ByteSize() > 10 * server.config.request_bytes_limit
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await single_flight.read_all(stub.Prefill(bomb, timeout=10))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "Decompressed message larger than max" in refused.value.details()
        assert server.servicer.admission.inflight == 0


async def test_open_connections_past_max_connections_are_closed_and_come_back():
    """--max-connections 3: two more raw connections are closed before any handshake, a call
    while the port is full is UNAVAILABLE, and once the three leave calls are served."""
    async with single_flight.producer(max_connections=3) as (server, _):
        held = [await asyncio.open_connection("127.0.0.1", _port(server)) for _ in range(5)]
        closed = []
        for reader, _writer in held:
            try:
                closed.append(await asyncio.wait_for(reader.read(1), 5.0) == b"")  # held: the server's SETTINGS
            except TimeoutError:
                closed.append(False)
        assert sorted(closed) == [False] * 3 + [True] * 2, closed
        async with grpc.aio.insecure_channel(server.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as full:
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
            assert full.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        for _, writer in held:
            writer.close()

        async def served():
            async with grpc.aio.insecure_channel(server.address) as channel:
                try:
                    return await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
                except grpc.aio.AioRpcError:
                    return None

        assert (await _eventually(served)).status == health_pb2.HealthCheckResponse.SERVING
