"""Service behaviour over real gRPC: health, Describe, input errors, data integrity,
cancellation, deadlines and draining."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from consumer.engine import paged_attention
from consumer.server import ConsumerServer
from producer.server import ProducerServer
from shared.config import ConsumerConfig, ProducerConfig
from shared.models import load_model
from shared.pb import common_pb2, consumer_pb2, producer_pb2, producer_pb2_grpc
from tests.conftest import prompt, running_pair

CONTEXT = "Most layers are rebuilt from low rank subspaces and a few layers are patched. " * 20
LONG_IDS = [(7 * i) % 300 + 3 for i in range(8000)]


async def health_status(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as ch:
        reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        return reply.status


async def producer_stats(pair) -> producer_pb2.ProducerStats:
    reply = await pair.producer_stub.Describe(producer_pb2.ProducerServiceDescribeRequest(), timeout=5)
    return reply.stats


async def wait_stats(pair, field: str, value: int, timeout_s: float = 10.0) -> producer_pb2.ProducerStats:
    """Poll the producer's counters (bounded) until field == value."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = await producer_stats(pair)
        if getattr(stats, field) == value or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.02)


async def test_health_goes_not_serving_to_serving():
    server = ProducerServer(ProducerConfig(port=0, model="tiny-llama", device="cpu", drain_grace_s=0.1))
    await server.start()
    try:
        assert await health_status(server.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        async with grpc.aio.insecure_channel(server.address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await producer_pb2_grpc.ProducerServiceStub(ch).Describe(producer_pb2.ProducerServiceDescribeRequest())
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        await server.load()
        assert await health_status(server.address) == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop()


async def test_describe_reports_what_was_loaded():
    local = load_model("tiny-qwen2", "bfloat16", "cpu")
    async with running_pair("tiny-qwen2", dtype="bfloat16") as pair:
        p = await pair.producer_stub.Describe(producer_pb2.ProducerServiceDescribeRequest())
        c = await pair.stub.Describe(consumer_pb2.ConsumerServiceDescribeRequest())
    for model in (p.model, c.model):
        assert model.model_id == "tiny-qwen2"
        assert model.weight_digest == local.info.weight_digest
        assert (model.architecture, model.dtype, model.device) == ("Qwen2ForCausalLM", "bfloat16", "cpu")
        assert (model.num_layers, model.num_kv_heads, model.head_dim) == (4, 2, 16)
    assert {x.name for x in c.codecs} >= {"raw", "oracle"}
    assert "oracle" not in {x.name for x in p.codecs}
    assert p.api_version == c.api_version == "scd.v1"
    assert c.producer_target == ""  # no internal addresses in Describe
    # decode rows through the paged kernel where a compiler built it, else per-row SDPA saying why
    assert c.decode_attention == paged_attention.which()
    assert c.decode_attention.startswith("kernel " if paged_attention.compiler() else "sdpa: ")
    # prefill rows: tiny-qwen2's head_dim 16 is not one the bfloat16 prefill kernel serves
    assert c.prefill_attention == "sdpa: head_dim 16 not one of (32, 64, 128)"


@pytest.mark.parametrize(
    "fields, field_named",
    [
        (dict(question=prompt("q")), "context: required"),
        (dict(context=prompt(ids=[1, 2, 99999]), question=prompt("q")), "context.token_ids: id 99999 >= vocab_size 384"),
        (dict(context=prompt(CONTEXT), question=prompt("q"), max_new_tokens=100000), "max_new_tokens: 100000 > limit 512"),
        (dict(context=prompt(CONTEXT), question=prompt("q"), transfer=common_pb2.CodecSpec(name="zip")), "transfer.name: unknown codec 'zip'"),
        (dict(context=prompt(CONTEXT), question=prompt("q"), transfer=common_pb2.CodecSpec(name="raw", options={"bits": "3"})),
         "transfer.options: unknown option(s) ['bits']"),
        (dict(context=prompt(CONTEXT), question=prompt("q"), sampling=consumer_pb2.SamplingParams(temperature=-1)),
         "sampling.temperature: -1.0 not in [0, 10]"),
        (dict(context=prompt(ids=list(range(3, 300)) * 40), question=prompt("q")), "context: 11880 tokens not in 1..8192"),
    ],
)
async def test_bad_input_names_field_and_limit_and_service_keeps_serving(fields, field_named):
    async with running_pair("tiny-llama") as pair:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pair.generate(**fields)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field_named in err.value.details()
        ids, _, stats = await pair.generate(context=prompt(CONTEXT), question=prompt("q"), max_new_tokens=4)
        assert stats.generated_tokens == len(ids) >= 1


async def test_producer_refuses_bad_prefill_requests():
    async with running_pair("tiny-llama") as pair:
        for request, message in [
            (producer_pb2.PrefillRequest(token_ids=[]), "token_ids: length 0 not in 1..8192"),
            (producer_pb2.PrefillRequest(token_ids=[5, 384]), "token_ids: id 384 >= vocab_size 384"),
            (producer_pb2.PrefillRequest(token_ids=[5], codec=common_pb2.CodecSpec(name="oracle")), "unknown codec 'oracle'"),
        ]:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in pair.producer_stub.Prefill(request, timeout=10):
                    pass
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert message in err.value.details()


class CorruptingProxy(producer_pb2_grpc.ProducerServiceServicer):
    """A real gRPC server between consumer and producer that flips one bit of one chunk."""

    def __init__(self, target: str, corrupt_chunk: int):
        self.channel = grpc.aio.insecure_channel(target)
        self.stub = producer_pb2_grpc.ProducerServiceStub(self.channel)
        self.corrupt_chunk = corrupt_chunk

    async def Prefill(self, request, context):
        seen = 0
        async for message in self.stub.Prefill(request, timeout=context.time_remaining()):
            # a layer's chunks come in one layer_chunks message, messages ready together in one batch
            inner = message.batch.responses if message.WhichOneof("kind") == "batch" else [message]
            for chunk in [c for m in inner for c in ([m.chunk] if m.WhichOneof("kind") == "chunk" else m.layer_chunks.chunks)]:
                if seen == self.corrupt_chunk:
                    data = bytearray(chunk.data)
                    data[len(data) // 2] ^= 0x10
                    chunk.data = bytes(data)
                seen += 1
            yield message


async def test_corrupt_chunk_fails_with_data_loss_and_no_partial_answer():
    async with running_pair("tiny-llama", producer_kw={"max_chunk_bytes": 1024}) as pair:
        proxy = grpc.aio.server()
        producer_pb2_grpc.add_ProducerServiceServicer_to_server(CorruptingProxy(pair.producer.address, 5), proxy)
        port = proxy.add_insecure_port("127.0.0.1:0")
        await proxy.start()
        consumer = ConsumerServer(ConsumerConfig(port=0, model="tiny-llama", device="cpu", producer=f"127.0.0.1:{port}"))
        await consumer.start()
        await consumer.load()
        try:
            async with grpc.aio.insecure_channel(consumer.address) as ch:
                from shared.pb import consumer_pb2_grpc

                stub = consumer_pb2_grpc.ConsumerServiceStub(ch)
                received = []
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    # raw by name: a proxy without Describe leaves the producer's weights unknown (default oracle)
                    request = consumer_pb2.GenerateRequest(context=prompt(CONTEXT), question=prompt("q"),
                                                           transfer=common_pb2.CodecSpec(name="raw"))
                    async for msg in stub.Generate(request,
                                                   timeout=30):
                        received.append(msg)
            assert err.value.code() == grpc.StatusCode.DATA_LOSS
            assert "CRC32C mismatch" in err.value.details()
            assert "layer 0, payload 'k', chunk 5/" in err.value.details()
            assert received == []  # no partial answer
        finally:
            await consumer.stop(0)
            await proxy.stop(0)


async def test_client_cancellation_stops_producer_work():
    async with running_pair("tiny-llama", producer_kw={"max_chunk_bytes": 4096}) as pair:
        call = pair.producer_stub.Prefill(producer_pb2.PrefillRequest(token_ids=LONG_IDS), timeout=30)
        first = await call.read()
        assert first.WhichOneof("kind") == "header"
        # stop reading: the producer fills the flow-control window and its queue, then blocks
        stats = await wait_stats(pair, "prefills_started", 1)
        call.cancel()
        stats = await wait_stats(pair, "prefills_cancelled", 1)
        assert stats.prefills_cancelled == 1 and stats.prefills_completed == 0
        # and it keeps serving
        ids, _, _ = await pair.generate(context=prompt(CONTEXT), question=prompt("q"), max_new_tokens=2)
        assert len(ids) >= 1


async def test_too_short_deadline_is_deadline_exceeded_promptly():
    async with running_pair("tiny-llama") as pair:
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pair.generate(timeout=0.05, context=prompt(ids=LONG_IDS), question=prompt("q"), max_new_tokens=200)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - started < 1.0
        ids, _, _ = await pair.generate(context=prompt(CONTEXT), question=prompt("q"), max_new_tokens=2)
        assert len(ids) >= 1


async def test_drain_finishes_in_flight_call_and_reports_not_serving():
    async with running_pair("tiny-llama") as pair:
        call = pair.stub.Generate(consumer_pb2.GenerateRequest(context=prompt(ids=LONG_IDS[:4000]), question=prompt("q"),
                                                                 max_new_tokens=64, stop_token_ids=[383]), timeout=60)
        first = await call.read()
        assert first.WhichOneof("kind") == "token"
        async with grpc.aio.insecure_channel(pair.consumer.address) as ch:
            watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""))
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            drain = asyncio.ensure_future(pair.consumer.server.drain(grace_s=30))
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            watch.cancel()
        rest = []
        while (msg := await call.read()) is not grpc.aio.EOF:
            rest.append(msg)
        assert rest[-1].WhichOneof("kind") == "stats"  # the in-flight call completed
        await drain
