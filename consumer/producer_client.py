"""gRPC client of the producer's Prefill stream: the consumer's `TransferSource`.

Feeds every message to a `StreamReader` (the stream contract, consumer.stream_reader) and yields
its events; maps the producer's statuses to the consumer's documented ones, without the
producer's address. The channel's service config retries UNAVAILABLE and RESOURCE_EXHAUSTED
before the first response (gRPC's own retry policy: nothing was received, so it is safe).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import grpc

from consumer.stream_reader import Event, Expectation, StreamReader
from shared.errors import Cancelled, DataLoss, DeadlineExceeded, FailedPrecondition, ServiceError, Unavailable
from shared.pb import common_pb2, producer_pb2, producer_pb2_grpc
from shared.serving import GRPC_OPTIONS

SERVICE = "scd.v1.ProducerService"
RETRY_CONFIG = {
    "methodConfig": [
        {
            "name": [{"service": SERVICE}],
            "retryPolicy": {
                "maxAttempts": 4,
                "initialBackoff": "0.05s",
                "maxBackoff": "1s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE", "RESOURCE_EXHAUSTED"],
            },
        }
    ]
}

# producer status -> (consumer error, what it means for the caller)
_MAPPED: dict[grpc.StatusCode, tuple[type[ServiceError], str]] = {
    grpc.StatusCode.RESOURCE_EXHAUSTED: (Unavailable, "producer overloaded"),
    grpc.StatusCode.UNAVAILABLE: (Unavailable, "producer unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (DeadlineExceeded, "deadline passed during the transfer"),
    grpc.StatusCode.CANCELLED: (Cancelled, "transfer cancelled"),
    grpc.StatusCode.INVALID_ARGUMENT: (FailedPrecondition, "producer refused the request"),
    grpc.StatusCode.FAILED_PRECONDITION: (FailedPrecondition, "producer cannot serve this codec for this pair"),
    grpc.StatusCode.DATA_LOSS: (DataLoss, "producer reported data loss"),
}


def upstream_error(exc: grpc.aio.AioRpcError) -> ServiceError:
    """The consumer's error for a failed producer call (never the producer's address)."""
    cls, what = _MAPPED.get(exc.code(), (Unavailable, "producer failed"))
    details = (exc.details() or "")[:300]
    return cls(f"{what} ({exc.code().name}): {details}")


class ProducerClient:
    def __init__(self, target: str, consumer_digest: str = "", channel: grpc.aio.Channel | None = None):
        self.target = target
        self.consumer_digest = consumer_digest
        options = [*GRPC_OPTIONS, ("grpc.service_config", json.dumps(RETRY_CONFIG)), ("grpc.enable_retries", 1)]
        self.channel = channel or grpc.aio.insecure_channel(target, options=options)
        self.stub = producer_pb2_grpc.ProducerServiceStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def open(self, request_id: str, context_ids: list[int], expect: Expectation, timeout_s: float) -> AsyncIterator[Event]:
        request = producer_pb2.PrefillRequest(
            request_id=request_id,
            token_ids=context_ids,
            codec=common_pb2.CodecSpec(name=expect.codec.name, options=dict(expect.options)),
            consumer_weight_digest=self.consumer_digest,
        )
        reader = StreamReader(expect)
        call = self.stub.Prefill(request, timeout=timeout_s, metadata=(("x-request-id", request_id),))
        try:
            async for message in call:
                for event in reader.feed(message):
                    yield event
            reader.end()
        except grpc.aio.AioRpcError as exc:
            raise upstream_error(exc) from None
        finally:
            call.cancel()  # a no-op once the call ended; stops the producer on any error here
