"""Consumer gRPC servicer (thin: validate and tokenize the request, run RequestPipeline, convert
events to messages) and process wiring (config, model load, producer client, health, drain)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import time
from collections.abc import AsyncGenerator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from grpc_health.v1 import health_pb2

import shared
from consumer import defaults, readiness
from consumer.auto import Candidate, Chooser
from consumer.batch import BatchEngine
from consumer.defaults import DefaultMode
from consumer.engine_process import EngineProcess
from consumer.kv_admission import KVAdmission
from consumer.kv_pool import KVPool, default_pool_bytes
from consumer.learning import learn
from consumer.messages import auto_trail, budget_to_pb, item_to_pb, prefix_stats
from consumer.openai_api import OpenAIServer
from consumer.pipeline import RequestPipeline
from consumer.planner import TransferPlanner
from consumer.prefix_cache import PrefixCache
from consumer.probe import BackgroundProbe
from consumer.producer_client import ProducerClient
from consumer.producer_memory import ProducerMemory
from consumer.request import AUDIT_OFF, FAIL, ORACLE_MODE, VERIFY_OFF, Commit, Extras, GenerateJob, GenerateResult, TokenOut
from consumer.requests import JobBuilder
from consumer.runner import scratch_limit_bytes
from shared import codecs as codec_lib
from shared import describe, handlers, logs, outcomes, security, serving, startup
from shared.config import ConsumerConfig
from shared.errors import Unavailable
from shared.kv_events import KVEventPublisher
from shared.metrics import Metrics
from shared.models import LoadedModel, load_model, warm_up
from shared.pb import common_pb2, consumer_pb2, consumer_pb2_grpc
from shared.scd.artifact import discover

log = logs.get("consumer")
SERVICE_NAME = consumer_pb2.DESCRIPTOR.services_by_name["ConsumerService"].full_name


class ConsumerServicer(consumer_pb2_grpc.ConsumerServiceServicer):
    """Registered before the port opens; answers UNAVAILABLE until `attach` gives it a model."""

    metrics: Metrics  # the server's, set by ConsumerServer right after construction

    def __init__(self, config: ConsumerConfig):
        self.config = config
        self.tokenizer_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="consumer-tokenize")
        self.loaded: LoadedModel | None = None
        self.admission = serving.Admission("max_inflight", config.max_inflight)
        self.outcomes = outcomes.Outcomes()
        self.transfer_fallbacks = 0
        self.auto_choices = 0
        self.probe: BackgroundProbe | None = None  # ConsumerServer sets it: told of every Generate
        # the model's one public name: /v1/models, Describe, logs, metrics (never a filesystem path)
        self.model_name = config.served_model_name or describe.public_model_id(config.model)

    def attach(
        self,
        loaded: LoadedModel,
        batch: BatchEngine | EngineProcess,
        kv_admission: KVAdmission,
        prefix: PrefixCache | None,
        client: ProducerClient,
    ) -> None:
        self.codecs = codec_lib.create_codecs(loaded, artifacts=discover(self.config.artifact_paths))
        self.batch, self.kv_admission, self.prefix = batch, kv_admission, prefix
        self.planner = TransferPlanner()
        self.pipeline = RequestPipeline(
            loaded,
            batch,
            kv_admission,
            client,
            prefix,
            self._producer_identity,
            self.planner,
            self._producer_dtype,
            self._exact_transfer,
        )
        self.memory = ProducerMemory(chains=self.pipeline.keys.chains)  # both on the event loop: one packing per context
        self.chooser = Chooser(
            loaded,
            self.codecs,
            self.planner,
            self.memory,
            self._cached_tokens,
            self._producer_digest,
            self._producer_usable,
            self._producer_dtype,
            self._producer_identity,
        )
        cfg = self.config
        self.jobs = JobBuilder(
            cfg,
            loaded,
            self.codecs,
            self.planner,
            self._tokenize,
            self.chooser,
            security.load_token(cfg.token, cfg.token_file),
            security.load_token(cfg.producer_token, cfg.producer_token_file),
        )
        self.default = DefaultMode(self.config.default_mode, self.codecs, loaded.info.weight_digest)
        self.jobs.default_mode = lambda: self.default.mode
        self.link: readiness.ProducerLink | None = None  # ConsumerServer sets it
        self.loaded = loaded

    def _exact_transfer(self, job: GenerateJob) -> GenerateJob | None:
        """Verified decoding's exact cache by a transfer (consumer.auto.Chooser.exact_transfer):
        the transfer's job, or None for the own prefill."""
        c = self.chooser.exact_transfer(job.context_ids)
        if c is None:
            return None
        return dataclasses.replace(
            job,
            codec=self.codecs[c.mode],
            options=dict(c.options),
            on_failure=FAIL,
            transfer_budget_s=None,
            audit=AUDIT_OFF,
            verify=VERIFY_OFF,
            repair=None,
            auto=None,
            fallback="",
        )

    def _producer_digest(self) -> str:
        """The producer's weight digest as the link last saw it ("" before it answered)."""
        link = getattr(self, "link", None)
        return link.state.producer_digest if link is not None else ""

    def _producer_identity(self) -> str:
        """What shapes the producer's K/V (ModelInfo.identity) as the link last saw it ("" before it answered)."""
        link = getattr(self, "link", None)
        return link.state.producer_identity if link is not None else ""

    def _producer_dtype(self) -> str:
        """The dtype the producer computes its KV in, as the link last saw it ("" before it answered)."""
        link = getattr(self, "link", None)
        return link.state.producer_dtype if link is not None else ""

    def _producer_usable(self) -> bool:
        """Whether the producer link may be tried (usable, or not checked yet)."""
        link = getattr(self, "link", None)
        return link is None or link.state.state in (*readiness.USABLE, "unknown")

    def _cached_tokens(self, c: Candidate, context_ids: list[int], tenant: str = "") -> int:
        codec = self.codecs.get(c.mode) if c.remote else None
        return self.pipeline.cached_tokens(codec, dict(c.options), context_ids, tenant)

    def _ready(self) -> LoadedModel:
        if self.loaded is None:
            raise Unavailable("consumer model is still loading")
        return self.loaded

    async def _tokenize(self, text: str, special: bool) -> list[int]:
        """Tokenize on its own thread: never on the event loop, never queued behind a decode."""
        tokenizer = self._ready().tokenizer
        return await logs.run_in(self.tokenizer_pool, lambda: tokenizer(text, add_special_tokens=special)["input_ids"])

    @serving.stream_errors
    async def Generate(self, request, context):
        received = time.perf_counter()
        timeout_s = serving.remaining_s(context, self.config.default_timeout_s)
        async with contextlib.aclosing(self.generate_items(request, timeout_s, context, received)) as items:
            async for item in items:
                yield item_to_pb(item)

    async def generate_items(
        self,
        request: consumer_pb2.GenerateRequest,
        timeout_s: float,
        caller: Any,
        received: float,
        extras: Extras | None = None,
    ) -> AsyncGenerator[TokenOut | Commit | GenerateResult, None]:
        """One Generate whatever the transport (gRPC here, HTTP in consumer.openai_api): admission
        (max_inflight), outcome counting, the job, the pipeline, the result's bookkeeping; `caller`
        answers cancelled() (the grpc context, or the HTTP request's stand-in); `extras`: what the
        HTTP API asks beyond the message (stop strings, logit processors, log-probabilities)."""
        request_id = serving.request_id(request.request_id)
        if self.probe is not None:
            self.probe.touch()
        with serving.request_scope(request_id), self.admission.slot():
            async for item in self.outcomes.track(
                self._generate(request, request_id, timeout_s, received, extras), caller, log, "generate"
            ):
                yield item

    async def _generate(self, request, request_id: str, timeout_s: float, received: float, extras: Extras | None):
        self._ready()
        job = await self.jobs.build(request, request_id, timeout_s, extras)
        job.received_at = received
        log.info(
            "generate.start",
            mode=job.mode,
            context_tokens=len(job.context_ids),
            question_tokens=len(job.question_ids),
            deadline_s=timeout_s,
            on_failure=job.on_failure,
        )
        async with contextlib.aclosing(self.pipeline.run(job)) as items:
            async for item in items:
                if isinstance(item, GenerateResult):
                    learn(self.planner, self.memory, self.chooser.key, job, item)
                    if self.probe is not None:
                        self.probe.touch()
                    self.auto_choices += job.auto is not None and not job.fallback
                    if job.fallback:
                        item.options["fallback"] = job.fallback
                    self.transfer_fallbacks += bool(item.transfer_failure)
                    self.metrics.observe_generate(item)
                    log.info(
                        "generate.done",
                        mode=item.codec,
                        ttft_ms=round(item.ttft_ms, 2),
                        tokens=item.generated_tokens,
                        bytes=item.bytes_received,
                        total_ms=round(item.total_ms, 2),
                        transfer_failure=item.transfer_failure or None,
                        **auto_trail(job.auto),
                    )
                yield item

    @serving.unary_errors
    async def Describe(self, request, context):
        loaded = self._ready()
        cfg = self.config
        return consumer_pb2.ConsumerServiceDescribeResponse(
            model=describe.model_to_pb(loaded.info, self.model_name),
            codecs=[describe.local_mode_pb(ORACLE_MODE), *describe.codecs_to_pb(self.codecs)],
            limits=common_pb2.Limits(
                max_context_tokens=cfg.max_context_tokens,
                max_question_tokens=cfg.max_question_tokens,
                max_new_tokens=cfg.max_new_tokens,
            ),
            server_version=shared.__version__,
            api_version=shared.API_VERSION,
            artifacts=describe.artifacts_to_pb(self.codecs),
            auto_default_budget=budget_to_pb(self.chooser.default_budget()),
            default_mode=self.default.mode,
            default_mode_reason=self.default.why,
            producer_link=readiness.link_to_pb(self.link),
            estimates=self.planner.snapshot(),
            stats=consumer_pb2.ConsumerStats(
                generates_started=self.outcomes.started,
                generates_completed=self.outcomes.completed,
                generates_cancelled=self.outcomes.cancelled,
                generates_failed=self.outcomes.failed,
                transfer_fallbacks=self.transfer_fallbacks,
                inflight=self.admission.inflight,
                kv_pool_bytes=self.batch.pool.capacity_bytes,
                kv_used_bytes=self.batch.pool.used_bytes,
                kv_queue=self.kv_admission.queued,
                last_batch_rows=self.batch.stats.last_batch,
                max_batch_rows_seen=self.batch.stats.max_batch_seen,
                scratch_bytes=self.batch.stats.scratch_bytes,
                scratch_limit_bytes=scratch_limit_bytes(self.batch.pool),
                kv_reclaimable_bytes=self.batch.pool.reclaimable_blocks * self.batch.pool.block_bytes,
                max_batch=self.batch.max_batch,
                nonfinite_rows=self.batch.stats.failed_rows,
                transfers_abandoned=self.pipeline.abandoned,
                auto_choices=self.auto_choices,
                **prefix_stats(self.prefix),
            ),
        )


class ConsumerServer:
    """Bind, load the model (health NOT_SERVING meanwhile), warm up, then SERVING."""

    def __init__(self, config: ConsumerConfig):
        self.config = config
        self.server = serving.Server([SERVICE_NAME], config)
        self.servicer = ConsumerServicer(config)
        self.servicer.metrics = self.server.metrics
        self.server.watch(admission=self.servicer.admission)
        self.executor: BatchEngine | EngineProcess | None = None  # the batch engine: the device's only executor, once loaded
        handlers.add_servicer(self.server.server, self.servicer, consumer_pb2.DESCRIPTOR.services_by_name["ConsumerService"])
        self.client: ProducerClient | None = None
        self.link: readiness.ProducerLink | None = None
        self.probe: BackgroundProbe | None = None
        self.engine_failure = ""  # why the engine process exited, once it has (--engine-process)
        # the OpenAI-compatible HTTP port (--http-port), on this servicer: the same admission and pipeline
        self.http = OpenAIServer(self.servicer, config, self.server.why_not_serving) if config.http_port >= 0 else None
        self.http_port = -1
        self.kv_events: KVEventPublisher | None = None  # set by load when --kv-events-endpoint is given

    @property
    def address(self) -> str:
        return self.server.address

    async def start(self) -> None:
        await self.server.start()
        if self.http is not None:  # open before the model loads, as the gRPC port: 503 until then
            self.http_port = await self.http.start()
        log.info(
            "server.started",
            address=self.address,
            model=self.servicer.model_name,
            producer=self.config.producer,
            http_port=self.http_port,
        )

    async def load(self, loaded: LoadedModel | None = None) -> None:
        cfg = self.config
        if loaded is None:
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="consumer-load") as loader:
                loaded = await logs.run_in(loader, load_model, cfg.model, cfg.dtype, cfg.device)
        pool = KVPool(loaded.info, loaded.device, default_pool_bytes(cfg, loaded), cfg.kv_block_tokens)
        batch: BatchEngine | EngineProcess
        if cfg.engine_process:
            loop = asyncio.get_running_loop()

            def exited(why: str) -> None:  # the engine process's reader thread
                loop.call_soon_threadsafe(self._engine_exited, why)

            threads = torch.get_num_threads()  # as this process resolved it (shared.serving.intra_op_threads)
            args = (loaded, pool, cfg.model, threads, cfg.max_batch, cfg.prefill_chunk, cfg.max_batch_tokens)
            batch = await asyncio.to_thread(EngineProcess, *args, on_exit=exited)
        else:
            batch = BatchEngine(loaded, pool, cfg.max_batch, cfg.prefill_chunk, cfg.max_batch_tokens)
        self.executor = batch
        await logs.run_in(batch, warm_up, loaded)
        budget = pool.capacity_bytes // 2 if cfg.prefix_cache_bytes < 0 else cfg.prefix_cache_bytes
        # KV events (--kv-events-endpoint): the prefix cache's chunks as vLLM blocks, medium GPU (the
        # serving pool, whatever its device: what routers treat as the engine's own cache)
        self.kv_events = KVEventPublisher.from_config(cfg, medium="GPU") if budget > 0 else None
        prefix = PrefixCache(pool, budget, cfg.chunk_tokens, self.kv_events) if budget > 0 else None
        make_room = None
        if prefix is not None:

            def make_room(blocks: int, prefix: PrefixCache = prefix) -> concurrent.futures.Future:
                """An intent: the engine evicts (only what frees blocks) and zeroes them between forwards."""
                # with headroom (the need again, or a 16th of the pool), so that the next admissions
                # under memory pressure find blocks free instead of waiting for the engine again
                want = blocks + max(blocks, pool.num_blocks // 16)
                return batch.submit(lambda: (prefix.make_room(want), pool.reclaim()))

        kv_admission = KVAdmission(pool, cfg.max_queue, make_room)
        # liveness from the engine's progress (and its local job thread's), not a place in its queue
        self.server.progress = [batch.progress] + ([batch.local.progress] if isinstance(batch, EngineProcess) else [])
        self.client = client = ProducerClient.from_config(cfg, loaded.info.weight_digest, self.server.tracing)
        self.servicer.attach(loaded, batch, kv_admission, prefix, self.client)
        self.server.metrics.watch_engine(batch, pool, kv_admission, prefix, self.servicer.pipeline)
        self.server.metrics.watch_router(
            self.servicer.model_name, self.servicer.admission, kv_admission, pool, prefix, self.kv_events
        )
        self.link = link = readiness.ProducerLink(
            self.client.stub, self.servicer.codecs, self.client.transport, cfg.producer_check_interval_s, self._link_changed
        )
        self.servicer.link = link
        self.server.health_reasons[readiness.HEALTH_SERVICE] = lambda: f"producer link {link.state.state}: {link.state.reason}"
        self.server.metrics.watch_state(
            "scd_producer_link", "producer link state (1: current)", readiness.LINK_STATES, lambda: link.state.state
        )
        await link.check()  # readiness and the default mode from what the producer says
        known = defaults.producer_digest_known(self.servicer.codecs, loaded.info.weight_digest, link.state.producer_digest)
        naive = self.servicer.default.naive_reuse(known, cfg.allow_naive_reuse_default)
        if naive:
            raise startup.StartupError(naive)
        await self.server.serving()
        link.start()
        self.probe = BackgroundProbe(
            self.servicer.chooser,
            self.servicer.planner,
            self.client,
            self.servicer.codecs,
            loaded.info,
            cfg.probe_idle_s,
            lambda: self.servicer.admission.inflight > 0,
            cfg.max_context_tokens,
            lambda: client.streams_open > 0,
        )
        self.servicer.probe = self.probe
        self.server.metrics.watch_probes(self.probe)
        self.probe.start()
        log.info(
            "server.serving",
            model=self.servicer.model_name,
            dtype=loaded.info.dtype,
            dtype_reason=loaded.info.dtype_reason,
            device=loaded.info.device,
            digest=loaded.info.weight_digest[:16],
            kv_pool_bytes=pool.capacity_bytes,
            max_batch=cfg.max_batch,
        )

    def _engine_exited(self, reason: str) -> None:
        """The engine process died: not ready from now on (liveness already reads it stalled)."""
        self.engine_failure = reason
        asyncio.ensure_future(self.server.set_not_ready(reason))

    async def _link_changed(self, state: readiness.LinkState) -> None:
        """A new producer link state: the default mode for what is now known, the link's own health
        service, then readiness (consumer.readiness.not_ready: whether the default can be served now)."""
        default = self.servicer.default
        usable = state.state in readiness.USABLE
        if self.client is not None:
            self.client.link_problem = "" if usable else state.reason
        if state.producer_digest and default.producer_known(state.producer_digest, state.producer_artifacts):
            log.info("consumer.default_mode", mode=default.mode, reason=default.why)
        status = health_pb2.HealthCheckResponse.SERVING if usable else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.server.health.set(readiness.HEALTH_SERVICE, status)
        naive = default.naive_reuse(state.producer_digest, self.config.allow_naive_reuse_default)
        reason = readiness.not_ready(state, default.mode, default.needs_producer, naive)
        await self.server.set_not_ready(self.engine_failure or reason)

    async def stop(self, grace_s: float | None = None) -> None:
        if self.probe is not None:
            await self.probe.stop()
        if self.link is not None:
            await self.link.stop()
        await self.server.drain(self.config.drain_grace_s if grace_s is None else grace_s, self.servicer.admission)
        if self.http is not None:  # its calls were drained with the gRPC ones (one admission)
            await self.http.stop()
        if self.client is not None:
            await self.client.close()
        if self.executor is not None:  # the engine thread ends its iteration and exits before the interpreter does
            await asyncio.to_thread(self.executor.shutdown, wait=True, cancel_futures=True)
        if self.kv_events is not None:  # after the engine: its last changes are published
            await asyncio.to_thread(self.kv_events.close)
        self.servicer.tokenizer_pool.shutdown(wait=False, cancel_futures=True)
