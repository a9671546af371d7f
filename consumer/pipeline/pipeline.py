"""The consumer's request pipeline, the same for every transfer codec:

  wait for KV memory (consumer.engine.kv_admission: blocks for context + question + max_new_tokens,
  starting with what the prefix cache holds; twice that under verify) -> the context's KV: the
  transfer (consumer.request.transfer) or the consumer's own prefill -> the audit's policy
  (consumer.exact.audit_policy) -> anchor-token repair (consumer.exact.repair) -> question and decode in the batch engine (consumer.request.engine_stream), or
  under verify drafts on that cache checked against the exact one (consumer.exact.verify), yielding
  tokens as they come -> keep the context's chunks (consumer.engine.prefix_cache, named by
  consumer.link.prefix_keys) -> release the blocks -> stats.

Policies compose in one order: transfer (its failure policy) -> audit (report, fallback,
upgrade, or repair: a flagged cache is repaired as below and audited again before the own
prefill replaces it) -> repair (the transfer option `repair`: recompute the K/V of the context tokens the
question attends to most, over the cache the audit's policy left) -> verify. A cache the earlier
steps made exact (LOCAL_PREFILL replaced the transfer, the audit fell back to the own prefill, mode
oracle) is neither repaired nor verified: its answer is the oracle's already, and the second set
of blocks goes back at once (`repair_choice` and `verify_decision` say "skipped: ..."). A repaired
cache is its own thing: it is never kept in the prefix cache, and a request that asks for repair
reuses no cached chunks (its repair writes into every block of its context).

Its parts, one job each: `Transfer` pulls a stream and rebuilds its layers; `AuditPolicy` checks a
rebuilt cache and applies report / fallback / upgrade; `PrefixKeys` names KV by what made it;
`engine_task` turns an engine task into an async stream. This module composes them and owns the
request's blocks from admission to release, and the failure policy: a transfer failure (producer
unreachable or overloaded, stream corrupt or incompatible, too slow for its share of the
deadline, abandoned mid-stream by the transfer's watch) fails the request, or, with
LOCAL_PREFILL, becomes the consumer's own prefill, recorded in the stats.

A local prefill (mode oracle, LOCAL_PREFILL, an audit's fallback) is a chunked prefill inside the
engine's batches, never a forward that holds the device for its whole length. A request whose
rebuilt cache gives non-finite logits fails alone: DataLoss, or under LOCAL_PREFILL the
consumer's own prefill (recorded in the stats).

Knows nothing about gRPC: the transfer arrives through a `TransferSource` (consumer.request.transfer),
which the servicer builds from the producer client.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncGenerator, Callable

from consumer.auto.planner import TransferPlanner
from consumer.engine.batch import BatchEngine, Task
from consumer.engine.decoding import Sampler
from consumer.engine.kv_admission import KVAdmission
from consumer.engine.kv_pool import SequenceKV
from consumer.engine.prefix_cache import Hit, PrefixCache
from consumer.engine.process import EngineProcess
from consumer.exact.audit_policy import AuditPolicy
from consumer.exact.repair import DEFAULT_AUDIT_REPAIR, Repairer
from consumer.exact.verify import Verifier
from consumer.link.prefix_keys import PrefixKeys
from consumer.request.decode import decode
from consumer.request.ending import ending_of
from consumer.request.engine_stream import engine_task
from consumer.request.job import (
    AUDIT_OFF,
    AUDIT_REPAIR,
    LOCAL_PREFILL,
    ORACLE_MODE,
    VERIFY_OFF,
    Commit,
    GenerateJob,
    GenerateResult,
    TokenOut,
    left,
)
from consumer.request.transfer import Transfer, TransferSource, TransferTooSlow
from shared import chunks, logs
from shared.codecs import Codec
from shared.errors import Cancelled, DataLoss, ResourceExhausted, ServiceError
from shared.models import LoadedModel

log = logs.get("consumer.pipeline.pipeline")


class RequestPipeline:
    def __init__(
        self,
        loaded: LoadedModel,
        engine: BatchEngine | EngineProcess,
        admission: KVAdmission,
        source: TransferSource | None,
        prefix: PrefixCache | None = None,
        producer_identity: Callable[[], str] = lambda: "",
        planner: TransferPlanner | None = None,
        producer_dtype: Callable[[], str] = lambda: "",
        exact_transfer: Callable[[GenerateJob], GenerateJob | None] = lambda job: None,
    ):
        self.loaded = loaded
        # verified decoding's exact cache by a transfer (identical weights, same dtype: raw) when
        # estimated faster than the own prefill: the job of that transfer, or None (consumer.auto.chooser)
        self.exact_transfer = exact_transfer
        self.engine = engine  # the device's only executor: jobs and batched forwards
        self.admission = admission
        self.source = source
        self.prefix = prefix  # rebuilt KV kept per context chunk (consumer.engine.prefix_cache); None: off
        self.producer_identity = producer_identity  # what shapes the producer's K/V (ModelInfo.identity) as last seen, "" unknown
        self.producer_dtype = producer_dtype  # the dtype its KV is computed in, as last seen, "" unknown
        # the names of context KV (prefix cache keys, the producer's prefix keys); through the two
        # attributes above, so that what the link saw is read at the time of each request
        chunk = prefix.chunk_tokens if prefix is not None else None
        self.keys = PrefixKeys(loaded.info, chunk, lambda: self.producer_identity(), lambda: self.producer_dtype())
        self.planner = planner  # running estimates: the mid-stream watch under LOCAL_PREFILL
        self.transfer = Transfer(loaded, engine, source, self.keys, planner)
        self.audits = AuditPolicy(loaded, self.transfer, self._local_prefill, self._audit_repair)
        self.repairer = Repairer(loaded, engine)
        self.verifier = Verifier(loaded, engine)
        self.abandoned = 0  # transfers abandoned mid-stream
        # prefix-cache inserts queued on the engine and not run yet, by their context's first chunk key
        self._inserting: dict[str, asyncio.Future] = {}

    @property
    def rebuilt_layers(self) -> int:  # the metrics read these from the pipeline
        return self.transfer.rebuilt_layers

    @property
    def batched_layers(self) -> int:
        return self.transfer.batched_layers

    async def _local_prefill(self, job: GenerateJob, result: GenerateResult, seq: SequenceKV, start: int = 0) -> None:
        """The consumer's own prefill of context tokens [start, T) into seq (tokens before start:
        a cached prefix of the consumer's own KV), in chunks inside the engine's batches."""
        self._context_from(job, result, seq, start)
        if start == len(job.context_ids):
            return  # the whole context was cached
        started = time.perf_counter()
        task = Task(seq, list(job.context_ids[start:]), sink=lambda _: None)
        async with contextlib.aclosing(engine_task(self.engine, job, task)) as events:
            async for _ in events:
                pass
        took = (time.perf_counter() - started) * 1e3
        result.rebuild_ms += took
        result.local_prefill_ms += took

    def _context_from(self, job: GenerateJob, result: GenerateResult, seq: SequenceKV, start: int) -> int:
        """The consumer's own prefill of context tokens [start, T) about to be fed (by _local_prefill,
        or for oracle by the question's own task, ahead of the question: one engine task, no wait
        between the two, and a chunk may hold the context's end and the question): the deadline and
        the shared prefix checked, seq cut back to `start`, the tokens counted; `start`."""
        left(job, "context prefill")
        if start < seq.shared_blocks * self.engine.pool.block_tokens:
            # a cached prefix rebuilt by a codec cannot be overwritten in place (other requests share it)
            raise DataLoss("the cached prefix this request shares cannot be replaced by a local prefill")
        seq.length = start  # a failed or flagged transfer's layers are overwritten
        result.local_tokens += len(job.context_ids) - start
        return start

    def _replaced_by_local(self, job: GenerateJob, result: GenerateResult, exc: ServiceError) -> bool:
        """Whether LOCAL_PREFILL turns this transfer failure into the consumer's own prefill (and
        record it)."""
        if job.on_failure != LOCAL_PREFILL or isinstance(exc, Cancelled) or job.deadline - time.monotonic() <= 0:
            return False
        result.transfer_failure = f"{exc.code}: {str(exc)[:300]}"
        result.transfer_abandoned = isinstance(exc, TransferTooSlow)
        self.abandoned += result.transfer_abandoned
        log.warning("generate.transfer_failed", mode=job.mode, code=exc.code, reason=str(exc)[:300], policy=LOCAL_PREFILL)
        result.codec, result.options = ORACLE_MODE, {}
        result.bytes_received = result.rebuild_ms = result.local_prefill_ms = 0
        result.raw_kv_bytes = self.loaded.info.kv_bytes(len(job.context_ids))
        return True

    async def _cache(
        self, job: GenerateJob, result: GenerateResult, seq: SequenceKV, cached: int, partial: tuple[int, str] | None
    ) -> int | None:
        """The context's KV into seq; its first `cached` tokens are there already (prefix cache);
        `partial`: ask the producer only for the tokens after them. Oracle's context is left to the
        question's task: the first token it leaves to feed, else None."""
        if job.codec is None:  # oracle: the context's own prefill rides in the question's task (_answer)
            return self._context_from(job, result, seq, cached)
        if cached == len(job.context_ids):  # the same context rebuilt the same way before: no transfer
            return None
        try:
            decoder = await self.transfer.pull(job, result, seq, partial)
        except ServiceError as exc:
            if partial is not None or not self._replaced_by_local(job, result, exc):
                raise  # a partial transfer's failure: run() retries the whole context first
            await self._local_prefill(job, result, seq)
            return None
        if job.audit != AUDIT_OFF:
            await self.audits.apply(job, result, seq, decoder)
        return None

    async def run(self, job: GenerateJob) -> AsyncGenerator[TokenOut | Commit | GenerateResult, None]:
        result = GenerateResult(job.request_id, job.mode, dict(job.options), len(job.context_ids), len(job.question_ids))
        result.auto = job.auto
        result.raw_kv_bytes = self.loaded.info.kv_bytes(len(job.context_ids))
        # a codec's chunks are named by the metadata its streams carry (an SCD artifact and schedule):
        # looked up under what the last stream said, and a partial transfer must say it again
        assumed = self.keys.lookup_metadata(job.codec, job.options)
        refs = self.keys.chain(job.codec, job.options, job.context_ids, job.tenant, metadata=assumed)
        verify = job.verify != VERIFY_OFF and job.codec is not None
        if job.verify != VERIFY_OFF and not verify:
            result.verify_decision = "skipped: mode oracle is exact"
        seq, exact, partial = await self._admit(job, result, refs, assumed, reuse=True, verify=verify)
        if job.codec is not None and result.prefix_reused_tokens == len(job.context_ids):
            result.options = {**result.options, **assumed}  # what made the cached KV (GenerateStats.transfer)
        try:
            try:
                deferred = await self._cache(job, result, seq, result.prefix_reused_tokens, partial)
                if partial is not None and result.stream_metadata != assumed:
                    raise DataLoss(f"the stream's codec metadata {result.stream_metadata} is not the cached prefix's {assumed}")
            except ServiceError as exc:
                if partial is None or isinstance(exc, Cancelled) or job.deadline - time.monotonic() <= 0:
                    raise
                # the producer no longer holds what our prefix key names (or refused): whole context
                log.warning("generate.partial_transfer_failed", code=exc.code, reason=str(exc)[:300], first_token=partial[0])
                self._release(seq, exact)
                result.bytes_received = 0
                seq, exact, partial = await self._admit(job, result, refs, assumed, reuse=False, verify=verify)
                deferred = await self._cache(job, result, seq, 0, None)
            if job.repair is not None and job.audit != AUDIT_REPAIR:  # under AUDIT_REPAIR: only when flagged
                await self._repair(job, result, seq)
            if exact is not None and (result.codec == ORACLE_MODE or result.audit_decision.endswith("prefilled locally")):
                result.verify_decision = "skipped: the context was prefilled locally"
                self._release(exact)
                exact = None
            answer: AsyncGenerator[TokenOut | Commit | GenerateResult, None]
            via: GenerateJob | None = None  # verify: the exact cache's transfer, when one is faster
            if exact is None:
                answer = self._answer(job, result, seq, deferred)
            else:
                if deferred is not None:  # never for oracle (it has no exact cache); the context first, then
                    await self._local_prefill(job, result, seq, deferred)
                start = await self._exact_start(job, exact)
                via = self.exact_transfer(job) if start == 0 and self.source is not None else None
                fill = functools.partial(self._exact_by_transfer, job, via, result) if via is not None else None
                answer = self.verifier.answer(job, result, seq, exact, self._release, start, fill)
            async with contextlib.aclosing(answer) as items:
                async for item in items:
                    yield item
            # kept only once it answered (finite logits, no contract error), and never a flagged cache;
            # after verification the exact cache, the consumer's own prefill
            # nor a repaired one (its K/V are neither the codec's nor the own prefill's)
            repaired = result.repair_tokens > 0 and result.codec != ORACLE_MODE
            kept_ok = not result.audit_decision.startswith("diverged") and not repaired and job.keep is None
            if self.prefix is not None and (exact is not None or kept_ok):
                keep = self._made_as(job, result) if exact is None else self._exact_made_as(job, result, via)
                if keep:  # on the engine thread, before the release queued after it
                    kept = seq if exact is None else exact
                    self._insert(keep, kept)
        finally:
            self._release(seq, exact)

    async def _repair(self, job: GenerateJob, result: GenerateResult, seq: SequenceKV) -> None:
        """Anchor-token repair of seq's rebuilt context (consumer.exact.repair), after the audit's policy;
        skipped when the context is the consumer's own prefill already."""
        assert job.repair is not None
        if job.codec is None:
            result.repair_choice = "skipped: mode oracle is exact"
        elif result.codec == ORACLE_MODE or result.audit_decision.endswith("prefilled locally"):
            result.repair_choice = "skipped: the context was prefilled locally"
        else:
            await self.repairer.apply(job, result, seq, job.repair)

    async def _audit_repair(self, job: GenerateJob, result: GenerateResult, seq: SequenceKV) -> None:
        """AUDIT_REPAIR's response to a flagged cache: the request's repair, else DEFAULT_AUDIT_REPAIR."""
        await self.repairer.apply(job, result, seq, job.repair or DEFAULT_AUDIT_REPAIR)

    async def _exact_by_transfer(self, job: GenerateJob, via: GenerateJob, result: GenerateResult, exact: SequenceKV) -> str:
        """Verified decoding's exact cache by a second transfer (`via`: raw from a producer with the
        consumer's weights and dtype), beside the drafting; the own prefill when it fails or its
        stream's header names another producer (then its K/V are not the consumer's own). A note."""
        scratch = GenerateResult(job.request_id, via.mode, dict(via.options), len(job.context_ids), len(job.question_ids))
        started = time.perf_counter()
        try:
            try:
                await self.transfer.pull(via, scratch, exact)
            finally:
                result.bytes_received += scratch.bytes_received  # both streams' bytes count, also a failed one's
            if scratch.stream_producer != self.loaded.info.own_kv:
                raise DataLoss(f"the stream's producer {scratch.stream_producer} is not this model in {self.loaded.info.dtype}")
        except ServiceError as exc:
            if isinstance(exc, Cancelled):
                raise
            log.warning("generate.exact_transfer_failed", mode=via.mode, code=exc.code, reason=str(exc)[:200])
            note = await self.verifier.own_fill(job, exact)
            return f"{note} after the {via.mode} transfer failed ({exc.code})"
        result.exact_transfer = via.mode
        ms = (time.perf_counter() - started) * 1e3
        return f"; exact cache: {via.mode} transfer ({scratch.bytes_received} bytes, {ms:.0f} ms)"

    async def _exact_start(self, job: GenerateJob, exact: SequenceKV) -> int:
        """Verified decoding's exact cache starts with what the prefix cache holds of the context as
        the consumer's own prefill, copied into its blocks (a copy: its question and answer follow
        right after); the tokens copied."""
        refs = self.keys.chain(None, {}, job.context_ids, job.tenant) if self.prefix is not None else []
        if self.prefix is None or not refs:
            return 0
        hit = self.prefix.lookup(refs, hold=True)
        blocks = hit.shared_blocks + hit.tail_blocks
        try:
            if blocks:
                await logs.run_in(self.engine, self.engine.pool.copy_blocks, blocks, exact.blocks)
        finally:
            self.engine.pool.drop(blocks)
        return hit.tokens

    def _made_as(self, job: GenerateJob, result: GenerateResult) -> list[chunks.ChunkRef]:
        """The chunk refs that name how seq's context KV was really made: the own prefill when a
        transfer became one; for a transfer, the producer (digest, dtype) its stream's header named,
        not the one the link check saw before it (a rolling deploy, a pool of unlike producers)."""
        if job.codec is None or result.codec != job.mode:
            return self.keys.chain(None, {}, job.context_ids, job.tenant)
        if result.stream_producer is None:
            return []  # nothing streamed: the whole context came from the cache, already kept
        return self.keys.chain(
            job.codec, job.options, job.context_ids, job.tenant, result.stream_producer, result.stream_metadata
        )

    def _exact_made_as(self, job: GenerateJob, result: GenerateResult, via: GenerateJob | None) -> list[chunks.ChunkRef]:
        """The chunk refs of a verified answer's exact cache: the own prefill's, or the exact
        transfer's (keyed by that transfer, its producer checked to be this model and dtype)."""
        if via is None or result.exact_transfer != via.mode:
            return self.keys.chain(None, {}, job.context_ids, job.tenant)
        return self.keys.chain(via.codec, via.options, job.context_ids, job.tenant, self.loaded.info.own_kv)

    def cached_tokens(self, codec: Codec | None, options: dict[str, str], context_ids: list[int], tenant: str = "") -> int:
        """Context tokens the prefix cache holds for `tenant` made by `codec` (None: the own prefill),
        without touching its counters: the whole context, or its cached full chunks."""
        refs = self.keys.chain(codec, options, context_ids, tenant)
        return self.prefix.peek(refs) if refs and self.prefix is not None else 0

    async def _admit(
        self,
        job: GenerateJob,
        result: GenerateResult,
        refs: list[chunks.ChunkRef],
        metadata: dict[str, str],
        reuse: bool,
        verify: bool = False,
    ) -> tuple[SequenceKV, SequenceKV | None, tuple[int, str] | None]:
        """KV blocks for the request, starting with what the prefix cache holds of its context:
        the whole context, or (own prefill, or a codec that can send from a chunk boundary) its
        cached full chunks (`refs`, named with the codec `metadata`); and the (first_token,
        prefix_key) to ask the producer with. Under
        `verify` also the exact cache's own blocks (context + question + max_new_tokens again),
        reserved in the same admission: a request never holds one set while it waits for the other."""
        T = len(job.context_ids)
        # an audited transfer audits its own stream (and its policy may rewrite the whole cache)
        # and a repaired one writes into all of its context's blocks (consumer.exact.repair)
        # and a keep transfer's kept set depends on the whole context: it neither reads nor fills the
        # prefix cache (a kept chunk is never served as a whole one, nor a whole one as kept)
        reuse = reuse and job.keep is None and (job.codec is None or (job.audit == AUDIT_OFF and job.repair is None))
        pool = self.engine.pool
        # held (pinned) by the lookup itself: the engine may evict them any time after it
        pending = self._inserting.get(refs[0].key) if refs else None
        if reuse and pending is not None:  # read your writes: this context's insert, queued, not run yet
            await asyncio.shield(pending)
        hit = self.prefix.lookup(refs, hold=True) if (reuse and self.prefix is not None and refs) else Hit([])
        partial = None
        if job.codec is not None and hit.tokens < T and job.keep is None:
            partial = self.keys.partial(job.codec, job.options, job.context_ids, len(hit.shared), job.producer_tenant, metadata)
            kept = Hit(hit.shared) if partial is not None else Hit([])  # a tail is re-sent with the rest
            keep = set(kept.shared_blocks)
            pool.drop([b for b in hit.shared_blocks + hit.tail_blocks if b not in keep])
            hit = kept
        tail = hit.tail_blocks
        # the request's worst case: the last sampled token is never fed back
        need = job.stored_context + len(job.question_ids) + job.max_new_tokens  # a keep set: its kept tokens only
        # verify's exact cache holds the whole context, whatever the transfer kept
        exact_blocks = pool.blocks_for(T + len(job.question_ids) + job.max_new_tokens)
        try:
            seq, waited = await self.admission.acquire(
                (pool.blocks_for(need) + exact_blocks) * pool.block_tokens if verify else need,
                job.deadline,
                shared=hit.shared_blocks,
            )
            exact = seq.split_off(exact_blocks) if verify else None
            if tail:
                try:
                    await logs.run_in(self.engine, pool.copy_blocks, tail, seq.blocks[len(hit.shared_blocks) :])
                except BaseException:  # cancelled or deadline while copying: the blocks go back
                    self._release(seq, exact)
                    raise
        except ResourceExhausted as exc:
            if verify:  # why it needs twice what its tokens say
                raise ResourceExhausted(f"{exc} (verify reserves context + question + max_new_tokens twice)") from None
            raise
        finally:
            pool.drop(tail)
        result.queue_wait_ms += waited * 1e3
        result.prefix_reused_tokens = hit.tokens
        return seq, exact, partial

    def _insert(self, refs: list[chunks.ChunkRef], seq: SequenceKV) -> None:
        """Keep seq's context chunks: a prefix-cache insert on the engine thread, queued before the
        release that follows it, not awaited (the caller's stream ends without waiting for an
        iteration boundary); a later lookup of the same context waits for it (`_admit`)."""
        assert self.prefix is not None
        inserting = asyncio.wrap_future(self.engine.submit(self.prefix.insert, refs, seq))

        def failed(f: asyncio.Future) -> None:
            if not f.cancelled() and f.exception() is not None:
                log.error("prefix.insert_failed", error=f"{type(f.exception()).__name__}: {str(f.exception())[:200]}")

        inserting.add_done_callback(failed)
        first = refs[0].key
        self._inserting[first] = inserting
        inserting.add_done_callback(lambda f: self._inserting.pop(first, None) if self._inserting.get(first) is f else None)

    def _release(self, *seqs: SequenceKV | None) -> None:
        """The sequences' blocks back to the pool, on the engine thread after anything still using
        them (a second release of one is a no-op)."""
        for seq in seqs:
            if seq is None:
                continue
            try:
                self.engine.release(seq).add_done_callback(lambda _: self.admission.wake())
            except RuntimeError:  # the engine has stopped (server stop): nothing runs on the pool any more
                self.engine.pool.release(seq)

    async def _answer(
        self, job: GenerateJob, result: GenerateResult, seq: SequenceKV, start: int | None = None
    ) -> AsyncGenerator[TokenOut | GenerateResult, None]:
        """Question prefill and decode in the engine's batches (consumer.request.decode); a cache whose
        logits are not finite fails the request (DataLoss) or, under LOCAL_PREFILL, is replaced by
        the own prefill once."""
        left(job, "question prefill")
        context_len = len(job.context_ids) - seq.dropped  # stored: a kept sequence runs on at its logical length
        first_at: list[float] = []
        while True:
            seq.length = context_len if start is None else start
            ahead = [] if start is None else list(job.context_ids[start:])
            sampler = Sampler(job.sampling, self.loaded.device)
            task = Task(seq, ahead + list(job.question_ids), lambda _: None, sampler, job.max_new_tokens, job.stop_ids)
            submitted = time.perf_counter()
            context_done: list[float] = []
            if ahead:
                question = len(job.question_ids)

                def fed(pending: int, done: list[float] = context_done, question: int = question) -> None:  # engine thread
                    if pending <= question and not done:
                        done.append(time.perf_counter())

                task.on_fed = fed

            def first(
                at: float, submitted: float = submitted, done: list[float] = context_done, ahead: bool = bool(ahead)
            ) -> None:
                first_at.append(at)
                if ahead:  # the context's own prefill until its last token was fed (all of it where not relayed)
                    context_end = done[0] if done else at
                    result.local_prefill_ms = result.rebuild_ms = (context_end - submitted) * 1e3
                    submitted = context_end
                result.question_prefill_ms = (at - submitted) * 1e3
                result.ttft_ms = (at - job.received_at) * 1e3

            ending = ending_of(self.loaded.tokenizer, job)
            try:
                async with contextlib.aclosing(decode(self.engine, job, result, task, ending, first)) as out:
                    async for item in out:
                        yield item
            except DataLoss as exc:
                if result.generated_tokens or job.codec is None or result.codec == ORACLE_MODE:
                    raise
                if not self._replaced_by_local(job, result, exc):
                    raise
                await self._local_prefill(job, result, seq)
                continue
            break
        done = time.perf_counter()
        result.decode_ms = (done - (first_at[0] if first_at else submitted)) * 1e3
        result.total_ms = (done - job.received_at) * 1e3
        yield result
