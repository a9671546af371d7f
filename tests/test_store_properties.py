"""The producer's chunk store keeps its books straight on both tiers, whatever the sequence:
random puts, continuations (one request's new chunks, put together), gets, evictions (a large
entry, a clear), pins and restarts (the disk tier scanned again, maybe with a smaller budget),
checked after every step:
- RAM: the index and the entries hold the same keys; bytes counted = bytes held <= budget; the
  children counts are those of the entries held; the removal events match (stored - removed =
  held);
- disk: the index and the files hold the same keys; bytes counted = the files' bytes <= budget;
- every key `has` reports is one `get` returns, with the bytes that were put under it.
Plus the orders of events that broke this before: a continuation whose chain outgrows the RAM
budget evicted the other leaves from the index and kept their entries (present, then a KeyError
on get: INTERNAL on every later request), and a disk directory larger than the budget was
admitted whole at start-up."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from producer.chunk_store import POLICIES, ChunkEntry, ChunkStore, Index, Slot
from producer.disk_tier import SUFFIX, DiskTier

UNIT = 64  # bytes of the smallest entry: 16 float32


def tensors_for(key: str, units: int) -> dict[str, torch.Tensor]:
    fill = float(sum(map(ord, key)) % 251)
    return {"0.k": torch.full((8 * units,), fill), "0.v": torch.full((8 * units,), -fill)}


class Recorder:
    """shared.kv_events.KVEventPublisher's hooks, as a set of the keys announced held."""

    def __init__(self) -> None:
        self.held: set[str] = set()

    def stored(self, key, parent, start, tokens) -> None:
        assert key not in self.held, f"{key} stored twice without its removal"
        self.held.add(key)

    def removed(self, key) -> None:
        assert key in self.held, f"{key} removed but never stored"
        self.held.discard(key)

    def cleared(self) -> None:
        self.held.clear()


def check_ram(store: ChunkStore, events: Recorder) -> None:
    index = store.index
    assert set(index.slots) == set(store.entries)
    held = sum(e.nbytes for e in store.entries.values())
    assert index.nbytes == held <= index.budget_bytes
    counts: dict[str, int] = {}
    for e in store.entries.values():
        counts[e.parent] = counts.get(e.parent, 0) + 1
    assert index.children == counts
    assert events.held == set(store.entries)


def check_disk(tier: DiskTier) -> None:
    tier.flush()
    files = {p.name[: -len(SUFFIX)]: p.stat().st_size for p in tier.dir.glob(f"*{SUFFIX}")}
    assert set(files) == set(tier.index.slots)
    assert tier.index.nbytes == sum(files.values()) <= tier.index.budget_bytes


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="store-props-"))
        self.chains: list[list[str]] = []  # keys of each context's chunks, in order
        self.units: dict[str, int] = {}  # key -> its size in UNITs (what was put under it)
        self.pins: list = []

    @initialize(
        policy=st.sampled_from(POLICIES),
        ram_units=st.integers(2, 24),
        disk_units=st.integers(0, 40),
    )
    def start(self, policy: str, ram_units: int, disk_units: int) -> None:
        self.policy = policy
        self.ram_budget = ram_units * UNIT
        self.disk_budget = disk_units * (UNIT + 512)  # a file is its tensors and a header
        self._open(self.disk_budget)

    def _open(self, disk_budget: int) -> None:
        self.disk = DiskTier(self.dir, disk_budget, self.policy) if disk_budget else None
        self.events = Recorder()
        self.store = ChunkStore(self.ram_budget, self.policy, self.disk, self.events)

    def _entries(self, chain: int, count: int, units: st.SearchStrategy | list[int]) -> list[ChunkEntry]:
        keys = self.chains[chain]
        out = []
        for j, size in zip(range(len(keys), len(keys) + count), units):
            key = f"c{chain}x{j}"
            parent = keys[-1] if keys else f"root{chain % 3}"
            self.units[key] = size
            out.append(ChunkEntry(key, parent, (j + 1) * 16, tensors_for(key, size), tokens=tuple(range(16))))
            keys.append(key)
        return out

    @rule(sizes=st.lists(st.integers(1, 6), min_size=1, max_size=5))
    def new_context(self, sizes: list[int]) -> None:
        self.chains.append([])
        self.store.put_many(self._entries(len(self.chains) - 1, len(sizes), sizes))

    @precondition(lambda self: self.chains)
    @rule(data=st.data(), sizes=st.lists(st.integers(1, 6), min_size=1, max_size=5))
    def continuation(self, data, sizes: list[int]) -> None:
        chain = data.draw(st.integers(0, len(self.chains) - 1))
        self.store.put_many(self._entries(chain, len(sizes), sizes))

    @precondition(lambda self: self.chains)
    @rule(data=st.data(), size=st.integers(1, 6))
    def put_one(self, data, size: int) -> None:
        chain = data.draw(st.integers(0, len(self.chains) - 1))
        self.store.put(self._entries(chain, 1, [size])[0])

    @precondition(lambda self: self.units)
    @rule(data=st.data())
    def get(self, data) -> None:
        key = data.draw(st.sampled_from(sorted(self.units)))
        self._check_get(key)

    @rule(size=st.integers(4, 30))
    def evict_by_a_large_entry(self, size: int) -> None:
        self.chains.append([])
        self.store.put(self._entries(len(self.chains) - 1, 1, [size])[0])

    @rule()
    def clear(self) -> None:
        self.store.clear()

    @precondition(lambda self: self.store.entries)
    @rule(data=st.data())
    def pin(self, data) -> None:
        keys = data.draw(st.lists(st.sampled_from(sorted(self.store.entries)), max_size=3))
        self.pins.append(self.store.pin([self.store.entries[k] for k in keys]))

    @precondition(lambda self: self.pins)
    @rule()
    def release(self) -> None:
        self.pins.pop(0)()

    @rule(shrink=st.booleans())
    def restart(self, shrink: bool) -> None:
        """The process stops (its queued writes finish) and starts again on the same directory,
        maybe with half the disk budget."""
        if self.disk is not None:
            self.disk.flush()
            self.disk.close()
        self.pins.clear()
        if shrink:
            self.disk_budget //= 2
        self._open(self.disk_budget)

    def _check_get(self, key: str) -> None:
        if self.store.has(key):
            got = self.store.get(key)
            assert got is not None, f"{key}: has() said present, get() found nothing"
            want = tensors_for(key, self.units[key])
            assert all(torch.equal(got.tensors[n], want[n]) for n in want), f"{key}: other bytes"

    @invariant()
    def books_balance(self) -> None:
        if self.disk is not None:
            check_disk(self.disk)
        check_ram(self.store, self.events)
        for key in sorted(self.units):
            self._check_get(key)
        check_ram(self.store, self.events)  # gets promote from disk: still balanced

    def teardown(self) -> None:
        if self.disk is not None:
            self.disk.close()
        shutil.rmtree(self.dir, ignore_errors=True)


StoreMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=30, deadline=None, suppress_health_check=list(HealthCheck)
)
test_random_sequences_keep_both_tiers_consistent = StoreMachine.TestCase


# -- the sequences that broke it ------------------------------------------------------------------
def entry(key: str, parent: str, units: int, end: int = 16) -> ChunkEntry:
    return ChunkEntry(key, parent, end, tensors_for(key, units), tokens=tuple(range(16)))


def test_a_continuation_that_outgrows_the_budget_evicts_nothing_and_orphans_nothing():
    """Chain k0 (2 units) and two side leaves (1 each) in 5 units; a continuation stores k1 (2:
    one leaf goes), then k2 (2) does not fit beside its own chain. Before: k2's room-making evicted
    the other leaf from the index, returned "nothing evicted", and the leaf's entry stayed: has()
    True, get() KeyError (INTERNAL on every later request for its context), no removal event."""
    events = Recorder()
    store = ChunkStore(5 * UNIT, "cost", events=events)
    for e in (entry("k0", "root", 2), entry("s1", "r1", 1), entry("s2", "r2", 1)):
        assert store.put(e)
    assert store.put_many([entry("k1", "k0", 2, 32), entry("k2", "k1", 2, 48)]) == 1
    check_ram(store, events)
    assert sorted(store.entries) == ["k0", "k1", "s2"] and store.evictions == 1
    for key in ("s1", "s2", "k0", "k1"):
        assert store.has(key) == (store.get(key) is not None)


def test_protected_chains_protect_their_ancestors():
    """A continuation's second new chunk keeps the stored prefix before the first (its ancestors):
    the other contexts' leaves go, never the chain it hangs from."""
    store = ChunkStore(8 * UNIT, "cost")
    for e in (entry("k0", "root", 2), entry("k1", "k0", 2, 32), entry("s1", "r1", 1), entry("s2", "r2", 1)):
        assert store.put(e)
    assert store.put_many([entry("k2", "k1", 1, 48), entry("k3", "k2", 2, 64)]) == 2
    assert sorted(store.entries) == ["k0", "k1", "k2", "k3", "s2"]


def test_a_disk_directory_larger_than_the_budget_is_evicted_to_it_at_start_up(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20)
    for j in range(6):
        tier.write(entry(f"k{j}", f"k{j - 1}" if j else "root", 4, 16 * (j + 1)))
    tier.flush()
    tier.close()
    size = tier.index.nbytes // 6
    again = DiskTier(tmp_path, 3 * size + size // 2)  # a smaller budget on restart
    check_disk(again)
    assert sorted(again.index.slots) == ["k0", "k1", "k2"]  # "cost": the chain's leaves went first
    again.close()


@pytest.mark.parametrize("policy", POLICIES)
def test_victims_come_from_a_heap_not_a_scan(policy):
    """The victim search does not walk every slot: 20000 entries, 5000 evictions, well under a second."""
    import time

    index = Index(20000 * UNIT, policy)
    for j in range(20000):
        index.add(f"e{j}", Slot(UNIT, f"r{j % 7}", 16 * (j % 50 + 1)))
    began = time.perf_counter()
    index.budget_bytes = 15000 * UNIT
    assert len(index.over_budget()) == 5000 and index.nbytes == 15000 * UNIT
    assert time.perf_counter() - began < 1.0


async def test_a_conversation_that_outgrows_the_store_is_served_on_every_turn():
    """Issue 44's end-to-end case (raw, 16-token chunks, a 60 KiB RAM tier in bfloat16: 120 KiB in
    the tests' float32): a conversation whose chain outgrows the store, beside small side contexts.
    On 2cf1243 the fourth turn and every later request for it answered `INTERNAL: internal error
    (request_id=)`."""
    from shared.pb import common_pb2
    from tests.test_prefill_engine import contexts
    from tests.test_prefix_service import prefill, producer, same

    raw = common_pb2.CodecSpec(name="raw")
    conv = contexts(20, seed=1)[0]
    async with producer(chunk_tokens=16, store_bytes=120 << 10) as (server, stub):
        store = server.servicer.chunks
        for turn in range(6):
            for side in range(2):
                await prefill(stub, contexts(10, seed=100 + 2 * turn + side)[0], spec=raw)
            conv = conv + contexts(40, seed=10 + turn)[0]
            _, got, trailer = await prefill(stub, conv, spec=raw)
            assert set(store.entries) == set(store.index.slots) and store.nbytes <= store.budget_bytes
        _, again, _ = await prefill(stub, conv, spec=raw)
    async with producer(store_bytes=0) as (_, stub):
        _, cold, _ = await prefill(stub, conv, spec=raw)
    assert same(got, cold) and same(again, cold)
