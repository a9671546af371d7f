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
never found). Runs on the event loop; knows nothing about gRPC or codecs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from consumer.kv_pool import KVPool, SequenceKV
from shared.chunks import ChunkRef


@dataclass(eq=False)
class CachedChunk:
    ref: ChunkRef
    blocks: list[int]  # pool blocks holding tokens [ref.start, ref.end)
    tail: bool  # shorter than chunk_tokens: the last chunk of its context
    hits: int = 0
    children: int = 0  # cached chunks whose parent this is
    last_used: float = field(default_factory=time.monotonic)

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


class PrefixCache:
    def __init__(self, pool: KVPool, budget_bytes: int, chunk_tokens: int):
        if chunk_tokens % pool.block_tokens:
            raise ValueError(f"chunk_tokens {chunk_tokens}: must be a multiple of kv_block_tokens {pool.block_tokens}")
        self.pool, self.budget_bytes, self.chunk_tokens = pool, budget_bytes, chunk_tokens
        self.entries: dict[str, CachedChunk] = {}
        self.hits = self.partial_hits = self.misses = self.evictions = 0

    @property
    def nbytes(self) -> int:
        return sum(len(c.blocks) for c in self.entries.values()) * self.pool.block_bytes

    def lookup(self, refs: Sequence[ChunkRef]) -> Hit:
        """The longest cached prefix of a context's chunks (every chunk cached up to there)."""
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
        for ref in refs:
            entry = self.entries.get(ref.key)
            if entry is None:
                break
            end = entry.ref.end
            if entry.tail:
                break
        return end

    def insert(self, refs: Sequence[ChunkRef], seq: SequenceKV) -> int:
        """Keep the chunks of seq's context (its KV complete over every ref) that are not cached
        yet; returns how many were added. Within the byte budget, evicting lesser chunks."""
        added = 0
        bt = self.pool.block_tokens
        for ref in refs:
            if ref.key in self.entries:
                continue
            if ref.parent not in self.entries and ref.start > 0:
                break  # its parent was evicted meanwhile: a chunk without its parent is no prefix
            blocks = seq.blocks[ref.start // bt : -(-ref.end // bt)]
            need = len(blocks) * self.pool.block_bytes
            if not self._fit(need, keep=ref.parent):
                break
            self.pool.hold(blocks)
            self.entries[ref.key] = CachedChunk(ref, blocks, tail=ref.end - ref.start < self.chunk_tokens)
            if ref.start > 0:
                self.entries[ref.parent].children += 1
            added += 1
        return added

    def _fit(self, need: int, keep: str = "") -> bool:
        while self.nbytes + need > self.budget_bytes:
            if not self._evict_one(keep):
                return False
        return True

    def make_room(self, blocks: int) -> None:
        """Evict until `blocks` pool blocks are free or nothing evictable is left (a request is
        waiting for KV memory)."""
        while self.pool.free_blocks < blocks and self._evict_one():
            pass

    def _evict_one(self, keep: str = "") -> bool:
        leaves = [c for k, c in self.entries.items() if c.children == 0 and k != keep]
        if not leaves:
            return False
        victim = min(leaves, key=lambda c: (c.value_per_byte(self.pool.block_bytes), c.last_used))
        del self.entries[victim.ref.key]
        parent = self.entries.get(victim.ref.parent)
        if parent is not None:
            parent.children -= 1
        self.pool.drop(victim.blocks)
        self.evictions += 1
        return True

    def clear(self) -> None:
        while self._evict_one():
            pass
