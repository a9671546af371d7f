"""Verified decoding (VeriCache's idea; docs/design.md, "Verified decoding"): answer from the
transferred cache at once (drafts) while the consumer builds the exact cache, its own prefill of
the context, chunked inside the engine's batches into a second set of blocks that admission
reserved together with the first (consumer.pipeline.pipeline). When the exact cache is complete, one
forward over question + drafts on it (a prefill task that keeps the logits of its last k + 1
positions, consumer.engine.batch) checks every draft: the longest agreeing prefix stands, the first
disagreement is replaced by the exact model's token (all agreeing: the exact model's next token
follows), and decoding continues on the exact cache. The draft blocks go back as soon as the
drafting stops.

Greedy: a draft stands when it is the exact model's argmax, so the answer is the oracle's token
for token. Sampling: the speculative-sampling rule (Leviathan et al.; Chen et al.;
consumer.engine.speculative, which also bounds what a draft keeps): draft x stands with probability
min(1, p(x) / q(x)); at the first rejection the token is drawn from norm(max(0, p - q)); after all
stand the next is drawn from p. p is the exact model's distribution, q the draft's, both after
temperature and top-p, so every token's distribution is the oracle's. (A seed no longer fixes
the tokens: how many drafts there are depends on timing.)

Where the answer ends comes from its tokens (consumer.request.ending: a stop id, max_new_tokens, a stop
string), never from when the engine's Finished arrives: the drafts are cut by their own ending,
the verified tokens by the answer's, and the continuation is the pipeline's decode loop
(consumer.request.decode) on the exact cache.

Delivery: VERIFY_VERIFIED streams verified tokens only (the first ones when the drafts are
checked); VERIFY_PROVISIONAL streams drafts as they come, then one `Commit` (how many of them
stand, the tokens that follow instead of the rest, the verified text), then verified tokens only.

The engine alone runs forwards and writes or frees blocks: this module hands it tasks and one job
(the acceptance, on the engine thread beside the kept rows). With `--engine-process` the tasks run
in the engine's process and the acceptance on the frontend's job thread, over the rows that
process sends back (consumer.engine.process: the drafts' q, the check's argmax ids or p): the same
functions either way. Knows nothing about gRPC, codecs or the prefix cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import torch

from consumer.engine.batch import BatchEngine, Finished, Task
from consumer.engine.decoding import Sampler, Sampling
from consumer.engine.kv_pool import SequenceKV
from consumer.engine.process import EngineProcess
from consumer.engine.speculative import DraftSampler, accept_greedy, accept_sampled
from consumer.request.decode import decode
from consumer.request.ending import Ending, ending_of
from consumer.request.engine_stream import engine_task
from consumer.request.job import VERIFY_PROVISIONAL, Commit, GenerateJob, GenerateResult, TokenOut
from shared import logs
from shared.errors import DataLoss
from shared.models import LoadedModel

log = logs.get("consumer.exact.verify")
SEED_MASK = (1 << 63) - 1
ACCEPT_SEED = 0x5EED_0ACC  # the acceptance's draws: a stream apart from the drafts' ...
CONTINUE_SEED = 0xC0_4714  # ... and from the continuation's on the exact cache


def _ignore(_: Any) -> None:
    pass


@dataclass
class Drafts:
    """What the drafting produced: the draft tokens (cut where they end the answer, and, sampled,
    at the last one whose row the sampler kept), the sampler holding their rows, their own
    ending, and a note for verify_decision."""

    sampler: DraftSampler
    ending: Ending
    ids: list[int]
    note: str = ""

    @property
    def greedy(self) -> bool:
        return self.sampler.generator is None


class Verifier:
    def __init__(self, loaded: LoadedModel, engine: BatchEngine | EngineProcess):
        self.loaded, self.engine = loaded, engine

    async def _fill(self, job: GenerateJob, exact: SequenceKV, start: int) -> str:
        """The exact cache: the consumer's own prefill of context tokens [start, T) into `exact`
        (those before `start` are there already), chunked in the engine's batches; a note."""
        started = time.perf_counter()
        exact.length = start
        if start == len(job.context_ids):
            return ""
        task = Task(exact, list(job.context_ids[start:]), sink=_ignore)
        async with contextlib.aclosing(engine_task(self.engine, job, task)) as events:
            async for _ in events:
                pass
        return f"; exact cache: own prefill ({(time.perf_counter() - started) * 1e3:.0f} ms)" if not start else ""

    async def own_fill(self, job: GenerateJob, exact: SequenceKV) -> str:
        """The own prefill of the whole context into `exact` (an exact transfer's fallback)."""
        return await self._fill(job, exact, 0)

    async def _draft(
        self,
        job: GenerateJob,
        result: GenerateResult,
        draft: SequenceKV,
        filling: asyncio.Future,
        drafts: Drafts,
        first: Callable[[float], None],
    ) -> AsyncGenerator[TokenOut, None]:
        """Drafting: question and decode on the transferred cache until the drafts' tokens end
        the answer, the sampler's rows reach the request's cap, or the exact cache is complete
        (`filling`); under VERIFY_PROVISIONAL the drafts stream as they come."""
        started = time.perf_counter()
        task = Task(draft, list(job.question_ids), _ignore, drafts.sampler, job.max_new_tokens, job.stop_ids)
        try:
            async with contextlib.aclosing(engine_task(self.engine, job, task)) as events:
                async for items in events:
                    tokens = [item for item in items if not isinstance(item, Finished)]
                    if not drafts.greedy:  # only drafts whose row was kept can be checked
                        tokens = tokens[: max(0, len(drafts.sampler.rows) - len(drafts.ids))]
                    ids, text = drafts.ending.take(tokens)
                    if ids and not drafts.ids:
                        result.question_prefill_ms = (time.perf_counter() - started) * 1e3
                    drafts.ids += ids
                    if ids and job.verify == VERIFY_PROVISIONAL:
                        first(time.perf_counter())
                        yield TokenOut(ids, text)
                    if drafts.ending.reason:
                        break  # the drafts' own tokens end the answer
                    if drafts.sampler.limited and len(drafts.ids) == len(drafts.sampler.rows):  # every kept row drafted
                        drafts.note += f"; drafting stopped: draft rows reached verify_draft_bytes {drafts.sampler.cap}"
                        break
                    if filling.done() or isinstance(items[-1], Finished):
                        break  # the exact cache is complete: no more drafts (or the engine has no more)
        except DataLoss as exc:  # the transferred cache gives non-finite logits: drafting stops there
            drafts.note += "; drafting stopped: non-finite logits"
            log.warning("generate.draft_failed", mode=job.mode, reason=str(exc)[:200])

    def _accept(self, job: GenerateJob, drafts: Drafts, check: Task) -> tuple[int, int]:
        """On the engine thread (the frontend's, under --engine-process): the verification
        forward's kept rows (finite: the engine failed the task otherwise) -> (drafts that stand,
        next)."""
        k = len(drafts.ids)
        if drafts.greedy:
            return accept_greedy(drafts.ids, torch.cat(check.scores)[-(k + 1) :].tolist())  # [k + 1] argmax ids
        generator = torch.Generator().manual_seed((job.sampling.seed ^ ACCEPT_SEED) & SEED_MASK)
        return accept_sampled(drafts.ids, drafts.sampler.rows[:k], check.nuclei[-(k + 1) :], generator)

    async def _check(self, job: GenerateJob, exact: SequenceKV, drafts: Drafts) -> tuple[int, int]:
        """Acceptance: one forward over question + drafts on the exact cache, its kept rows read
        by the acceptance rule -> (drafts that stand, the exact model's token after them)."""
        k = len(drafts.ids)
        check = Task(exact, list(job.question_ids) + drafts.ids, _ignore, keep_logits=k + 1, keep_argmax=drafts.greedy)
        if not drafts.greedy:
            check.keep_nucleus = Sampler(job.sampling, self.loaded.device)  # p over its top-p support, as q
        async with contextlib.aclosing(engine_task(self.engine, job, check)) as events:
            async for _ in events:
                pass
        return await logs.run_in(self.engine, self._accept, job, drafts, check)

    async def answer(
        self,
        job: GenerateJob,
        result: GenerateResult,
        draft: SequenceKV,
        exact: SequenceKV,
        release: Callable[[SequenceKV], None],
        exact_from: int = 0,
        fill: Callable[[SequenceKV], Awaitable[str]] | None = None,
    ) -> AsyncGenerator[TokenOut | Commit | GenerateResult, None]:
        """Draft on `draft` (the transferred context, length T) while `exact` is filled: by `fill`
        when given (the pipeline's exact transfer, identical weights; it returns a note for
        verify_decision), else by the own prefill from `exact_from` (tokens the caller copied in
        from the prefix cache); verify; continue on `exact`. Yields token deltas (provisional ones
        and a Commit under VERIFY_PROVISIONAL), then the result. `release(draft)` once drafting
        stopped."""
        started = time.perf_counter()
        first_at: list[float] = []

        def first(at: float) -> None:
            if not first_at:
                first_at.append(at)
                result.ttft_ms = (at - job.received_at) * 1e3

        # (a context the prefix cache held whole was never streamed); a kept one stores its kept tokens
        draft.length = len(job.context_ids) - draft.dropped
        filling = asyncio.ensure_future(fill(exact) if fill is not None else self._fill(job, exact, exact_from))
        try:
            sampler = DraftSampler(job.sampling, self.loaded.device, job.verify_draft_bytes)
            drafts = Drafts(sampler, ending_of(self.loaded.tokenizer, job), [])
            if exact_from and fill is None:
                drafts.note = f"; exact cache: {exact_from} context tokens from the prefix cache"
            async with contextlib.aclosing(self._draft(job, result, draft, filling, drafts, first)) as provisional:
                async for delta in provisional:
                    yield delta
            release(draft)  # freed once the draft task has left the batch
            fill_note = await filling
            accepted, following = await self._check(job, exact, drafts)
            first(self._record(job, result, drafts, accepted, fill_note, started))
            async with contextlib.aclosing(self._deliver(job, result, exact, drafts, accepted, following)) as verified:
                async for item in verified:
                    yield item
            done = time.perf_counter()
            result.decode_ms = (done - first_at[0]) * 1e3
            result.total_ms = (done - job.received_at) * 1e3
            yield result
        finally:
            if not filling.done():
                filling.cancel()  # its engine task leaves the batch at the next iteration
            await asyncio.gather(filling, return_exceptions=True)

    async def _deliver(
        self, job: GenerateJob, result: GenerateResult, exact: SequenceKV, drafts: Drafts, accepted: int, following: int
    ) -> AsyncGenerator[TokenOut | Commit, None]:
        """Delivery and continuation: the verified tokens (the accepted drafts, then the exact
        model's token unless they end the answer) as one Commit or TokenOut; then, unless they
        ended it, the pipeline's decode loop (consumer.request.decode) on the exact cache from the last."""
        exact.length = len(job.context_ids) + len(job.question_ids) + accepted  # rejected drafts: overwritten from here
        ending = ending_of(self.loaded.tokenizer, job)
        verified, text = ending.take(drafts.ids[:accepted] + [following])
        if job.verify == VERIFY_PROVISIONAL:
            yield Commit(accepted, verified[accepted:], text)
        else:
            yield TokenOut(verified, text)
        result.generated_tokens = len(verified)
        if ending.reason:
            rest = ending.flush()
            if rest:
                yield TokenOut([], rest)
            result.finish_reason = ending.reason
            return
        s = job.sampling
        cont = Sampler(Sampling(s.temperature, s.top_p, (s.seed ^ CONTINUE_SEED) & SEED_MASK), self.loaded.device)
        task = Task(exact, [verified[-1]], _ignore, cont, job.max_new_tokens, job.stop_ids, generated=len(verified))
        async with contextlib.aclosing(decode(self.engine, job, result, task, ending)) as out:
            async for item in out:
                yield item

    @staticmethod
    def _record(job: GenerateJob, result: GenerateResult, drafts: Drafts, accepted: int, fill_note: str, started: float) -> float:
        """The check's outcome into the stats and the log; the time it was known."""
        now = time.perf_counter()
        k = len(drafts.ids)
        result.drafted_tokens, result.accepted_tokens = k, accepted
        result.time_to_verified_ms = (now - job.received_at) * 1e3
        result.verify_ms = (now - started) * 1e3
        replaced = f", draft {accepted + 1} replaced" if accepted < k else ""
        result.verify_decision = f"verified: {accepted} of {k} drafts accepted{replaced}{fill_note}{drafts.note}"
        log.info("generate.verified", drafted=k, accepted=accepted, exact_cache=fill_note.removeprefix("; exact cache: "))
        return now
