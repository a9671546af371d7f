"""Admission by KV memory: a request enters the engine only when the pool has blocks for its whole
worst case (context + question + max_new_tokens); until then it waits in a bounded FIFO queue (the
wait is part of its TTFT and reported in its stats). A request that can never fit, or that finds
the queue full, gets RESOURCE_EXHAUSTED naming the limit.

Runs on the event loop; blocks come back from the engine thread through `wake` (thread-safe).
Strict FIFO: a large request at the head is not overtaken by smaller ones behind it (no
starvation). Knows nothing about gRPC or codecs.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass

from consumer.kv_pool import KVPool, SequenceKV
from shared.errors import DeadlineExceeded, ResourceExhausted


@dataclass(eq=False)
class _Waiter:
    tokens: int
    future: asyncio.Future


class KVAdmission:
    def __init__(self, pool: KVPool, max_queue: int):
        self.pool, self.max_queue = pool, max_queue
        self.waiters: collections.deque[_Waiter] = collections.deque()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.rejected = {"never_fits": 0, "queue_full": 0}

    @property
    def queued(self) -> int:
        return len(self.waiters)

    async def acquire(self, tokens: int, deadline: float) -> tuple[SequenceKV, float]:
        """Blocks for `tokens` tokens and the seconds waited for them; waits at most until
        `deadline` (time.monotonic())."""
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
            ready = pool.allocate(tokens)
            if ready is not None:
                return ready, 0.0
        if len(self.waiters) >= self.max_queue:
            self.rejected["queue_full"] += 1
            raise ResourceExhausted(f"KV memory queue full: {len(self.waiters)} requests waiting >= max_queue {self.max_queue}")
        started = time.monotonic()
        waiter = _Waiter(tokens, self.loop.create_future())
        self.waiters.append(waiter)
        try:
            seq: SequenceKV = await asyncio.wait_for(asyncio.shield(waiter.future), max(0.0, deadline - time.monotonic()))
        except BaseException as exc:  # deadline, cancel: out of the queue; blocks granted meanwhile go back
            if waiter in self.waiters:
                self.waiters.remove(waiter)
            if waiter.future.done() and not waiter.future.cancelled():
                pool.release(waiter.future.result())  # never touched by the engine: safe from this thread
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
            seq = self.pool.allocate(head.tokens)
            if seq is None:
                return
            self.waiters.popleft()
            head.future.set_result(seq)
