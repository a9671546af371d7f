"""The batch engine in a process of its own (`--engine-process`): the frontend/engine split.

In one process the consumer's asyncio side (gRPC, stream checks, codec rebuilds, admission, the
prefix cache) and its batch engine (consumer.engine.batch: forwards and sampling) share one interpreter
lock. With a small model both are mostly Python, and the process runs at about one core however
many the host has. With `--engine-process` the engine runs in a child process:

- The KV pool lives in shared memory (`KVPool.share` / `KVPool.attach`). The frontend rebuilds a
  request's layers into its blocks; the child's forwards read and extend them. Nothing is copied
  between the two.
- The frontend owns allocation, admission, the prefix cache and every job that is not a forward:
  rebuilds, audits, copies and releases. They run on a local BatchEngine that is given no tasks
  (its job thread, grouped as in process). The child runs tasks only.
- One pipe. The frontend sends add / cancel / stop. After each iteration the child sends what its
  tasks produced (token ids; a Finished with the sequence's new length; errors), the tasks that
  left its batch after a cancel, and its counters.
- Verified decoding (consumer.exact.verify) drafts, checks and continues in the child like any task;
  its acceptance stays in the frontend (one implementation) and reads what the child sends beside
  the item that completes it, once: with each sampled draft token the distribution it was drawn
  from (a DraftSampler, named by class in the add), with the verification task's Finished its
  kept rows (k + 1 argmax ids when greedy, the exact model's k + 1 distributions when sampling),
  each distribution over its top-p support only (consumer.engine.speculative.Nucleus). A kept row that
  is not finite fails the task in the child (DataLoss), as in process. A request that asked for
  log-probabilities gets each sampled id's TokenLogprobs beside it the same way.
- A request's blocks are freed only once the child has said its task left. A cancelled task may
  still be in the forward being run, and freed blocks are handed to the next request.
- Liveness: the child's Progress lives in shared memory (`SharedProgress`), and the frontend's
  watchdog reads it. A child that exits reads as stalled for ever (NOT_SERVING). Every request it
  held fails UNAVAILABLE.

The frontend keeps its own copy of the model: Patch layers, recompute spans and audits run there.
The child loads the same weights. Knows nothing about gRPC.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import itertools
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.multiprocessing as mp

from consumer.engine.batch import BatchEngine, EngineStats, Finished, PostHook, Task
from consumer.engine.decoding import Sampler, TokenLogprobs
from consumer.engine.kv_pool import KVPool, SequenceKV
from consumer.engine.pool_forward import PoolRunner
from consumer.engine.speculative import DraftSampler, Nucleus
from shared import liveness, logs, torch_threads
from shared.errors import ServiceError, Unavailable
from shared.models import LoadedModel, load_model, warm_up

log = logs.get("consumer.engine.process")
START_TIMEOUT_S = 600.0  # the child loads the model: as long as a service start may take


class SharedProgress(liveness.Progress):
    """A Progress whose state is a shared float64 tensor [active iterations, last progress
    (time.monotonic, the same clock in every process), iterations done]: the engine process
    advances it, the frontend's watchdog reads it. `dead` (frontend): the process exited."""

    def __init__(self, name: str, state: torch.Tensor | None = None):
        super().__init__(name)
        if state is None:
            state = torch.zeros(3, dtype=torch.float64).share_memory_()
            state[1] = time.monotonic()
        self.state = state
        self.dead = False

    @contextlib.contextmanager
    def iteration(self) -> Iterator[None]:
        self.state[0] += 1
        self.state[1] = time.monotonic()
        try:
            yield
        finally:
            self.state[0] -= 1
            self.state[1] = time.monotonic()
            self.state[2] += 1

    def beat(self) -> None:
        self.state[1] = time.monotonic()

    def stalled_s(self) -> float:
        if self.dead:
            return float("inf")
        active, last = self.state[0].item(), self.state[1].item()
        return time.monotonic() - last if active else 0.0


def check_shm(pool: KVPool, path: str = "/dev/shm") -> None:
    """A CPU pool about to move to shared memory must fit there (a container's /dev/shm is 64 MB
    by default): ValueError naming both sizes, instead of a bus error at the first write."""
    if pool.device.type != "cpu":
        return
    need = pool.k.nbytes + pool.v.nbytes
    try:
        stat = os.statvfs(path)
    except OSError:
        return  # no such mount: torch's own strategy decides
    free = stat.f_bavail * stat.f_frsize
    if need > free:
        raise ValueError(
            f"engine_process: the KV pool ({need} bytes of K and V) does not fit {path} ({free} bytes free);"
            " raise the container's shm_size or lower kv_pool_bytes"
        )


def _portable(item: Any) -> Any:
    """An engine outcome the pipe can carry: service errors keep their class, any other
    exception becomes a RuntimeError naming it."""
    if isinstance(item, BaseException) and not isinstance(item, ServiceError):
        return RuntimeError(f"{type(item).__name__}: {str(item)[:300]}")
    return item


def _rows(task: Task, item: Any) -> Any:
    """Child: what verified decoding reads in the frontend, sent once beside the item that
    completes it: a sampled draft token's Nucleus (handed on: the child keeps none), a sampled
    id's log-probabilities when the request asked (a TokenLogprobs), a verification task's kept
    rows with its Finished (argmax ids, or one Nucleus per row); None for everything else. As
    numpy arrays: pickled by value, no shared-memory handle per tensor."""
    if isinstance(item, int) and isinstance(task.sampler, DraftSampler):
        row = task.sampler.take()
        return None if row is None else (row.probs, row.ids, row.vocab)
    if isinstance(item, int) and task.sampler is not None and task.sampler.kept:
        return task.sampler.kept.pop()  # the log-probabilities the request asked for (a TokenLogprobs)
    if isinstance(item, Finished) and task.keep_logits:
        if task.keep_nucleus is not None:
            return [(row.probs, row.ids, row.vocab) for row in task.nuclei]
        if task.scores:
            return torch.cat(task.scores).cpu().numpy()
    return None


def _take_rows(task: Task, item: Any, rows: Any) -> None:
    """Frontend: the rows `_rows` sent, where the in-process engine would have left them (a draft
    row counted against its request's cap by the frontend's DraftSampler)."""
    if isinstance(item, Finished):
        if isinstance(rows, list):
            task.nuclei = [Nucleus(*row) for row in rows]
        else:
            task.scores = [torch.from_numpy(rows)]
    elif isinstance(rows, TokenLogprobs):
        assert task.sampler is not None
        task.sampler.kept.append(rows)
    elif isinstance(task.sampler, DraftSampler):
        task.sampler.keep(Nucleus(*rows))


def _no_sink(_: Any) -> None:
    pass


def _child(spec: dict[str, Any], k: torch.Tensor, v: torch.Tensor, state: torch.Tensor, conn: Any) -> None:
    """The engine process: load the model, attach the pool, run tasks the frontend sends."""
    # the frontend decides when it stops (its drain first): a Ctrl-C or a SIGTERM sent to the
    # whole process group must not kill the engine under requests still being answered
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        loaded, pool = _load(spec, k, v)
    except Exception as exc:  # reported to the frontend, which fails its start with it
        conn.send(("failed", f"{type(exc).__name__}: {str(exc)[:500]}"))
        return
    relay = _Relay(conn)
    engine = relay.engine = BatchEngine(
        loaded,
        pool,
        spec["max_batch"],
        spec["prefill_chunk"],
        spec["max_batch_tokens"],
        progress=SharedProgress("consumer-engine", state),
        runner=functools.partial(PoolRunner, **spec["forward"]),
    )
    try:
        engine.submit(warm_up, loaded).result()  # on the engine's thread, at its threads
    except Exception as exc:
        engine.shutdown(wait=True)
        conn.send(("failed", f"{type(exc).__name__}: {str(exc)[:500]}"))
        return
    # "ready" goes first, then the relay: the iteration that ran the warm-up may still be ending on
    # the engine thread, and a relay set before "ready" sent its counters as the first message
    # (the frontend failed its start with "failed to start: []" and left this process running)
    conn.send(("ready",))
    engine.after_iteration = relay.flush
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):  # the frontend went away
                break
            if msg[0] == "add":
                tid, task = _task_of(msg, loaded, pool)
                relay.add(tid, task)
                engine.add(task)
            elif msg[0] == "cancel":
                relay.cancel(msg[1])
            elif msg[0] == "stop":
                break
    finally:
        engine.shutdown(wait=True)


def _load(spec: dict[str, Any], k: torch.Tensor, v: torch.Tensor) -> tuple[LoadedModel, KVPool]:
    """Child: torch's threads, the model (the frontend's, checked by identity; loaded on a thread
    that ends, and this thread pinned to one: the engine's thread forms the process's one OpenMP
    team, shared.torch_threads), the shared pool attached."""
    if spec["torch_threads"]:
        torch.set_num_threads(spec["torch_threads"])
    loaded = torch_threads.on_new_thread(load_model, spec["model"], spec["dtype"], spec["device"], name="consumer-load")
    torch_threads.pin(1)
    if loaded.info.identity != spec["identity"]:  # weights at their precision, forward config, dtype
        raise RuntimeError(f"{spec['model']}: model differs from the frontend's (identity {loaded.info.identity[:16]})")
    return loaded, KVPool.attach(loaded.info, k, v, spec["block_tokens"])


def _task_of(msg: tuple, loaded: LoadedModel, pool: KVPool) -> tuple[int, Task]:
    """Child: the task an "add" message describes, over the blocks it names (EngineProcess.add)."""
    _, tid, blocks, capacity, length, shared_blocks, dropped, pending, sampler_of, sampling, rest = msg
    table = torch.tensor(blocks, dtype=torch.long, device=loaded.device)
    seq = SequenceKV(pool, blocks, table, capacity, length, shared_blocks=shared_blocks, dropped=dropped)
    sampler = sampler_of(sampling, loaded.device) if sampling is not None else None
    max_new, stop_ids, generated, keep_logits, keep_argmax, nucleus_of = rest
    task = Task(seq, pending, _no_sink, sampler, max_new, frozenset(stop_ids), generated)
    task.keep_logits, task.keep_argmax = keep_logits, keep_argmax
    task.keep_nucleus = Sampler(nucleus_of, loaded.device) if nucleus_of is not None else None
    return tid, task


class _Relay:
    """Child: what goes back to the frontend. Each task's items (its sink, on the engine thread)
    wait in an outbox; after every iteration (`flush`) one message carries them, the cancelled
    tasks that have left the batch, and the counters when they changed. The message loop adds
    and cancels tasks under the same lock."""

    def __init__(self, conn: Any):
        self.conn = conn
        self.engine: BatchEngine  # set once built (its after_iteration is `flush`)
        self.lock = threading.Lock()
        self.tasks: dict[int, Task] = {}
        self.cancelled: set[int] = set()
        # (task id, item, the sequence's length after a terminal item, what verification reads: rows)
        self.outbox: list[tuple[int, Any, int, Any]] = []
        self.sent_stats: tuple[int, ...] = ()

    def add(self, tid: int, task: Task) -> None:
        task.sink = self._sink_for(tid, task)
        with self.lock:
            self.tasks[tid] = task

    def cancel(self, tid: int) -> None:
        with self.lock:
            self.cancelled.add(tid)
            held = self.tasks.get(tid)
        if held is not None:
            self.engine.cancel(held)
        else:
            self.engine.submit(lambda: None)  # an iteration, so flush reports it left

    def _sink_for(self, tid: int, task: Task) -> Callable[[Any], None]:
        def sink(item: Any) -> None:  # engine thread
            terminal = isinstance(item, (Finished, BaseException))
            self.outbox.append((tid, _portable(item), task.seq.length if terminal else 0, _rows(task, item)))
            if terminal:
                with self.lock:
                    self.tasks.pop(tid, None)

        return sink

    def flush(self) -> None:  # engine thread, at the end of every iteration
        items = self.outbox[:]
        self.outbox.clear()
        with self.lock:
            left = [tid for tid in self.cancelled if tid not in self.tasks or not self.engine.holds(self.tasks[tid])]
            for tid in left:
                self.cancelled.discard(tid)
                self.tasks.pop(tid, None)
        s = self.engine.stats
        stats = (s.forwards, s.rows, s.last_batch, s.failed_rows, s.max_batch_seen, s.scratch_bytes)
        if items or left or stats != self.sent_stats:
            self.sent_stats = stats
            self.conn.send(("out", items, left, stats))


class EngineProcess(concurrent.futures.Executor):
    """The BatchEngine surface the frontend uses (add, cancel, release, submit, submit_grouped,
    stats, progress, pool, max_batch), backed by the engine process."""

    def __init__(
        self,
        loaded: LoadedModel,
        pool: KVPool,
        model: str,
        torch_threads: int = 0,
        max_batch: int = 32,
        prefill_chunk: int = 512,
        max_batch_tokens: int = 2048,
        on_exit: Callable[[str], None] | None = None,
        forward: dict[str, Any] | None = None,
    ):
        self.loaded, self.pool, self.max_batch = loaded, pool, max_batch
        self.on_exit = on_exit  # called (reader thread) with the reason when the child exits unasked
        self.post_hook: PostHook | None = None  # tests: see consumer.engine.batch.PostHook (reader thread)
        forward = forward or {}  # PoolRunner's options (decode_attention, prefill_attention, packed), the same in both engines
        # the frontend's jobs only: never given a task
        self.local = BatchEngine(loaded, pool, max_batch, runner=functools.partial(PoolRunner, **forward))
        self.stats = EngineStats()
        self.progress = SharedProgress("consumer-engine")
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._tasks: dict[int, Task] = {}
        self._tid: dict[int, int] = {}  # id(task) -> task id, while the child may hold the task
        self._on_seq: dict[int, set[int]] = {}  # id(seq) -> ids of its tasks the child may hold
        self._deferred: dict[int, tuple[SequenceKV, concurrent.futures.Future]] = {}  # releases waiting for them
        self._dead = ""
        self._stopping = False
        spec = {
            "model": model,
            "dtype": loaded.info.dtype,
            "identity": loaded.info.identity,
            "device": str(loaded.device),
            "torch_threads": torch_threads,
            "block_tokens": pool.block_tokens,
            "max_batch": max_batch,
            "prefill_chunk": prefill_chunk,
            "max_batch_tokens": max_batch_tokens,
            "forward": forward,
        }
        check_shm(pool)
        k, v = pool.share()
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(
            target=_child, args=(spec, k, v, self.progress.state, child_conn), name="consumer-engine", daemon=True
        )
        self._proc.start()
        child_conn.close()
        if not self._conn.poll(START_TIMEOUT_S):
            self._proc.kill()
            raise RuntimeError(f"the engine process did not start within {START_TIMEOUT_S:.0f}s")
        first = self._conn.recv()
        if first[0] != "ready":
            self._proc.join(10)
            if self._proc.is_alive():  # it ignores SIGTERM (its frontend decides): never left behind
                self._proc.kill()
                self._proc.join(10)
            raise RuntimeError(f"the engine process failed to start: {first[1]}")
        self._reader = threading.Thread(target=self._read, name="consumer-engine-reader", daemon=True)
        self._reader.start()
        log.info("engine_process.started", pid=self._proc.pid)

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    # --- the asyncio side's surface ----------------------------------------------------------------

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:  # type: ignore[override]
        return self.local.submit(fn, *args, **kwargs)

    def submit_grouped(self, many, item) -> concurrent.futures.Future:
        return self.local.submit_grouped(many, item)

    def add(self, task: Task) -> Task:
        if not task.pending:
            raise ValueError("a task needs tokens to feed")
        seq = task.seq
        with self._lock:
            dead = self._dead
            if not dead:
                tid = next(self._ids)
                self._tasks[tid] = task
                self._tid[id(task)] = tid
                self._on_seq.setdefault(id(seq), set()).add(tid)
        if dead:
            task.sink(Unavailable(dead))
            return task
        sampling = task.sampler.sampling if task.sampler is not None else None
        nucleus_of = task.keep_nucleus.sampling if task.keep_nucleus is not None else None
        msg = (
            *("add", tid, seq.blocks, seq.capacity, seq.length, seq.shared_blocks, seq.dropped, list(task.pending)),
            *(type(task.sampler), sampling),  # the class by name: a DraftSampler drafts there too
            (task.max_new, sorted(task.stop_ids), task.generated, task.keep_logits, task.keep_argmax, nucleus_of),
        )
        if self.loaded.device.type != "cuda":
            self._send_add(tid, task, msg)
            return task

        def synced_add() -> None:  # rebuilt blocks written (local job thread) before the child reads them
            torch.cuda.synchronize(self.loaded.device)
            self._send_add(tid, task, msg)

        try:  # on the local job thread, never the event loop: a synchronize waits for the device
            self.local.submit(synced_add)
        except RuntimeError:  # stopping
            self._left(tid)
        return task

    def _send_add(self, tid: int, task: Task, msg: tuple) -> None:
        """Send an add unless the task was cancelled first (checked under the send lock, which
        cancel also takes: the child never sees a cancel before the add it cancels)."""
        with self._send_lock:
            if task.cancelled:
                sent = False
            else:
                with contextlib.suppress(OSError, ValueError):  # the child is gone: the reader fails the task
                    self._conn.send(msg)
                sent = True
        if not sent:
            self._left(tid)

    def cancel(self, task: Task) -> None:
        with self._send_lock:
            task.cancelled = True
        with self._lock:
            tid = self._tid.get(id(task))
        if tid is not None:
            with contextlib.suppress(OSError, ValueError):  # the child is gone: nothing runs the task any more
                self._send(("cancel", tid))

    def release(self, seq: SequenceKV) -> concurrent.futures.Future:
        """Free seq's blocks once the child holds none of its tasks (at once when it holds none)."""
        with self._lock:
            if self._on_seq.get(id(seq)):
                future: concurrent.futures.Future = concurrent.futures.Future()
                self._deferred[id(seq)] = (seq, future)
                return future
        return self.local.release(seq)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._stopping = True
        with contextlib.suppress(OSError, ValueError):
            self._send(("stop",))
        if wait:
            self._proc.join(15)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self.local.shutdown(wait=wait, cancel_futures=cancel_futures)

    # --- the reader thread ---------------------------------------------------------------------------

    def _send(self, msg: tuple) -> None:
        with self._send_lock:
            self._conn.send(msg)

    def _read(self) -> None:
        try:
            self._relay()
        except Exception as exc:  # a message this side cannot use: the child is stopped, its requests fail
            log.error("engine_process.bad_message", error=f"{type(exc).__name__}: {str(exc)[:300]}")
            self._proc.kill()
        self._exited()

    def _relay(self) -> None:
        """The child's messages to the tasks' sinks, until the pipe closes."""
        while True:
            try:
                _, items, left, stats = self._conn.recv()
            except (EOFError, OSError):
                return
            st = self.stats
            st.forwards, st.rows, st.last_batch, st.failed_rows, st.max_batch_seen, st.scratch_bytes = stats
            for tid, item, length, rows in items:
                with self._lock:
                    task = self._tasks.get(tid)
                if task is None:
                    continue
                terminal = isinstance(item, (Finished, BaseException))
                if isinstance(item, Finished):
                    task.seq.length = length  # what the child's prefill or decode advanced it to
                if rows is not None:
                    _take_rows(task, item, rows)  # before the sink: the item's reader finds them
                task.sink(item)
                if terminal:
                    self._left(tid)
            for tid in left:
                self._left(tid)

    def _left(self, tid: int) -> None:
        """The child no longer holds task tid: a release waiting for it may run."""
        with self._lock:
            task = self._tasks.pop(tid, None)
            if task is None:
                return
            self._tid.pop(id(task), None)
            live = self._on_seq.get(id(task.seq), set())
            live.discard(tid)
            deferred = None
            if not live:
                self._on_seq.pop(id(task.seq), None)
                deferred = self._deferred.pop(id(task.seq), None)
        if deferred is not None:
            seq, future = deferred
            try:
                done = self.local.release(seq)
            except RuntimeError:  # the local engine stopped (server stop): nothing runs on the pool any more
                self.pool.release(seq)
                future.set_result(None)
                return
            done.add_done_callback(lambda f: future.set_exception(f.exception()) if f.exception() else future.set_result(None))

    def _exited(self) -> None:
        self._proc.join(5)
        code = self._proc.exitcode
        with self._lock:
            self._dead = f"the consumer's engine process exited (code {code})"
            tids = list(self._tasks)
        if not self._stopping:
            log.error("engine_process.exited", code=code)
            self.progress.dead = True  # liveness: stalled for ever
            if self.on_exit is not None:
                self.on_exit(self._dead)
        for tid in tids:
            with self._lock:
                task = self._tasks.get(tid)
            if task is not None:
                task.sink(Unavailable(self._dead))
            self._left(tid)
