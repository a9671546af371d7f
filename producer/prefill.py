"""The producer's compute: batched prefills whose layers are encoded off the forward and handed
out as soon as each is ready.

Three stages per request, each on its own thread(s):
- the scheduler (event loop) collects the prefills waiting for the compute thread when it frees
  up, up to `max_batch` contexts and `max_batch_tokens` padded tokens (at least one), in arrival
  order;
- the compute thread runs one forward over the whole batch (shared.kv.batch_capture: our own
  forward, shared.model, over the rows side by side, no hooks) and after each layer hands every
  row's captured `LayerState` to that request's encode lane, never waiting for it;
- the encode pool (producer.encode) encodes, copies to the host, CRCs and packs each layer, in
  layer order per request, into the request's own buffer (an unbounded asyncio queue).

Memory bounds. Captured states waiting for their encode: at most num_layers per admitted
request (a forward hands each row each layer once; admission caps the requests at
max_inflight), each a view into that layer's batch tensors (K/V, and the hidden or normed
input when the codec asks), so at most num_layers x max_inflight layer states, usually far
fewer as the encode keeps pace. A request's buffer here is drained as it fills by its flight
(producer.flight), which bounds what its callers have not read; a slow or stalled reader delays
only its own stream (no head-of-line blocking of the forward or of other requests).

Prefix reuse (producer.reuse): a request may come with a `Continuation`. A replay never reaches
the engine (the servicer joins stored chunks). A continuation with stored prefix K/V (start > 0)
runs as a forward of its own (shared.kv.continue_capture: the new tokens on top of the prefix,
positions continuing), never batched with others; its lane assembles each layer from the stored
chunks and the new payloads and records the new chunks, handed over with PrefillDone.

Closing a stream early (caller cancelled, deadline passed, error) takes the request's row out
of the batch at the next layer boundary; its pending encodes are skipped; a request still
waiting for the compute thread leaves the queue at once (its token ids and continuation with
it), so the queue holds only requests that hold an admission slot (`max_waiting` bounds it too). An encode error fails
that request alone; a forward error fails the batch's requests. Knows nothing about gRPC: the
servicer passes a `pack` function that turns payloads into whatever it sends.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from producer.encode import EncodePool, Lane
from producer.reuse import Continuation
from shared import kv, liveness, logs
from shared.codecs import LayerEncoder
from shared.errors import ResourceExhausted
from shared.models import LoadedModel

log = logs.get("producer.prefill")


@dataclass
class EncodedLayer:
    layer: int
    packed: Any  # what pack(layer, payloads) returned
    payload_bytes: int
    encode_ms: float


@dataclass
class PrefillDone:
    # The forward and the encodes overlap, so the two do not add up to the request's time:
    prefill_ms: float  # forward wall time for this context: batch start to its last layer (encode excluded)
    encode_ms: float  # encode-thread time spent on this context's layers (encode, copy, CRC, packing)
    layers: int
    batch_size: int = 1  # contexts in the forward that prefilled this one
    reused_tokens: int = 0  # context tokens whose prefill the chunk store saved
    computed_tokens: int = 0  # context tokens the forward ran over
    queue_ms: float = 0.0  # the context's wait from stream() to the start of its forward
    kept: list = field(default_factory=list)  # new chunk entries to store (producer.chunk_store.ChunkEntry)


@dataclass
class _Failed:
    exc: BaseException


@dataclass(eq=False)  # one job is one object: removed from `waiting` by identity
class _Job:
    """One request's prefill, from the event loop to the compute thread and the encode lane."""

    token_ids: list[int]
    encoder: LayerEncoder
    pack: Callable[[int, dict[str, torch.Tensor]], Any]
    emit: Callable[[object], None]  # thread-safe: into the request's buffer
    lane: Lane
    reuse: Continuation | None = None
    closed: threading.Event = field(default_factory=threading.Event)
    encode_ms: float = 0.0  # written by the lane only (one task at a time)
    layers_done: int = 0
    enqueued: float = field(default_factory=time.perf_counter)

    @property
    def start(self) -> int:
        """Tokens the stored prefix covers (the forward runs over token_ids[start:])."""
        return self.reuse.start if self.reuse is not None else 0

    @property
    def captures(self) -> kv.Capture:
        keep = self.reuse is not None and self.reuse.keep
        return self.encoder.captures | (kv.Capture.KV if keep else kv.Capture.NONE)


class PrefillEngine:
    def __init__(
        self,
        loaded: LoadedModel,
        executor: concurrent.futures.Executor,
        encode: EncodePool | None = None,
        max_batch: int = 8,
        max_batch_tokens: int = 8192,
        progress: liveness.Progress | None = None,
        max_waiting: int = 0,
    ):
        self.loaded = loaded
        self.executor = executor  # the compute thread
        self.encode = encode if encode is not None else EncodePool(1, loaded.device)
        self.max_batch, self.max_batch_tokens = max_batch, max_batch_tokens
        self.progress = progress if progress is not None else liveness.Progress("producer-compute")
        self.waiting: collections.deque[_Job] = collections.deque()
        self._waiting_lock = threading.Lock()  # the event loop adds and removes, the compute thread takes
        self.max_waiting = max_waiting  # prefills waiting for the compute thread, at most (0: no bound)
        self._scheduler: asyncio.Future | None = None
        self.forwards = 0  # batched forwards run
        self.forward_rows = 0  # contexts prefilled by them (forward_rows / forwards: mean batch size)

    async def stream(
        self,
        token_ids: list[int],
        encoder: LayerEncoder,
        pack: Callable[[int, dict[str, torch.Tensor]], Any],
        reuse: Continuation | None = None,
    ) -> AsyncIterator[EncodedLayer | PrefillDone]:
        """Yields one EncodedLayer per layer in order, then PrefillDone. Use with aclosing()."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()  # this request's buffer; see the module doc for its bound

        def emit(item: object) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone (process stopping)
                loop.call_soon_threadsafe(queue.put_nowait, item)

        job = _Job(list(token_ids), encoder, pack, emit, self.encode.lane(), reuse)
        with self._waiting_lock:
            if self.max_waiting and len(self.waiting) >= self.max_waiting:
                raise ResourceExhausted(f"prefills waiting for the forward: {len(self.waiting)} >= {self.max_waiting}")
            self.waiting.append(job)
        if self._scheduler is None:
            self._scheduler = asyncio.ensure_future(self._schedule())
        try:
            while True:
                item = await queue.get()
                if isinstance(item, _Failed):
                    raise item.exc
                yield item
                if isinstance(item, PrefillDone):
                    return
        finally:
            job.closed.set()  # its row leaves the forward at the next layer; its queued encodes are skipped
            with self._waiting_lock, contextlib.suppress(ValueError):  # not taken yet: it leaves the queue now
                self.waiting.remove(job)

    # -- scheduler --------------------------------------------------------------------------
    def _take(self) -> list[_Job]:
        """The next batch, taken on the compute thread as it frees up: the prefills waiting then,
        in arrival order, while they fit (at least one). The event loop appends to `waiting` and
        removes a closed job from it (under the same lock)."""
        with self._waiting_lock:
            return self._take_locked()

    def _take_locked(self) -> list[_Job]:
        batch: list[_Job] = []
        width = 0
        while self.waiting:
            job = self.waiting[0]
            if job.closed.is_set():  # cancelled while waiting
                self.waiting.popleft()
                continue
            if job.start:  # a continuation runs alone, on top of its stored prefix
                if not batch:
                    batch.append(self.waiting.popleft())
                break
            wider = max(width, len(job.token_ids))
            if batch and (len(batch) >= self.max_batch or wider * (len(batch) + 1) > self.max_batch_tokens):
                break
            batch.append(self.waiting.popleft())
            width = wider
        return batch

    async def _schedule(self) -> None:
        """Runs (on the event loop) while prefills wait: one batch at a time on the compute thread."""
        try:
            while self.waiting:
                try:
                    await asyncio.get_running_loop().run_in_executor(self.executor, self._run_next)
                except RuntimeError as exc:  # the compute thread is shut down (process stopping)
                    with self._waiting_lock:
                        failed, self.waiting = list(self.waiting), collections.deque()
                    for job in failed:
                        job.emit(_Failed(exc))
        finally:
            self._scheduler = None

    def _run_next(self) -> None:
        batch = self._take()
        if batch:
            self._forward(batch)

    # -- compute thread -----------------------------------------------------------------------
    def _forward(self, batch: list[_Job]) -> None:
        started = time.perf_counter()
        self.forwards += 1
        self.forward_rows += len(batch)
        num_layers = self.loaded.info.num_layers

        def on_layer(row: int, state: kv.LayerState) -> None:
            job = batch[row]
            self.progress.beat()
            event = self.encode.mark()
            job.lane.put(lambda: self._encode(job, state, event))
            job.layers_done += 1
            if job.layers_done == num_layers:  # this row's forward is over; its encodes may not be
                done = PrefillDone((time.perf_counter() - started) * 1e3, 0.0, num_layers, len(batch))
                done.queue_ms = (started - job.enqueued) * 1e3
                job.lane.put(lambda: self._finish(job, done))

        with self.progress.iteration():
            try:
                if batch[0].start:  # a continuation: alone, on top of its stored prefix's K/V
                    job = batch[0]
                    kv.continue_capture(
                        self.loaded,
                        job.reuse.prefix_kv() if job.reuse is not None else [],
                        job.token_ids[job.start :],
                        job.captures,
                        lambda state: on_layer(0, state),
                        active=lambda: not job.closed.is_set(),
                    )
                else:
                    kv.batch_capture(
                        self.loaded,
                        [job.token_ids for job in batch],
                        [job.captures for job in batch],
                        on_layer,
                        active=lambda row: not batch[row].closed.is_set(),
                    )
            except BaseException as exc:  # the whole batch fails; each request alone reports it
                for job in batch:
                    if not job.closed.is_set():
                        job.closed.set()
                        job.emit(_Failed(exc))
        stopped = [job.layers_done for job in batch if job.layers_done < num_layers]
        if stopped:
            log.info("prefill.stopped", layers_done=stopped, num_layers=num_layers, batch=len(batch))

    # -- encode pool --------------------------------------------------------------------------
    def _encode(self, job: _Job, state: kv.LayerState, event: object) -> None:
        if job.closed.is_set():
            return

        def run() -> None:
            started = time.perf_counter()
            with torch.inference_mode():
                encoded = job.reuse.encode_new(state) if job.reuse is not None else job.encoder.encode(state)
                payloads = {name: t.detach().to("cpu").contiguous() for name, t in encoded.items()}
                if job.reuse is not None:  # stored chunks before the new tokens; new chunks recorded
                    payloads = job.reuse.assemble(state.index, payloads, state)
            packed = job.pack(state.index, payloads)
            took = (time.perf_counter() - started) * 1e3
            job.encode_ms += took
            nbytes = sum(t.numel() * t.element_size() for t in payloads.values())
            job.emit(EncodedLayer(state.index, packed, nbytes, took))

        try:
            self.encode.on_copy_stream(event, run)  # type: ignore[arg-type]
        except BaseException as exc:  # this request fails alone; its row leaves the forward
            job.closed.set()
            job.emit(_Failed(exc))

    def _finish(self, job: _Job, done: PrefillDone) -> None:
        if not job.closed.is_set():
            done.encode_ms = job.encode_ms
            done.computed_tokens = len(job.token_ids) - job.start
            done.reused_tokens = job.start
            if job.reuse is not None:
                done.kept = job.reuse.kept()
            job.emit(done)
