"""Prometheus metrics of one service, on their own HTTP port (`--metrics-port`).

Owns: a per-server `CollectorRegistry` (two servers in one process never collide), the gRPC
server interceptor that counts RPCs by method and status and times them, collectors that read
plain counters kept elsewhere at scrape time (Admission, the producer's context store), and the
consumer's per-request histograms from a finished Generate. The modules it reads stay free of
prometheus: they keep ints.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Callable, Iterable

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from shared import core_log, metrics_http

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
BYTES_BUCKETS = tuple(float(1 << k) for k in range(10, 34, 2))  # 1 KiB .. 8 GiB
# statuses that mean a transfer broke the stream contract (checksum, schema, order, format)
CONTRACT_CODES = ("DATA_LOSS", "FAILED_PRECONDITION")
GENERATE_STAGES = ("queue_wait", "ttft", "transfer", "rebuild", "question_prefill", "decode")
RATIO_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)
HEALTH_PREFIX = "/grpc.health.v1.Health/"  # probes: not requests, kept out of the RPC metrics
disable_created_metrics()  # no `_created` series: every family here is per process, started with it


def short_method(method: str) -> str:
    """'/scd.v1.ConsumerService/Generate' -> 'Generate' (the label an operator types)."""
    return method.rsplit("/", 1)[-1] or method


class _Callback(Collector):
    """Metric families computed at scrape time by a function (plain ints read from elsewhere)."""

    def __init__(self, fn: Callable[[], Iterable]):
        self.fn = fn

    def collect(self):
        yield from self.fn()


def by_reason(name: str, help_: str, counts: dict[str, int]):
    """One counter family with a `reason` label (refusals by reason)."""
    c = CounterMetricFamily(name, help_, labels=["reason"])
    for reason, n in sorted(counts.items()):
        c.add_metric([reason], n)
    yield c


def unlabelled(family, *rows: tuple[str, str, float]):
    """One metric family of `family` (Gauge/CounterMetricFamily) per (name, help, value)."""
    for name, help_, value in rows:
        metric = family(name, help_)
        metric.add_metric([], value)
        yield metric


def _handshake_failures():
    """TLS handshakes gRPC core reported failed (shared.core_log; 0 where it is not installed)."""
    c = CounterMetricFamily("scd_tls_handshake_failures", "TLS handshakes that failed (rejected client certificates, ...)")
    c.add_metric([], core_log.CORE_LOG.handshake_failures if core_log.CORE_LOG is not None else 0)
    yield c


class Metrics:
    """Families common to both services, plus the consumer's or the producer's own (by the
    service name: only what that service ever moves is exported)."""

    def __init__(self, service: str):
        self.service = service
        self.registry = CollectorRegistry(auto_describe=True)
        self._children: dict[tuple[int, tuple[str, ...]], object] = {}  # labelled children by metric and labels
        r = self.registry
        self.rpcs = Counter(
            "scd_rpc",
            "calls finished, by method and status (gRPC: the method and its status code; HTTP: 'POST /v1/completions', its HTTP status)",
            ["method", "code"],
            registry=r,
        )
        self.rpc_seconds = Histogram(
            "scd_rpc_duration_seconds",
            "call duration, gRPC and HTTP (streams: until the last message)",
            ["method"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.contract = Counter(
            "scd_stream_contract_violations", "calls ended with a stream-contract status, by code", ["method", "code"], registry=r
        )
        self.http: metrics_http.BoundedServer | None = None
        self.registry.register(_Callback(_handshake_failures))
        if service.endswith("ConsumerService"):
            self._consumer_families()
        elif service.endswith("ProducerService"):
            self._producer_families()

    def _consumer_families(self) -> None:
        r = self.registry
        self.generate_seconds = Histogram(
            "scd_generate_stage_seconds",
            "consumer Generate stage times by transfer mode (stage: " + ", ".join(GENERATE_STAGES) + ")",
            ["stage", "mode"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.generate_bytes = Counter(
            "scd_transfer_bytes", "payload bytes received from the producer, by transfer mode", ["mode"], registry=r
        )
        self.generate_bytes_per_request = Histogram(
            "scd_transfer_request_bytes", "payload bytes of one transfer, by mode", ["mode"], buckets=BYTES_BUCKETS, registry=r
        )
        self.generates = Counter("scd_generate", "Generate calls answered, by transfer mode", ["mode"], registry=r)
        self.fallbacks = Counter(
            "scd_transfer_fallbacks",
            "transfers replaced by the consumer's own prefill (LOCAL_PREFILL), by reason",
            ["reason"],
            registry=r,
        )
        self.auto_choices = Counter(
            "scd_auto_choices",
            "requests whose mode auto chose (the default included), by the mode chosen and whether it was a cold start",
            ["mode", "cold_start"],
            registry=r,
        )
        self.abandoned = Counter(
            "scd_transfers_abandoned", "transfers abandoned mid-stream for the own prefill (too slow to finish)", registry=r
        )
        self.raw_kv_bytes = Counter(
            "scd_raw_kv_bytes", "bytes the producer's full K/V would have taken (the raw baseline), by mode", ["mode"], registry=r
        )
        self.compression = Histogram(
            "scd_compression_ratio",
            "raw K/V bytes / bytes received, per transfer, by mode",
            ["mode"],
            buckets=RATIO_BUCKETS,
            registry=r,
        )
        self.audits = Counter(
            "scd_audit_decisions",
            "cache audits by decision (ok, diverged, diverged_prefilled, diverged_upgraded, diverged_repaired, ...)",
            ["decision"],
            registry=r,
        )
        self.divergences = Counter(
            "scd_audit_divergences", "audits that flagged the rebuilt cache, by mode", ["mode"], registry=r
        )
        self.verify_tokens = Counter(
            "scd_verify_draft_tokens",
            "verified decoding: drafted tokens by mode and outcome (accepted; discarded: the first rejected and all after it)",
            ["mode", "outcome"],
            registry=r,
        )

    def _producer_families(self) -> None:
        r = self.registry
        self.sent_bytes = Counter(
            "scd_prefill_sent_bytes", "payload bytes sent in Prefill streams, by codec", ["codec"], registry=r
        )
        self.prefill_seconds = Histogram(
            "scd_prefill_seconds",
            "producer forward time per Prefill (store hits are not observed)",
            ["codec"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.encode_seconds = Histogram(
            "scd_encode_seconds", "producer encode time per Prefill, by codec", ["codec"], buckets=LATENCY_BUCKETS_S, registry=r
        )

    def observe_prefill(self, codec: str, sent_bytes: int, prefill_ms: float, encode_ms: float, store_hit: bool) -> None:
        """One finished Prefill stream (the producer's trailer figures)."""
        self.sent_bytes.labels(codec).inc(sent_bytes)
        if not store_hit:
            self.prefill_seconds.labels(codec).observe(prefill_ms / 1e3)
            self.encode_seconds.labels(codec).observe(encode_ms / 1e3)

    # -- exposition --------------------------------------------------------------------------
    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Start the HTTP endpoint (a daemon thread, shared.metrics_http); returns the bound port
        (port 0: any free)."""
        self.http = metrics_http.serve(self.registry, port, host)
        return self.http.server_port

    def stop(self) -> None:
        if self.http is not None:
            self.http.shutdown()
            self.http.server_close()
            self.http = None

    # -- sources read at scrape time ---------------------------------------------------------
    def watch_admission(self, admission) -> None:
        """In-flight calls, the limit and the rejections of a shared.admission.Admission."""

        def families():
            yield from unlabelled(
                GaugeMetricFamily,
                ("scd_inflight", "calls in flight (admitted, not finished)", admission.inflight),
                ("scd_inflight_limit", f"admission limit ({admission.limit_name})", admission.limit),
            )
            yield from by_reason("scd_admission_rejected", "calls refused at admission, by reason", admission.rejected)

        self.registry.register(_Callback(families))

    def watch_store(self, store) -> None:
        """The producer's context store: hits, misses, evictions, entries and bytes held."""

        def families():
            yield from unlabelled(
                CounterMetricFamily,
                ("scd_store_hits", "context store lookups that replayed a stored stream", store.hits),
                ("scd_store_misses", "context store lookups that ran the prefill", store.misses),
                ("scd_store_evictions", "entries evicted to stay within the byte budget", store.evictions),
            )
            yield from unlabelled(
                GaugeMetricFamily,
                ("scd_store_bytes", "payload bytes held by the context store", store.nbytes),
                ("scd_store_entries", "streams held by the context store", len(store.entries)),
                ("scd_store_budget_bytes", "context store byte budget", store.budget_bytes),
            )

        self.registry.register(_Callback(families))

    def watch_engine(self, engine, pool, admission, prefix=None, generate=None) -> None:
        """The consumer's batch engine (consumer.engine.batch), its KV pool, KV admission queue, prefix
        cache (consumer.engine.prefix_cache, when on) and request pipeline's rebuilds (consumer.pipeline.pipeline)."""

        def families():
            if prefix is not None:
                yield from unlabelled(
                    GaugeMetricFamily,
                    ("scd_prefix_cache_bytes", "KV pool bytes the prefix cache holds", prefix.nbytes),
                    ("scd_prefix_cache_chunks", "context chunks the prefix cache holds", len(prefix.entries)),
                )
                yield from unlabelled(
                    CounterMetricFamily,
                    ("scd_prefix_hits", "prefix cache lookups that found the whole context", prefix.hits),
                    ("scd_prefix_partial_hits", "prefix cache lookups that found a part of the context", prefix.partial_hits),
                    ("scd_prefix_misses", "prefix cache lookups that found nothing", prefix.misses),
                    ("scd_prefix_evictions", "chunks evicted from the prefix cache", prefix.evictions),
                )
            yield from unlabelled(
                GaugeMetricFamily,
                ("scd_kv_pool_bytes", "KV pool size (--kv-pool-bytes)", pool.capacity_bytes),
                ("scd_kv_used_bytes", "KV pool bytes held by admitted requests", pool.used_bytes),
                (
                    "scd_kv_reclaimable_bytes",
                    "KV pool bytes waiting for the engine to zero and free them",
                    pool.reclaimable_blocks * pool.block_bytes,
                ),
                ("scd_scratch_bytes", "bytes of the runner's attention gather buffers", engine.stats.scratch_bytes),
                ("scd_kv_queue", "requests waiting for KV memory", admission.queued),
                ("scd_batch_rows", "rows of the engine's last forward", engine.stats.last_batch),
                ("scd_batch_limit", "rows per forward (--max-batch)", engine.max_batch),
            )
            yield from unlabelled(
                CounterMetricFamily,
                ("scd_engine_forwards", "batched forwards run by the engine", engine.stats.forwards),
                ("scd_engine_rows", "request rows summed over the engine's forwards", engine.stats.rows),
                ("scd_engine_nonfinite_rows", "rows failed alone for non-finite logits", engine.stats.failed_rows),
            )
            if generate is not None:
                yield from unlabelled(
                    CounterMetricFamily,
                    ("scd_rebuild_layers", "codec layer rebuilds run by the engine", generate.rebuilt_layers),
                    (
                        "scd_rebuild_layers_batched",
                        "layer rebuilds decoded together with other requests'",
                        generate.batched_layers,
                    ),
                )
            yield from by_reason("scd_kv_rejected", "requests refused for KV memory, by reason", admission.rejected)

        self.registry.register(_Callback(families))

    def watch_router(self, model_name: str, admission, kv_admission, pool, prefix=None, events=None) -> None:
        """The Model Server Protocol gauges routers read (the Gateway API Inference Extension's
        endpoint picker, llm-d, Dynamo), under vLLM's names and `model_name` label, beside scd_*:
        - vllm:num_requests_waiting: requests waiting for KV memory (scd_kv_queue);
        - vllm:num_requests_running: the other calls in flight (gRPC and HTTP: one admission);
        - vllm:kv_cache_usage_perc (and its older name vllm:gpu_cache_usage_perc): the KV pool's
          fraction (0..1) held by requests; blocks only the prefix cache holds count as free, as
          vLLM counts its evictable cached blocks (a block a request shares with the cache counts
          as the cache's);
        - vllm:cache_config_info{block_size, num_gpu_blocks}: 1 (the pool's block size and count).
        With KV events on: scd_kv_events_{batches,events,dropped} counters, and with the replay port
        scd_kv_events_replays{,_ignored,_abandoned}."""

        def families():
            waiting = kv_admission.queued
            running = max(0, admission.inflight - waiting)
            held = pool.used_bytes - pool.reclaimable_blocks * pool.block_bytes - (prefix.nbytes if prefix is not None else 0)
            usage = min(1.0, max(0.0, held / pool.capacity_bytes)) if pool.capacity_bytes else 0.0
            for name, help_, value in (
                ("vllm:num_requests_waiting", "requests waiting for KV memory (Model Server Protocol)", waiting),
                ("vllm:num_requests_running", "requests running: in flight, not waiting for KV memory", running),
                ("vllm:kv_cache_usage_perc", "fraction of the KV pool held by requests (0..1)", usage),
                ("vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc under its older name", usage),
            ):
                g = GaugeMetricFamily(name, help_, labels=["model_name"])
                g.add_metric([model_name], value)
                yield g
            info = GaugeMetricFamily(
                "vllm:cache_config_info",
                "KV cache configuration (labels); value 1",
                labels=["model_name", "block_size", "num_gpu_blocks", "enable_prefix_caching"],
            )
            info.add_metric([model_name, str(pool.block_tokens), str(pool.num_blocks), str(prefix is not None)], 1)
            yield info
            yield from _kv_event_families(events)

        self.registry.register(_Callback(families))

    def watch_prefill(self, servicer) -> None:
        """The producer's prefill engine: single-flight joins, batched forwards and the contexts
        they prefilled, prefills waiting for the compute thread (read from the servicer at
        scrape time; zero until its model is attached); with KV events on, their counters as the
        consumer's (scd_kv_events_*)."""

        def families():
            engine = getattr(servicer, "engine", None)
            yield from unlabelled(
                CounterMetricFamily,
                (
                    "scd_prefill_shared",
                    "Prefill calls that joined a prefill already running (single flight)",
                    servicer.flights.shared,
                ),
                ("scd_prefill_forwards", "batched prefill forwards run", engine.forwards if engine else 0),
                ("scd_prefill_forward_contexts", "contexts prefilled by those forwards", engine.forward_rows if engine else 0),
            )
            yield from unlabelled(
                GaugeMetricFamily,
                ("scd_prefill_waiting", "cold prefills waiting for the compute thread", len(engine.waiting) if engine else 0),
            )
            yield from _store_tiers(servicer)
            yield from _kv_event_families(servicer.sources.events)

        self.registry.register(_Callback(families))

    def watch_probes(self, probe) -> None:
        """Mode auto's background probes (consumer.auto.probe): transfers measured, by why (idle |
        link), and the ones that failed."""

        def families():
            c = CounterMetricFamily("scd_background_probes", "background probe transfers measured, by why", labels=["why"])
            for why, n in sorted(probe.done.items()):
                c.add_metric([why], n)
            yield c
            yield from unlabelled(
                CounterMetricFamily, ("scd_background_probe_failures", "background probes that failed", probe.failures)
            )

        self.registry.register(_Callback(families))

    def watch_state(self, name: str, help_: str, states, read: Callable[[], str]) -> None:
        """A state gauge: one series per state, 1 on the current one (`read()` at scrape time)."""

        def families():
            g = GaugeMetricFamily(name, help_, labels=["state"])
            current = read()
            for state in states:
                g.add_metric([state], float(state == current))
            yield g

        self.registry.register(_Callback(families))

    # -- the consumer's per-request figures --------------------------------------------------
    def _child(self, metric, *labels: str):
        """metric.labels(*labels), looked up once: label values here are bounded (modes, methods,
        codes, short reasons), and `labels` validates and locks on every call."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def observe_generate(self, result) -> None:
        """One finished Generate (consumer.request.job.GenerateResult)."""
        mode = result.codec
        self._child(self.generates, mode).inc()
        for stage in GENERATE_STAGES:
            self._child(self.generate_seconds, stage, mode).observe(getattr(result, f"{stage}_ms") / 1e3)
        self._child(self.generate_bytes, mode).inc(result.bytes_received)
        self._child(self.generate_bytes_per_request, mode).observe(result.bytes_received)
        if result.transfer_failure:
            self._child(self.fallbacks, result.transfer_failure.split(":", 1)[0][:40]).inc()
        if getattr(result, "auto", None) is not None:
            cold = str(result.auto.reason.startswith("cold start")).lower()
            self._child(self.auto_choices, result.auto.chosen.mode, cold).inc()
        if getattr(result, "transfer_abandoned", False):
            self.abandoned.inc()
        self._child(self.raw_kv_bytes, mode).inc(result.raw_kv_bytes)
        if result.bytes_received > 0 and result.raw_kv_bytes > 0:
            self._child(self.compression, mode).observe(result.raw_kv_bytes / result.bytes_received)
        if result.audit_decision:
            # "diverged: upgraded to s3: ok" -> "diverged_upgraded": bounded label values
            words = [w.split()[0] for w in result.audit_decision.split(": ")[:2] if w.split()]
            self._child(self.audits, "_".join(words)[:40]).inc()
            if result.audit_decision.startswith("diverged"):
                self._child(self.divergences, mode).inc()
        drafted = getattr(result, "drafted_tokens", 0)
        if drafted:
            self._child(self.verify_tokens, mode, "accepted").inc(result.accepted_tokens)
            self._child(self.verify_tokens, mode, "discarded").inc(drafted - result.accepted_tokens)

    # -- gRPC --------------------------------------------------------------------------------
    def interceptor(self) -> grpc.aio.ServerInterceptor:
        return RpcMetrics(self)

    def record(self, method: str, code: str, seconds: float) -> None:
        """One finished call; `method` is the short RPC name (short_method)."""
        self._child(self.rpcs, method, code).inc()
        self._child(self.rpc_seconds, method).observe(seconds)
        if code in CONTRACT_CODES:
            self._child(self.contract, method, code).inc()

    def record_http(self, route: str, status: int, seconds: float, error_code: str = "") -> None:
        """One finished HTTP request (consumer.api.openai_api) in the gRPC families: `route` as
        'POST /v1/completions' (the method label), its HTTP status (the code label); `error_code`,
        the status name of the error it answered, counts stream-contract violations as gRPC's do."""
        self.record(route, str(status), seconds)
        if error_code in CONTRACT_CODES:
            self._child(self.contract, route, error_code).inc()


def _code(context, exc: BaseException | None) -> str:
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(code, int) and code:  # the aio context reports the raw integer
        return next((c.name for c in grpc.StatusCode if c.value[0] == code), "UNKNOWN")
    if exc is None:
        return "OK"
    # the call's task cancelled, or its response generator closed (the caller went away): as outcomes.track counts it
    return "CANCELLED" if isinstance(exc, GeneratorExit) or type(exc).__name__ == "CancelledError" else "UNKNOWN"


def _timed_coroutine(inner, method: str, record):
    async def call(request, context):
        started, exc = time.perf_counter(), None
        try:
            return await inner(request, context)
        except BaseException as e:
            exc = e
            raise
        finally:
            record(method, _code(context, exc), time.perf_counter() - started)

    return call


def _timed_generator(inner, method: str, record):
    async def call(request, context):
        started, exc = time.perf_counter(), None
        try:
            async with contextlib.aclosing(inner(request, context)) as items:
                async for item in items:
                    yield item
        except BaseException as e:
            exc = e
            raise
        finally:
            record(method, _code(context, exc), time.perf_counter() - started)

    return call


class RpcMetrics(grpc.aio.ServerInterceptor):
    """Counts and times every unary-request call by short method name and final status (health
    probes and streaming-request calls such as reflection are not counted)."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith(HEALTH_PREFIX):
            return handler
        method, record = short_method(details.method), self.metrics.record
        if handler.unary_unary:
            return handler._replace(unary_unary=_timed_coroutine(handler.unary_unary, method, record))
        if handler.unary_stream:
            inner = handler.unary_stream
            wrap = _timed_generator if inspect.isasyncgenfunction(inner) else _timed_coroutine
            return handler._replace(unary_stream=wrap(inner, method, record))
        return handler


def _kv_event_families(events):
    """The KV event publisher's counters (shared.kv_events), none while it is off: both services'."""
    if events is None:
        return
    counters = [
        ("scd_kv_events_batches", "KV event batches published (shared.kv_events)", events.batches),
        ("scd_kv_events_events", "KV events published", events.events),
        ("scd_kv_events_dropped", "KV event records dropped: the publisher queue was full", events.dropped),
    ]
    if (replay := events.replay) is not None:
        counters += [
            ("scd_kv_events_replays", "replay answers sent to their end (shared.kv_events_replay)", replay.replays),
            ("scd_kv_events_replays_ignored", "malformed replay requests ignored", replay.ignored),
            ("scd_kv_events_replays_abandoned", "replay answers dropped: the reader left or stopped reading", replay.abandoned),
        ]
    yield from unlabelled(CounterMetricFamily, *counters)


def _store_tiers(servicer):
    """Per tier of the producer's store (ProducerServicer.store_tiers) and its prefix reuse."""
    chunk_store = getattr(servicer, "chunks", None)
    yield from unlabelled(
        CounterMetricFamily,
        (
            "scd_prefill_partial_hits",
            "Prefill calls that continued a stored prefix",
            chunk_store.partial_hits if chunk_store else 0,
        ),
        ("scd_prefill_tokens_reused", "context tokens whose prefill the store saved", servicer.tokens_reused),
        ("scd_prefill_tokens_computed", "context tokens the prefill forward ran over", servicer.tokens_computed),
        ("scd_prefill_prefix_waits", "Prefill calls that waited for a running prefill of their prefix", servicer.prefix_waits),
    )
    tiers = servicer.store_tiers()
    for kind, name, help_ in (
        (GaugeMetricFamily, "bytes", "bytes held by the store tier"),
        (GaugeMetricFamily, "budget_bytes", "byte budget of the store tier"),
        (GaugeMetricFamily, "entries", "entries held by the store tier"),
        (CounterMetricFamily, "hits", "entry lookups served by the store tier"),
        (CounterMetricFamily, "evictions", "entries evicted from the store tier"),
        (CounterMetricFamily, "corrupt", "entries dropped for bad bytes (disk: unparsable, truncated, checksum)"),
        (CounterMetricFamily, "write_skipped", "disk writes skipped because the writer's queue was full"),
        (GaugeMetricFamily, "queued_bytes", "tensor bytes waiting for the disk writer"),
        (GaugeMetricFamily, "pinned_evicted_bytes", "bytes evicted from the tier but still held by running requests"),
    ):
        family = kind(f"scd_store_tier_{name}", help_, labels=["tier"])
        for tier in tiers:
            family.add_metric([tier.name], getattr(tier, "corrupt_dropped" if name == "corrupt" else name))
        yield family
