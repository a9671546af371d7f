"""KV cache events in vLLM's wire format, so that routers built for vLLM (NVIDIA Dynamo's KV router,
llm-d's precise-prefix-cache-scorer behind the Gateway API Inference Extension) see what the
producer's chunk store and the consumer's prefix cache hold.

Wire (vLLM's `vllm/distributed/kv_events.py`, ZmqEventPublisher; re-implemented here):
- a ZMQ PUB socket (`--kv-events-endpoint`; bound when the address has `*`, `::`, or is ipc:// or
  inproc://, else connected, as vLLM does); each message is three frames: the topic (bytes,
  `--kv-events-topic`, "" by default), the batch's sequence number (8 bytes, big-endian, from 0)
  and the msgpack payload of one EventBatch, an array `[ts, events, data_parallel_rank]` in
  every released vLLM (its EventBatch is `array_like`);
- events are msgspec tagged structs, `omit_defaults`, field order as vLLM declares them:
  BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name,
  extra_keys=None, group_idx=None, kv_cache_spec_kind=None, kv_cache_spec_sliding_window=None),
  BlockRemoved(block_hashes, medium, group_idx=None), AllBlocksCleared(). Two layouts
  (`--kv-events-layout`), each named after the vLLM release whose own structs decode it
  (tests/test_kv_events.py decodes our bytes with them): "vllm-0.24" (the default: events as
  tagged maps, `{"type": "BlockStored", ...}`, defaults omitted; vLLM 0.24.0 dropped
  `array_like` from its events, and 0.24.0 to 0.34.0 publish this) and "vllm-0.23" (events as
  tagged arrays, `["BlockStored", hashes, parent, ...]`, every field present since msgspec does
  not thin arrays: vLLM 0.23.0 and earlier);
- the first batch after every start (sequence 0) is `[AllBlocksCleared]`, so a router that held
  this endpoint's blocks from before a restart drops them;
- replay (`--kv-events-replay-endpoint`, a ROUTER socket, always bound; shared.kv_events_replay): a
  request `[identity, b"", start_seq (8 bytes big-endian)]` is answered with one
  `[identity, b"", seq, payload]` per buffered batch whose seq >= start_seq (up to the newest when
  it asked), then `[identity, b"", -1 (8 bytes, signed), b""]`, at the pace the reader takes them;
  the buffer keeps the last `buffer_steps` batches.

Block hashes (vLLM's `hash_block_tokens` and `init_none_hash`, vllm/v1/core/kv_cache_utils.py): a
context's token ids in blocks of `block_size` (vLLM's default 16) tokens, only full blocks;
block i's digest = H((parent, tuple(block i's token ids), None)), parent = block i-1's digest
(32 bytes), and for block 0 NONE_HASH = H(seed) with the seed hashed as a str (vLLM hashes the
PYTHONHASHSEED string; set the router's seed to `--kv-events-hash-seed`); extra_keys None (no
LoRA, multimodal input or cache salt here). H: "sha256_cbor" (the default: sha256 of the
canonical CBOR encoding, vLLM's `--prefix-caching-hash-algo sha256_cbor`, reproducible in any
language) or "sha256" (vLLM's default: sha256 of the pickle, protocol 5, Python only). On the wire
a hash is vLLM's default external form (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1): the digest's last
8 bytes read as a big-endian unsigned int. docs/operations.md works one block through, byte by byte.

From chunks to blocks: our stores keep chunks of `chunk_tokens` tokens (a multiple of the block
size, checked at start-up), so chunk [start, end) is blocks start/16 .. end/16 of the context, and a
chunk's first block chains from its parent chunk's last block (remembered per chunk key). A
context's last, shorter chunk publishes only its full blocks (vLLM caches no partial block).
Two entries with the same tokens (the producer keeps a chunk's K/V and its encoded payloads under
two keys; contexts whose tails share blocks) hold the same blocks: a block is announced stored when
its first holder arrives and removed when its last goes (counted per block hash).

Threads: the hooks (`stored`, `removed`, `cleared`) only put a small record on a bounded queue
(never block: a full queue drops the record and counts it, `dropped`); one publisher thread hashes,
keeps the counts, encodes, sends and answers replays, so the engine thread and the event loop
never wait for hashing or the network. A dropped record can leave a router with a stale block
(a hint, as routers treat events); `dropped` says it happened.

Knows nothing about the stores or gRPC.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import pickle
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq

from shared.kv_events_replay import ReplayServer

log = logging.getLogger(__name__)

HASH_ALGOS = ("sha256_cbor", "sha256")
# layout name -> whether events are arrays (msgspec array_like); each named after the vLLM release
# whose own structs decode it
LAYOUTS = {"vllm-0.24": False, "vllm-0.23": True}
DEFAULT_LAYOUT = "vllm-0.24"
U64 = (1 << 64) - 1


# --- the schema (vLLM's field order and struct options) -----------------------------------------------


def structs(layout: str = DEFAULT_LAYOUT) -> dict[str, type]:
    """vLLM's event structs in one layout (LAYOUTS): EventBatch is array_like in both; events are
    tagged by their class name, as arrays (vllm-0.23) or as maps with a "type" key (vllm-0.24)."""
    if layout not in LAYOUTS:
        raise ValueError(f"kv events layout {layout!r} not in {sorted(LAYOUTS)}")
    array_like = LAYOUTS[layout]

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False, tag=True):
        pass

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

    return {
        "EventBatch": EventBatch,
        "BlockStored": BlockStored,
        "BlockRemoved": BlockRemoved,
        "AllBlocksCleared": AllBlocksCleared,
    }


# --- vLLM's block hashes ---------------------------------------------------------------------------------


def _cbor_head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([major << 5 | n])
    for extra, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if n < 1 << (8 * size):
            return bytes([major << 5 | extra]) + n.to_bytes(size, "big")
    raise ValueError(f"integer {n} too large for CBOR")


def cbor(obj: Any) -> bytes:
    """Canonical CBOR (RFC 8949 core deterministic encoding, as cbor2.dumps(canonical=True)) of the
    few types a block hash's input holds: None, bool, int, bytes, str, tuple and list."""
    if obj is None:
        return b"\xf6"
    if obj is True or obj is False:
        return b"\xf5" if obj else b"\xf4"
    if isinstance(obj, int):
        return _cbor_head(0, obj) if obj >= 0 else _cbor_head(1, -1 - obj)
    if isinstance(obj, bytes):
        return _cbor_head(2, len(obj)) + obj
    if isinstance(obj, str):
        raw = obj.encode()
        return _cbor_head(3, len(raw)) + raw
    if isinstance(obj, tuple | list):
        return _cbor_head(4, len(obj)) + b"".join(cbor(x) for x in obj)
    raise TypeError(f"cbor: {type(obj).__name__} not supported")


def hash_fn(algo: str):
    """vLLM's hash function by its --prefix-caching-hash-algo name: bytes (the sha256 digest)."""
    if algo == "sha256_cbor":
        return lambda obj: hashlib.sha256(cbor(obj)).digest()
    if algo == "sha256":
        return lambda obj: hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()
    raise ValueError(f"kv events hash {algo!r} not in {HASH_ALGOS}")


def external(digest: bytes) -> int:
    """vLLM's external block hash (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1): the digest's last 8
    bytes as a big-endian unsigned int (its low 64 bits)."""
    return int.from_bytes(digest, "big") & U64


class BlockHasher:
    """A context's chained block hashes, as vLLM computes them."""

    def __init__(self, algo: str = "sha256_cbor", seed: str = "0", block_size: int = 16):
        self.fn = hash_fn(algo)
        self.none_hash = self.fn(seed)
        self.block_size = block_size

    def chain(self, token_ids: Sequence[int], parent: bytes | None = None) -> list[bytes]:
        """The digests of token_ids' full blocks, the first chained from `parent` (NONE_HASH when None)."""
        out = []
        prev = self.none_hash if parent is None else parent
        bs = self.block_size
        for i in range(0, len(token_ids) - bs + 1, bs):
            prev = self.fn((prev, tuple(token_ids[i : i + bs]), None))
            out.append(prev)
        return out


# --- chunks to block events (the publisher thread's state) ------------------------------------------------


class BlockTracker:
    """Chunk store changes -> vLLM block events: per chunk key its blocks' digests, per digest its
    holders, per key the last digest (to chain a child whose parent has gone)."""

    def __init__(self, hasher: BlockHasher, medium: str, memo: int = 1 << 16):
        self.hasher, self.medium, self.memo_size = hasher, medium, memo
        self.held: dict[str, list[bytes]] = {}
        self.holders: dict[bytes, int] = {}
        self.last: OrderedDict[str, bytes] = OrderedDict()  # chunk key -> its last block's digest
        self.unchained = 0  # chunks skipped: their parent's hashes unknown here

    def stored(self, key: str, parent: str, start: int, tokens: Sequence[int]) -> list[dict]:
        if key in self.held or not tokens:
            return []
        bs = self.hasher.block_size
        if start == 0:
            prev = None
        elif parent in self.last:
            prev = self.last[parent]
            self.last.move_to_end(parent)
        else:
            self.unchained += 1
            return []
        digests = self.hasher.chain(tokens, prev)
        self.held[key] = digests
        if digests:
            self.last[key] = digests[-1]
            self.last.move_to_end(key)
            while len(self.last) > self.memo_size:
                self.last.popitem(last=False)
        events: list[dict] = []
        run: list[int] = []  # indices of a run of newly held blocks
        for i, d in enumerate(digests):
            n = self.holders.get(d, 0)
            self.holders[d] = n + 1
            if n == 0:
                run.append(i)
            if run and (n != 0 or i == len(digests) - 1):
                first = run[0]
                parent_digest = digests[first - 1] if first else prev
                events.append(
                    {
                        "kind": "BlockStored",
                        "block_hashes": [external(digests[j]) for j in run],
                        "parent_block_hash": None if parent_digest is None else external(parent_digest),
                        "token_ids": list(tokens[first * bs : (run[-1] + 1) * bs]),
                        "block_size": bs,
                        "lora_id": None,
                        "medium": self.medium,
                        "lora_name": None,
                        "extra_keys": [None] * len(run),
                        "group_idx": 0,
                        "kv_cache_spec_kind": "full_attention",
                    }
                )
                run = []
        return events

    def removed(self, key: str) -> list[dict]:
        gone = []
        for d in self.held.pop(key, []):
            n = self.holders.get(d, 0) - 1
            if n > 0:
                self.holders[d] = n
            else:
                self.holders.pop(d, None)
                gone.append(external(d))
        if not gone:
            return []
        return [{"kind": "BlockRemoved", "block_hashes": gone, "medium": self.medium, "group_idx": 0}]

    def cleared(self) -> list[dict]:
        self.held.clear()
        self.holders.clear()
        return [{"kind": "AllBlocksCleared"}]


# --- the publisher -------------------------------------------------------------------------------------


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """One service's event stream: hooks that only enqueue, a thread that publishes."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str = "",
        *,
        topic: str = "",
        medium: str = "GPU",
        block_size: int = 16,
        hash_algo: str = "sha256_cbor",
        hash_seed: str = "0",
        layout: str = DEFAULT_LAYOUT,
        buffer_steps: int = 10_000,
        max_queue: int = 100_000,
        hwm: int = 100_000,
        data_parallel_rank: int = 0,
    ):
        self.tracker = BlockTracker(BlockHasher(hash_algo, hash_seed, block_size), medium)
        self.block_size = block_size
        self.topic = topic.encode()
        self.rank = data_parallel_rank
        self.kinds = structs(layout)
        self.encoder = msgspec.msgpack.Encoder()
        self.queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.dropped = 0  # hook records the full queue refused
        self.batches = 0  # batches published
        self.events = 0  # events published
        self._seq = itertools.count()
        self._ctx: zmq.Context = zmq.Context.instance()
        self.pub = self._ctx.socket(zmq.PUB)
        self.pub.set_hwm(hwm)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.replay: ReplayServer | None = None
        try:
            if _binds(endpoint):
                self.pub.bind(endpoint)
            else:
                self.pub.connect(endpoint)
            self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint
            self.replay_endpoint = ""
            if replay_endpoint:
                self.replay = ReplayServer(self._ctx, replay_endpoint)
                self.replay_endpoint = self.replay.endpoint
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(
                f"--kv-events-endpoint {endpoint!r} / --kv-events-replay-endpoint {replay_endpoint!r}: cannot open ({e})"
            ) from e
        self._running = True
        # sequence 0 of every start: a router drops what it held from this endpoint before a restart
        self.queue.put_nowait(("cleared",))
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config, medium: str) -> KVEventPublisher | None:
        """The publisher the service's --kv-events-* flags ask for, or None (off)."""
        if not config.kv_events_endpoint:
            return None
        return cls(
            config.kv_events_endpoint,
            config.kv_events_replay_endpoint,
            topic=config.kv_events_topic,
            medium=medium,
            block_size=config.kv_events_block_size,
            hash_algo=config.kv_events_hash,
            hash_seed=config.kv_events_hash_seed,
            layout=config.kv_events_layout,
            hwm=config.kv_events_hwm,
            buffer_steps=config.kv_events_buffer_steps,
            max_queue=config.kv_events_max_queue,
        )

    # --- hooks: any thread, never block ----------------------------------------------------------

    def _put(self, record: tuple) -> None:
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1

    def stored(self, key: str, parent: str, start: int, tokens: Sequence[int]) -> None:
        """A chunk [start, start + len(tokens)) under `key` (chained from `parent`) is held."""
        if tokens:
            self._put(("stored", key, parent, start, tokens))

    def removed(self, key: str) -> None:
        self._put(("removed", key))

    def cleared(self) -> None:
        self._put(("cleared",))

    # --- the publisher thread ------------------------------------------------------------------

    def _events(self, record: tuple) -> list[dict]:
        kind = record[0]
        if kind == "stored":
            return self.tracker.stored(*record[1:])
        if kind == "removed":
            return self.tracker.removed(record[1])
        return self.tracker.cleared()

    def _struct(self, event: dict) -> Any:
        fields = dict(event)
        return self.kinds[fields.pop("kind")](**fields)

    def _run(self) -> None:
        while self._running or not self.queue.empty():
            if self.replay is not None:
                try:
                    self.replay.turn(self.buffer)  # a few requests and sends: never holds up publishing
                except zmq.ZMQError as e:
                    if not self._running:
                        break
                    log.warning("kv events replay: %s", e)
            try:
                first = self.queue.get(timeout=0.001 if self.replay is not None and self.replay.busy else 0.02)
            except queue.Empty:
                continue
            if first is None:
                self.queue.task_done()
                break
            records = [first]
            while len(records) < 4096:
                try:
                    more = self.queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self.queue.task_done()
                    self._running = False
                    break
                records.append(more)
            try:
                events = [self._struct(e) for r in records for e in self._events(r)]
                if events:
                    self._publish(events)
            except Exception:  # never let one bad record stop the stream
                log.exception("kv events: publishing failed")
            finally:
                for _ in records:
                    self.queue.task_done()

    def _publish(self, events: list) -> None:
        seq = next(self._seq)
        payload = self.encoder.encode(self.kinds["EventBatch"](ts=time.time(), events=events, data_parallel_rank=self.rank))
        self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
        self.buffer.append((seq, payload))
        self.batches += 1
        self.events += len(events)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every queued record is published (tests); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.queue.empty() and self.queue.unfinished_tasks == 0:
                return True
            time.sleep(0.01)
        return False

    def close(self) -> None:
        if not self._running and not self._thread.is_alive():
            return
        self._running = False
        try:
            self.queue.put_nowait(None)
        except queue.Full:
            pass
        self._thread.join(timeout=2.0)
        self._close_sockets()

    @property
    def replays(self) -> int:
        """Replay answers sent to their end."""
        return self.replay.replays if self.replay is not None else 0

    def _close_sockets(self) -> None:
        if not self.pub.closed:
            self.pub.close(linger=0)
        if self.replay is not None:
            self.replay.close()
