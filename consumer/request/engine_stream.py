"""A task in the batch engine as an async stream: what the pipeline awaits for a local prefill or
an answer. The engine's sink (called on its thread) feeds an asyncio queue; whatever arrived since
the caller last took from it comes out as one list, so a loaded event loop sends fewer, fuller
messages. The sinks of every task on one event loop post through one `Mailbox`: what the engine
delivers in one burst (every row of a forward, or one message of the engine process) wakes the
loop once, not once per request. With a stream interval N > 1 a task's sink holds its tokens on the
engine's side (`Holder`) and posts N at a time: the loop wakes once per N tokens. Knows nothing
about gRPC or codecs.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import weakref
from collections.abc import AsyncGenerator
from typing import Any

from consumer.engine.batch import BatchEngine, Finished, Task
from consumer.engine.process import EngineProcess
from consumer.request.job import GenerateJob, left
from shared.errors import DeadlineExceeded

Engine = BatchEngine | EngineProcess


class Mailbox:
    """Items posted from any thread for queues of one event loop: the first post after a delivery
    schedules the next delivery; posts until it runs ride along (one wakeup per burst)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._items: list[tuple[asyncio.Queue, Any]] = []
        self._lock = threading.Lock()

    def post(self, queue: asyncio.Queue, item: Any) -> None:
        with self._lock:
            self._items.append((queue, item))
            first = len(self._items) == 1
        if first:
            self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for queue, item in items:
            queue.put_nowait(item)


_MAILBOXES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Mailbox] = weakref.WeakKeyDictionary()


def mailbox(loop: asyncio.AbstractEventLoop) -> Mailbox:
    """The loop's one mailbox (made at its first use, on the loop's thread)."""
    box = _MAILBOXES.get(loop)
    if box is None:
        box = _MAILBOXES[loop] = Mailbox(loop)
    return box


class Holder:
    """The engine side of a stream interval N > 1: a task's sink posts its first token at once,
    then keeps ids until N are there (or the task's end or an error comes, which go out after
    them) and posts those N in one burst. The event loop then wakes once per N tokens of a task,
    not once per token: at 32 streams on 2 cores each wakeup (a GIL handoff to the loop and gRPC's
    poller, and a message) cost the engine's forwards ~6% of a batch's time (bench.peer.vs_vllm).
    Called on the thread that runs the sink (the engine's, or the engine process's reader);
    `drain` (the event loop, when the deadline fires) takes what is held."""

    def __init__(self, post: Any, interval: int):
        self.post, self.interval = post, interval
        self.held: list[int] = []
        self.first = True
        self.lock = threading.Lock()

    def __call__(self, item: Any) -> None:
        with self.lock:  # posts under the lock: drain() never overtakes a burst on its way
            if isinstance(item, int) and not self.first:
                self.held.append(item)
                if len(self.held) < self.interval:
                    return
                out, self.held = self.held, []
            else:
                self.first = False
                out, self.held = [*self.held, item], []
            for x in out:
                self.post(x)

    def drain(self) -> list[int]:
        with self.lock:
            out, self.held = self.held, []
        return out


def take_ready(first: Any, events: asyncio.Queue) -> tuple[list[Any], BaseException | None]:
    """`first` and whatever else is queued now, up to a Finished (included) or an exception
    (returned apart: the items before it are still delivered); nothing after them is taken."""
    batch = [first]
    while not isinstance(batch[-1], (Finished, BaseException)) and not events.empty():
        batch.append(events.get_nowait())
    error = batch.pop() if isinstance(batch[-1], BaseException) else None
    return batch, error


async def engine_task(
    engine: Engine, job: GenerateJob, task: Task, interval: int = 1
) -> AsyncGenerator[list[int | Finished], None]:
    """Hand task to the batch engine; its sampled token ids, then its Finished, in lists of
    whatever arrived since the last one was taken (one item while the caller keeps up; more
    when the event loop falls behind, so a loaded loop sends fewer, fuller messages). With
    `interval` N > 1 the first token goes out alone and then up to N together (vLLM's
    --stream-interval: fewer messages and event-loop wakeups, each paid once for N tokens; the
    tokens are held on the engine's side, `Holder`); the end, an error or the deadline sends what
    is held first. Leaving early (deadline, cancel, error) takes the task out of the engine at its
    next iteration."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    box = mailbox(loop)

    def post(item: Any) -> None:
        box.post(events, item)

    holder = Holder(post, interval) if interval > 1 else None
    sink = post if holder is None else holder

    remaining = left(job, "the engine")
    hook = engine.post_hook
    task.sink = sink if hook is None else functools.partial(hook, task, sink)
    engine.add(task)
    # one timer for the task's whole life, not a wait_for (a task and a timer) per token: the
    # deadline arrives in the queue as an error, after whatever the engine delivered before it
    expiry = loop.call_later(remaining, events.put_nowait, DeadlineExceeded("deadline passed while waiting for the engine"))
    finished, held, sent = False, [], False
    try:
        while not finished:
            batch, error = take_ready(await events.get(), events)
            if error is not None and holder is not None:
                batch += holder.drain()  # the deadline: what the engine made before it still goes out
            finished = bool(batch) and isinstance(batch[-1], Finished)
            # the holder's bursts are posted item by item: the loop may wake mid-burst, so it holds too
            held += batch
            if held and not sent and interval > 1:  # the first token alone, however many are ready
                yield held[:1]
                held, sent = held[1:], True
            if held and (finished or error is not None or not sent or len(held) >= interval):
                yield held  # the tokens before an error still go out
                held, sent = [], True
            if error is not None:
                raise error
    finally:
        expiry.cancel()
        if not finished:
            engine.cancel(task)
