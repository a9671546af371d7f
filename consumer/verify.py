"""Verified decoding (VeriCache's idea; docs/design.md, "Verified decoding"): answer from the
transferred cache at once (drafts) while the consumer builds the exact cache, its own prefill of
the context, chunked inside the engine's batches into a second set of blocks that admission
reserved together with the first (consumer.pipeline). When the exact cache is complete, one
forward over question + drafts on it (a prefill task that keeps the logits of its last k + 1
positions, consumer.batch) checks every draft: the longest agreeing prefix stands, the first
disagreement is replaced by the exact model's token (all agreeing: the exact model's next token
follows), and decoding continues on the exact cache. The draft blocks go back as soon as the
drafting stops.

Greedy: a draft stands when it is the exact model's argmax, so the answer is the oracle's token
for token. Sampling: the speculative-sampling rule (Leviathan et al.; Chen et al.): draft x stands
with probability min(1, p(x) / q(x)); at the first rejection the token is drawn from
norm(max(0, p - q)); after all stand the next is drawn from p. p is the exact model's
distribution, q the draft's, both after temperature and top-p, so every token's distribution is
the oracle's. (A seed no longer fixes the tokens: how many drafts there are depends on timing.)

Delivery: VERIFY_VERIFIED streams verified tokens only (the first ones when the drafts are
checked); VERIFY_PROVISIONAL streams drafts as they come, then one `Commit` (how many of them
stand, the tokens that follow instead of the rest, the verified text), then verified tokens only.

The engine alone runs forwards and writes or frees blocks: this module hands it tasks and one job
(the acceptance, on the engine thread beside the kept rows). With `--engine-process` the tasks run
in the engine's process and the acceptance on the frontend's job thread, over the rows that
process sends back (consumer.engine_process: the drafts' q rows, the check's kept rows): the same
functions either way. Knows nothing about gRPC, codecs or the prefix cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import torch

from consumer.batch import BatchEngine, Finished, Task
from consumer.decoding import Detokenizer, Sampler, Sampling
from consumer.engine_process import EngineProcess
from consumer.engine_stream import engine_task
from consumer.kv_pool import SequenceKV
from consumer.request import VERIFY_PROVISIONAL, Commit, GenerateJob, GenerateResult, TokenOut
from shared import logs
from shared.errors import DataLoss
from shared.models import LoadedModel

log = logs.get("consumer.verify")
SEED_MASK = (1 << 63) - 1
ACCEPT_SEED = 0x5EED_0ACC  # the acceptance's draws: a stream apart from the drafts' ...
CONTINUE_SEED = 0xC0_4714  # ... and from the continuation's on the exact cache


def _ignore(_: Any) -> None:
    pass


class DraftSampler(Sampler):
    """A Sampler that keeps the distribution each draft token was drawn from (q), in order (engine
    thread; under --engine-process the child's copy sends each row to this one, which keeps it);
    greedy drafts keep nothing."""

    def __init__(self, sampling: Sampling, device: torch.device):
        super().__init__(sampling, device)
        self.drawn: list[torch.Tensor] = []  # [vocab] each

    def __call__(self, logits: torch.Tensor) -> int:
        if self.generator is None:
            return int(torch.argmax(logits))
        probs = self.probs(logits)
        self.drawn.append(probs)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def accept_greedy(drafts: list[int], exact: list[int]) -> tuple[int, int]:
    """exact: k + 1 ids, i the exact model's argmax after the question and drafts[:i]. Returns
    (how many drafts in a row are its argmax, its argmax at the first that is not, or after all)."""
    accepted = next((i for i, d in enumerate(drafts) if exact[i] != d), len(drafts))
    return accepted, exact[accepted]


def accept_sampled(drafts: list[int], q: list[torch.Tensor], p: torch.Tensor, generator: torch.Generator) -> tuple[int, int]:
    """The speculative-sampling rule. p [k + 1, vocab]: the exact model's distributions (row i
    after drafts[:i]); q: the k distributions the drafts were drawn from (unnormalized is fine).
    Returns (drafts that stand, the token that follows them)."""
    p = p / p.sum(dim=-1, keepdim=True)
    for i, d in enumerate(drafts):
        qi = q[i] / q[i].sum()
        u = float(torch.rand((), generator=generator))
        if u * float(qi[d]) < float(p[i, d]):  # u < p(d) / q(d); q(d) > 0: d was drawn from it
            continue
        residual = (p[i] - qi).clamp(min=0)  # [vocab]
        dist = residual if float(residual.sum()) > 0 else p[i]
        return i, int(torch.multinomial(dist, 1, generator=generator))
    return len(drafts), int(torch.multinomial(p[-1], 1, generator=generator))


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

    def _accept(self, job: GenerateJob, drafts: list[int], sampler: DraftSampler, check: Task) -> tuple[int, int]:
        """On the engine thread (the frontend's, under --engine-process): the verification
        forward's kept rows (finite: the engine failed the task otherwise) -> (drafts that stand,
        next)."""
        k = len(drafts)
        kept = torch.cat(check.scores)[-(k + 1) :]  # [k + 1] argmax ids (greedy) or [k + 1, vocab] logits
        if sampler.generator is None:
            return accept_greedy(drafts, kept.tolist())
        p = torch.stack([sampler.probs(row) for row in kept]).cpu()
        generator = torch.Generator().manual_seed((job.sampling.seed ^ ACCEPT_SEED) & SEED_MASK)
        return accept_sampled(drafts, [q.cpu() for q in sampler.drawn[:k]], p, generator)

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
        tokenizer, M = self.loaded.tokenizer, job.max_new_tokens
        base = len(job.context_ids) + len(job.question_ids)
        started = time.perf_counter()
        first_at: list[float] = []

        def first(at: float) -> None:
            if not first_at:
                first_at.append(at)
                result.ttft_ms = (at - job.received_at) * 1e3

        draft.length = len(job.context_ids)  # (a context the prefix cache held whole was never streamed)
        filling = asyncio.ensure_future(fill(exact) if fill is not None else self._fill(job, exact, exact_from))
        try:
            sampler = DraftSampler(job.sampling, self.loaded.device)
            drafting = Task(draft, list(job.question_ids), _ignore, sampler, M, job.stop_ids)
            drafts: list[int] = []
            drafted_to = ""  # the draft's own finish ("stop" | "length"), when it got there
            note = f"; exact cache: {exact_from} context tokens from the prefix cache" if exact_from and fill is None else ""
            provisional = Detokenizer(tokenizer)
            try:
                async with contextlib.aclosing(engine_task(self.engine, job, drafting)) as events:
                    async for items in events:
                        ids = [item for item in items if not isinstance(item, Finished)]
                        if ids and not drafts:
                            result.question_prefill_ms = (time.perf_counter() - started) * 1e3
                        drafts += ids
                        if ids and job.verify == VERIFY_PROVISIONAL:
                            first(time.perf_counter())
                            yield TokenOut(ids, provisional.push_many(ids))
                        last = items[-1]
                        if isinstance(last, Finished):
                            drafted_to = last.reason
                            break
                        if filling.done():
                            break  # the exact cache is complete: no more drafts
            except DataLoss as exc:  # the transferred cache gives non-finite logits: drafting stops there
                note += "; drafting stopped: non-finite logits"
                log.warning("generate.draft_failed", mode=job.mode, reason=str(exc)[:200])
            release(draft)  # freed once the draft task has left the batch
            fill_note = await filling
            note = fill_note + note

            k = len(drafts)
            greedy = sampler.generator is None
            check = Task(exact, list(job.question_ids) + drafts, _ignore, keep_logits=k + 1, keep_argmax=greedy)
            async with contextlib.aclosing(engine_task(self.engine, job, check)) as events:
                async for _ in events:
                    pass
            accepted, following = await logs.run_in(self.engine, self._accept, job, drafts, sampler, check)
            exact.length = base + accepted  # later positions held rejected drafts: overwritten from here
            verified = drafts[:accepted]
            finish = drafted_to if accepted == k else ""
            if not finish:
                verified.append(following)
                finish = "stop" if following in job.stop_ids else "length" if len(verified) >= M else ""
            now = time.perf_counter()
            result.drafted_tokens, result.accepted_tokens = k, accepted
            result.time_to_verified_ms = (now - job.received_at) * 1e3
            result.verify_ms = (now - started) * 1e3
            replaced = f", draft {accepted + 1} replaced" if accepted < k else ""
            result.verify_decision = f"verified: {accepted} of {k} drafts accepted{replaced}{note}"
            log.info("generate.verified", drafted=k, accepted=accepted, exact_cache=fill_note.removeprefix("; exact cache: "))

            detok = Detokenizer(tokenizer)
            text = detok.push_many(verified)
            first(now)
            if job.verify == VERIFY_PROVISIONAL:
                yield Commit(accepted, verified[accepted:], text)
            else:
                yield TokenOut(verified, text)
            result.generated_tokens = len(verified)
            if not finish:  # decoding continues on the exact cache, from the last verified token
                cont = Sampler(
                    Sampling(job.sampling.temperature, job.sampling.top_p, (job.sampling.seed ^ CONTINUE_SEED) & SEED_MASK),
                    self.loaded.device,
                )
                task = Task(exact, [verified[-1]], _ignore, cont, M, job.stop_ids, generated=len(verified))
                async with contextlib.aclosing(engine_task(self.engine, job, task, job.stream_interval)) as events:
                    async for items in events:
                        ids = [item for item in items if not isinstance(item, Finished)]
                        if ids:
                            result.generated_tokens += len(ids)
                            yield TokenOut(ids, detok.push_many(ids))
                        if isinstance(items[-1], Finished):
                            finish = items[-1].reason
                            break
            rest = detok.flush()
            if rest:
                yield TokenOut([], rest)
            done = time.perf_counter()
            result.finish_reason = finish or "length"
            result.decode_ms = (done - first_at[0]) * 1e3
            result.total_ms = (done - job.received_at) * 1e3
            yield result
        finally:
            if not filling.done():
                filling.cancel()  # its engine task leaves the batch at the next iteration
            await asyncio.gather(filling, return_exceptions=True)
