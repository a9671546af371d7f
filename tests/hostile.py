"""A hostile producer for tests: a real grpc.aio ProducerService that replays a script of
messages (recorded from a real producer, then mutated, and joined into batches at will: `batch`)
to a real consumer, plus helpers to record streams and rewrite chunks consistently (CRC
recomputed)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import google_crc32c
import grpc
import torch

from consumer.server import ConsumerServer
from shared.config import ConsumerConfig
from shared.pb import common_pb2, producer_pb2, producer_pb2_grpc

Script = Callable[[producer_pb2.PrefillRequest], list]  # request -> messages; a number: sleep; a status or (status, details): abort


def copy(message):
    out = type(message)()
    out.CopyFrom(message)
    return out


async def record(
    producer_address: str,
    token_ids: list[int],
    codec: str = "raw",
    options: dict | None = None,
    consumer_digest: str = "",
    keep: common_pb2.KeepSpec | None = None,
) -> list[producer_pb2.PrefillResponse]:
    """The messages a real producer sends for one request (with `keep`: a keep transfer's)."""
    async with grpc.aio.insecure_channel(producer_address) as channel:
        stub = producer_pb2_grpc.ProducerServiceStub(channel)
        request = producer_pb2.PrefillRequest(
            token_ids=token_ids,
            codec=common_pb2.CodecSpec(name=codec, options=options or {}),
            consumer_weight_digest=consumer_digest,
            keep=keep,
        )
        return [m async for m in stub.Prefill(request, timeout=60)]


def batch(*messages: producer_pb2.PrefillResponse) -> producer_pb2.PrefillResponse:
    """One PrefillResponse.batch carrying `messages` in order (copies: the originals stay as they are)."""
    return producer_pb2.PrefillResponse(batch=producer_pb2.PrefillBatch(responses=[copy(m) for m in messages]))


def kinds(messages) -> list[str]:
    return [m.WhichOneof("kind") for m in messages]


def chunks(messages, kind: str | None = None, layer: int | None = None) -> list[int]:
    """Indices of chunk messages (of one payload kind / layer)."""
    return [
        i
        for i, m in enumerate(messages)
        if m.WhichOneof("kind") == "chunk"
        and (kind is None or m.chunk.kind == kind)
        and (layer is None or m.chunk.layer == layer)
    ]


def set_data(message, data: bytes) -> None:
    """Replace a chunk's data and make its CRC match (a self-consistent corruption)."""
    message.chunk.data = data
    message.chunk.crc32c = google_crc32c.value(data)


def poke(message, dtype: torch.dtype, index: int, value: float) -> None:
    """Write `value` at element `index` of a chunk's data read as `dtype`, CRC fixed."""
    flat = torch.frombuffer(bytearray(message.chunk.data), dtype=dtype).clone()
    flat[index] = value
    set_data(message, flat.view(torch.uint8).numpy().tobytes())


class HostileProducer(producer_pb2_grpc.ProducerServiceServicer):
    def __init__(self, script: Script, describe: producer_pb2.ProducerServiceDescribeResponse | None = None):
        self.script = script
        self.calls = 0
        self.describe = describe  # what Describe answers (a real producer's, recorded); None: UNIMPLEMENTED

    async def Describe(self, request, context):
        if self.describe is None:
            return super().Describe(request, context)
        return self.describe

    async def Prefill(self, request, context) -> AsyncIterator[producer_pb2.PrefillResponse]:
        self.calls += 1
        for item in self.script(request):
            if isinstance(item, (int, float)):
                await asyncio.sleep(item)
            elif isinstance(item, grpc.StatusCode):
                await context.abort(item, "refused by 10.1.2.3:50051 (internal detail)")
            elif isinstance(item, tuple):  # (status, details)
                await context.abort(*item)
            else:
                yield item


@contextlib.asynccontextmanager
async def consumer_of(script: Script, model: str = "tiny-llama", describe=None, **consumer_kw):
    """A real consumer whose producer is a HostileProducer running `script` (and answering
    Describe with `describe`, when given)."""
    server = grpc.aio.server()
    hostile = HostileProducer(script, describe)
    producer_pb2_grpc.add_ProducerServiceServicer_to_server(hostile, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    consumer = ConsumerServer(
        ConsumerConfig(port=0, model=model, device="cpu", producer=f"127.0.0.1:{port}", drain_grace_s=0.5, **consumer_kw)
    )
    await consumer.start()
    await consumer.load()
    try:
        yield consumer, hostile
    finally:
        await consumer.stop(0)
        await server.stop(0)


async def all_back(consumer: ConsumerServer) -> None:
    """No call in flight, the prefix cache (if any) emptied (by the engine, its owner) and then every KV
    block free again, within 2 s: nothing a failed or answered request held is kept."""
    assert consumer.servicer.admission.inflight == 0
    pool = consumer.servicer.batch.pool
    if consumer.servicer.prefix is not None:  # a consumer without a prefix cache has none to empty
        await asyncio.wrap_future(consumer.servicer.batch.submit(consumer.servicer.prefix.clear))
    for _ in range(100):  # releases run once the answers went out
        if pool.free_blocks == pool.num_blocks:
            break
        await asyncio.sleep(0.02)
    assert pool.free_blocks == pool.num_blocks, f"{pool.num_blocks - pool.free_blocks} blocks not returned"


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0
