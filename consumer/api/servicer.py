"""The consumer's gRPC front (thin: validate and tokenize the request, run RequestPipeline, convert
events to messages). The process around it (model load, engine, producer link, the HTTP front,
health, drain) is wired by the composition root, consumer/server.py."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import AsyncGenerator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import shared
from consumer.api.job_builder import JobBuilder
from consumer.api.messages import auto_trail, budget_to_pb, item_to_pb, prefix_stats
from consumer.auto.chooser import Candidate, Chooser
from consumer.auto.defaults import DefaultMode
from consumer.auto.planner import TransferPlanner
from consumer.auto.probe import BackgroundProbe
from consumer.auto.producer_memory import ProducerMemory
from consumer.engine import paged_attention
from consumer.engine.batch import BatchEngine
from consumer.engine.kv_admission import KVAdmission
from consumer.engine.prefix_cache import PrefixCache
from consumer.engine.process import EngineProcess
from consumer.link import readiness
from consumer.link.producer_client import ProducerClient
from consumer.pipeline.learning import learn
from consumer.pipeline.pipeline import RequestPipeline
from consumer.request.job import AUDIT_OFF, FAIL, ORACLE_MODE, VERIFY_OFF, Commit, Extras, GenerateJob, GenerateResult, TokenOut
from shared import admission, describe, logs, outcomes, rpc_errors, security
from shared import codecs as codec_lib
from shared.config import ConsumerConfig
from shared.errors import Unavailable
from shared.metrics import Metrics
from shared.models import LoadedModel
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
        self.admission = admission.Admission("max_inflight", config.max_inflight)
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
            self._producer_keep_weights,
            exact_by_transfer=self.config.exact_by_transfer,
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
        """Verified decoding's exact cache by a transfer (consumer.auto.chooser.Chooser.exact_transfer):
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
            keep=None,  # the exact cache is the whole context's, never a kept one
        )

    def _producer_digest(self) -> str:
        """The producer's weight digest as the link last saw it ("" before it answered)."""
        link = getattr(self, "link", None)
        return link.state.producer_digest if link is not None else ""

    def _producer_identity(self) -> str:
        """What shapes the producer's K/V (ModelInfo.identity) as the link last saw it ("" before it answered)."""
        link = getattr(self, "link", None)
        return link.state.producer_identity if link is not None else ""

    def _producer_keep_weights(self) -> dict[str, str]:
        """Artifact id -> the digest of the keep weights the producer serves learned keep with, as the
        link last saw it (empty before it answered)."""
        link = getattr(self, "link", None)
        return dict(link.state.producer_keep_weights) if link is not None else {}

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

    def _runner(self):
        """The engine's runner; with --engine-process, this process's twin of the child's (built
        with the same options, loading the same kernel builds)."""
        batch = self.batch
        return batch.local.runner if isinstance(batch, EngineProcess) else batch.runner

    def decode_attention(self) -> str:
        """What the engine's decode rows attend with (paged_attention.runs): "kernel avx512", or
        "sdpa: why"."""
        return paged_attention.runs(self._runner())

    def prefill_attention(self) -> str:
        """What the engine's prefill rows attend with (PoolRunner.prefill_runs): "kernel avx512bf16",
        or "sdpa: why"."""
        runner = self._runner()
        return getattr(runner, "prefill_runs", f"sdpa: {type(runner).__name__} has no prefill kernel")

    def elementwise_ops(self) -> str:
        """What the forward's norms, residual adds, SiLU * up and RoPE run (PoolRunner.fused_runs):
        "fused avx512 bf16", "fused avx512", or "eager: why"."""
        runner = self._runner()
        return getattr(runner, "fused_runs", f"eager: {type(runner).__name__} has no fused ops")

    def packed_weights(self) -> str:
        """Whether the engine's projections run on oneDNN-prepacked weights: "on", or "off: why"."""
        runner = self._runner()
        if getattr(runner, "packed", None) is not None:
            return "on"
        return "off: --packed-weights false" if not self.config.packed_weights else f"off: {runner.packed_off}"

    def _ready(self) -> LoadedModel:
        if self.loaded is None:
            raise Unavailable("consumer model is still loading")
        return self.loaded

    async def _tokenize(self, text: str, special: bool) -> list[int]:
        """Tokenize on its own thread: never on the event loop, never queued behind a decode."""
        tokenizer = self._ready().tokenizer
        return await logs.run_in(self.tokenizer_pool, lambda: tokenizer(text, add_special_tokens=special)["input_ids"])

    @rpc_errors.stream_errors
    async def Generate(self, request, context):
        received = time.perf_counter()
        timeout_s = rpc_errors.remaining_s(context, self.config.default_timeout_s)
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
        """One Generate whatever the transport (gRPC here, HTTP in consumer.api.openai_api): admission
        (max_inflight), outcome counting, the job, the pipeline, the result's bookkeeping; `caller`
        answers cancelled() (the grpc context, or the HTTP request's stand-in); `extras`: what the
        HTTP API asks beyond the message (stop strings, logit processors, log-probabilities)."""
        request_id = rpc_errors.request_id(request.request_id)
        if self.probe is not None:
            self.probe.touch()
        ended: list[GenerateResult] = []  # the call's GenerateStats, once handed over to be sent

        def final(item):
            if isinstance(item, GenerateResult):
                ended.append(item)
            return item

        with rpc_errors.request_scope(request_id), self.admission.slot():
            tracked = self.outcomes.track(
                self._generate(request, request_id, timeout_s, received, extras), caller, log, "generate", lambda: bool(ended)
            )
            async with contextlib.aclosing(tracked) as items:  # its outcome counted here, not when collected
                async for item in items:
                    yield final(item)

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
                    learn(self.planner, self.memory, job, item)
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

    @rpc_errors.unary_errors
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
            decode_attention=self.decode_attention(),
            prefill_attention=self.prefill_attention(),
            elementwise_ops=self.elementwise_ops(),
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
                scratch_limit_bytes=0,  # the engine's forward reads the pool in place: no gather buffers
                kv_reclaimable_bytes=self.batch.pool.reclaimable_blocks * self.batch.pool.block_bytes,
                max_batch=self.batch.max_batch,
                nonfinite_rows=self.batch.stats.failed_rows,
                transfers_abandoned=self.pipeline.abandoned,
                auto_choices=self.auto_choices,
                **prefix_stats(self.prefix),
            ),
        )
