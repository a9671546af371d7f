"""One transfer into a request's KV blocks: pull the producer's stream (through a `TransferSource`,
the contract enforced by consumer.stream_reader) and rebuild each layer into the blocks on the
engine thread as soon as its payloads arrive, while later layers are still in flight. The stream
pump and the rebuild run as two tasks; the first failure of either cancels the other.

Under LOCAL_PREFILL the stream is watched as it arrives (`watch`): when, at the throughput
observed since its first layer, the rest would take longer than the consumer's own prefill of
the whole context (consumer.planner's estimate, with a margin), it raises TransferTooSlow and the
pipeline prefills instead. Knows nothing about gRPC, the prefix cache or answering.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any, Protocol

from consumer.batch import BatchEngine
from consumer.engine_process import EngineProcess
from consumer.kv_pool import SequenceKV
from consumer.planner import TransferPlanner, mode_key
from consumer.prefix_keys import PrefixKeys
from consumer.request import LOCAL_PREFILL, GenerateJob, GenerateResult, left
from consumer.stream_reader import Event, Expectation, LayerPayloads, StreamHeader, StreamTrailer
from shared import logs
from shared.codecs import CacheDecoder
from shared.codecs.base import LayerJob, add_layers
from shared.errors import DataLoss, DeadlineExceeded, ServiceError
from shared.models import LoadedModel

log = logs.get("consumer.transfer")
ABANDON_MARGIN = 1.25  # abandon a stream when the rest is estimated to take this x the own prefill ...
ABANDON_SLACK_MS = 20.0  # ... plus this
ABANDON_MIN_WATCH_S = 0.05  # and only after watching it this long since its first layer


class TransferTooSlow(DeadlineExceeded):
    """The stream's observed throughput makes finishing it slower than the own prefill."""


class TransferSource(Protocol):
    def open(
        self, request_id: str, context_ids: list[int], expect: Expectation, timeout_s: float
    ) -> AsyncGenerator[Event, None]: ...


class Transfer:
    def __init__(
        self,
        loaded: LoadedModel,
        engine: BatchEngine | EngineProcess,
        source: TransferSource | None,
        keys: PrefixKeys,
        planner: TransferPlanner | None,
    ):
        self.loaded, self.engine, self.source, self.keys, self.planner = loaded, engine, source, keys, planner
        self.rebuilt_layers = 0  # layer rebuilds run ...
        self.batched_layers = 0  # ... of which in a decode shared with other requests

    def _rebuild_many(self, jobs: list[LayerJob]) -> list[float | BaseException]:
        """Several requests' layer rebuilds queued together, on the engine thread (a grouped
        engine job): batched where their decoders allow (shared.codecs.base.add_layers); per job
        the ms the call took, or the exception its own rebuild raised."""
        started = time.perf_counter()
        errors, batched = add_layers(jobs)
        took = (time.perf_counter() - started) * 1e3
        self.rebuilt_layers += len(jobs)
        self.batched_layers += batched
        return [took if error is None else error for error in errors]

    async def _timed(self, fn, *args) -> tuple[Any, float]:
        def run():
            started = time.perf_counter()
            value = fn(*args)
            return value, (time.perf_counter() - started) * 1e3

        return await logs.run_in(self.engine, run)

    def watch(self, job: GenerateJob, result: GenerateResult, sent_tokens: int) -> Callable[[int], None] | None:
        """Under LOCAL_PREFILL, a check to call with the bytes received after each layer: it raises
        TransferTooSlow when, at the throughput since the first layer, the rest of the stream would
        take longer than the own prefill of the whole context (ABANDON_MARGIN, ABANDON_SLACK_MS).
        None when not allowed or not estimable (no byte or own-prefill estimate yet)."""
        if job.on_failure != LOCAL_PREFILL or self.planner is None or job.codec is None:
            return None
        local = self.planner.estimate_local(len(job.context_ids)).ms
        per_token = self.planner.bytes_per_token.get(mode_key(job.codec.name, job.options))
        prior = job.auto.chosen.bytes_per_token if job.auto is not None else None
        bpt = per_token.value if per_token is not None and per_token.value is not None else prior
        if local is None or not bpt:
            return None
        expected = bpt * sent_tokens
        start: list[float] = []

        def check(received: int) -> None:
            now = time.perf_counter()
            if not start:
                start.extend((now, received))
                return
            watched_s = now - start[0]
            if watched_s < ABANDON_MIN_WATCH_S or received <= start[1]:
                return
            rate = (received - start[1]) / (watched_s * 1e3)  # bytes per ms
            rest_ms = max(expected - received, 0.0) / rate
            if rest_ms > ABANDON_MARGIN * local + ABANDON_SLACK_MS:
                result.abandoned_span = (received - int(start[1]), watched_s * 1e3)
                raise TransferTooSlow(
                    f"transfer abandoned mid-stream: at {rate * 8e-3:.2f} Mbit/s the remaining"
                    f" ~{max(expected - received, 0) / 1e6:.2f} MB take ~{rest_ms:.0f} ms > own prefill ~{local:.0f} ms"
                )

        return check

    async def pull(
        self, job: GenerateJob, result: GenerateResult, seq: SequenceKV, partial: tuple[int, str] | None = None
    ) -> CacheDecoder:
        """Pull the producer stream and rebuild each layer into seq on the engine thread while
        later ones arrive (from `partial`'s first token on, when given); the first failure of
        either side cancels the other."""
        assert job.codec is not None and self.source is not None
        source, codec = self.source, job.codec
        started = time.perf_counter()
        first, key = partial or (0, "")
        seq.first_write = first
        result.sent_tokens = len(job.context_ids) - first
        watch = self.watch(job, result, result.sent_tokens) if partial is None else None
        expect = Expectation(len(job.context_ids), job.codec, job.options, self.loaded.info, first, key)
        budget = left(job, "transfer")
        if job.transfer_budget_s is not None:
            budget = min(budget, job.transfer_budget_s)
        layers: asyncio.Queue[LayerPayloads | None] = asyncio.Queue()
        state: dict[str, Any] = {}

        async def pump() -> None:
            stream = source.open(job.request_id, job.context_ids, expect, budget)
            try:
                async for event in stream:
                    if isinstance(event, StreamHeader):
                        event.decoder.bind(seq)  # rebuilt layers go straight into the request's blocks
                        state["decoder"] = event.decoder
                        info = event.stream
                        self.keys.saw_stream(codec, job.options, info, event.chunk_tokens)
                        result.stream_producer = (info.producer_digest, info.kv_dtype)
                        result.chunk_tokens = event.chunk_tokens
                        result.options = {**event.stream.options, **event.stream.metadata}
                        producer_kv = dataclasses.replace(self.loaded.info, dtype=event.stream.kv_dtype)
                        result.raw_kv_bytes = producer_kv.kv_bytes(event.stream.num_tokens)
                    elif isinstance(event, LayerPayloads):
                        result.bytes_received += event.nbytes
                        layers.put_nowait(event)
                        if watch is not None:
                            watch(result.bytes_received)
                    elif isinstance(event, StreamTrailer):
                        state["trailer"] = event
            finally:
                await stream.aclose()
            layers.put_nowait(None)

        async def rebuild() -> None:
            while (item := await layers.get()) is not None:
                decoder: CacheDecoder = state["decoder"]
                try:
                    job = LayerJob(decoder, item.layer, item.payloads)
                    took = await asyncio.wrap_future(self.engine.submit_grouped(self._rebuild_many, job))
                except ServiceError:
                    raise
                except Exception as exc:  # peer data the decoder could not use: never a crash, never INTERNAL
                    log.warning("generate.rebuild_failed", layer=item.layer, error=f"{type(exc).__name__}: {str(exc)[:200]}")
                    raise DataLoss(f"layer {item.layer}: payloads could not be decoded ({type(exc).__name__})") from None
                result.rebuild_ms += took

        tasks = [asyncio.ensure_future(pump()), asyncio.ensure_future(rebuild())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in tasks:
                if task in done and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        trailer: StreamTrailer = state["trailer"]
        result.transfer_ms += (time.perf_counter() - started) * 1e3
        result.producer_prefill_ms = trailer.prefill_ms
        result.producer_encode_ms = trailer.encode_ms
        result.producer_store_hit = trailer.store_hit
        result.trailer = trailer
        decoder: CacheDecoder = state["decoder"]
        _, took = await self._timed(decoder.finish)
        result.rebuild_ms += took
        seq.length = len(job.context_ids)
        return decoder
