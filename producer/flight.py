"""Single flight: concurrent requests for the same (context token ids, codec, resolved options,
codec metadata) share one prefill and one encode.

The first request for a key starts a `Flight`: a task that drives the engine's stream for it
and keeps every item it yields. Each caller, the first included, is a subscriber with its own
buffer: it is given the items produced so far, then the live ones, so a slow subscriber never
holds up the flight or the others. The flight does not belong to the caller that started it:
it runs while anyone still listens and is stopped (its forward row leaves the batch at the next
layer) once the last subscriber has gone. A failure reaches every subscriber. The flight is
forgotten when it ends; a completed stream's keeping (the context store) is the `on_complete`
callback's, called before any subscriber sees the end.

Memory: the flight keeps its encoded stream until it ends (as the store does); subscribers'
buffers hold references to those same items. Knows nothing about gRPC or models.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any


class _End:
    """Queued after the last item: None when the stream completed, else what stopped it."""

    def __init__(self, exc: BaseException | None):
        self.exc = exc


class Flight:
    def __init__(self, source: AsyncIterator[Any], is_last: Callable[[Any], bool], on_complete: Callable[[list[Any]], None]):
        self.items: list[Any] = []
        self.end: _End | None = None
        self.subscribers: set[asyncio.Queue] = set()
        self._source, self._is_last, self._on_complete = source, is_last, on_complete
        self.task = asyncio.ensure_future(self._pump())
        self.forgotten: Callable[[], None] = lambda: None  # set by Flights: drop it from the registry

    async def _pump(self) -> None:
        end = _End(RuntimeError("prefill stream ended without its last item"))
        try:
            async with contextlib.aclosing(self._source) as items:  # type: ignore[type-var]
                async for item in items:
                    self.items.append(item)
                    if self._is_last(item):
                        self._on_complete(self.items)
                        end = _End(None)
                    for queue in self.subscribers:
                        queue.put_nowait(item)
                    if end.exc is None:
                        break
        except asyncio.CancelledError:
            end = _End(asyncio.CancelledError())
            raise
        except Exception as exc:
            end = _End(exc)
        finally:
            self.end = end
            self.forgotten()
            for queue in self.subscribers:
                queue.put_nowait(end)

    def subscribe(self) -> Subscription:
        """A new subscriber, registered now: the flight's items from the first, then live."""
        return Subscription(self)

    def _leave(self, queue: asyncio.Queue) -> None:
        self.subscribers.discard(queue)
        if not self.subscribers and self.end is None:  # nobody listens: stop the shared work
            self.forgotten()  # a request arriving now starts afresh rather than join a dying flight
            self.task.cancel()


class Subscription:
    """One subscriber's stream of a flight (its own buffer); raises what failed the flight.
    Registered from creation, so a caller that leaves before reading still counts as leaving:
    use with aclosing()."""

    def __init__(self, flight: Flight):
        self.flight = flight
        self.queue: asyncio.Queue = asyncio.Queue()
        for item in flight.items:
            self.queue.put_nowait(item)
        if flight.end is not None:
            self.queue.put_nowait(flight.end)
        flight.subscribers.add(self.queue)
        self.closed = False

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> Any:
        if self.closed:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, _End):
            await self.aclose()
            if item.exc is not None:
                raise item.exc
            raise StopAsyncIteration
        return item

    async def aclose(self) -> None:
        if not self.closed:
            self.closed = True
            self.flight._leave(self.queue)


class Flights:
    """The flights running now, by key."""

    def __init__(self) -> None:
        self.running: dict[str, Flight] = {}
        self.shared = 0  # subscriptions that joined a flight another request had started

    def join(
        self,
        key: str,
        start: Callable[[], AsyncIterator[Any]],
        is_last: Callable[[Any], bool],
        on_complete: Callable[[list[Any]], None],
    ) -> tuple[Subscription, bool]:
        """(the stream for key, whether it joined a flight already running)."""
        flight = self.running.get(key)
        if flight is not None:
            self.shared += 1
            return flight.subscribe(), True
        new = Flight(start(), is_last, on_complete)
        self.running[key] = new
        new.forgotten = lambda: self._forget(key, new)
        subscription = new.subscribe()
        return subscription, False

    def _forget(self, key: str, flight: Flight) -> None:
        if self.running.get(key) is flight:
            del self.running[key]
