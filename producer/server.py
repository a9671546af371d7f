"""Producer gRPC servicer (thin: validate, check the prefix, send the header, the layers that
producer.sources gives, serialized once by shared.wire_bytes, and the trailer; to a caller that
accepts batches, what is ready together in one message, producer.coalesce) and process wiring
(config, model load, health, drain). Stores, single flight and replays are producer.sources'."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

import shared
from producer import coalesce
from producer.chunk_store import ChunkStore
from producer.encode import EncodePool
from producer.flight import Flight, Flights
from producer.keep_weights import KeepWeights
from producer.prefill import EncodedLayer, PrefillDone, PrefillEngine
from producer.reuse import Roots
from producer.sources import Sources
from producer.store import ContextStore
from producer.tenant_stats import TenantStats
from shared import (
    admission,
    call_watch,
    chunks,
    describe,
    grpc_server,
    handlers,
    keep_wire,
    liveness,
    logs,
    outcomes,
    rpc_errors,
    security,
    startup,
    tenants,
    torch_threads,
    wire_bytes,
)
from shared import codecs as codec_lib
from shared.call_watch import CallWatch
from shared.codecs.base import chunk_layouts
from shared.codecs.kept import KeptEncoder
from shared.config import ProducerConfig
from shared.errors import FailedPrecondition, InvalidArgument, Unavailable
from shared.metrics import Metrics
from shared.models import LoadedModel, load_model, warm_up
from shared.pb import common_pb2, producer_pb2, producer_pb2_grpc
from shared.scd.artifact import discover

log = logs.get("producer")
COMPUTE_THREAD = "producer-fwd"  # the forward's thread at the OS level (15 bytes at most)
SERVICE_NAME = producer_pb2.DESCRIPTOR.services_by_name["ProducerService"].full_name


class ProducerServicer(producer_pb2_grpc.ProducerServiceServicer):
    """Registered before the port opens; answers UNAVAILABLE until `attach` gives it a model."""

    metrics: Metrics  # the server's, set by ProducerServer right after construction

    def __init__(self, config: ProducerConfig, executor: ThreadPoolExecutor):
        self.config = config
        self.executor = executor
        self.loaded: LoadedModel | None = None
        self.store_hits = 0
        self.admission = admission.Admission("max_inflight", config.max_inflight)
        self.outcomes = outcomes.Outcomes()
        self.tokens_reused = self.tokens_computed = 0
        self.tenant_stats = TenantStats()  # the same reuse counts per tenant: what Describe shows a caller
        self.token = security.load_token(config.token, config.token_file)  # the default tenant's (shared.tenants)
        self.encode = EncodePool(config.encode_threads)
        self.sources = Sources(config, self.encode)  # stores, single flight, replays
        self.compute_progress = liveness.Progress("producer-compute")  # the watchdog reads it from the start

    # what the metrics, Describe, the server's wiring and tests read: the sources' own
    @property
    def whole(self) -> ContextStore:
        return self.sources.whole

    @property
    def chunks(self) -> ChunkStore | None:
        return self.sources.chunks

    @property
    def store(self) -> ContextStore | ChunkStore:
        return self.sources.store

    @property
    def flights(self) -> Flights:
        return self.sources.flights

    @property
    def prefix_flights(self) -> dict[str, Flight]:
        return self.sources.prefix_flights

    @property
    def prefix_waits(self) -> int:
        return self.sources.prefix_waits

    def attach(self, loaded: LoadedModel) -> None:
        artifacts = discover(self.config.artifact_paths)
        self.codecs = codec_lib.create_codecs(loaded, artifacts=artifacts)
        self.keep_weights = KeepWeights(artifacts, loaded.info)  # a learned keep policy's, per pair
        self.encode.attach(loaded.device)
        self.engine = PrefillEngine(
            loaded,
            self.executor,
            self.encode,
            max_batch=self.config.max_prefill_batch,
            max_batch_tokens=self.config.max_prefill_batch_tokens,
            progress=self.compute_progress,
            max_waiting=self.config.max_inflight,  # each waiting prefill is an admitted call's (or flight's)
        )
        self.sources.engine = self.engine
        self.loaded = loaded

    def _ready(self) -> LoadedModel:
        if self.loaded is None:
            raise Unavailable("producer model is still loading")
        return self.loaded

    def _validate(self, request: producer_pb2.PrefillRequest) -> None:
        loaded = self._ready()
        n = len(request.token_ids)
        if not 1 <= n <= self.config.max_context_tokens:
            raise InvalidArgument(f"token_ids: length {n} not in 1..{self.config.max_context_tokens}")
        vocab = loaded.info.vocab_size
        bad = next((t for t in request.token_ids if t >= vocab), None)
        if bad is not None:
            raise InvalidArgument(f"token_ids: id {bad} >= vocab_size {vocab}")

    @rpc_errors.stream_errors
    async def Prefill(self, request, context):
        """Admission, then header, layers, trailer. The whole call is inside one try/finally that
        returns the slot and counts exactly one outcome: completed, cancelled or failed."""
        started = time.perf_counter()
        metadata_id = dict(context.invocation_metadata() or ()).get(rpc_errors.REQUEST_ID_HEADER, "")
        request_id = rpc_errors.request_id(request.request_id or metadata_id)
        cfg = self.config
        timeout_s = call_watch.deadline_s(context, cfg.default_timeout_s, cfg.max_timeout_s)
        flags = ("--default-timeout-s / --max-timeout-s", "--write-idle-timeout-s")
        with rpc_errors.request_scope(request_id):
            async with CallWatch(context, timeout_s, cfg.write_idle_timeout_s, flags) as watch:
                messages = self._admitted(request, request_id, context, started, timeout_s)
                # a reader that stops: its slot, buffers and row taken back
                async with contextlib.aclosing(watch.stream(messages)) as stream:
                    async for message in stream:
                        yield message

    async def _admitted(self, request, request_id: str, context, started: float, timeout_s: float):
        """The call's slot and outcome around its stream (what the call holds, all of it)."""
        ended: list[bool] = []  # the message carrying the trailer handed over to be sent
        with self.admission.slot():
            tracked = self.outcomes.track(
                self._prefill(request, request_id, context, started, timeout_s, ended),
                context,
                log,
                "prefill",
                lambda: bool(ended),
            )
            async with contextlib.aclosing(tracked) as messages:  # closed with this one: nothing waits for the collector
                async for message in messages:
                    yield message

    def _roots(self, codec, options, encoder, tenant: str) -> Roots:
        """The request's chains: under the model's identity (not its artifact digest: the K/V of
        another config or precision differ) and its tenant (shared.tenants)."""
        info = self._ready().info
        meta = encoder.metadata()
        return Roots(
            chunks.model_root(info.identity, info.dtype, tenant),
            chunks.codec_root(info.identity, info.dtype, codec.name, codec.format_version, options, meta, tenant),
        )

    def _check_prefix(self, request, codec, encoder, roots: Roots | None) -> None:
        """PrefillRequest.first_token / prefix_key (see the proto)."""
        first, n = request.first_token, len(request.token_ids)
        if not first:
            if request.prefix_key:
                raise InvalidArgument("prefix_key: set without first_token")
            return
        if roots is None:
            raise InvalidArgument("first_token: chunked prefix reuse is off on this producer (chunk_tokens=0)")
        if not request.prefix_key:
            raise InvalidArgument(f"prefix_key: empty with first_token = {first} (it names the tokens before first_token)")
        size = self.config.chunk_tokens
        if first >= n or first % size:
            raise InvalidArgument(f"first_token: {first} must be a multiple of chunk_tokens={size} and < {n} (context tokens)")
        if chunk_layouts(encoder, self._ready().info.num_layers, size) is None:
            raise InvalidArgument(
                f"first_token: codec '{codec.name}' with these options cannot send from a chunk boundary"
                f" (its payloads do not cut at multiples of {size} tokens)"
            )
        if request.prefix_key != chunks.prefix_key(roots.codec, list(request.token_ids), first, size):
            raise FailedPrecondition(
                "prefix_key: does not name tokens [0, first_token) under this producer's model, codec, options, tenant"
                " and codec metadata (the caller's prefix was built from another stream)"
            )

    async def _prefill(self, request, request_id: str, context, started: float, timeout_s: float, ended: list[bool]):
        self._validate(request)
        tenant = tenants.tenant(tenants.checked_salt(request.cache_salt), self.token)
        codec = codec_lib.lookup(self.codecs, request.codec.name or "raw")
        options = codec.resolve(dict(request.codec.options))
        keep = keep_wire.requested(request, codec)
        encoder = codec.encoder(options, codec_lib.EncodeRequest(len(request.token_ids), request.consumer_weight_digest))
        weights = None  # a learned keep policy's: this pair's (producer.keep_weights)
        if keep is not None:  # scored and cut per layer; stored whole under its selection (producer.sources)
            weights = self.keep_weights.resolve(keep, request.consumer_weight_digest, options.get("artifact", ""))
            policy = weights.policy if weights is not None else None
            encoder = KeptEncoder(encoder, keep, self._ready(), len(request.token_ids), policy)
        roots = self._roots(codec, options, encoder, tenant) if self.chunks is not None else None
        self._check_prefix(request, codec, encoder, roots)
        log.info("prefill.start", tokens=len(request.token_ids), codec=codec.name, deadline_s=round(timeout_s, 3))
        info = self._ready().info
        header = producer_pb2.PrefillResponse(
            header=producer_pb2.PrefillHeader(
                request_id=request_id,
                producer=describe.model_to_pb(info),
                codec=common_pb2.CodecSpec(name=codec.name, options=options),
                codec_format_version=codec.format_version,
                num_layers=info.num_layers,
                num_tokens=len(request.token_ids),
                kv_dtype=info.dtype,
                codec_metadata=encoder.metadata(),
                max_chunk_bytes=self.config.max_chunk_bytes,
                first_token=request.first_token,
                prefix_key=request.prefix_key,
                chunk_tokens=self.config.chunk_tokens if self.chunks is not None else 0,
                keep=keep_wire.to_pb(keep) if keep is not None else None,
                kept_tokens=keep.kept(len(request.token_ids)) if keep is not None else 0,
            )
        )
        label = keep.label if keep is not None else ""
        if keep is not None and weights is not None:  # another weights file keeps other tokens: never the same stored stream
            label = dataclasses.replace(keep, weights=weights.digest).label
        trailer: list[bytes] = []  # the serialized trailer, once made
        messages = self._messages(request, codec.name, options, encoder, roots, tenant, started, label, trailer)
        if not request.accept_batches:  # one stream message per gRPC message, as before accept_batches
            yield header
            async with contextlib.aclosing(messages) as items:
                async for message, _ in items:
                    if trailer and message is trailer[0]:
                        ended.append(True)
                    yield message
            return
        # the header goes alone and first (the caller's header time stays a round trip); the
        # source opens while it is written, and what is ready after each write goes together
        batched = coalesce.Coalesced(messages)
        try:
            yield header
            async for message in batched:
                if batched.done and batched.error is None and not batched.pending:  # the last: it ends with the trailer
                    ended.append(True)
                yield message
        finally:
            await batched.aclose()

    async def _messages(
        self,
        request,
        codec_name: str,
        options,
        encoder,
        roots: Roots | None,
        tenant: str,
        started: float,
        keep: str = "",
        made: list[bytes] | None = None,
    ):
        """The stream after its header, serialized: each layer's messages (packed once at encode
        time, replayed as they are from the store) and the trailer, each with its chunk count."""
        info = self._ready().info
        max_chunk = self.config.max_chunk_bytes

        def pack(layer, payloads) -> wire_bytes.PackedLayer:  # on an encode thread
            return wire_bytes.pack_layer(layer, payloads, max_chunk)

        source, shared, store_hit = await self.sources.open(
            request.token_ids, request.first_token, codec_name, options, encoder, roots, tenant, pack, info.num_layers, keep
        )
        sent_chunks = sent_payloads = sent_bytes = 0
        async with contextlib.aclosing(source) as layers:
            async for item in layers:
                if isinstance(item, EncodedLayer):
                    packed: wire_bytes.PackedLayer = item.packed
                    counts = packed.chunks_per_message(request.accept_layer_chunks)
                    for message, count in zip(packed.messages(request.accept_layer_chunks), counts):
                        yield message, count
                    sent_chunks += packed.chunk_count
                    sent_payloads += packed.payload_count
                    sent_bytes += item.payload_bytes
                elif isinstance(item, PrefillDone):
                    total_ms = (time.perf_counter() - started) * 1e3
                    trailer = producer_pb2.PrefillTrailer(
                        payload_bytes=sent_bytes,
                        chunk_count=sent_chunks,
                        payload_count=sent_payloads,
                        prefill_ms=item.prefill_ms,
                        encode_ms=item.encode_ms,
                        total_ms=total_ms,
                        store_hit=store_hit,
                        prefill_shared=shared,
                        prefill_batch_size=item.batch_size,
                        reused_tokens=item.reused_tokens,
                        computed_tokens=item.computed_tokens,
                        queue_ms=item.queue_ms,
                    )
                    last = producer_pb2.PrefillResponse(trailer=trailer).SerializeToString()
                    if made is not None:
                        made.append(last)
                    yield last, 0
                    self.store_hits += store_hit
                    self.tokens_reused += item.reused_tokens
                    self.tokens_computed += item.computed_tokens
                    own = self.tenant_stats.of(tenant)  # what Describe shows this tenant, and no other
                    own.store_hits += store_hit
                    own.shared += shared
                    own.partial_hits += not (store_hit or shared) and item.reused_tokens > 0
                    own.tokens_reused += item.reused_tokens
                    own.tokens_computed += item.computed_tokens
                    self.metrics.observe_prefill(codec_name, sent_bytes, item.prefill_ms, item.encode_ms, store_hit)
                    log.info(
                        "prefill.done",
                        bytes=sent_bytes,
                        chunks=sent_chunks,
                        prefill_ms=round(item.prefill_ms, 2),
                        encode_ms=round(item.encode_ms, 2),
                        total_ms=round(total_ms, 2),
                        store_hit=store_hit,
                        shared=shared,
                        batch=item.batch_size,
                        reused_tokens=item.reused_tokens,
                    )

    def store_tiers(self) -> list[producer_pb2.StoreTier]:
        """Per tier: bytes, budget, entries, hits, evictions, corrupt entries dropped; disk: writes
        skipped and bytes queued; RAM: evicted bytes running requests still hold."""
        if self.chunks is None:
            s = self.whole
            return [
                producer_pb2.StoreTier(
                    name="whole",
                    bytes=s.nbytes,
                    budget_bytes=s.budget_bytes,
                    entries=len(s.entries),
                    hits=s.hits,
                    evictions=s.evictions,
                )
            ]
        return [
            producer_pb2.StoreTier(
                name=tier.name,
                bytes=tier.index.nbytes,
                budget_bytes=tier.index.budget_bytes,
                entries=len(tier.index.slots),
                hits=tier.index.hits,
                evictions=tier.index.evictions,
                corrupt_dropped=tier.corrupt,
                write_skipped=tier.write_skipped,
                queued_bytes=tier.queued_bytes,
                pinned_evicted_bytes=tier.pinned_evicted_bytes,
            )
            for tier in self.chunks.tiers()
        ]

    @rpc_errors.unary_errors
    async def Describe(self, request, context):
        loaded = self._ready()
        own = self.tenant_stats.peek(tenants.tenant(tenants.checked_salt(request.cache_salt), self.token))
        return producer_pb2.ProducerServiceDescribeResponse(
            model=describe.model_to_pb(loaded.info),
            codecs=describe.codecs_to_pb(self.codecs),
            limits=common_pb2.Limits(
                max_context_tokens=self.config.max_context_tokens, max_chunk_bytes=self.config.max_chunk_bytes
            ),
            server_version=shared.__version__,
            api_version=shared.API_VERSION,
            artifacts=describe.artifacts_to_pb(self.codecs, self.keep_weights.digest_of),
            stats=producer_pb2.ProducerStats(
                prefills_started=self.outcomes.started,
                prefills_completed=self.outcomes.completed,
                prefills_cancelled=self.outcomes.cancelled,
                prefills_failed=self.outcomes.failed,
                store_hits=own.store_hits,
                inflight=self.admission.inflight,
                prefills_shared=own.shared,
                prefill_forwards=self.engine.forwards,
                prefill_forward_contexts=self.engine.forward_rows,
                store_partial_hits=own.partial_hits,
                prefill_tokens_reused=own.tokens_reused,
                prefill_tokens_computed=own.tokens_computed,
                store_tiers=self.store_tiers(),
            ),
            chunk_tokens=self.config.chunk_tokens if self.chunks is not None else 0,
        )


class ProducerServer:
    """Bind, load the model (health NOT_SERVING meanwhile), warm up, then SERVING."""

    def __init__(self, config: ProducerConfig):
        self.config = config
        self.server = grpc_server.Server([SERVICE_NAME], config)
        # the forward's thread (its OpenMP workers take its OS name: per-thread CPU in /proc, top -H)
        self.executor = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="producer-compute",
            initializer=torch_threads.name_os_thread,
            initargs=(COMPUTE_THREAD,),
        )
        self.servicer = ProducerServicer(config, self.executor)
        self.servicer.metrics = self.server.metrics
        self.server.watch(
            admission=self.servicer.admission,
            store=self.servicer.store,
            progress=[self.servicer.compute_progress, self.servicer.encode.progress],
        )
        self.server.metrics.watch_prefill(self.servicer)
        handlers.add_servicer(self.server.server, self.servicer, producer_pb2.DESCRIPTOR.services_by_name["ProducerService"])

    @property
    def address(self) -> str:
        return self.server.address

    async def start(self) -> None:
        await self.server.start()
        log.info("server.started", address=self.address, model=self.config.model)

    async def load(self, loaded: LoadedModel | None = None) -> None:
        cfg = self.config
        if loaded is None:
            loaded = await logs.run_in(self.executor, load_model, cfg.model, cfg.dtype, cfg.device)
        await logs.run_in(self.executor, warm_up, loaded)
        self.servicer.attach(loaded)
        startup.loaded_artifacts(
            "producer", self.servicer
        )  # before readiness and `server.serving`: a wrong artifact never serves
        await self.server.serving()
        log.info(
            "server.serving",
            model=loaded.info.model_id,
            dtype=loaded.info.dtype,
            dtype_reason=loaded.info.dtype_reason,
            device=loaded.info.device,
            digest=loaded.info.weight_digest[:16],
            identity=loaded.info.identity[:16],
        )

    async def stop(self, grace_s: float | None = None) -> None:
        await self.server.drain(self.config.drain_grace_s if grace_s is None else grace_s, self.servicer.admission)
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.servicer.encode.shutdown()
        if self.servicer.chunks is not None and self.servicer.chunks.disk is not None:
            self.servicer.chunks.disk.close()  # queued disk writes finish (atomic: none is half-done)
