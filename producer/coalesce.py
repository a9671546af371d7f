"""The Prefill stream's messages coalesced for a caller that set PrefillRequest.accept_batches:
the messages that are ready together go in one gRPC message (a `PrefillResponse.batch`, joined
by shared.wire_bytes.batch_message), since grpc-python's CPU cost per streamed message dominates
a short request's.

A pump task reads the stream's serialized messages as they are produced, while the previous gRPC
message is being written; each write then takes everything that accumulated meanwhile, up to one
message's bounds (MAX_MESSAGE_DATA bytes, MAX_CHUNKS_PER_MESSAGE chunks, MAX_BATCH_MESSAGES
entries). Nothing ever waits to fill a batch: a message ready alone goes alone, as it is. The pump
reads at most LOOKAHEAD_BYTES ahead of the writes, so a replay built layer by layer holds about
one more message than before. A failure of the stream reaches the caller after the messages
produced before it, as without coalescing. Knows nothing about the messages' content.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator

from shared import wire_bytes

Message = tuple[bytes, int]  # a serialized PrefillResponse (never a batch) and the chunks it carries
LOOKAHEAD_BYTES = wire_bytes.MAX_MESSAGE_DATA  # read ahead of the writes: one full message's worth


class Coalesced:
    """The messages of `messages`, as gRPC messages to write: each one, or a batch of several.
    Starts reading at construction; `aclose` stops the pump and closes `messages`."""

    def __init__(self, messages: AsyncIterator[Message]):
        self.pending: deque[Message] = deque()
        self.pending_bytes = 0
        self.error: BaseException | None = None
        self.done = False
        self.ready = asyncio.Event()  # something to write, or the end
        self.room = asyncio.Event()  # the pump may read on
        self.room.set()
        self.task = asyncio.ensure_future(self._pump(messages))

    async def _pump(self, messages: AsyncIterator[Message]) -> None:
        try:
            async with contextlib.aclosing(messages) as items:  # type: ignore[type-var]
                async for item in items:
                    self.pending.append(item)
                    self.pending_bytes += len(item[0])
                    self.ready.set()
                    if self.pending_bytes >= LOOKAHEAD_BYTES:
                        self.room.clear()
                        await self.room.wait()
        except BaseException as exc:  # delivered after the messages before it
            self.error = exc
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            self.done = True
            self.ready.set()

    def __aiter__(self) -> Coalesced:
        return self

    async def __anext__(self) -> bytes:
        await self.ready.wait()
        if self.pending:
            return self._take()
        if self.error is not None:
            raise self.error
        raise StopAsyncIteration

    def _take(self) -> bytes:
        """The next gRPC message: the first pending message and those after it that fit with it."""
        group = [self.pending.popleft()]
        size, chunks = len(group[0][0]), group[0][1]
        while self.pending and len(group) < wire_bytes.MAX_BATCH_MESSAGES:
            message, count = self.pending[0]
            # serialized size bounds the data (and keeps the message under the 8 MiB limit)
            if size + len(message) > wire_bytes.MAX_MESSAGE_DATA or chunks + count > wire_bytes.MAX_CHUNKS_PER_MESSAGE:
                break
            group.append(self.pending.popleft())
            size, chunks = size + len(message), chunks + count
        self.pending_bytes -= sum(len(m) for m, _ in group)
        if self.pending_bytes < LOOKAHEAD_BYTES:
            self.room.set()
        if not self.pending and not self.done:
            self.ready.clear()
        return group[0][0] if len(group) == 1 else wire_bytes.batch_message([m for m, _ in group])

    async def aclose(self) -> None:
        """Stop reading and close the stream (its source leaves a shared flight, releases pins)."""
        self.task.cancel()
        await asyncio.wait({self.task})
