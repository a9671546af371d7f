"""Single flight: concurrent requests for the same (context token ids, codec, resolved options,
codec metadata, tenant) share one prefill and one encode.

The first request for a key starts a `Flight`: a task that drives the engine's stream for it
and keeps every item it yields. Each caller, the first included, is a subscriber with its own
buffer: it is given the items produced so far, then the live ones, so a slow subscriber never
holds up the flight or the others. The flight does not belong to the caller that started it:
it runs while anyone still listens and is stopped (its forward row leaves the batch at the next
layer) once the last subscriber has gone. A failure reaches every subscriber. The flight is
forgotten when it ends; a completed stream's keeping (the context store) is the `on_complete`
callback's, called before any subscriber sees the end.

Memory: the flight keeps its encoded stream while it runs (a late subscriber starts from the
first item) and drops it when it ends; a subscriber's buffer holds what it has not taken yet.
Those unsent bytes (`size` of each item) are bounded (`Unsent`): per subscriber, and over all of
them; a subscriber past either bound is failed alone with RESOURCE_EXHAUSTED, its buffer emptied
at once (the slowest reader goes first when the total is past its bound): a reader that falls
behind costs its own stream, never the others' or the process's memory. Knows nothing about
gRPC or models.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from shared.errors import ResourceExhausted


class _End:
    """Queued after the last item: None when the stream completed, else what stopped it."""

    def __init__(self, exc: BaseException | None):
        self.exc = exc


class Unsent:
    """The bytes the flights' subscribers hold but have not taken, per subscriber and in all, and
    their bounds (0: none)."""

    def __init__(self, max_total: int = 0, max_each: int = 0, size: Callable[[Any], int] = lambda item: 0):
        self.max_total, self.max_each, self.size = max_total, max_each, size
        self.total = 0
        self.subscribers: set[Subscription] = set()
        self.failed = 0  # subscribers failed for falling behind

    def over(self, sub: Subscription) -> Subscription | None:
        """The subscriber to fail now that `sub` holds more, or None: `sub` past its own bound,
        else the one holding most while the total is past its bound. A subscriber holding one
        item is never past its own bound (one layer may be larger than the bound: it must pass)."""
        if self.max_each and sub.unsent > self.max_each and sub.queue.qsize() > 1:
            return sub
        if self.max_total and self.total > self.max_total:
            return max(self.subscribers, key=lambda s: s.unsent)
        return None


class Flight:
    def __init__(
        self,
        source: AsyncIterator[Any],
        is_last: Callable[[Any], bool],
        on_complete: Callable[[list[Any]], None],
        unsent: Unsent | None = None,
    ):
        self.items: list[Any] = []
        self.end: _End | None = None
        self.subscribers: set[Subscription] = set()
        self.unsent = unsent if unsent is not None else Unsent()
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
                    for sub in list(self.subscribers):
                        sub.put(item)
                    if end.exc is None:
                        break
        except asyncio.CancelledError:
            end = _End(asyncio.CancelledError())
            raise
        except Exception as exc:
            end = _End(exc)
        finally:
            self.end = end
            self.items = []  # no subscriber joins an ended flight: each holds what it has not taken
            self.forgotten()
            for sub in list(self.subscribers):
                sub.queue.put_nowait(end)

    def subscribe(self) -> Subscription:
        """A new subscriber, registered now: the flight's items from the first, then live."""
        return Subscription(self)

    def _leave(self, sub: Subscription) -> None:
        self.subscribers.discard(sub)
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
        self.unsent = 0  # bytes of the items in `queue`
        self.closed = False
        flight.subscribers.add(self)
        flight.unsent.subscribers.add(self)
        for item in flight.items:
            self.put(item)
        if flight.end is not None:
            self.queue.put_nowait(flight.end)

    def put(self, item: Any) -> None:
        if self.closed:
            return
        size = self.flight.unsent.size(item)
        self.queue.put_nowait(item)
        self.unsent += size
        self.flight.unsent.total += size
        victim = self.flight.unsent.over(self)
        if victim is not None:
            victim.fall_behind()

    def fall_behind(self) -> None:
        """Fail this subscriber alone (it holds too many unsent bytes): its buffer emptied now,
        RESOURCE_EXHAUSTED when it next reads."""
        held, limits = self.unsent, self.flight.unsent
        self._drop()
        limits.failed += 1
        each = f"--max-request-unsent-bytes {limits.max_each}" if limits.max_each else "no per-request bound"
        self.queue.put_nowait(
            _End(
                ResourceExhausted(
                    f"the caller fell behind: {held} encoded payload bytes not yet read"
                    f" ({each}, --max-unsent-bytes {limits.max_total} for all calls): read faster or ask for less"
                )
            )
        )

    def _drop(self) -> None:
        """Leave the flight and forget the unsent items (their bytes leave the totals)."""
        self.closed = True
        self.flight.unsent.total -= self.unsent
        self.unsent = 0
        self.flight.unsent.subscribers.discard(self)
        while not self.queue.empty():
            self.queue.get_nowait()
        self.flight._leave(self)

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> Any:
        if self.closed and self.queue.empty():
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, _End):
            await self.aclose()
            if item.exc is not None:
                raise item.exc
            raise StopAsyncIteration
        size = self.flight.unsent.size(item)
        self.unsent -= size
        self.flight.unsent.total -= size
        return item

    async def aclose(self) -> None:
        if not self.closed:
            self._drop()
            task = self.flight.task
            if not self.flight.subscribers and not task.done():  # the last one: the shared work stops
                await asyncio.wait({task})  # ... now, its prefill out of the compute queue before we return


class Flights:
    """The flights running now, by key, and the bound on their subscribers' unsent bytes."""

    def __init__(self, unsent: Unsent | None = None) -> None:
        self.running: dict[str, Flight] = {}
        self.shared = 0  # subscriptions that joined a flight another request had started
        self.unsent = unsent if unsent is not None else Unsent()

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
        new = Flight(start(), is_last, on_complete, self.unsent)
        self.running[key] = new
        new.forgotten = lambda: self._forget(key, new)
        subscription = new.subscribe()
        return subscription, False

    def _forget(self, key: str, flight: Flight) -> None:
        if self.running.get(key) is flight:
            del self.running[key]
