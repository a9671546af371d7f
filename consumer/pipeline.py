"""The consumer's request pipeline, the same for every transfer codec:

  wait for KV memory (consumer.kv_admission: blocks for context + question + max_new_tokens) ->
  open the transfer (unless the mode is the consumer's own prefill) -> rebuild each layer into the
  request's KV pool blocks on the engine thread as soon as its payloads arrive, while later layers
  are still in flight -> finish the cache -> hand question and decode to the batch engine
  (consumer.batch), yielding tokens as they come -> release the blocks -> stats.

A transfer failure (producer unreachable or overloaded, stream corrupt or incompatible, too slow
for the transfer's share of the deadline) fails the request, or, with the LOCAL_PREFILL policy,
becomes the consumer's own prefill, recorded in the stats. Either way it is noticed at once: the
stream pump and the rebuild run as two tasks and the first failure of either cancels the other.

Under LOCAL_PREFILL the stream is also watched as it arrives: when, at the throughput observed
since its first layer, the rest would take longer than the consumer's own prefill of the whole
context (consumer.planner's estimate, with a margin), the transfer is abandoned for that prefill
(GenerateResult.transfer_abandoned).

A local prefill (mode oracle, LOCAL_PREFILL, an audit's fallback) is a chunked prefill inside the
engine's batches, never a forward that holds the device for its whole length. A request whose
rebuilt cache gives non-finite logits fails alone: DataLoss, or under LOCAL_PREFILL the
consumer's own prefill (recorded in the stats).

Knows nothing about gRPC: the transfer arrives through a `TransferSource` (an async iterator of
StreamHeader / LayerPayloads / StreamTrailer events, contract enforced by
consumer.stream_reader), which the servicer builds from the producer client.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from consumer.auto import AutoChoice
from consumer.batch import BatchEngine, Finished, Task
from consumer.decoding import Detokenizer, Sampler, Sampling
from consumer.engine_process import EngineProcess
from consumer.kv_admission import KVAdmission
from consumer.kv_pool import SequenceKV
from consumer.planner import TransferPlanner, mode_key
from consumer.prefix_cache import Hit, PrefixCache
from consumer.stream_reader import Event, Expectation, LayerPayloads, StreamHeader, StreamTrailer
from shared import audit, chunks, logs
from shared.codecs import CacheDecoder, Codec, EncodeRequest
from shared.codecs.base import LayerJob, add_layers, chunk_layouts
from shared.errors import Cancelled, DataLoss, DeadlineExceeded, ServiceError
from shared.models import LoadedModel

log = logs.get("consumer.engine")
LOCAL_MODE = "oracle"  # the consumer's own prefill: only token ids cross
FAIL, LOCAL_PREFILL = "fail", "local_prefill"  # on_transfer_failure policies
AUDIT_OFF, AUDIT_REPORT, AUDIT_FALLBACK, AUDIT_UPGRADE = "off", "report", "fallback", "upgrade"  # cache audit policies
ABANDON_MARGIN = 1.25  # abandon a stream when the rest is estimated to take this x the own prefill ...
ABANDON_SLACK_MS = 20.0  # ... plus this
ABANDON_MIN_WATCH_S = 0.05  # and only after watching it this long since its first layer


class TransferTooSlow(DeadlineExceeded):
    """The stream's observed throughput makes finishing it slower than the own prefill."""


def take_ready(first: Any, events: asyncio.Queue) -> tuple[list[Any], BaseException | None]:
    """`first` and whatever else is queued now, up to a Finished (included) or an exception
    (returned apart: the items before it are still delivered); nothing after them is taken."""
    batch = [first]
    while not isinstance(batch[-1], (Finished, BaseException)) and not events.empty():
        batch.append(events.get_nowait())
    error = batch.pop() if isinstance(batch[-1], BaseException) else None
    return batch, error


class TransferSource(Protocol):
    def open(
        self, request_id: str, context_ids: list[int], expect: Expectation, timeout_s: float
    ) -> AsyncGenerator[Event, None]: ...


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
    on_failure: str = FAIL  # FAIL | LOCAL_PREFILL
    transfer_budget_s: float | None = None  # LOCAL_PREFILL: the share of the deadline the transfer may use
    audit: str = AUDIT_OFF  # AUDIT_OFF | AUDIT_REPORT | AUDIT_FALLBACK | AUDIT_UPGRADE
    audit_positions: int = 8
    audit_threshold: float = 0.05  # used when the codec has no calibrated threshold
    auto: AutoChoice | None = None  # how mode auto (or fallback_to_oracle) chose codec and options

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
    transfer_failure: str = ""  # why LOCAL_PREFILL replaced the transfer
    audit_layer_errors: tuple[float, ...] = ()
    audit_thresholds: tuple[float, ...] = ()
    audit_decision: str = ""
    audit_ms: float = 0.0
    queue_wait_ms: float = 0.0  # waiting for KV memory before any work
    prefix_reused_tokens: int = 0  # context tokens whose KV came from the prefix cache
    auto: AutoChoice | None = None
    transfer_abandoned: bool = False  # the stream was too slow to finish: prefilled locally instead
    local_tokens: int = 0  # context tokens the consumer prefilled itself
    sent_tokens: int = 0  # context tokens the last stream's payloads covered
    trailer: StreamTrailer | None = None  # the last stream's trailer (its timings feed the planner)
    chunk_tokens: int = 0  # the producer's chunk size as the last stream header gave it
    abandoned_span: tuple[int, float] | None = None  # (bytes, ms) an abandoned stream delivered after its first layer


@dataclass(frozen=True)
class StreamRoot:
    """What a stream header said that names the producer's chunks of a codec's payloads."""

    producer_digest: str
    metadata: dict[str, str]
    chunk_tokens: int


def stream_key(job: GenerateJob) -> str:
    assert job.codec is not None
    return json.dumps([job.codec.name, sorted(job.options.items())])


class GenerateEngine:
    def __init__(
        self,
        loaded: LoadedModel,
        engine: BatchEngine | EngineProcess,
        admission: KVAdmission,
        source: TransferSource | None,
        prefix: PrefixCache | None = None,
        producer_digest: Callable[[], str] = lambda: "",
        planner: TransferPlanner | None = None,
    ):
        self.loaded = loaded
        self.engine = engine  # the device's only executor: jobs and batched forwards
        self.admission = admission
        self.source = source
        self.prefix = prefix  # rebuilt KV kept per context chunk (consumer.prefix_cache); None: off
        self.producer_digest = producer_digest  # the producer's weight digest as last seen, "" unknown
        self.stream_roots: dict[str, StreamRoot] = {}  # per codec and options: what the last header said
        self.planner = planner  # running estimates: the mid-stream watch under LOCAL_PREFILL
        self.abandoned = 0  # transfers abandoned mid-stream
        self.rebuilt_layers = 0  # layer rebuilds run ...
        self.batched_layers = 0  # ... of which in a decode shared with other requests

    def _left(self, job: GenerateJob, what: str) -> float:
        left = job.deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded(f"deadline passed before {what}")
        return left

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

    async def _engine_task(self, job: GenerateJob, task: Task) -> AsyncGenerator[list[int | Finished], None]:
        """Hand task to the batch engine; its sampled token ids, then its Finished, in lists of
        whatever arrived since the last one was taken (one item while the caller keeps up; more
        when the event loop falls behind, so a loaded loop sends fewer, fuller messages). Leaving
        early (deadline, cancel, error) takes the task out of the engine at its next iteration."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def sink(item: Any) -> None:
            loop.call_soon_threadsafe(events.put_nowait, item)

        left = self._left(job, "the engine")
        task.sink = sink
        self.engine.add(task)
        # one timer for the task's whole life, not a wait_for (a task and a timer) per token: the
        # deadline arrives in the queue as an error, after whatever the engine delivered before it
        expiry = loop.call_later(left, events.put_nowait, DeadlineExceeded("deadline passed while waiting for the engine"))
        finished = False
        try:
            while not finished:
                batch, error = take_ready(await events.get(), events)
                finished = bool(batch) and isinstance(batch[-1], Finished)
                if batch:
                    yield batch  # the tokens before an error still go out
                if error is not None:
                    raise error
        finally:
            expiry.cancel()
            if not finished:
                self.engine.cancel(task)

    async def _local_prefill(self, job: GenerateJob, result: GenerateResult, seq: SequenceKV, start: int = 0) -> None:
        """The consumer's own prefill of context tokens [start, T) into seq (tokens before start:
        a cached prefix of the consumer's own KV), in chunks inside the engine's batches."""
        self._left(job, "context prefill")
        if start < seq.shared_blocks * self.engine.pool.block_tokens:
            # a cached prefix rebuilt by a codec cannot be overwritten in place (other requests share it)
            raise DataLoss("the cached prefix this request shares cannot be replaced by a local prefill")
        seq.length = start  # a failed or flagged transfer's layers are overwritten
        if start == len(job.context_ids):
            return  # the whole context was cached
        started = time.perf_counter()
        result.local_tokens += len(job.context_ids) - start
        task = Task(seq, list(job.context_ids[start:]), sink=lambda _: None)
        async with contextlib.aclosing(self._engine_task(job, task)) as events:
            async for _ in events:
                pass
        result.rebuild_ms += (time.perf_counter() - started) * 1e3

    def _replaced_by_local(self, job: GenerateJob, result: GenerateResult, exc: ServiceError) -> bool:
        """Whether LOCAL_PREFILL turns this transfer failure into the consumer's own prefill (and
        record it)."""
        if job.on_failure != LOCAL_PREFILL or isinstance(exc, Cancelled) or job.deadline - time.monotonic() <= 0:
            return False
        result.transfer_failure = f"{exc.code}: {str(exc)[:300]}"
        result.transfer_abandoned = isinstance(exc, TransferTooSlow)
        self.abandoned += result.transfer_abandoned
        log.warning("generate.transfer_failed", mode=job.mode, code=exc.code, reason=str(exc)[:300], policy=LOCAL_PREFILL)
        result.codec, result.options = LOCAL_MODE, {}
        result.bytes_received = result.rebuild_ms = 0
        result.raw_kv_bytes = self.loaded.info.kv_bytes(len(job.context_ids))
        return True

    async def _cache(
        self, job: GenerateJob, result: GenerateResult, seq: SequenceKV, cached: int, partial: tuple[int, str] | None
    ) -> None:
        """The context's KV into seq; its first `cached` tokens are there already (prefix cache);
        `partial`: ask the producer only for the tokens after them."""
        if job.codec is None:
            await self._local_prefill(job, result, seq, cached)
            return
        if cached == len(job.context_ids):  # the same context rebuilt the same way before: no transfer
            return
        try:
            decoder = await self._remote(job, result, seq, partial)
        except ServiceError as exc:
            if partial is not None or not self._replaced_by_local(job, result, exc):
                raise  # a partial transfer's failure: run() retries the whole context first
            await self._local_prefill(job, result, seq)
            return
        if job.audit != AUDIT_OFF:
            await self._audited(job, result, seq, decoder)

    async def _audited(self, job: GenerateJob, result: GenerateResult, seq: SequenceKV, decoder: CacheDecoder) -> None:
        """Spot-check the rebuilt cache (shared.audit). Policy report: answer from it anyway;
        fallback: prefill locally when it is flagged; upgrade: when flagged, transfer once more
        with the codec's richer options and audit that, prefilling locally if it is flagged too,
        no richer option exists or the second transfer fails."""
        if not await self._audit(job, result, seq, decoder):
            return
        if job.audit == AUDIT_REPORT:
            return
        if job.audit == AUDIT_UPGRADE:
            richer = decoder.richer_options()
            if richer is None:
                result.audit_decision += ": no richer options"
            else:
                assert job.codec is not None
                label = richer.get("schedule") or ",".join(f"{k}={v}" for k, v in sorted(richer.items()))
                first = result.audit_decision
                try:
                    upgraded = dataclasses.replace(job, options=job.codec.resolve(richer))
                    decoder = await self._remote(upgraded, result, seq)  # the whole context again
                except ServiceError as exc:
                    if isinstance(exc, Cancelled) or job.deadline - time.monotonic() <= 0:
                        raise
                    result.audit_decision = f"{first}: upgrade to {label} failed ({exc.code})"
                    log.warning("generate.upgrade_failed", mode=job.mode, code=exc.code, reason=str(exc)[:300])
                else:
                    flagged = await self._audit(upgraded, result, seq, decoder)
                    result.audit_decision = f"{first}: upgraded to {label}: {result.audit_decision}"
                    if not flagged:
                        return
        result.audit_decision += ": prefilled locally"
        await self._local_prefill(job, result, seq)

    async def _audit(self, job: GenerateJob, result: GenerateResult, seq: SequenceKV, decoder: CacheDecoder) -> bool:
        """Audit the rebuilt cache in seq into `result` (errors, thresholds, decision "ok" |
        "diverged", time added); True when it diverged."""
        self._left(job, "cache audit")
        thresholds = decoder.audit_thresholds() or (job.audit_threshold,) * self.loaded.info.num_layers
        T = len(job.context_ids)
        checked = audit.positions(T, job.audit_positions, seed=T)
        report, _ = await self._timed(lambda: audit.audit(self.loaded, job.context_ids, seq.to_dynamic(T), checked))
        result.audit_layer_errors, result.audit_thresholds = report.layer_errors, thresholds
        result.audit_ms += report.ms
        diverged = any(e > t for e, t in zip(report.layer_errors, thresholds))
        result.audit_decision = "diverged" if diverged else "ok"
        if diverged:
            log.warning(
                "generate.audit_diverged",
                mode=job.mode,
                options=job.options,
                thresholds=[round(t, 4) for t in thresholds],
                layer_errors=[round(e, 4) for e in report.layer_errors],
                policy=job.audit,
            )
        return diverged

    def _root(self, job: GenerateJob, local: bool) -> str | None:
        """The prefix cache's root for KV made the way this request's is: the consumer's own
        prefill, or a codec (format, resolved options) over the producer's weights; None when it
        cannot be named (the producer's weights are not known yet, or no prefix cache)."""
        return self._root_of(None if local else job.codec, job.options)

    def _root_of(self, codec: Codec | None, options: dict[str, str]) -> str | None:
        if self.prefix is None:
            return None
        own = self.loaded.info.weight_digest
        if codec is None:
            return chunks.model_root(own)
        producer = self.producer_digest()
        if not producer:
            return None
        return chunks.codec_root(f"{own}|{producer}", codec.name, codec.format_version, options, {})

    def cached_tokens(self, codec: Codec | None, options: dict[str, str], context_ids: list[int]) -> int:
        """Context tokens the prefix cache holds made by `codec` (None: the own prefill), without
        touching its counters: the whole context, or its cached full chunks."""
        root = self._root_of(codec, options)
        if root is None or self.prefix is None:
            return 0
        return self.prefix.peek(chunks.chain(root, context_ids, self.prefix.chunk_tokens))

    def _refs(self, job: GenerateJob, local: bool) -> list[chunks.ChunkRef]:
        root = self._root(job, local)
        if root is None:
            return []
        assert self.prefix is not None  # a root is named only with a prefix cache
        return chunks.chain(root, job.context_ids, self.prefix.chunk_tokens)

    def _partial(self, job: GenerateJob, hit: Hit) -> tuple[int, str] | None:
        """(first_token, prefix_key) asking the producer for the context after the cached full
        chunks of `hit`, when it can: the producer cuts its chunks as we do, this codec's payloads
        cut along tokens there, and an earlier stream of this codec and options told us the
        producer's weights and codec metadata (its prefix key is computed from them)."""
        if not hit.shared:
            return None
        assert job.codec is not None and self.prefix is not None  # a hit comes from the prefix cache
        seen = self.stream_roots.get(stream_key(job))
        size = self.prefix.chunk_tokens
        if seen is None or seen.chunk_tokens != size or seen.producer_digest != self.producer_digest():
            return None
        try:
            encoder = job.codec.encoder(job.options, EncodeRequest(len(job.context_ids), self.loaded.info.weight_digest))
        except ServiceError:
            return None
        if chunk_layouts(encoder, self.loaded.info.num_layers, size) is None:
            return None
        first = len(hit.shared) * size
        root = chunks.codec_root(seen.producer_digest, job.codec.name, job.codec.format_version, job.options, seen.metadata)
        return first, chunks.prefix_key(root, job.context_ids, first, size)

    async def run(self, job: GenerateJob) -> AsyncGenerator[TokenOut | GenerateResult, None]:
        result = GenerateResult(job.request_id, job.mode, dict(job.options), len(job.context_ids), len(job.question_ids))
        result.auto = job.auto
        result.raw_kv_bytes = self.loaded.info.kv_bytes(len(job.context_ids))
        refs = self._refs(job, local=False)
        seq, partial = await self._admit(job, result, refs, reuse=True)
        try:
            try:
                await self._cache(job, result, seq, result.prefix_reused_tokens, partial)
            except ServiceError as exc:
                if partial is None or isinstance(exc, Cancelled) or job.deadline - time.monotonic() <= 0:
                    raise
                # the producer no longer holds what our prefix key names (or refused): whole context
                log.warning("generate.partial_transfer_failed", code=exc.code, reason=str(exc)[:300], first_token=partial[0])
                self._release(seq)
                result.bytes_received = 0
                seq, partial = await self._admit(job, result, refs, reuse=False)
                await self._cache(job, result, seq, 0, None)
            async with contextlib.aclosing(self._answer(job, result, seq)) as items:
                async for item in items:
                    yield item
            # kept only once it answered (finite logits, no contract error), and never a flagged cache
            if self.prefix is not None and not result.audit_decision.startswith("diverged"):
                made_as_asked = result.codec == job.mode  # else a failed transfer became the own prefill
                self.prefix.insert(refs if made_as_asked else self._refs(job, local=True), seq)
        finally:
            self._release(seq)

    async def _admit(
        self, job: GenerateJob, result: GenerateResult, refs: list[chunks.ChunkRef], reuse: bool
    ) -> tuple[SequenceKV, tuple[int, str] | None]:
        """KV blocks for the request, starting with what the prefix cache holds of its context:
        the whole context, or (own prefill, or a codec that can send from a chunk boundary) its
        cached full chunks; and the (first_token, prefix_key) to ask the producer with."""
        T = len(job.context_ids)
        # an audited transfer audits its own stream (and its policy may rewrite the whole cache)
        reuse = reuse and (job.codec is None or job.audit == AUDIT_OFF)
        hit = self.prefix.lookup(refs) if (reuse and self.prefix is not None and refs) else Hit([])
        partial = None
        if job.codec is not None and hit.tokens < T:
            partial = self._partial(job, hit)
            hit = Hit(hit.shared) if partial is not None else Hit([])  # a tail is re-sent with the rest
        pool = self.engine.pool
        tail = hit.tail.blocks if hit.tail is not None else []
        pool.hold(hit.shared_blocks + tail)  # pinned: the cache may evict them meanwhile
        # the request's worst case: the last sampled token is never fed back
        need = T + len(job.question_ids) + job.max_new_tokens
        try:
            seq, waited = await self.admission.acquire(need, job.deadline, shared=hit.shared_blocks)
            if tail:
                try:
                    await logs.run_in(self.engine, pool.copy_blocks, tail, seq.blocks[len(hit.shared_blocks) :])
                except BaseException:  # cancelled or deadline while copying: the blocks go back
                    self._release(seq)
                    raise
        finally:
            pool.drop(tail)
        result.queue_wait_ms += waited * 1e3
        result.prefix_reused_tokens = hit.tokens
        return seq, partial

    def _release(self, seq: SequenceKV) -> None:
        """seq's blocks back to the pool, on the engine thread after anything still using them."""
        try:
            self.engine.release(seq).add_done_callback(lambda _: self.admission.wake())
        except RuntimeError:  # the engine has stopped (server stop): nothing runs on the pool any more
            self.engine.pool.release(seq)

    async def _answer(
        self, job: GenerateJob, result: GenerateResult, seq: SequenceKV
    ) -> AsyncGenerator[TokenOut | GenerateResult, None]:
        """Question prefill and decode in the engine's batches; a cache whose logits are not finite
        fails the request (DataLoss) or, under LOCAL_PREFILL, is replaced by the own prefill once."""
        self._left(job, "question prefill")
        detok = Detokenizer(self.loaded.tokenizer)
        context_len = len(job.context_ids)
        while True:
            seq.length = context_len
            task = Task(
                seq,
                list(job.question_ids),
                sink=lambda _: None,
                sampler=Sampler(job.sampling, self.loaded.device),
                max_new=job.max_new_tokens,
                stop_ids=job.stop_ids,
            )
            submitted = time.perf_counter()
            first_at = submitted
            try:
                async with contextlib.aclosing(self._engine_task(job, task)) as events:
                    async for items in events:
                        ids = [item for item in items if not isinstance(item, Finished)]
                        if ids:
                            if result.generated_tokens == 0:
                                first_at = time.perf_counter()
                                result.question_prefill_ms = (first_at - submitted) * 1e3
                                result.ttft_ms = (first_at - job.received_at) * 1e3
                            result.generated_tokens += len(ids)
                            yield TokenOut(ids, detok.push_many(ids))
                        if isinstance(items[-1], Finished):
                            result.finish_reason = items[-1].reason
                            break
            except DataLoss as exc:
                if result.generated_tokens or job.codec is None or result.codec == LOCAL_MODE:
                    raise
                if not self._replaced_by_local(job, result, exc):
                    raise
                await self._local_prefill(job, result, seq)
                continue
            break
        rest = detok.flush()
        if rest:
            yield TokenOut([], rest)
        done = time.perf_counter()
        result.decode_ms = (done - first_at) * 1e3
        result.total_ms = (done - job.received_at) * 1e3
        yield result

    def _watch(self, job: GenerateJob, result: GenerateResult, sent_tokens: int) -> Callable[[int], None] | None:
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

    async def _remote(
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
        result.sent_tokens = len(job.context_ids) - first
        watch = self._watch(job, result, result.sent_tokens) if partial is None else None
        expect = Expectation(len(job.context_ids), job.codec, job.options, self.loaded.info, first, key)
        budget = self._left(job, "transfer")
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
                        self.stream_roots[stream_key(job)] = StreamRoot(
                            info.producer_digest, dict(info.metadata), event.chunk_tokens
                        )
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
