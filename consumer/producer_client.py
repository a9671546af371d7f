"""gRPC client of the producer's Prefill stream: the consumer's `TransferSource`.

Turns the stream into engine events (header, one LayerPayloads per completed layer, trailer),
reassembling and CRC-checking chunks with shared.wire, and turns gRPC errors into
shared.errors with the producer's status code kept.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

import grpc

from consumer.engine import LayerPayloads, StreamHeader, StreamTrailer
from shared import wire
from shared.codecs import StreamInfo
from shared.errors import DataLoss, UpstreamError
from shared.pb import common_pb2, producer_pb2, producer_pb2_grpc
from shared.serving import GRPC_OPTIONS


class ProducerClient:
    def __init__(self, target: str, consumer_digest: str = ""):
        self.target = target
        self.consumer_digest = consumer_digest
        self.channel = grpc.aio.insecure_channel(target, options=GRPC_OPTIONS)
        self.stub = producer_pb2_grpc.ProducerServiceStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def open(
        self, request_id: str, context_ids: list[int], codec: str, options: Mapping[str, str], timeout_s: float
    ) -> AsyncIterator[StreamHeader | LayerPayloads | StreamTrailer]:
        request = producer_pb2.PrefillRequest(
            request_id=request_id,
            token_ids=context_ids,
            codec=common_pb2.CodecSpec(name=codec, options=dict(options)),
            consumer_weight_digest=self.consumer_digest,
        )
        call = self.stub.Prefill(request, timeout=timeout_s, metadata=(("x-request-id", request_id),))
        try:
            assembler = None
            layer, payloads, nbytes = None, {}, 0
            async for message in call:
                kind = message.WhichOneof("kind")
                if kind == "header":
                    h = message.header
                    assembler = wire.PayloadAssembler(h.num_layers)
                    yield StreamHeader(
                        StreamInfo(
                            h.num_layers,
                            h.num_tokens,
                            h.kv_dtype,
                            dict(h.codec.options),
                            dict(h.codec_metadata),
                            h.codec_format_version,
                            h.producer.weight_digest,
                        ),
                        h.codec.name,
                    )
                elif kind == "chunk":
                    if assembler is None:
                        raise DataLoss("producer sent a chunk before the header")
                    chunk = message.chunk
                    if layer is not None and chunk.layer != layer:
                        yield LayerPayloads(layer, payloads, nbytes)  # layer complete: the next one began
                        layer, payloads, nbytes = None, {}, 0
                    done = assembler.add(chunk)
                    layer = chunk.layer
                    nbytes += len(chunk.data)
                    if done is not None:
                        payloads[done[1]] = done[2]
                elif kind == "trailer":
                    if assembler is None or assembler.pending():
                        raise DataLoss(f"stream ended with incomplete payloads {assembler.pending() if assembler else []}")
                    if layer is not None:
                        yield LayerPayloads(layer, payloads, nbytes)
                    t = message.trailer
                    yield StreamTrailer(t.payload_bytes, t.prefill_ms, t.encode_ms, t.store_hit)
        except grpc.aio.AioRpcError as exc:
            raise UpstreamError(exc.code().name, f"producer {self.target}: {exc.details()}") from None
        finally:
            call.cancel()
