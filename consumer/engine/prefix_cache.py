"""The consumer's prefix cache: rebuilt (or own-prefilled) KV kept per context chunk inside the KV
pool, so a follow-up question about the same document, or the next turn of a conversation, reuses
what was already rebuilt instead of transferring and rebuilding it again.

Chunks are `chunk_tokens` long (a multiple of the pool's block size, so a chunk owns whole
blocks) and named by chained keys (shared.chunks) under a root that says how their KV was made:
the consumer's own weights and the mode (the consumer's own prefill, or a codec with its format,
resolved options and the producer's weights), so KV rebuilt one way is never served for another.
A cached chunk holds its blocks in the pool (a holder count there): a request that starts with
cached full chunks shares their blocks read-only and writes only after them; a cached tail (the
last, shorter chunk of a context) is copied into the request's own blocks, because the request
writes its question right after it, in the same block.

Memory: the cache holds at most `budget_bytes` of blocks, and gives blocks back whenever a request
waits for KV memory (`make_room`): admitted requests come first. What goes first is the chunk of
least value per byte (AsymCache): value = (hits + 1) x the tokens its reuse saves (its end
position), and only leaves go (a chunk whose child is cached stays; a chunk without its parent is
never found). Victims come from a heap keyed by that value (stale items skipped), not a scan.
`make_room` evicts only chunks whose blocks the cache alone holds: evicting one that a running
request shares frees nothing, so it stays cached.

Threads (docs/design.md, "Who owns what"): the engine thread changes the cache (`insert`,
`make_room`, `clear`: engine jobs); the event loop reads it (`lookup`, which also takes the
request's hold on what it found, and `peek`), under the cache's lock, so a chunk found is never
evicted before it is held. Dropped blocks are zeroed and freed by the engine (KVPool.reclaim).
Knows nothing about gRPC or codecs.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from consumer.engine.kv_pool import KVPool, SequenceKV
from shared.chunks import ChunkRef


@dataclass(eq=False)
class CachedChunk:
    ref: ChunkRef
    blocks: list[int]  # pool blocks holding tokens [ref.start, ref.end)
    tail: bool  # shorter than chunk_tokens: the last chunk of its context
    hits: int = 0
    children: int = 0  # cached chunks whose parent this is
    last_used: float = field(default_factory=time.monotonic)
    version: int = 0  # bumped whenever its heap order changes: older heap items are stale

    def value_per_byte(self, block_bytes: int) -> float:
        return (self.hits + 1) * self.ref.end / (len(self.blocks) * block_bytes)


@dataclass
class Hit:
    """What a lookup found: full chunks to share, and a tail to copy."""

    shared: list[CachedChunk]
    tail: CachedChunk | None = None

    @property
    def tokens(self) -> int:
        if self.tail is not None:
            return self.tail.ref.end
        return self.shared[-1].ref.end if self.shared else 0

    @property
    def shared_blocks(self) -> list[int]:
        return [b for c in self.shared for b in c.blocks]

    @property
    def tail_blocks(self) -> list[int]:
        return list(self.tail.blocks) if self.tail is not None else []


class PrefixCache:
    def __init__(self, pool: KVPool, budget_bytes: int, chunk_tokens: int, events=None):
        if chunk_tokens % pool.block_tokens:
            raise ValueError(f"chunk_tokens {chunk_tokens}: must be a multiple of kv_block_tokens {pool.block_tokens}")
        self.pool, self.budget_bytes, self.chunk_tokens = pool, budget_bytes, chunk_tokens
        self.entries: dict[str, CachedChunk] = {}
        self.hits = self.partial_hits = self.misses = self.evictions = 0
        self.kept_shared = 0  # make_room passes over a chunk a running request shares (evicting it frees nothing)
        self._blocks = 0  # blocks the entries hold
        self._heap: list[tuple[float, float, int, int, str]] = []  # (value/byte, last_used, order, version, key)
        self._order = itertools.count()
        self._lock = threading.Lock()
        # KV events (shared.kv_events.KVEventPublisher, --kv-events-endpoint): insert, eviction and
        # clear enqueue a record (the engine thread never waits); None: off
        self.events = events

    @property
    def nbytes(self) -> int:
        return self._blocks * self.pool.block_bytes

    def _push(self, entry: CachedChunk) -> None:
        """(Re)index a leaf by its current value; items of earlier versions become stale."""
        entry.version += 1
        if entry.children:
            return  # not evictable until its last child goes (then it is pushed again)
        item = (entry.value_per_byte(self.pool.block_bytes), entry.last_used, next(self._order), entry.version, entry.ref.key)
        heapq.heappush(self._heap, item)
        if len(self._heap) > 64 + 4 * len(self.entries):  # stale items: rebuild from the live leaves
            self._heap = [i for i in self._heap if self._live(i) is not None]
            heapq.heapify(self._heap)

    def _live(self, item: tuple[float, float, int, int, str]) -> CachedChunk | None:
        entry = self.entries.get(item[4])
        return entry if entry is not None and entry.version == item[3] and not entry.children else None

    # --- the event loop's side (reads, and the request's holds) -------------------------------------

    def lookup(self, refs: Sequence[ChunkRef], hold: bool = False) -> Hit:
        """The longest cached prefix of a context's chunks (every chunk cached up to there). `hold`:
        also take one hold on its blocks (KVPool.hold) for the caller, in the same step, so that
        they cannot be evicted before the caller holds them; the caller drops them."""
        with self._lock:
            hit = Hit([])
            for ref in refs:
                entry = self.entries.get(ref.key)
                if entry is None:
                    break
                if entry.tail:
                    hit.tail = entry
                    break
                hit.shared.append(entry)
            now = time.monotonic()
            for entry in hit.shared + ([hit.tail] if hit.tail else []):
                entry.hits += 1
                entry.last_used = now
                self._push(entry)
            if hold:
                self.pool.hold(hit.shared_blocks + hit.tail_blocks)
            whole = refs and hit.tokens == refs[-1].end
            if whole:
                self.hits += 1
            elif hit.tokens:
                self.partial_hits += 1
            else:
                self.misses += 1
            return hit

    def peek(self, refs: Sequence[ChunkRef]) -> int:
        """Tokens of the longest cached prefix (as lookup finds it), touching no counter or entry."""
        end = 0
        with self._lock:
            for ref in refs:
                entry = self.entries.get(ref.key)
                if entry is None:
                    break
                end = entry.ref.end
                if entry.tail:
                    break
        return end

    # --- the engine thread's side (changes) ----------------------------------------------------------

    def insert(self, refs: Sequence[ChunkRef], seq: SequenceKV) -> int:
        """Keep the chunks of seq's context (its KV complete over every ref) that are not cached
        yet; returns how many were added. Within the byte budget, evicting lesser chunks. A tail's
        last block keeps only the tail's tokens: the rest (the inserting request's question and
        answer) is zeroed. Engine thread, after seq's task finished."""
        added = 0
        bt = self.pool.block_tokens
        with self._lock:
            for ref in refs:
                if ref.key in self.entries:
                    continue
                if ref.parent not in self.entries and ref.start > 0:
                    break  # its parent was evicted meanwhile: a chunk without its parent is no prefix
                blocks = seq.blocks[ref.start // bt : -(-ref.end // bt)]
                if not self._fit(len(blocks), keep=ref.parent):
                    break
                self.pool.hold(blocks)
                entry = CachedChunk(ref, blocks, tail=ref.end - ref.start < self.chunk_tokens)
                if entry.tail:
                    self.pool.zero_after(blocks[-1], ref.end - (len(blocks) - 1) * bt - ref.start // bt * bt)
                self.entries[ref.key] = entry
                self._blocks += len(blocks)
                if ref.start > 0:
                    parent = self.entries[ref.parent]
                    parent.children += 1
                    parent.version += 1  # its leaf items are stale now
                self._push(entry)
                added += 1
                if self.events is not None:
                    self.events.stored(ref.key, ref.parent, ref.start, ref.tokens)
        return added

    def _fit(self, blocks: int, keep: str = "") -> bool:
        """Evict lesser leaves (any, shared or not: the budget counts what the cache holds) until
        `blocks` more fit in the budget."""
        need = blocks * self.pool.block_bytes
        passed = []
        try:
            while self.nbytes + need > self.budget_bytes:
                victim = self._pop()
                if victim is None:
                    return False
                if victim.ref.key == keep:
                    passed.append(victim)
                    continue
                self._evict(victim)
            return True
        finally:
            for entry in passed:
                self._push(entry)

    def make_room(self, blocks: int) -> int:
        """Evict, least value per byte first, chunks only the cache holds until `blocks` pool blocks
        are free or waiting to be reclaimed, or no such chunk is left (a request is waiting for KV
        memory). Returns the blocks this freed. Engine thread: the caller reclaims them."""
        freed = 0
        passed = []
        with self._lock:
            while self.pool.free_blocks + self.pool.reclaimable_blocks < blocks:
                victim = self._pop()
                if victim is None:
                    break
                if not self.pool.only_holder(victim.blocks):
                    passed.append(victim)  # a running request shares it: evicting it frees nothing
                    self.kept_shared += 1
                    continue
                freed += len(victim.blocks)
                self._evict(victim)
            for entry in passed:
                self._push(entry)
        return freed

    def _pop(self) -> CachedChunk | None:
        """The live leaf of least value per byte, out of the heap (the caller evicts or re-pushes it)."""
        while self._heap:
            entry = self._live(heapq.heappop(self._heap))
            if entry is not None:
                return entry
        return None

    def _evict(self, victim: CachedChunk, publish: bool = True) -> None:
        del self.entries[victim.ref.key]
        if publish and self.events is not None:
            self.events.removed(victim.ref.key)
        self._blocks -= len(victim.blocks)
        parent = self.entries.get(victim.ref.parent)
        if parent is not None:
            parent.children -= 1
            if not parent.children:
                self._push(parent)  # a leaf again
        self.pool.drop(victim.blocks)
        self.evictions += 1

    def clear(self) -> None:
        with self._lock:
            while (victim := self._pop()) is not None:
                self._evict(victim, publish=False)
            if self.events is not None:
                self.events.cleared()  # one AllBlocksCleared, as vLLM's prefix cache reset
