"""A task in the batch engine as an async stream: what the pipeline awaits for a local prefill or
an answer. The engine's sink (called on its thread) feeds an asyncio queue; whatever arrived since
the caller last took from it comes out as one list, so a loaded event loop sends fewer, fuller
messages. Knows nothing about gRPC or codecs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

from consumer.batch import BatchEngine, Finished, Task
from consumer.engine_process import EngineProcess
from consumer.request import GenerateJob, left
from shared.errors import DeadlineExceeded

Engine = BatchEngine | EngineProcess


def take_ready(first: Any, events: asyncio.Queue) -> tuple[list[Any], BaseException | None]:
    """`first` and whatever else is queued now, up to a Finished (included) or an exception
    (returned apart: the items before it are still delivered); nothing after them is taken."""
    batch = [first]
    while not isinstance(batch[-1], (Finished, BaseException)) and not events.empty():
        batch.append(events.get_nowait())
    error = batch.pop() if isinstance(batch[-1], BaseException) else None
    return batch, error


async def engine_task(engine: Engine, job: GenerateJob, task: Task) -> AsyncGenerator[list[int | Finished], None]:
    """Hand task to the batch engine; its sampled token ids, then its Finished, in lists of
    whatever arrived since the last one was taken (one item while the caller keeps up; more
    when the event loop falls behind, so a loaded loop sends fewer, fuller messages). Leaving
    early (deadline, cancel, error) takes the task out of the engine at its next iteration."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()

    def sink(item: Any) -> None:
        loop.call_soon_threadsafe(events.put_nowait, item)

    remaining = left(job, "the engine")
    task.sink = sink
    engine.add(task)
    # one timer for the task's whole life, not a wait_for (a task and a timer) per token: the
    # deadline arrives in the queue as an error, after whatever the engine delivered before it
    expiry = loop.call_later(remaining, events.put_nowait, DeadlineExceeded("deadline passed while waiting for the engine"))
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
            engine.cancel(task)
