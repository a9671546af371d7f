"""The producer's chunk store under memory and file races: a disk tier read opens its file once
(a file replaced meanwhile is read whole, a file deleted meanwhile is a miss, neither counted as
corrupt); the disk writer's queue stays within its byte bound (skipped writes counted); entries
evicted while a running request's plan holds them are counted, and go after unpinned ones."""

from __future__ import annotations

import asyncio
import json
import os

import structlog
import torch

from producer import disk_tier as disk_tier_module
from producer.chunk_store import ChunkEntry, ChunkStore
from producer.disk_tier import DiskTier
from shared.pb import common_pb2, producer_pb2
from tests import test_single_flight as single_flight
from tests.test_metrics import scrape, value
from tests.test_prefill_engine import contexts, held
from tests.test_prefix_service import C, prefill, producer

RAW = common_pb2.CodecSpec(name="raw")


def entry(key: str, fill: float, parent: str = "root", n: int = 64) -> ChunkEntry:
    return ChunkEntry(key, parent, 64, {"0.k": torch.full((2, n, 4), fill), "0.v": torch.full((2, n, 4), -fill)})


def written(tmp_path, name: str, e: ChunkEntry) -> bytes:
    """The bytes of e's file as a disk tier writes it (in a directory of its own)."""
    tier = DiskTier(tmp_path / name, 1 << 20)
    tier.write(e)
    tier.flush()
    tier.close()
    return tier.path(e.key).read_bytes()


async def describe_tiers(stub) -> dict:
    stats = (await stub.Describe(producer_pb2.ProducerServiceDescribeRequest(), timeout=5)).stats
    return {t.name: t for t in stats.store_tiers}


# -- reads: one open --------------------------------------------------------------------------------
def test_a_file_deleted_between_the_index_check_and_the_read_is_a_miss_not_corruption(tmp_path):
    tier = DiskTier(tmp_path / "chunks", 1 << 20)
    tier.write(entry("a", 1.0))
    tier.flush()
    assert tier.has("a")
    tier.path("a").unlink()  # evicted or deleted after the caller's has(), before its read()
    with structlog.testing.capture_logs() as lines:
        assert tier.read("a") is None
    assert tier.corrupt == 0 and not [x for x in lines if x["event"] == "disk_tier.corrupt"]
    assert not tier.has("a")  # forgotten: the next lookup misses at the index
    tier.close()


def test_a_file_replaced_while_it_is_read_is_read_whole_old_or_new(tmp_path, monkeypatch):
    """A rewrite of the same key (other bytes: a continued forward differs from a whole one by
    rounding) lands by os.replace right after the read's first open of the file. One open: the
    read gets the old file or the new one, whole, and checks it. Two opens (a header, then the
    tensors) would check one file's checksum against the other's tensors and drop a good file."""
    old, new = entry("a", 1.0), entry("a", 2.0)
    new_bytes = written(tmp_path, "other", new)
    tier = DiskTier(tmp_path / "chunks", 1 << 20)
    tier.write(old)
    tier.flush()
    path = tier.path("a")
    replaced = []

    def replace_once() -> None:
        if not replaced:
            staged = path.with_name(".staged.tmp")
            staged.write_bytes(new_bytes)
            os.replace(staged, path)
            replaced.append(True)

    def after_open(opener):  # the race timing only: the real open, then the replace
        def opened(*args, **kwargs):
            handle = opener(*args, **kwargs)
            replace_once()
            return handle

        return opened

    monkeypatch.setattr(disk_tier_module, "open", after_open(open), raising=False)
    if hasattr(disk_tier_module, "safe_open"):
        monkeypatch.setattr(disk_tier_module, "safe_open", after_open(disk_tier_module.safe_open))
    got = tier.read("a")
    assert replaced, "the read never opened the file"
    assert tier.corrupt == 0 and got is not None and path.exists()
    assert any(all(torch.equal(got.tensors[n], e.tensors[n]) for n in e.tensors) for e in (old, new))
    monkeypatch.undo()
    again = tier.read("a")  # the file now: the new one, served
    assert again is not None and torch.equal(again.tensors["0.k"], new.tensors["0.k"]) and tier.corrupt == 0
    tier.close()


# -- the writer's queue: a byte bound ---------------------------------------------------------------
def test_the_writer_queue_stays_within_its_byte_bound_and_counts_skipped_writes(tmp_path):
    size = entry("x", 0.0).nbytes
    tier = DiskTier(tmp_path / "chunks", 1 << 20, queue_bytes=2 * size + size // 2)
    seen = []
    with held(tier._writer):  # the writer thread busy: writes wait in its queue
        for j in range(5):
            tier.write(entry(f"k{j}", float(j)))
            seen.append(tier.queued_bytes)
        assert tier.write_skipped == 3 and max(seen) == 2 * size <= tier.queue_bytes
        tier.write(entry("k0", 0.0))  # already queued: neither queued again nor counted
        assert tier.write_skipped == 3
    tier.flush()
    assert tier.queued_bytes == 0 and sorted(tier.index.slots) == ["k0", "k1"]
    tier.write(entry("k2", 2.0))  # room again: a skipped entry is written when it comes back
    tier.flush()
    assert sorted(p.name[:2] for p in (tmp_path / "chunks").glob("*.safetensors")) == ["k0", "k1", "k2"]
    tier.close()


async def test_skipped_disk_writes_and_queued_bytes_reach_describe_and_metrics(tmp_path):
    ids = contexts(2 * C + 40, seed=71)[0]
    disk = {"store_disk_dir": str(tmp_path / "chunks"), "store_disk_queue_bytes": 1, "metrics_port": 0}
    async with producer(**disk) as (server, stub):
        _, _, trailer = await prefill(stub, ids, spec=RAW)
        server.servicer.chunks.disk.flush()
        tiers = await describe_tiers(stub)
        samples = await asyncio.to_thread(scrape, server.server.metrics_port)
    assert tiers["disk"].write_skipped == 3 and tiers["disk"].queued_bytes == 0 and tiers["disk"].entries == 0
    assert tiers["ram"].entries == 3 and trailer.computed_tokens == len(ids)  # RAM keeps them as usual
    assert value(samples, "scd_store_tier_write_skipped_total", tier="disk") == 3
    assert value(samples, "scd_store_tier_queued_bytes", tier="disk") == 0
    assert not list((tmp_path / "chunks").glob("*.safetensors"))


# -- entries evicted while a plan holds them ---------------------------------------------------------
def test_pinned_entries_evicted_are_counted_and_go_after_unpinned_ones():
    size = entry("x", 0.0).nbytes
    store = ChunkStore(budget_bytes=3 * size, policy="lru")
    a, b, c = entry("a", 1.0, "r1"), entry("b", 2.0, "r2"), entry("c", 3.0, "r3")
    for e in (a, b, c):
        assert store.put(e)
    release = store.pin([a, a])  # a running plan holds a (the least recently used)
    store.pin([a])()  # another one held it and ended
    assert store.pinned_evicted_bytes == 0
    assert store.put(entry("d", 4.0, "r4")) and "a" in store.entries and "b" not in store.entries  # b went, not a
    store.pin([c])
    assert store.put(entry("e", 5.0, "r5")) and "a" in store.entries and "d" not in store.entries  # c and a pinned
    store.clear()  # pinned or not, what RAM must drop goes; the pinned still hold memory
    assert store.pinned_evicted_bytes == 2 * size
    other = store.pin([c])
    release()
    release()  # once only: a second call changes nothing
    assert store.pinned_evicted_bytes == size  # c's pins are still held
    other()
    other()
    assert store.pinned_evicted_bytes == size  # one of them still is
    assert store.put(a) and store.pinned_evicted_bytes == size


async def test_a_running_request_holding_evicted_chunks_is_counted_until_it_ends():
    first = contexts(2 * C + 40, seed=81)[0]
    second = first + contexts(50, seed=82)[0]  # continues the stored prefix and tail
    async with producer(metrics_port=0) as (server, stub):
        await prefill(stub, first, spec=RAW)
        store = server.servicer.chunks
        held_bytes = sum(e.nbytes for e in store.entries.values())
        with held(server.executor):  # the second request planned, its forward waits
            call = asyncio.ensure_future(prefill(stub, second, spec=RAW))
            await single_flight.until(lambda: store.misses == 2)
            assert store.pinned_evicted_bytes == 0
            store.clear()  # evicted (a RAM budget spent elsewhere): the plan still holds them
            tiers = await describe_tiers(stub)
            samples = await asyncio.to_thread(scrape, server.server.metrics_port)
            assert tiers["ram"].pinned_evicted_bytes == held_bytes > 0 and tiers["ram"].entries == 0
            assert value(samples, "scd_store_tier_pinned_evicted_bytes", tier="ram") == held_bytes
        _, _, trailer = await call
        assert trailer.reused_tokens == 2 * C + 32  # it did continue from them
        await single_flight.until(lambda: store.pinned_evicted_bytes == 0)  # released when its flight ended
        await prefill(stub, second, spec=RAW)  # cold again (its prefix was cleared): stores all its chunks
        replayed = await prefill(stub, second, spec=RAW)  # a replay pins and releases too
        assert replayed[2].store_hit and store.pinned_evicted_bytes == 0
        assert (await describe_tiers(stub))["ram"].pinned_evicted_bytes == 0


def test_a_chunk_read_back_from_disk_keeps_its_token_ids_and_is_announced_again(tmp_path):
    """A context's chunk written with its token ids reads back with them (checksummed) and,
    promoted into RAM, is announced as stored in the KV events like any chunk; a file whose token
    ids were altered is dropped as corrupt, never announced."""
    from shared import chunks

    class Announced:
        def __init__(self):
            self.stored, self.removed = [], []

        def stored_(self, key, parent, start, tokens):
            self.stored.append((key, parent, start, tuple(tokens)))

    tokens = tuple(range(10, 74))
    key = chunks.chunk_key("root", tokens)
    e = ChunkEntry(key, "root", 64, {"0.k": torch.ones(2, 64, 4), "0.v": torch.zeros(2, 64, 4)}, tokens)
    tier = DiskTier(tmp_path / "chunks", 1 << 20)
    tier.write(e)
    tier.flush()
    back = tier.read(key)
    assert back is not None and back.tokens == tokens
    seen = Announced()
    events = type("Events", (), {"stored": seen.stored_, "removed": seen.removed.append, "cleared": lambda self: None})()
    store = ChunkStore(1 << 20, disk=tier, events=events)
    assert store.get(key) is not None  # from disk into RAM
    assert seen.stored == [(key, "root", 0, tokens)]
    # the token ids are checked: a file naming others than its checksum is corrupt
    data = tier.path(key).read_bytes()
    tier.path(key).write_bytes(data.replace(b'"tokens":"[10, 11', b'"tokens":"[12, 11', 1))
    assert tier.path(key).read_bytes() != data
    assert tier.read(key) is None and tier.corrupt == 1
    tier.close()


# -- what a file may say about itself ----------------------------------------------------------------
def rewrite_header(path, change) -> None:
    """Edit a safetensors file's JSON header in place (padded to its length): bytes untouched."""
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    change(header)
    new = json.dumps(header, separators=(",", ":")).encode()
    assert len(new) <= n
    path.write_bytes(data[:8] + new + b" " * (n - len(new)) + data[8 + n :])


def test_a_header_edited_to_another_dtype_shape_or_end_is_never_served(tmp_path):
    """The checksum covered the tensors' bytes only: a header saying F16 for BF16 bytes (or
    another shape of the same size) was replayed with status OK as other K/V. It covers every
    tensor's dtype and shape and the metadata a read trusts (end, parent, order, token ids)."""
    changes = {
        "dtype": lambda h: h["0.k"].__setitem__("dtype", "F16"),
        "shape": lambda h: h["0.k"].__setitem__("shape", [4, 32, 4]),
        "end": lambda h: h["__metadata__"].__setitem__("end", "99"),
        "order": lambda h: h["__metadata__"].__setitem__("order", '["0.v", "0.k"]'),
    }
    for name, change in changes.items():
        directory = tmp_path / name
        tier = DiskTier(directory, 1 << 20)
        tier.write(
            ChunkEntry(
                "a",
                "root",
                64,
                {
                    "0.k": torch.arange(512, dtype=torch.bfloat16).reshape(2, 64, 4),
                    "0.v": torch.ones(2, 64, 4, dtype=torch.bfloat16),
                },
            )
        )
        tier.flush()
        tier.close()
        rewrite_header(tier.path("a"), change)
        again = DiskTier(directory, 1 << 20)
        assert again.read("a") is None and again.corrupt == 1, name
        again.close()


def test_entries_that_are_not_chunk_files_never_fail_a_start_and_a_grown_file_is_not_read(tmp_path):
    """A directory or a dangling link under a chunk's name failed the start ("--store-disk-dir:
    Is a directory"); a file that grew past the size the index holds was read whole into memory
    (1 GiB for a 1 MiB tier) before it was refused."""
    directory = tmp_path / "chunks"
    tier = DiskTier(directory, 1 << 20)
    tier.write(entry("a", 1.0))
    tier.flush()
    tier.close()
    (directory / ("b" * 64 + disk_tier_module.SUFFIX)).mkdir()
    os.symlink(directory / "nowhere", directory / ("c" * 64 + disk_tier_module.SUFFIX))
    tier = DiskTier(directory, 1 << 20)  # starts
    assert tier.has("a") and (directory / ("b" * 64 + disk_tier_module.SUFFIX)).is_dir()
    with open(tier.path("a"), "r+b") as f:
        f.truncate(1 << 30)  # sparse: a huge file in place of the chunk
    with structlog.testing.capture_logs() as lines:
        assert tier.read("a") is None
    assert tier.corrupt == 1 and "the index holds" in next(x["why"] for x in lines if x["event"] == "disk_tier.corrupt")
    tier.close()


def test_an_older_formats_files_are_dropped_at_start_not_counted_corrupt(tmp_path):
    directory = tmp_path / "chunks"
    tier = DiskTier(directory, 1 << 20)
    tier.write(entry("a", 1.0))
    tier.flush()
    tier.close()
    rewrite_header(tier.path("a"), lambda h: h["__metadata__"].__setitem__("format", "scd.chunk.v1"))
    again = DiskTier(directory, 1 << 20)
    assert (again.format_dropped, again.corrupt) == (1, 0) and not again.has("a") and not again.path("a").exists()
    again.close()
