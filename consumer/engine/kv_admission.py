"""Admission by KV memory: a request enters the engine only when the pool has blocks for its whole
worst case (context + question + max_new_tokens); until then it waits in a bounded FIFO queue (the
wait is part of its TTFT and reported in its stats). A request that can never fit, or that finds
the queue full, gets RESOURCE_EXHAUSTED naming the limit.

Runs on the event loop; blocks come back from the engine thread through `wake` (thread-safe: the
pool calls it whenever the engine's reclaim freed blocks). When the pool is short, admission asks
the engine to make room (`make_room`, an intent: the prefix cache evicts on the engine thread) and
the request waits for the blocks that frees.
Strict FIFO: a large request at the head is not overtaken by smaller ones behind it (no
starvation). Knows nothing about gRPC or codecs.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from consumer.engine.kv_pool import KVPool, SequenceKV
from shared.errors import DeadlineExceeded, ResourceExhausted


@dataclass(eq=False)
class _Waiter:
    tokens: int
    future: asyncio.Future
    shared: list[int] = field(default_factory=list)


class KVAdmission:
    def __init__(self, pool: KVPool, max_queue: int, make_room: Callable[[int], Any] | None = None):
        self.pool, self.max_queue = pool, max_queue
        # asks the engine to free cached blocks (the prefix cache) for a waiting request; returns a
        # concurrent future done once it ran (its freed blocks reach `wake` through the pool)
        self.make_room = make_room
        self._room_asked: Any = None  # the make_room call in flight: one at a time
        self.waiters: collections.deque[_Waiter] = collections.deque()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.rejected = {"never_fits": 0, "queue_full": 0}
        pool.on_freed.append(self.wake)

    @property
    def queued(self) -> int:
        return len(self.waiters)

    def _allocate(self, tokens: int, shared: list[int]) -> SequenceKV | None:
        seq = self.pool.allocate(tokens, shared)
        if seq is None and self.make_room is not None and (self._room_asked is None or self._room_asked.done()):
            self._room_asked = self.make_room(self.pool.blocks_for(tokens) - len(shared))
        return seq

    async def acquire(self, tokens: int, deadline: float, shared: list[int] | None = None) -> tuple[SequenceKV, float]:
        """Blocks for `tokens` tokens and the seconds waited for them; waits at most until
        `deadline` (time.monotonic()). `shared`: a cached prefix's blocks the caller holds
        (`KVPool.hold`); the hold passes to the sequence, or is dropped here when none comes."""
        shared = list(shared or ())
        granted = False
        try:
            seq, waited = await self._acquire(tokens, deadline, shared)
            granted = True
            return seq, waited
        finally:
            if not granted and shared:
                self.pool.drop(shared)

    async def _acquire(self, tokens: int, deadline: float, shared: list[int]) -> tuple[SequenceKV, float]:
        self.loop = asyncio.get_running_loop()
        pool = self.pool
        if not pool.fits_ever(tokens):
            self.rejected["never_fits"] += 1
            need = pool.blocks_for(tokens) * pool.block_bytes
            raise ResourceExhausted(
                f"KV memory: this request needs {tokens} tokens ({need} bytes of KV) > kv_pool_bytes"
                f" {pool.capacity_bytes} (the consumer's whole KV pool); shorten the context or max_new_tokens"
            )
        if not self.waiters:
            ready = self._allocate(tokens, shared)
            if ready is not None:
                return ready, 0.0
        if len(self.waiters) >= self.max_queue:
            self.rejected["queue_full"] += 1
            raise ResourceExhausted(f"KV memory queue full: {len(self.waiters)} requests waiting >= max_queue {self.max_queue}")
        started = time.monotonic()
        waiter = _Waiter(tokens, self.loop.create_future(), shared)
        self.waiters.append(waiter)
        try:
            seq: SequenceKV = await asyncio.wait_for(asyncio.shield(waiter.future), max(0.0, deadline - time.monotonic()))
        except BaseException as exc:  # deadline, cancel: out of the queue; blocks granted meanwhile go back
            if waiter in self.waiters:
                self.waiters.remove(waiter)
            if waiter.future.done() and not waiter.future.cancelled():
                seq = waiter.future.result()  # never touched by the engine: safe from this thread
                seq.released = True
                pool.drop(seq.blocks[seq.shared_blocks :])  # its own blocks; acquire's finally drops the shared
            waiter.future.cancel()
            self._grant()
            if isinstance(exc, TimeoutError):
                raise DeadlineExceeded(f"deadline passed while waiting for KV memory ({len(self.waiters)} queued)") from None
            raise
        return seq, time.monotonic() - started

    def wake(self) -> None:
        """Blocks were freed (any thread): grant waiting requests in order."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._grant)

    def _grant(self) -> None:
        while self.waiters:
            head = self.waiters[0]
            if head.future.done():
                self.waiters.popleft()
                continue
            seq = self._allocate(head.tokens, head.shared)
            if seq is None:
                return
            self.waiters.popleft()
            head.future.set_result(seq)
