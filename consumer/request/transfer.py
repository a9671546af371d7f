"""One transfer into a request's KV blocks: pull the producer's stream (through a `TransferSource`,
the contract enforced by consumer.link.stream_reader) and rebuild each layer into the blocks on the
engine thread as soon as its payloads arrive, while later layers are still in flight: each layer is
handed to the engine as it arrives, without awaiting the one before (`Rebuilds`); the first
failure of a rebuild ends the stream, and a failed stream cancels the rebuilds not yet run.

Under LOCAL_PREFILL the stream is watched as it arrives (`watch`): when, at the throughput
observed so far (since the call opened for a stream the link paces, since its first layer
otherwise), the rest would take longer than the consumer's own prefill of
the whole context (consumer.auto.planner's estimate, with a margin), it raises TransferTooSlow and the
pipeline prefills instead. Knows nothing about gRPC, the prefix cache or answering.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any, Protocol

from consumer.auto.planner import TransferPlanner
from consumer.engine.batch import BatchEngine
from consumer.engine.kv_pool import SequenceKV
from consumer.engine.process import EngineProcess
from consumer.link.prefix_keys import PrefixKeys
from consumer.link.stream_reader import Event, Expectation, LayerPayloads, StreamHeader, StreamTrailer
from consumer.request.job import LOCAL_PREFILL, GenerateJob, GenerateResult, left
from shared import logs
from shared.codecs import CacheDecoder
from shared.codecs.base import LayerJob, add_layers
from shared.codecs.kept import KEEP_OPTION
from shared.errors import DataLoss, DeadlineExceeded, ServiceError, Unavailable
from shared.models import LoadedModel

log = logs.get("consumer.request.transfer")
ABANDON_MARGIN = 1.25  # abandon a stream when the rest is estimated to take this x the own prefill ...
ABANDON_SLACK_MS = 20.0  # ... plus this
ABANDON_MIN_WATCH_S = 0.05  # and only after watching it this long since its first layer
ABANDON_MIN_GAPS = 2  # and this many gaps between layers (the slowest one is left out of the rate)


class TransferTooSlow(DeadlineExceeded):
    """The stream's observed throughput makes finishing it slower than the own prefill."""


class TransferSource(Protocol):
    def open(
        self, request_id: str, context_ids: list[int], expect: Expectation, timeout_s: float
    ) -> AsyncGenerator[Event, None]: ...


class Rebuilds:
    """One transfer's layer rebuilds in flight on the engine: their futures complete on the engine
    thread, and the event loop hears of them twice at most (the first failure, or all done), not
    once per layer."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.failed: asyncio.Future = loop.create_future()  # set with the first failure's exception
        self._done: asyncio.Future = loop.create_future()
        self._futures: list[concurrent.futures.Future] = []
        self._lock = threading.Lock()
        self._pending = 0
        self._closed = False  # the stream ended: the last rebuild to finish completes `_done`
        self._cancelling = False
        self.took_ms = 0.0

    def add(self, layer: int, future: concurrent.futures.Future) -> None:
        with self._lock:
            self._pending += 1
        self._futures.append(future)
        future.add_done_callback(lambda f: self._finished(layer, f))

    def _finished(self, layer: int, future: concurrent.futures.Future) -> None:  # any thread
        error: BaseException | None
        if future.cancelled():  # by cancel() below, or by an engine that stopped: never a layer left unbuilt unsaid
            error = None if self._cancelling else Unavailable(f"the engine stopped before layer {layer} was rebuilt")
        else:
            error = future.exception()
        with self._lock:
            self._pending -= 1
            if error is None and not future.cancelled():  # (a result: its ms)
                self.took_ms += future.result()
            last = self._closed and self._pending == 0
        if error is not None:
            self.loop.call_soon_threadsafe(self._fail, layer, error)
        elif last:
            self.loop.call_soon_threadsafe(self._all)

    def _fail(self, layer: int, error: BaseException) -> None:
        if self.failed.done():
            return
        if not isinstance(error, ServiceError):  # peer data the decoder could not use: never a crash, never INTERNAL
            log.warning("generate.rebuild_failed", layer=layer, error=f"{type(error).__name__}: {str(error)[:200]}")
            error = DataLoss(f"layer {layer}: payloads could not be decoded ({type(error).__name__})")
        self.failed.set_exception(error)

    def _all(self) -> None:
        if not self._done.done():
            self._done.set_result(None)

    def raise_failure(self) -> None:
        if self.failed.done():
            self.failed.result()  # raises the failure

    async def all_done(self) -> None:
        """Wait for every layer handed over; the first failure raised."""
        with self._lock:
            self._closed = True
            idle = self._pending == 0
        if idle:
            self._all()
        await asyncio.wait([self._done, self.failed], return_when=asyncio.FIRST_COMPLETED)
        self.raise_failure()

    def cancel(self) -> None:
        self._cancelling = True
        for future in self._futures:
            future.cancel()  # no-op for those running or done: the engine skips the rest
        if not self.failed.done():
            self.failed.cancel()
        elif not self.failed.cancelled():
            self.failed.exception()  # retrieved: no "never retrieved" warning

    async def settled(self) -> None:
        """Return once no rebuild of this transfer can still write (after `cancel`: those already
        running finish; a layer's rebuild takes milliseconds). Whatever writes the same blocks next
        (the own prefill a failed transfer falls back to, which with --engine-process runs in
        another process, not behind these rebuilds; or the pool reusing them) must come after:
        a rebuild landing on a fallback's K/V answered OK with other tokens, and the prefix cache
        kept that K/V as the consumer's own. Waits through a second cancellation, then re-raises it."""
        running = [asyncio.wrap_future(f, loop=self.loop) for f in self._futures if not f.done()]
        if not running:
            return
        waiting = asyncio.gather(*running, return_exceptions=True)
        cancelled = False
        while not waiting.done():
            try:
                await asyncio.shield(waiting)
            except asyncio.CancelledError:
                cancelled = True
        if cancelled:
            raise asyncio.CancelledError


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
        engine job): batched where their decoders allow (shared.codecs.base.add_layers), in waves
        that hold one layer per request, so that each request's layers are added in order (its
        layers are handed over without waiting for each other); per job the ms its wave took, or
        the exception its own rebuild raised (a request's layers after a failed one are not run)."""
        out: list[float | BaseException | None] = [None] * len(jobs)
        waves: list[list[int]] = []
        seen: dict[int, int] = {}  # id(decoder) -> its jobs so far
        for i, job in enumerate(jobs):
            n = seen.get(id(job.decoder), 0)
            seen[id(job.decoder)] = n + 1
            if n == len(waves):
                waves.append([])
            waves[n].append(i)
        failed: dict[int, BaseException] = {}
        for wave in waves:
            skipped = [i for i in wave if id(jobs[i].decoder) in failed]
            for i in skipped:
                out[i] = failed[id(jobs[i].decoder)]
            live = [i for i in wave if id(jobs[i].decoder) not in failed]
            if not live:
                continue
            started = time.perf_counter()
            errors, batched = add_layers([jobs[i] for i in live])
            took = (time.perf_counter() - started) * 1e3
            self.rebuilt_layers += len(live)
            self.batched_layers += batched
            for i, error in zip(live, errors):
                out[i] = took if error is None else error
                if error is not None:
                    failed[id(jobs[i].decoder)] = error
        return [r if r is not None else 0.0 for r in out]

    async def _timed(self, fn, *args) -> tuple[Any, float]:
        def run():
            started = time.perf_counter()
            value = fn(*args)
            return value, (time.perf_counter() - started) * 1e3

        return await logs.run_in(self.engine, run)

    def watch(
        self, job: GenerateJob, result: GenerateResult, sent_tokens: int, opened: float = 0.0
    ) -> Callable[[int], None] | None:
        """Under LOCAL_PREFILL, a check to call with the bytes received after each layer: it raises
        TransferTooSlow when, at the throughput measured so far, the rest of the stream would take
        longer than the own prefill of the whole context (ABANDON_MARGIN, ABANDON_SLACK_MS), after
        two gaps at least (ABANDON_MIN_GAPS). How the throughput is measured follows what auto's
        estimate expects to pace the stream (`Estimate.link_paced`):
        - the link (a store replay, or a wire slower than the producer's forward): bytes over the
          time since the call was opened (`opened`), every gap counted. A shaped link delivers in
          bursts (several layers at once, then nothing for seconds): any gap left out would read
          it faster than it is;
        - the producer's forward (or not known: a named mode): bytes since the first layer over
          the time since, the slowest gap left out: one stall of the forward (a busy host, a GC)
          is not a slow stream, and a stream slow throughout is slow without its worst gap too.
        None when not allowed or not estimable (no byte or own-prefill estimate yet)."""
        if job.on_failure != LOCAL_PREFILL or self.planner is None or job.codec is None:
            return None
        local = self.planner.estimate_local(len(job.context_ids)).ms
        per_token = self.planner.bytes_per_token.get(job.candidate_key)
        prior = job.auto.chosen.bytes_per_token if job.auto is not None else None
        bpt = per_token.value if per_token is not None and per_token.value is not None else prior
        if local is None or not bpt:
            return None
        expected = bpt * sent_tokens
        chosen = job.auto.picked if job.auto is not None else None
        link_paced = chosen is not None and chosen.estimate.link_paced and opened > 0
        seen: list[tuple[float, int]] = [(opened, 0)] if link_paced else []  # (when, bytes received) after each layer

        def check(received: int) -> None:
            now = time.perf_counter()
            if seen and received <= seen[-1][1]:
                return
            seen.append((now, received))
            watched_s = now - seen[0][0]
            if len(seen) <= ABANDON_MIN_GAPS or watched_s < ABANDON_MIN_WATCH_S:
                return
            if link_paced:
                rate = received / max(watched_s * 1e3, 1e-6)  # bytes per ms
            else:
                gaps = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(seen, seen[1:])]
                worst = max(gaps, key=lambda g: g[0] / g[1])  # the slowest per byte
                rate = (received - seen[0][1] - worst[1]) / max((watched_s - worst[0]) * 1e3, 1e-6)
            rest_ms = max(expected - received, 0.0) / rate
            if rest_ms > ABANDON_MARGIN * local + ABANDON_SLACK_MS:
                result.abandoned_span = (received - seen[0][1], watched_s * 1e3)
                log.info(
                    "transfer.watch",
                    link_paced=link_paced,
                    request_id=job.request_id,
                    arrivals_ms=[round((t - opened) * 1e3, 1) for t, _ in seen],
                    received=[b for _, b in seen],
                )
                raise TransferTooSlow(
                    f"transfer abandoned mid-stream: at {rate * 8e-3:.2f} Mbit/s"
                    f" ({'since the call opened' if link_paced else 'since the first layer, its slowest gap left out'}) the remaining"
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
        source = self.source
        started = time.perf_counter()
        first, key = partial or (0, "")
        seq.first_write = first
        result.sent_tokens = job.stored_context - first
        watch = self.watch(job, result, result.sent_tokens, started) if partial is None else None
        expect = Expectation(len(job.context_ids), job.codec, job.options, self.loaded.info, first, key, job.tenant, job.keep)
        budget = left(job, "transfer")
        if job.transfer_budget_s is not None:
            budget = min(budget, job.transfer_budget_s)
        pulling = _Pulling(self, job, result, seq, watch)
        await pulling.run(lambda: source.open(job.request_id, job.context_ids, expect, budget))
        result.rebuild_ms += pulling.rebuilds.took_ms
        result.transfer_ms += (time.perf_counter() - started) * 1e3
        trailer = pulling.trailer
        assert trailer is not None and pulling.decoder is not None  # the stream contract: header first, trailer last
        result.producer_prefill_ms = trailer.prefill_ms
        result.producer_encode_ms = trailer.encode_ms
        result.producer_store_hit = trailer.store_hit
        result.trailer = trailer
        _, took = await self._timed(pulling.decoder.finish)
        result.rebuild_ms += took
        seq.length = job.stored_context  # a keep transfer stores n tokens; the rest run at n + dropped
        seq.dropped = len(job.context_ids) - job.stored_context
        return pulling.decoder


class _Pulling:
    """One stream being pulled into a request's blocks (Transfer.pull): its header binds the
    decoder to the blocks and says what the stream is, each layer is handed to the engine as it
    arrives (`Rebuilds`) and counted by the watch, its trailer is kept; the stream ends at the
    first failed rebuild, and a failed stream cancels the rebuilds not yet run."""

    def __init__(
        self,
        transfer: Transfer,
        job: GenerateJob,
        result: GenerateResult,
        seq: SequenceKV,
        watch: Callable[[int], None] | None,
    ):
        self.transfer, self.job, self.result, self.seq, self.watch = transfer, job, result, seq, watch
        self.rebuilds = Rebuilds(asyncio.get_running_loop())
        self.decoder: CacheDecoder | None = None
        self.trailer: StreamTrailer | None = None

    async def run(self, open_stream: Callable[[], AsyncGenerator[Event, None]]) -> None:
        pumping = asyncio.ensure_future(self._pump(open_stream))
        rebuilds = self.rebuilds
        try:
            # the stream, unless a rebuild fails first (that ends the stream at once)
            await asyncio.wait([pumping, rebuilds.failed], return_when=asyncio.FIRST_COMPLETED)
            rebuilds.raise_failure()
            await pumping
            await rebuilds.all_done()
        finally:
            pumping.cancel()
            rebuilds.cancel()  # layers not rebuilt yet never run once the transfer failed
            try:
                await rebuilds.settled()  # and those running have written before anything else may
            finally:
                await asyncio.gather(pumping, return_exceptions=True)

    async def _pump(self, open_stream: Callable[[], AsyncGenerator[Event, None]]) -> None:
        stream = open_stream()
        try:
            async for event in stream:
                if isinstance(event, LayerPayloads):
                    self._layer(event)
                elif isinstance(event, StreamHeader):
                    self._header(event)
                elif isinstance(event, StreamTrailer):
                    self.trailer = event
        finally:
            await stream.aclose()

    def _layer(self, event: LayerPayloads) -> None:
        result = self.result
        result.bytes_received += event.nbytes
        assert self.decoder is not None  # the stream contract: the header comes first
        # handed to the engine at once: no round trip awaited per layer
        layer = LayerJob(self.decoder, event.layer, event.payloads)
        try:
            self.rebuilds.add(event.layer, self.transfer.engine.submit_grouped(self.transfer._rebuild_many, layer))
        except RuntimeError:  # stopping
            raise Unavailable("the consumer's engine stopped") from None
        if self.watch is not None:
            self.watch(result.bytes_received)

    def _header(self, event: StreamHeader) -> None:
        event.decoder.bind(self.seq)  # rebuilt layers go straight into the request's blocks
        self.decoder = event.decoder
        info, result = event.stream, self.result
        assert self.job.codec is not None
        self.transfer.keys.saw_stream(self.job.codec, self.job.options, info, event.chunk_tokens)
        result.stream_producer = (info.producer_identity, info.kv_dtype)
        auto = self.job.auto
        if auto is not None and auto.chosen.how == "exact":  # chosen as this model's own K/V on the link's view
            own = self.transfer.loaded.info.own_kv
            if result.stream_producer != own:  # the producer changed since the link check saw it
                raise DataLoss(
                    f"the stream's producer ({info.producer_identity[:16] or 'unnamed'}, {info.kv_dtype}) is not this"
                    f" model in {own[1]}: auto chose {self.job.codec.name} as exact from the last link check"
                )
        result.stream_metadata = dict(info.metadata)
        result.chunk_tokens = event.chunk_tokens
        result.options = {**info.options, **info.metadata}
        if self.job.keep is not None:  # what ran: the resolved selection (GenerateStats.transfer)
            result.options[KEEP_OPTION] = self.job.keep.label
        producer_kv = dataclasses.replace(self.transfer.loaded.info, dtype=info.kv_dtype)
        result.raw_kv_bytes = producer_kv.kv_bytes(info.num_tokens)
