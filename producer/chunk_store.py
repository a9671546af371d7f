"""The producer's chunk store: state kept per context chunk (shared.chunks), in RAM and, when
configured, on local disk (producer.disk_tier), each tier within its own byte budget.

An entry is one chunk's tensors: the producer model's own K/V over the chunk's tokens (under a
model-rooted key: what a continued prefill attends to) or one codec's encoded payloads for them
(under a codec-rooted key: what is replayed). `get` looks in RAM, then on disk (a disk hit is
promoted to RAM); `put` writes RAM and, write-through, the disk tier, so a restarted producer
still serves what it had written.

Eviction (`Index.victim`), per tier:
- "cost" (AsymCache's idea): among the tier's leaves (entries none of whose children it holds:
  a chunk is worthless without its parent, so leaves go before their prefixes), the lowest value
  per byte, value = (hits + 1) x end position (the prefill the chunk saves grows with every token
  up to its end); ties by least recent use;
- "lru": the least recently used entry, whatever its place in the chain (kept for comparison).
Making room is all or nothing (`Index.make_room`): the victims are dropped from the index and their
data from the tier in the same step under the lock, or nothing changes; what a request just stored
and every ancestor of it are never victims. So the index and the data agree at every step: bytes
counted = bytes held <= budget, every key `has` reports is one `get` returns, and each eviction
from RAM publishes its removal event (tests/test_store_properties.py checks these over random
sequences of puts, continuations, gets, evictions and restarts, on both tiers).

Memory outside the budget: a running request's plan (producer.reuse) holds the entries it loaded
until it ends, so an entry evicted (or a disk read not kept in RAM) meanwhile still holds its
memory. The plan pins what it holds (`pin`); `pinned_evicted_bytes` counts the pinned entries
the RAM tier no longer holds (the scd_store_tier_pinned_evicted_bytes metric, Describe), and
eviction takes unpinned entries first (evicting a pinned one frees nothing until it ends).

Thread-safe (one lock): lookups run on a worker thread, stores on the event loop. Knows nothing
about gRPC, models or codecs: entries are named CPU tensors.
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

POLICIES = ("cost", "lru")


@dataclass
class ChunkEntry:
    key: str
    parent: str  # the previous chunk's key, or the chain's root
    end: int  # token position where the chunk ends: the prefill it saves
    tensors: dict[str, torch.Tensor]  # "<layer>.<name>" -> CPU tensor over the chunk's tokens
    tokens: tuple[int, ...] = field(default=(), repr=False)  # its token ids when known (KV events); () from disk

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def layer(self, index: int) -> dict[str, torch.Tensor]:
        """One layer's tensors, by name (without the layer prefix)."""
        head = f"{index}."
        return {name[len(head) :]: t for name, t in self.tensors.items() if name.startswith(head)}


@dataclass
class Slot:
    """What eviction knows of an entry."""

    nbytes: int
    parent: str
    end: int
    hits: int = 0
    used: int = 0  # the index's clock at the last use
    version: int = 0  # bumped whenever its eviction order or leaf status changes: older heap items are stale


@dataclass
class Index:
    """One tier's bookkeeping: slots by key, bytes held, children per parent, and the eviction
    choice. The tier itself holds the data.

    The eviction order is a heap of candidates (leaves under "cost", every entry under "lru"),
    items of an older version of a slot skipped as stale: a victim costs O(log n), not a scan of
    every slot on the event loop."""

    budget_bytes: int
    policy: str = "cost"
    slots: dict[str, Slot] = field(default_factory=dict)
    children: dict[str, int] = field(default_factory=dict)  # parent key -> its children held here
    nbytes: int = 0
    clock: int = 0
    hits: int = 0
    evictions: int = 0
    _heap: list[tuple[float, int, int, str]] = field(default_factory=list, repr=False)  # (value/byte, used, version, key)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"eviction policy {self.policy!r} not in {POLICIES}")

    def _candidate(self, key: str) -> bool:
        return self.policy == "lru" or not self.children.get(key)  # "cost": a prefix of something held goes after it

    def _push(self, key: str) -> None:
        """(Re)order a slot by its current value; its earlier heap items become stale."""
        slot = self.slots[key]
        slot.version += 1
        if not self._candidate(key):
            return  # pushed again when its last child goes
        score = 0.0 if self.policy == "lru" else (slot.hits + 1) * slot.end / max(slot.nbytes, 1)
        heapq.heappush(self._heap, (score, slot.used, slot.version, key))
        if len(self._heap) > 64 + 4 * len(self.slots):  # mostly stale: rebuild from the live items
            self._heap = [item for item in self._heap if self._live(item)]
            heapq.heapify(self._heap)

    def _live(self, item: tuple[float, int, int, str]) -> bool:
        slot = self.slots.get(item[3])
        return slot is not None and slot.version == item[2] and self._candidate(item[3])

    def touch(self, key: str) -> None:
        self.clock += 1
        slot = self.slots[key]
        slot.hits += 1
        slot.used = self.clock
        self.hits += 1
        self._push(key)

    def add(self, key: str, slot: Slot) -> None:
        self.drop(key)
        self.clock += 1
        slot.used = slot.used or self.clock
        self._insert(key, slot)

    def _insert(self, key: str, slot: Slot) -> None:
        self.slots[key] = slot
        self.nbytes += slot.nbytes
        held = self.children.get(slot.parent, 0)
        self.children[slot.parent] = held + 1
        if not held and slot.parent in self.slots:
            self._push(slot.parent)  # no longer a leaf: its heap items go stale
        self._push(key)

    def drop(self, key: str) -> Slot | None:
        slot = self.slots.pop(key, None)
        if slot is not None:
            self.nbytes -= slot.nbytes
            left = self.children[slot.parent] - 1
            if left:
                self.children[slot.parent] = left
            else:
                del self.children[slot.parent]
                if slot.parent in self.slots:
                    self._push(slot.parent)  # a leaf again
        return slot

    def victim(self, keep: Collection[str] = ()) -> str | None:
        """The next entry to evict (never one of `keep`), or None when no other can go: under
        "cost" the leaf (an entry none of whose children is held here: a chunk is worthless without
        its parent, so leaves go before their prefixes) of lowest value per byte, value = (hits + 1)
        x end position, ties by least recent use; under "lru" the least recently used entry."""
        skipped = []
        chosen = None
        while self._heap:
            item = self._heap[0]
            if not self._live(item):
                heapq.heappop(self._heap)
            elif item[3] in keep:
                skipped.append(heapq.heappop(self._heap))
            else:
                chosen = item[3]
                break
        for item in skipped:
            heapq.heappush(self._heap, item)
        return chosen

    def closure(self, key: str, parent: str, protect: Iterable[str] = ()) -> set[str]:
        """What making room for `key` (under `parent`) must not evict: the key, `protect`, and under
        "cost" every ancestor of them held here (evicting one would orphan what it leads to)."""
        keep = {key, *protect}
        if self.policy != "cost":
            return keep
        starts = [parent, *(self.slots[p].parent for p in protect if p in self.slots)]
        for up in starts:
            while up in self.slots and up not in keep:
                keep.add(up)
                up = self.slots[up].parent
        return keep

    def make_room(
        self, key: str, parent: str, nbytes: int, protect: Sequence[str] = (), last: frozenset[str] = frozenset()
    ) -> list[str] | None:
        """Evict until nbytes more fit, all or nothing: the keys evicted (their slots dropped; the
        tier removes their data), or None with nothing changed when they cannot fit. Never evicts
        `closure` (the new entry, `protect`: what the same request just stored, and their held
        ancestors), and `last` (entries in use: evicting them frees nothing yet) only when nothing
        else can go. A chain that outgrows the budget keeps its prefix and stores no more."""
        keep = self.closure(key, parent, protect)
        replaced = self.slots[key].nbytes if key in self.slots else 0  # a rewrite: its old bytes go
        fixed = sum(self.slots[k].nbytes for k in keep if k in self.slots and k != key)
        if fixed + nbytes > self.budget_bytes:
            return None
        evicted: list[tuple[str, Slot]] = []
        while self.nbytes - replaced + nbytes > self.budget_bytes:
            victim = (self.victim(keep | last) if last else None) or self.victim(keep)
            if victim is None:  # cannot happen (what is not kept holds a leaf): undo, all or nothing
                for k, back in reversed(evicted):
                    self._insert(k, back)
                return None
            dropped = self.drop(victim)
            assert dropped is not None
            evicted.append((victim, dropped))
        self.evictions += len(evicted)
        return [k for k, _ in evicted]

    def over_budget(self) -> list[str]:
        """Evict by policy until the bytes held fit the budget (a tier found larger than its budget
        at start-up); the keys evicted."""
        evicted = []
        while self.nbytes > self.budget_bytes:
            victim = self.victim()
            if victim is None:
                break
            self.drop(victim)
            self.evictions += 1
            evicted.append(victim)
        return evicted


@dataclass(frozen=True)
class TierStats:
    """One tier as Describe and the metrics show it."""

    name: str
    index: Index
    corrupt: int = 0  # entries dropped for bad bytes
    write_skipped: int = 0  # disk: writes skipped, the writer's queue full
    queued_bytes: int = 0  # disk: tensor bytes waiting for the writer
    pinned_evicted_bytes: int = 0  # RAM: bytes evicted but still held by running requests


class LowerTier(Protocol):
    """What the store needs of a tier below RAM (producer.disk_tier.DiskTier)."""

    index: Index
    corrupt: int
    write_skipped: int
    queued_bytes: int

    def has(self, key: str) -> bool: ...

    def read(self, key: str) -> ChunkEntry | None: ...

    def write(self, entry: ChunkEntry) -> None: ...

    def close(self) -> None: ...


class Events(Protocol):
    """What the store tells about its RAM tier (shared.kv_events.KVEventPublisher): calls that only enqueue."""

    def stored(self, key: str, parent: str, start: int, tokens: Sequence[int]) -> None: ...

    def removed(self, key: str) -> None: ...

    def cleared(self) -> None: ...


class ChunkStore:
    def __init__(self, budget_bytes: int, policy: str = "cost", disk: LowerTier | None = None, events: Events | None = None):
        self.index = Index(budget_bytes, policy)
        self.events = events  # KV events of the RAM tier (vLLM's format), or None
        self.entries: dict[str, ChunkEntry] = {}
        self.disk = disk
        self._lock = threading.RLock()
        # per request (the servicer counts them; the whole-context store's metric names):
        self.hits = 0  # whole contexts replayed, no forward
        self.misses = 0  # requests that ran a forward (partial_hits of them on a stored prefix)
        self.partial_hits = 0
        self._pinned: dict[int, ChunkEntry] = {}  # id(entry) -> entry: entries running requests hold
        self._pins: dict[int, int] = {}  # id(entry) -> how many requests hold it

    @property
    def evictions(self) -> int:
        return self.index.evictions

    @property
    def budget_bytes(self) -> int:
        return self.index.budget_bytes

    @property
    def nbytes(self) -> int:
        return self.index.nbytes

    def has(self, key: str) -> bool:
        with self._lock:
            return key in self.entries or (self.disk is not None and self.disk.has(key))

    def get(self, key: str) -> ChunkEntry | None:
        """The entry from RAM, else from disk (checksum verified, promoted to RAM), else None."""
        with self._lock:
            entry = self.entries.get(key)
            if entry is not None:
                self.index.touch(key)
                return entry
        if self.disk is None:
            return None
        entry = self.disk.read(key)  # outside the lock: file I/O
        if entry is not None:
            self.put(entry, write_through=False)
        return entry

    def pin(self, entries: Iterable[ChunkEntry]) -> Callable[[], None]:
        """Count `entries` as held by a running request until the returned release is called
        (a second call does nothing; producer.reuse.plan's pin ends with its plan)."""
        held = list({id(e): e for e in entries}.values())
        with self._lock:
            for e in held:
                self._pinned[id(e)] = e
                self._pins[id(e)] = self._pins.get(id(e), 0) + 1

        def release() -> None:
            with self._lock:
                if not held:
                    return  # released already
                for e in held:
                    left = self._pins.pop(id(e), 0) - 1
                    if left > 0:
                        self._pins[id(e)] = left
                    else:
                        self._pinned.pop(id(e), None)
                held.clear()

        return release

    @property
    def pinned_evicted_bytes(self) -> int:
        """Bytes of entries running requests hold that RAM no longer holds (evicted, cleared, or
        read from disk and not kept): memory outside the budget until those requests end."""
        with self._lock:
            return sum(e.nbytes for e in self._pinned.values() if self.entries.get(e.key) is not e)

    def put_many(self, entries: Sequence[ChunkEntry]) -> int:
        """Keep one request's new chunks, in order (chunk by chunk: its K/V, then its payloads),
        none evicting another of them; RAM stops at the first that does not fit (what follows
        would not extend a stored prefix), the disk tier takes them all. How many RAM kept."""
        if self.disk is not None:
            for entry in entries:
                self.disk.write(entry)
        kept: list[str] = []
        for entry in entries:
            if not self.put(entry, write_through=False, protect=kept):
                break
            kept.append(entry.key)
        return len(kept)

    def put(self, entry: ChunkEntry, write_through: bool = True, protect: Sequence[str] = ()) -> bool:
        """Keep an entry (RAM, evicting by policy but never `protect`; disk write-through);
        False when it does not fit in RAM."""
        nbytes = entry.nbytes
        if write_through and self.disk is not None:
            self.disk.write(entry)
        if nbytes > self.index.budget_bytes:
            return False
        with self._lock:
            pinned = frozenset(e.key for e in self._pinned.values() if self.entries.get(e.key) is e)
            evicted = self.index.make_room(entry.key, entry.parent, nbytes, protect, pinned)
            if evicted is None:
                return False  # nothing was evicted
            for key in evicted:
                self.entries.pop(key)  # the index's slots and the entries are the same keys
            new = entry.key not in self.entries
            self.entries[entry.key] = entry
            self.index.add(entry.key, Slot(nbytes, entry.parent, entry.end))
            if self.events is not None:
                for key in evicted:
                    self.events.removed(key)
                if new:
                    self.events.stored(entry.key, entry.parent, entry.end - len(entry.tokens), entry.tokens)
        return True

    def clear(self) -> None:
        """Forget every RAM entry (counters stay; the disk tier keeps its files)."""
        with self._lock:
            self.entries.clear()
            for key in list(self.index.slots):
                self.index.drop(key)
            if self.events is not None:
                self.events.cleared()

    def tiers(self) -> list[TierStats]:
        """Each tier's index and counters, for Describe and metrics."""
        out = [TierStats("ram", self.index, pinned_evicted_bytes=self.pinned_evicted_bytes)]
        if self.disk is not None:
            d = self.disk
            out.append(TierStats("disk", d.index, d.corrupt, d.write_skipped, d.queued_bytes))
        return out
