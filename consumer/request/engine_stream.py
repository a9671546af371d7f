"""A task in the batch engine as an async stream: what the pipeline awaits for a local prefill or
an answer. The engine's sink (called on its thread) feeds an asyncio queue; whatever arrived since
the caller last took from it comes out as one list, so a loaded event loop sends fewer, fuller
messages. The sinks of every task on one event loop post through one `Mailbox`: what the engine
delivers in one burst (every row of a forward, or one message of the engine process) wakes the
loop once, not once per request. Knows nothing about gRPC or codecs.
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
    --stream-interval: fewer messages, each per-message cost paid once for N tokens); the end, an
    error or the deadline sends what is held first. Leaving early (deadline, cancel, error) takes
    the task out of the engine at its next iteration."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    box = mailbox(loop)

    def sink(item: Any) -> None:
        box.post(events, item)

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
            finished = bool(batch) and isinstance(batch[-1], Finished)
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
