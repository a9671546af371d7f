"""A server-side watch over one streaming call: its deadline (the caller's, else a default, never
past a maximum) and how long one message waits for the reader (a reader that stops). Either ends
the call with DEADLINE_EXCEEDED and a message naming the limit: the status is sent, then what
the call holds is returned at once rather than when the caller goes away: the handler's task is
cancelled when it waits on its own work; when it waits on a write (gRPC flow control: the reader
stopped, and neither the write nor the status completes until the reader reads or leaves) the
generator that holds the call's admission slot, buffers and forward row (`releases`) is closed.

    async with CallWatch(context, timeout_s, idle_s) as watch:
        messages = the_call(...)  # an async generator holding what the call holds (slot, buffers)
        async with contextlib.aclosing(watch.stream(messages)) as stream:
            async for message in stream:
                yield message

(`stream` never resumes `messages` while the watch is closing it: a reader that reads the pending
message just then finds the call over, not a generator already running.)

A watcher task wakes a few times per limit (at most once a second); a call's own work never waits
for it. Knows nothing of the services' messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Iterator
from typing import Any

import grpc

from shared import logs

log = logs.get("call_watch")


def deadline_s(context: grpc.aio.ServicerContext, default_s: float, max_s: float) -> float:
    """Seconds the call may run: the caller's remaining time, else `default_s`; at most `max_s`."""
    left = context.time_remaining()
    return min(default_s if left is None else left, max_s)


class CallWatch:
    def __init__(
        self, context: grpc.aio.ServicerContext, timeout_s: float, idle_s: float = 0.0, flags: tuple[str, str] = ("", "")
    ):
        self.context, self.timeout_s, self.idle_s = context, timeout_s, idle_s
        self.flags = flags  # (the deadline's flag, the idle limit's flag), named in the status
        self.fired = ""  # why the watch ended the call ("" while it has not)
        self._deadline = time.monotonic() + timeout_s
        self._writing_since: float | None = None
        self._task: asyncio.Task | None = None
        self._handler: asyncio.Task | None = None
        self._held: Any = None  # the async generator that holds what the call holds
        self._status: asyncio.Future | None = None  # the abort sending the status (kept: it may outlive the handler)
        self._closing: asyncio.Future | None = None  # the watch closing `_held` (set before anything awaits)

    def releases(self, messages: Any) -> None:
        """`messages` (an async generator the handler iterates) holds what the call holds: closed
        when the watch ends the call during a write."""
        self._held = messages

    async def stream(self, messages: AsyncGenerator[Any, None]) -> AsyncGenerator[Any, None]:
        """The handler's loop over `messages` (which `releases` names): each message handed out
        inside `writing`; once the watch closes `messages` itself, the loop waits for that close
        and ends, never resuming the generator meanwhile."""
        self.releases(messages)
        try:
            while self._closing is None:
                try:
                    message = await anext(messages)
                except StopAsyncIteration:
                    return
                with self.writing():
                    yield message
        finally:  # also when the handler itself is closed (the status sent, grpc ends the call)
            if self._closing is None:
                await messages.aclose()
            else:  # never a second close beside the watch's
                await asyncio.shield(self._closing)

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """Around a message handed to the reader (a streaming handler's yield)."""
        self._writing_since = time.monotonic()
        try:
            yield
        finally:
            self._writing_since = None

    def _why(self, now: float) -> str:
        if now >= self._deadline:
            flag = f" ({self.flags[0]})" if self.flags[0] else ""
            return f"deadline: the call ran {self.timeout_s:g} s, its limit{flag}"
        since = self._writing_since
        if self.idle_s and since is not None and now - since >= self.idle_s:
            flag = f" ({self.flags[1]})" if self.flags[1] else ""
            return f"the caller read no message for {self.idle_s:g} s{flag}: a reader that stopped"
        return ""

    async def _watch(self) -> None:
        step = max(0.01, min(1.0, self.idle_s / 4 if self.idle_s else 1.0, self.timeout_s / 4))
        while True:
            now = time.monotonic()
            why = self._why(now)
            if why:
                break
            await asyncio.sleep(min(step, max(self._deadline - now, 0.0) + 0.001))
        self.fired = why
        log.warning("call_watch.ended", reason=why)
        # the status goes out behind the pending write, if any: only once the reader reads or leaves
        self._status = asyncio.ensure_future(self._abort(why))
        if self._writing_since is not None and self._held is not None:
            # suspended at its yield: its finally blocks run now; `stream` sees _closing and waits
            self._closing = asyncio.ensure_future(self._close_held())
            await asyncio.wait({self._closing})
        elif self._handler is not None:  # waiting on its own work (the forward, a flight)
            await asyncio.wait({self._status})  # no write pending: the status is out at once
            self._handler.cancel()

    async def _close_held(self) -> None:
        with contextlib.suppress(Exception):
            await self._held.aclose()

    async def _abort(self, why: str) -> None:
        with contextlib.suppress(Exception):  # grpc.aio raises AbortError once the status is sent
            await self.context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, why)

    async def __aenter__(self) -> CallWatch:
        self._handler = asyncio.current_task()
        self._task = asyncio.ensure_future(self._watch())
        return self

    async def __aexit__(self, *exc) -> None:
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
