"""Where a Prefill's layers come from: the servicer (producer.server) sends what `Sources.open`
returns and knows nothing of stores or flights.

Owns:
- the store in use: the chunk store (chunk_tokens > 0: prefix reuse, producer.chunk_store, with
  its optional disk tier, producer.disk_tier) or the whole-context store (producer.store), and
  their per-request counters;
- single flight (producer.flight): each request's flight key (the whole-context store's key, or
  the codec chain's key of the whole context at its first token), so identical concurrent
  requests share one run; and the prefix flights: a call whose prefix a running flight is
  computing waits for it, then continues it;
- the choice per request between a replay of stored state (no forward; a chunk-store replay's
  layers assembled in runs of one message's worth) and the engine's stream (producer.prefill)
  over what is not stored (the plan: producer.reuse), the release of the
  plan's pin on stored entries when its stream ends, and the keeping of a completed forward's
  new state;
- keep transfers (a keep set per transfer, shared.codecs.kept): their keep set depends on every
  token, so their stream is stored and replayed whole, never in chunks: one chunk-store entry
  under shared.chunks.kept_key (the whole context under the codec's root, and the resolved
  selection), or the whole-context store's key with the selection in it. A whole transfer's key
  never names one, nor the other way round.

Knows nothing about gRPC: layers are packed by the `pack` the servicer gives.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from producer.chunk_store import ChunkEntry, ChunkStore
from producer.disk_tier import DiskTier
from producer.encode import EncodePool
from producer.flight import Flight, Flights, Unsent
from producer.prefill import EncodedLayer, PrefillDone, PrefillEngine
from producer.reuse import Roots, plan
from producer.store import ContextStore, StoredPrefill, store_key
from shared import chunks
from shared.codecs import keep_set
from shared.config import ProducerConfig
from shared.kv_events import KVEventPublisher
from shared.wire_bytes import MAX_MESSAGE_DATA

Pack = Callable[[int, dict], Any]  # (layer, payloads) -> the layer's packed messages (opaque here)
REPLAY_RUN_BYTES = MAX_MESSAGE_DATA  # a chunk-store replay assembles layers in runs of this many payload bytes


def _payload_bytes(item: object) -> int:
    return item.payload_bytes if isinstance(item, EncodedLayer) else 0


def _owned(t: torch.Tensor) -> torch.Tensor:
    """t, copied when it is a view into a larger buffer (the store counts the bytes it holds)."""
    return t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone()


def _whole_stream(entry: ChunkEntry, num_layers: int) -> bool:
    """A stored keep transfer holds every layer's keep set (a shorter entry is not served)."""
    return all(f"{layer}.{keep_set.KEEP_PAYLOAD}" in entry.tensors for layer in range(num_layers))


class Sources:
    def __init__(self, config: ProducerConfig, encode: EncodePool):
        self.chunk_tokens = config.chunk_tokens
        self.encode = encode
        self.engine: PrefillEngine | None = None  # set once the model is loaded
        self.whole = ContextStore(config.store_bytes)  # whole contexts (chunk_tokens = 0)
        self.chunks: ChunkStore | None = None  # per chunk (chunk_tokens > 0): prefix reuse
        self.events: KVEventPublisher | None = None
        if config.chunk_tokens:
            disk = None
            if config.store_disk_dir and config.store_disk_bytes:
                try:
                    disk = DiskTier(
                        config.store_disk_dir, config.store_disk_bytes, config.store_eviction, config.store_disk_queue_bytes
                    )
                except OSError as exc:  # not a directory, not writable: a start-up failure naming the flag
                    raise ValueError(f"--store-disk-dir {config.store_disk_dir}: {exc.strerror or exc}") from None
            # KV events (--kv-events-endpoint): the RAM tier's chunks as vLLM blocks, medium CPU (host memory)
            self.events = KVEventPublisher.from_config(config, medium="CPU")
            self.chunks = ChunkStore(config.store_bytes, config.store_eviction, disk, self.events)
        # the store in use: its counters (hits: whole contexts replayed; misses: calls that ran a
        # forward), bytes and entries are the scd_store_* metrics
        self.store: ContextStore | ChunkStore = self.chunks if self.chunks is not None else self.whole
        self.prefix_flights: dict[str, Flight] = {}  # K/V chunk key -> the running flight that will store it
        self.prefix_waits = 0  # calls that waited for a running flight computing their prefix
        # single flight: concurrent identical prefills share one run; what their callers have not read
        # yet is bounded per caller and in all (a caller past either fails alone: producer.flight)
        unsent = Unsent(config.max_unsent_bytes, config.max_request_unsent_bytes, size=_payload_bytes)
        self.flights = Flights(unsent)

    def _engine(self) -> PrefillEngine:
        assert self.engine is not None, "Sources.open before the model was attached"
        return self.engine

    async def open(
        self,
        token_ids: Sequence[int],
        first_token: int,
        codec_name: str,
        options: Mapping[str, str],
        encoder,
        roots: Roots | None,
        tenant: str,
        pack: Pack,
        num_layers: int,
        keep: str = "",
    ) -> tuple[Any, bool, bool]:
        """(the request's stream of EncodedLayer items then one PrefillDone, joined a running
        flight, replayed from the store). `roots` is None when chunked reuse is off; they name
        `tenant` (shared.tenants) already, the whole-context store's key names it here: a tenant's
        requests never join, replay or continue another's. `keep`: a keep transfer's resolved
        selection (shared.codecs.kept.KeepRequest.label): its keep set depends on the whole
        context, so it is stored and replayed whole, under a key that names the selection (the
        whole-context store's key, or shared.chunks.kept_key in the chunk store), and never
        continues nor fills a whole transfer's chunks."""
        if roots is not None:
            if keep:
                return await self._kept_source(list(token_ids), keep, encoder, roots, pack, num_layers)
            return await self._chunked_source(list(token_ids), first_token, encoder, roots, pack, num_layers)
        key = store_key(token_ids, codec_name, options, encoder.metadata(), tenant, keep)
        # a running flight first: its caller already missed the store, a follower is no second miss
        stored = None if key in self.flights.running else self.whole.get(key)
        if stored is not None:
            return self._replay(stored, len(token_ids)), False, True
        # a prefill already running for the same key is joined, not repeated
        source, shared = self.flights.join(
            key,
            lambda: self._engine().stream(list(token_ids), encoder, pack),
            is_last=lambda item: isinstance(item, PrefillDone),
            on_complete=lambda items: self._keep(key, items),
        )
        return source, shared, False

    async def _chunked_source(self, ids: list[int], first_token: int, encoder, roots: Roots, pack: Pack, num_layers: int):
        """(stream, joined a running flight, replayed from the chunk store): a running flight for
        the same chain and first token is joined; a running flight that computes a prefix of
        this context is waited for (single flight per chunk chain: the next turn arriving while
        the previous one prefills continues it rather than computing it again); then the store's
        plan (producer.reuse) decides between a replay of stored chunks and a forward over the
        tokens it does not hold."""
        assert self.chunks is not None
        size = self.chunk_tokens
        # each chain hashed once per request (token ids packed once for both roots): the flight
        # key, the prefix flights and the store's plan all read these
        chains = chunks.Chains(size=1)
        kv_refs, payload_refs = chains.chain(roots.model, ids, size), chains.chain(roots.codec, ids, size)
        key = f"{payload_refs[-1].key if payload_refs else roots.codec}@{first_token}"
        if key not in self.flights.running:
            for ref in reversed(kv_refs):  # full chunks of the context less its last token
                flight = self.prefix_flights.get(ref.key)
                if flight is not None and ref.end - ref.start == size and ref.end < len(ids):
                    self.prefix_waits += 1
                    await asyncio.wait({flight.task})  # it stores the prefix's K/V as it completes
                    break
        reuse = None  # joining a running flight: the plan is the flight's
        if key not in self.flights.running:
            device = self.engine.loaded.device if self.engine is not None else None
            planned = await asyncio.to_thread(
                plan, self.chunks, ids, size, roots, encoder, num_layers, first_token, (kv_refs, payload_refs), device
            )
            if planned.replay:
                self.chunks.hits += 1
                replay = self._replay_stored(planned.replay_layer, planned.release, planned.reused_tokens, pack, num_layers)
                return replay, False, True
            if key not in self.flights.running:  # a concurrent call may have started it while we planned
                reuse = planned
                self.chunks.misses += 1
                self.chunks.partial_hits += reuse.start > 0
            else:
                planned.release()
        source, shared = self.flights.join(
            key,
            lambda: self._engine().stream(ids, encoder, pack, reuse),
            is_last=lambda item: isinstance(item, PrefillDone),
            on_complete=self._keep_chunks,
        )
        if reuse is not None:  # the plan's entries are held until the flight ends
            source.flight.task.add_done_callback(lambda _: reuse.release())
        if not shared and reuse is not None and reuse.keep:  # the full chunks of K/V this flight will store
            flight = source.flight
            mine = [r.key for r in reuse.kv_refs[reuse.start // size :] if r.end - r.start == size]
            for chunk in mine:
                self.prefix_flights.setdefault(chunk, flight)
            flight.task.add_done_callback(lambda _: self._prefix_flight_done(mine, flight))
        return source, shared, False

    def _prefix_flight_done(self, keys: list[str], flight) -> None:
        for chunk in keys:
            if self.prefix_flights.get(chunk) is flight:
                del self.prefix_flights[chunk]

    async def _kept_source(self, ids: list[int], selection: str, encoder, roots: Roots, pack: Pack, num_layers: int):
        """(stream, joined a running flight, replayed from the chunk store) of a keep transfer: its
        stored payloads (one entry, shared.chunks.kept_key: the whole context under the codec's
        root, and the selection) replayed, else a running flight of the same key joined, else a
        forward whose payloads are kept under that key when it completes."""
        assert self.chunks is not None
        context = chunks.chain(roots.codec, ids, self.chunk_tokens)[-1].key
        key = chunks.kept_key(context, selection)
        if key not in self.flights.running:  # a running flight's caller already missed the store
            entry = await asyncio.to_thread(self.chunks.get, key)  # RAM, else disk (file I/O)
            if entry is not None and _whole_stream(entry, num_layers):
                self.chunks.hits += 1
                release = self.chunks.pin([entry])
                replay = self._replay_stored(entry.layer, release, len(ids), pack, num_layers)
                weakref.finalize(replay, release)  # a replay never started still lets go
                return replay, False, True
            if key not in self.flights.running:  # a concurrent call may have started it while we looked
                self.chunks.misses += 1
        layers: dict[int, dict] = {}  # this flight's payloads per layer, kept when it completes

        def recorded(layer: int, payloads: dict) -> Any:  # on the flight's encode lane
            if self.chunks is not None and self.chunks.budget_bytes > 0:
                layers[layer] = {name: _owned(t) for name, t in payloads.items()}
            return pack(layer, payloads)

        def store_kept(items: list) -> None:  # once per run, before any subscriber sees its end
            assert self.chunks is not None
            if len(layers) == num_layers:
                tensors = {f"{layer}.{name}": t for layer, payloads in layers.items() for name, t in payloads.items()}
                self.chunks.put_many([ChunkEntry(key, roots.codec, len(ids), tensors)])
            layers.clear()

        source, shared = self.flights.join(
            key,
            lambda: self._engine().stream(ids, encoder, recorded),
            is_last=lambda item: isinstance(item, PrefillDone),
            on_complete=store_kept,
        )
        return source, shared, False

    async def _replay_stored(
        self, payloads_of: Callable[[int], dict], release: Callable[[], object], reused: int, pack: Pack, num_layers: int
    ):
        """Stored payloads (`payloads_of(layer)`: a plan's chunks joined, or a keep transfer's
        entry) packed per layer on the encode threads, no forward; `release` ends the pin on the
        entries they come from, whichever way the stream ends."""
        loop = asyncio.get_running_loop()
        encode_ms = 0.0

        def build(layer: int) -> EncodedLayer:
            began = time.perf_counter()
            payloads = payloads_of(layer)
            packed = pack(layer, payloads)
            took = (time.perf_counter() - began) * 1e3
            return EncodedLayer(layer, packed, sum(t.numel() * t.element_size() for t in payloads.values()), took)

        def build_run(first: int) -> list[EncodedLayer]:
            """Layers from `first` on, up to one message's worth of payload bytes (at least one):
            assembled in one hop to the encode thread and ready together, so a caller that accepts
            batches gets them in one message (producer.coalesce)."""
            run: list[EncodedLayer] = []
            while first + len(run) < num_layers and sum(x.payload_bytes for x in run) < REPLAY_RUN_BYTES:
                run.append(build(first + len(run)))
            return run

        try:
            layer = 0
            while layer < num_layers:
                run = await loop.run_in_executor(self.encode.executor, build_run, layer)
                for item in run:
                    encode_ms += item.encode_ms
                    yield item
                layer += len(run)
        finally:
            release()
        yield PrefillDone(0.0, encode_ms, num_layers, batch_size=0, reused_tokens=reused, computed_tokens=0)

    def _keep_chunks(self, items: list) -> None:
        """A completed forward's new chunks go to the chunk store (once per run)."""
        assert self.chunks is not None
        self.chunks.put_many(items[-1].kept)
        items[-1].kept = []  # the flight keeps its items until it ends: let the store own these

    async def _replay(self, stored: StoredPrefill, num_tokens: int):
        """A whole-context store hit: the stored layers, no forward, no encode."""
        for layer in stored.layers:
            yield layer
        yield PrefillDone(prefill_ms=0.0, encode_ms=0.0, layers=len(stored.layers), batch_size=0, reused_tokens=num_tokens)

    def _keep(self, key: str, items: list) -> None:
        """A completed prefill's layers go to the store (called once per run, however many share it)."""
        kept = tuple(x for x in items if isinstance(x, EncodedLayer))
        self.whole.put(key, StoredPrefill(kept, sum(x.payload_bytes for x in kept)))
