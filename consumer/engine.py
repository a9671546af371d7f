"""The consumer's request pipeline, the same for every transfer codec:

  open the transfer (if the codec uses the producer) -> rebuild each layer on the compute thread
  as soon as its payloads arrive, while later layers are still in flight -> finish the cache ->
  prefill the question on top -> decode, yielding tokens as they come -> stats.

Knows nothing about gRPC: the transfer arrives through a `TransferSource` (an async iterator of
StreamHeader / LayerPayloads / StreamTrailer events), which the servicer builds from the
producer client.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Protocol

import torch

from consumer.decoding import Detokenizer, Sampler, Sampling, forward_logits
from shared import kv, logs
from shared.codecs import Codec, StreamInfo
from shared.errors import DataLoss, DeadlineExceeded, FailedPrecondition
from shared.models import LoadedModel

log = logs.get("consumer.engine")
LOCAL_MODE = "oracle"  # the consumer's own prefill: only token ids cross


@dataclass(frozen=True)
class StreamHeader:
    stream: StreamInfo
    codec_name: str


@dataclass(frozen=True)
class LayerPayloads:
    layer: int
    payloads: dict[str, torch.Tensor]
    nbytes: int


@dataclass(frozen=True)
class StreamTrailer:
    payload_bytes: int
    prefill_ms: float
    encode_ms: float
    store_hit: bool


class TransferSource(Protocol):
    def open(
        self, request_id: str, context_ids: list[int], codec: str, options: Mapping[str, str], timeout_s: float
    ) -> AsyncIterator[StreamHeader | LayerPayloads | StreamTrailer]: ...


@dataclass
class GenerateJob:
    request_id: str
    context_ids: list[int]
    question_ids: list[int]
    codec: Codec | None  # None: the consumer prefills the context itself (mode "oracle")
    options: dict[str, str]
    max_new_tokens: int
    sampling: Sampling
    stop_ids: frozenset[int]
    deadline: float  # time.monotonic() value
    received_at: float = field(default_factory=time.perf_counter)
    fallback: str = ""  # why the transfer planner kept or replaced the requested mode ("" = not asked)

    @property
    def mode(self) -> str:
        return self.codec.name if self.codec is not None else LOCAL_MODE


@dataclass
class TokenOut:
    ids: list[int]
    text: str


@dataclass
class GenerateResult:
    request_id: str
    codec: str
    options: dict[str, str]
    context_tokens: int
    question_tokens: int
    generated_tokens: int = 0
    ttft_ms: float = 0.0
    transfer_ms: float = 0.0
    rebuild_ms: float = 0.0
    question_prefill_ms: float = 0.0
    decode_ms: float = 0.0
    total_ms: float = 0.0
    bytes_received: int = 0
    raw_kv_bytes: int = 0
    finish_reason: str = "length"  # "length" | "stop"
    producer_prefill_ms: float = 0.0
    producer_encode_ms: float = 0.0
    producer_store_hit: bool = False


class GenerateEngine:
    def __init__(self, loaded: LoadedModel, executor: Executor, source: TransferSource | None):
        self.loaded = loaded
        self.executor = executor
        self.source = source

    def _left(self, job: GenerateJob, what: str) -> float:
        left = job.deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded(f"deadline passed before {what}")
        return left

    async def _timed(self, fn, *args) -> tuple[object, float]:
        def run():
            started = time.perf_counter()
            value = fn(*args)
            return value, (time.perf_counter() - started) * 1e3

        return await logs.run_in(self.executor, run)

    async def run(self, job: GenerateJob) -> AsyncIterator[TokenOut | GenerateResult]:
        result = GenerateResult(job.request_id, job.mode, dict(job.options), len(job.context_ids), len(job.question_ids))
        device = self.loaded.device
        result.raw_kv_bytes = self.loaded.info.kv_bytes(len(job.context_ids))
        if job.codec is None:
            context = torch.tensor([job.context_ids], device=device)  # [1, T]
            cache, took = await self._timed(kv.prefill_context, self.loaded, context)
        else:
            decoder = await self._transfer(job, result)
            cache, took = await self._timed(decoder.finish)
        result.rebuild_ms += took

        self._left(job, "question prefill")
        logits, result.question_prefill_ms = await self._timed(forward_logits, self.loaded, job.question_ids, cache)
        sampler = Sampler(job.sampling, device)
        detok = Detokenizer(self.loaded.tokenizer)
        first_at = None
        for step in range(job.max_new_tokens):
            token = sampler(logits)
            text = detok.push(token)
            now = time.perf_counter()
            if first_at is None:
                first_at = now
                result.ttft_ms = (now - job.received_at) * 1e3
            result.generated_tokens += 1
            yield TokenOut([token], text)
            if token in job.stop_ids:
                result.finish_reason = "stop"
                break
            if step + 1 < job.max_new_tokens:
                self._left(job, "next decode step")
                logits, _ = await self._timed(forward_logits, self.loaded, [token], cache)
        rest = detok.flush()
        if rest:
            yield TokenOut([], rest)
        done = time.perf_counter()
        result.decode_ms = (done - first_at) * 1e3
        result.total_ms = (done - job.received_at) * 1e3
        yield result

    async def _transfer(self, job: GenerateJob, result: GenerateResult):
        """Pull the producer stream; rebuild each layer on the compute thread while later ones arrive."""
        started = time.perf_counter()
        decoder = None
        rebuilds: list[asyncio.Future] = []
        trailer = None
        stream = self.source.open(job.request_id, job.context_ids, job.codec.name, job.options, self._left(job, "transfer"))
        try:
            async for event in stream:
                if isinstance(event, StreamHeader):
                    if event.stream.format_version != job.codec.format_version:
                        raise FailedPrecondition(
                            f"codec '{job.codec.name}' payload format {event.stream.format_version} from the "
                            f"producer; this consumer decodes format {job.codec.format_version}"
                        )
                    decoder = job.codec.decoder(event.stream)
                    result.options = {**event.stream.options, **event.stream.metadata}
                    producer_kv = dataclasses.replace(self.loaded.info, dtype=event.stream.kv_dtype)
                    result.raw_kv_bytes = producer_kv.kv_bytes(event.stream.num_tokens)
                elif isinstance(event, LayerPayloads):
                    result.bytes_received += event.nbytes
                    rebuilds.append(asyncio.ensure_future(self._timed(decoder.add_layer, event.layer, event.payloads)))
                elif isinstance(event, StreamTrailer):
                    trailer = event
        finally:
            await stream.aclose()
            if trailer is None:
                for pending in rebuilds:
                    pending.cancel()
        if decoder is None or trailer is None:
            raise DataLoss("producer stream ended without header or trailer")
        for _, took in await asyncio.gather(*rebuilds):
            result.rebuild_ms += took
        result.transfer_ms = (time.perf_counter() - started) * 1e3
        result.producer_prefill_ms = trailer.prefill_ms
        result.producer_encode_ms = trailer.encode_ms
        result.producer_store_hit = trailer.store_hit
        return decoder
