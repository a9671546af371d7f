"""The consumer's batch engine: one thread owns the compute device and, each iteration, advances
every admitted request by one batched forward (continuous batching).

An iteration:
  1. runs the jobs queued since the last forward, in order (a codec's layer rebuild, a cache
     audit, a prefix-cache insert or make-room; again between the forwards of one iteration): the
     engine is also the device's only executor, so nothing else ever touches the pool or the model.
     Grouped jobs (`submit_grouped`: several requests' layer rebuilds) queued one after another with
     the same function run as one call over all their items. At the iteration boundary, tasks
     that finished or were cancelled leave the batch; then, there and between forwards, the
     releases asked for sequences no task in the batch uses any more are carried out and the
     pool's dropped blocks are zeroed and freed (`KVPool.reclaim`): a block is freed only after
     every task that may write it has left the batch (a task cancelled during an iteration stays
     in it, and may still be in a later forward of it, until the boundary);
  2. prefill: requests with tokens still to prefill (a local context prefill or a question),
     oldest first, each taking at most `prefill_chunk` tokens, together at most
     `max_batch_tokens` and `max_batch` rows (chunked prefill: a long local prefill never stops
     the batch, it takes one chunk per iteration);
  3. decode: requests with a sampled token to feed, up to `max_batch` rows, taken round-robin
     when there are more.
On the engine's runner (consumer.engine.pool_forward: flat rows, nothing padded) the prefill chunks
and the decode rows of an iteration are one forward when they fit in `max_batch` rows (one pass
over the weights per iteration); else the prefill rows are one forward and the decode rows
another. A padding runner (the Hugging Face reference, tests) packs the prefill rows into as few
forwards as keep the padding of ragged rows under 2x (`pack`), then runs one decode forward.
A prefill task may keep the logits of its last positions (`keep_logits`; only their argmax ids
with `keep_argmax`, only the nucleus a sampler draws from with `keep_nucleus`): verified
decoding's one forward over question + drafted tokens (consumer.exact.verify) is such a prefill row,
chunked and batched like any other; a kept row that is not finite fails it (DataLoss).
Requests join and leave between iterations. A request's rows sample with its own settings and
stop ids; a row whose logits are not finite fails alone (DataLoss), the rest of the batch goes
on. A cancelled request leaves at the next iteration. `max_batch = 1` gives one row per forward,
interleaved round-robin: the behaviour before batching, kept as the comparison baseline.

Liveness comes from progress (shared.liveness): each iteration is one `Progress.iteration()`
that beats after every job and forward; the server's watchdog flags only an iteration that has not
advanced for longer than its bound, never work waiting in the queue.

Knows nothing about gRPC, codecs or transfers; results go back to asyncio through callbacks.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from consumer.engine.decoding import Sampler
from consumer.engine.kv_pool import KVPool, SequenceKV
from consumer.engine.pool_forward import PoolRunner
from consumer.engine.rows import Row
from consumer.engine.speculative import Nucleus
from shared import liveness, logs, torch_threads
from shared.errors import DataLoss, ServiceError
from shared.finite import rows_finite
from shared.models import LoadedModel

log = logs.get("consumer.engine.batch")

Sink = Callable[[Any], None]  # called on the engine thread with a token id (int), a Finished or an exception


@dataclass
class Finished:
    reason: str  # "length" | "stop" | "filled" (a prefill without sampling)


@dataclass(eq=False)
class Task:
    seq: SequenceKV
    pending: list[int]  # tokens still to feed: prefill tokens, or the last sampled token
    sink: Sink
    sampler: Sampler | None = None  # None: prefill only (fill the cache, sample nothing)
    max_new: int = 0
    stop_ids: frozenset[int] = frozenset()
    generated: int = 0
    cancelled: bool = False  # the frontend asked it to leave (any thread)
    done: bool = False  # it finished (engine thread): its outcome was sent
    # > 0: keep the logits after each of the last `keep_logits` fed tokens (verified decoding's one
    # forward over question + drafts, consumer.exact.verify): chunks of [n, vocab] float32 in `scores`,
    # complete when the task's Finished arrives (written on the engine thread before it is sent).
    # A kept row that is not finite fails the task (DataLoss)
    keep_logits: int = 0
    keep_argmax: bool = False  # keep each kept row's argmax id ([n] chunks) instead: greedy needs no more
    scores: list[torch.Tensor] = field(default_factory=list)
    # or keep each kept row as the distribution this sampler draws from, over its top-p support
    # (consumer.engine.speculative.Nucleus, in `nuclei`): what sampled acceptance reads, not [vocab] rows
    keep_nucleus: Sampler | None = None
    nuclei: list[Nucleus] = field(default_factory=list)
    # called on the engine thread after each forward that fed some of its prompt, with how many prompt
    # tokens are still to feed (the pipeline times a context prefilled in the question's task); the
    # engine process does not relay it
    on_fed: Callable[[int], None] | None = None

    @property
    def decoding(self) -> bool:
        return self.generated > 0

    @property
    def leaving(self) -> bool:
        """Leaves the batch at the next iteration boundary: finished or cancelled."""
        return self.cancelled or self.done


# tests only (consumer.request.engine_stream): called with a task, its post and each item in place of the
# post, on the thread that delivers it; it may post the item now, later, from any thread, or never
# (tests force the order in which a reader sees a task's last token and its Finished)
PostHook = Callable[[Task, Sink, Any], None]


@dataclass
class EngineStats:
    forwards: int = 0
    rows: int = 0  # summed over forwards
    last_batch: int = 0
    max_batch_seen: int = 0  # the most rows one forward has had
    scratch_bytes: int = 0  # the runner's gather buffers now
    failed_rows: int = 0


@dataclass(eq=False)
class Job:
    future: concurrent.futures.Future
    fn: Callable[[], Any] | None = None  # a job on its own
    many: Callable[[list[Any]], list[Any]] | None = None  # or a grouped job: many(items) -> a result or exception per item
    item: Any = None


def pack(rows: list[tuple[Task, int]]) -> list[list[tuple[Task, int]]]:
    """Prefill rows (task, tokens) grouped into forwards whose right-padding at most doubles the
    work: a 512-token chunk of a local prefill and ten 5-token questions are two forwards, not one
    of 11 x 512 query positions."""
    groups: list[list[tuple[Task, int]]] = []
    total = 0
    for row in sorted(rows, key=lambda r: -r[1]):
        if groups and (len(groups[-1]) + 1) * groups[-1][0][1] <= 2 * (total + row[1]):
            groups[-1].append(row)
            total += row[1]
        else:
            groups.append([row])
            total = row[1]
    return groups


def split_gather(rows: list[tuple[Task, int]], block_tokens: int, limit: int) -> list[list[tuple[Task, int]]]:
    """Rows (task, tokens) split into forwards that each gather at most `limit` blocks (rows x the
    longest row's blocks, the runner's scratch bound): one long row beside many short ones is its
    own forward instead of padding every short row to its length. In order of blocks read."""
    if not rows:
        return []

    def blocks(row: tuple[Task, int]) -> int:
        return -(-(row[0].seq.length + row[1]) // block_tokens)

    groups: list[list[tuple[Task, int]]] = []
    for row in sorted(rows, key=blocks):
        if groups and (len(groups[-1]) + 1) * blocks(row) <= limit:
            groups[-1].append(row)
        else:
            groups.append([row])
    return groups


# The model runner: our own forward with attention over the pool in place (consumer.engine.pool_forward).
# Tests pass the Hugging Face reference (consumer.engine.hf_reference.Runner) to compare with it; no
# serving path can select it.
Forward = Any  # a runner class: (loaded, pool) -> forward(rows), scratch_limit_blocks, scratch_bytes


class BatchEngine(concurrent.futures.Executor):
    def __init__(
        self,
        loaded: LoadedModel,
        pool: KVPool,
        max_batch: int = 32,
        prefill_chunk: int = 512,
        max_batch_tokens: int = 2048,
        progress: liveness.Progress | None = None,
        after_iteration: Callable[[], None] | None = None,
        runner: Forward = PoolRunner,
    ):
        if max_batch < 1 or prefill_chunk < 1 or max_batch_tokens < 1:
            raise ValueError("max_batch, prefill_chunk and max_batch_tokens: must be >= 1")
        self.loaded, self.pool = loaded, pool
        self.runner = runner(loaded, pool)
        self.max_batch, self.prefill_chunk, self.max_batch_tokens = max_batch, prefill_chunk, max_batch_tokens
        self.jobs: collections.deque[Job] = collections.deque()
        self.tasks: list[Task] = []  # admitted to the engine, in arrival order
        self._incoming: list[Task] = []
        self._releasing: list[tuple[SequenceKV, concurrent.futures.Future]] = []  # asked, not yet safe
        self._cv = threading.Condition()
        self._stopping = False
        self._rr = 0  # round-robin offset over decode rows
        self.stats = EngineStats()
        self.progress = progress or liveness.Progress("consumer-engine")
        self.after_iteration = after_iteration  # called on the engine thread at the end of every iteration
        self.post_hook: PostHook | None = None  # tests: see PostHook
        pool.on_dirty = self._wake  # dropped blocks: reclaim them at the next boundary
        self._thread = threading.Thread(target=self._loop, name="consumer-engine", daemon=True)
        self._thread.start()

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify()

    # --- the asyncio side's surface (any thread) -------------------------------------------------

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:  # type: ignore[override]
        """Run fn on the engine thread before the next forward (an Executor, for logs.run_in)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if self._stopping:
                raise RuntimeError("engine stopped")
            self.jobs.append(Job(future, fn=lambda: fn(*args, **kwargs)))
            self._cv.notify()
        return future

    def submit_grouped(self, many: Callable[[list[Any]], list[Any]], item: Any) -> concurrent.futures.Future:
        """Run `many([item, ...])` on the engine thread before the next forward, with the items of
        the grouped jobs of the same `many` queued right before or after this one (one call for
        all: a batched rebuild). `many` returns, per item in order, its result or an exception
        instance, which becomes that item's future's exception."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if self._stopping:
                raise RuntimeError("engine stopped")
            self.jobs.append(Job(future, many=many, item=item))
            self._cv.notify()
        return future

    def add(self, task: Task) -> Task:
        if not task.pending:
            raise ValueError("a task needs tokens to feed")
        with self._cv:
            self._incoming.append(task)
            self._cv.notify()
        return task

    def cancel(self, task: Task) -> None:
        task.cancelled = True
        with self._cv:
            self._cv.notify()

    def holds(self, task: Task) -> bool:
        """Whether task is still incoming or admitted: a forward may still read or write its blocks."""
        with self._cv:
            return any(t is task for t in self._incoming) or any(t is task for t in self.tasks)

    def release(self, seq: SequenceKV) -> concurrent.futures.Future:
        """Free seq's blocks (an intent, any thread): after the jobs queued before it, at the first
        iteration boundary where no task in the batch uses seq (a cancelled task may still be in the
        forward being run, or in a later prefill group of this iteration); zeroed and freed there
        with the other releases of that boundary. The future is done once they are free."""
        freed: concurrent.futures.Future = concurrent.futures.Future()

        def ask() -> None:
            self._releasing.append((seq, freed))

        self.submit(ask)  # in order with the jobs before it (a prefix-cache insert holds first)
        return freed

    def _settle_releases(self) -> None:
        """The releases whose sequence no admitted or incoming task uses any more (engine thread,
        between forwards): a task that finished or was cancelled still counts until it left the
        batch at an iteration boundary."""
        if not self._releasing:
            return
        with self._cv:
            busy = {id(t.seq) for t in self.tasks} | {id(t.seq) for t in self._incoming}
        ready = [(seq, f) for seq, f in self._releasing if id(seq) not in busy]
        if not ready:
            return
        self._releasing = [(seq, f) for seq, f in self._releasing if id(seq) in busy]
        self.pool.release_many([seq for seq, _ in ready])
        self.pool.reclaim()
        for _, freed in ready:
            freed.set_result(None)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if wait:
            self._thread.join(timeout=10)

    # --- the engine thread -----------------------------------------------------------------------

    def _loop(self) -> None:
        torch_threads.name_os_thread(self._thread.name)  # per-thread CPU (/proc, top -H, bench.harness.cpu_stages) names it
        while True:
            with self._cv:
                while not (self._stopping or self.jobs or self._incoming or self._runnable() or self._reclaim_due()):
                    self._cv.wait(timeout=1.0)
                if self._stopping:
                    break
                self.tasks.extend(self._incoming)
                self._incoming.clear()
            try:
                with self.progress.iteration():
                    self._run_jobs()
                    self._drop_leaving()
                    self._settle_releases()
                    self.pool.reclaim()
                    self._step()
            except Exception as exc:  # a forward that failed as a whole fails every row in it
                log.error("engine.iteration_failed", error=f"{type(exc).__name__}: {str(exc)[:300]}")
                for task in self.tasks:
                    task.sink(exc)
                self.tasks.clear()
            if self.after_iteration is not None:
                self.after_iteration()
        for job in self.jobs:
            job.future.cancel()
        for seq, freed in self._releasing:  # stopped: no forward runs on the pool any more
            self.pool.release(seq)
            freed.set_result(None)
        self._releasing.clear()

    def _run_jobs(self) -> None:
        """The jobs queued until now, in order (run at every forward boundary, so a rebuild or a
        release waits for at most one forward); a run of grouped jobs of one function, one call."""
        with self._cv:
            jobs = list(self.jobs)
            self.jobs.clear()
        i = 0
        while i < len(jobs):
            job = jobs[i]
            if job.many is None:
                if job.future.set_running_or_notify_cancel():
                    assert job.fn is not None
                    try:
                        job.future.set_result(job.fn())
                    except BaseException as exc:  # handed to the caller
                        job.future.set_exception(exc)
                i += 1
            else:
                end = i + 1
                while end < len(jobs) and jobs[end].many == job.many:
                    end += 1
                self._run_group(jobs[i:end])
                i = end
            self.progress.beat()

    @staticmethod
    def _run_group(jobs: list[Job]) -> None:
        live = [job for job in jobs if job.future.set_running_or_notify_cancel()]
        if not live:
            return
        assert live[0].many is not None
        try:
            results = live[0].many([job.item for job in live])
            if len(results) != len(live):
                raise RuntimeError(f"a grouped job gave {len(results)} results for {len(live)} items")
        except BaseException as exc:  # the call as a whole failed: every item's caller hears it
            for job in live:
                job.future.set_exception(exc)
            return
        for job, result in zip(live, results):
            if isinstance(result, BaseException):
                job.future.set_exception(result)
            else:
                job.future.set_result(result)

    def _runnable(self) -> bool:
        return any(t.pending and not t.leaving for t in self.tasks) or any(t.leaving for t in self.tasks)

    def _reclaim_due(self) -> bool:
        return bool(self.pool.reclaimable_blocks) or bool(self._releasing and not self.tasks)

    def _drop_leaving(self) -> None:
        if any(t.leaving for t in self.tasks):
            self.tasks = [t for t in self.tasks if not t.leaving]

    def _step(self) -> None:
        prefill: list[tuple[Task, int]] = []
        budget = self.max_batch_tokens
        for task in self.tasks:
            if len(prefill) >= self.max_batch or budget <= 0:
                break
            if task.pending and not task.decoding and not task.leaving:
                take = min(len(task.pending), self.prefill_chunk, budget)
                prefill.append((task, take))
                budget -= take
        flat = getattr(self.runner, "flat", False)  # rows side by side, nothing padded (the pool forward)
        if flat and prefill:
            decode = self._decode_rows()
            if len(prefill) + len(decode) <= self.max_batch:
                # one forward: every prefill chunk beside every decode row (one pass over the weights
                # per iteration, as vLLM's mixed batches); a row that ends its prefill here decodes next
                self._forward(prefill + [(t, 1) for t in decode])
                self._run_jobs()
                self._settle_releases()
                return
        for group in ([prefill] if prefill else []) if flat else pack(prefill):
            group = [(task, take) for task, take in group if not task.leaving]  # cancelled meanwhile
            for part in split_gather(group, self.pool.block_tokens, self.runner.scratch_limit_blocks):
                self._forward(part)
            self._run_jobs()
            # releases of sequences no task in the batch uses (their task left at an earlier
            # boundary): safe between forwards; a cancelled task's still wait for the boundary
            self._settle_releases()
        decode = self._decode_rows()
        for part in split_gather([(t, 1) for t in decode], self.pool.block_tokens, self.runner.scratch_limit_blocks):
            self._forward(part)

    def _decode_rows(self) -> list[Task]:
        """Requests with a sampled token to feed, at most max_batch, round-robin when there are more."""
        decode = [t for t in self.tasks if t.decoding and t.pending and not t.leaving]
        if len(decode) > self.max_batch:
            start = self._rr % len(decode)
            decode = (decode[start:] + decode[:start])[: self.max_batch]
            self._rr += self.max_batch
        return decode

    @staticmethod
    def _scored(task: Task, take: int) -> int:
        """How many of this chunk's `take` positions fall among the task's last `keep_logits`."""
        after = len(task.pending) - take  # tokens still to feed after this chunk
        return min(take, task.keep_logits - after) if task.keep_logits > after else 0

    def _forward(self, chosen: list[tuple[Task, int]]) -> None:
        rows = [Row(task.seq, task.pending[:take], task.seq.length, self._scored(task, take)) for task, take in chosen]
        logits = self.runner.forward(rows)  # [B, vocab]
        self.progress.beat()
        self.stats.forwards += 1
        self.stats.rows += len(rows)
        self.stats.last_batch = len(rows)
        self.stats.max_batch_seen = max(self.stats.max_batch_seen, len(rows))
        self.stats.scratch_bytes = self.runner.scratch_bytes
        finite = rows_finite(logits).tolist()  # shared.finite: isfinite() alone costs more than a small forward
        greedy = torch.argmax(logits, dim=1).tolist()
        for i, (task, take) in enumerate(chosen):
            kept = rows[i].logits
            if kept is not None and not self._keep(task, kept):
                continue
            del task.pending[:take]
            if task.on_fed is not None and not task.decoding:
                task.on_fed(len(task.pending))
            if task.pending:
                continue  # more prefill chunks to come: no sampling yet
            if task.sampler is None:
                self._finish(task, Finished("filled"))
                continue
            if not finite[i]:
                self.stats.failed_rows += 1
                self._finish(task, DataLoss("the rebuilt cache gives non-finite logits (corrupt or out-of-range values)"))
                continue
            try:
                token = greedy[i] if task.sampler.plain else task.sampler(logits[i])  # plain: greedy, nothing to process or keep
            except Exception as exc:  # one row's sampling (its own parameters) fails that row only
                self.stats.failed_rows += 1
                log.error("engine.sampling_failed", error=f"{type(exc).__name__}: {str(exc)[:300]}")
                self._finish(task, ServiceError(f"sampling failed: {type(exc).__name__}"))
                continue
            task.generated += 1
            task.sink(token)
            if token in task.stop_ids:
                self._finish(task, Finished("stop"))
            elif task.generated >= task.max_new:
                self._finish(task, Finished("length"))
            else:
                task.pending = [token]

    def _keep(self, task: Task, kept: torch.Tensor) -> bool:
        """A chunk's kept logits into task.scores (their argmax ids under keep_argmax), or their
        nuclei into task.nuclei (keep_nucleus); False when one row is not finite: the task failed
        (DataLoss), since the acceptance would read it."""
        if not bool(rows_finite(kept).all()):
            self.stats.failed_rows += 1
            self._finish(task, DataLoss("the exact cache gives non-finite logits"))
            return False
        if task.keep_nucleus is not None:
            task.nuclei += [Nucleus.of(*task.keep_nucleus.nucleus(row), kept.shape[-1]) for row in kept]
        else:
            task.scores.append(torch.argmax(kept, dim=-1) if task.keep_argmax else kept)
        return True

    def _finish(self, task: Task, outcome: Any) -> None:
        task.done = True  # leaves at the next iteration boundary
        task.pending = []
        task.sink(outcome)
