"""The consumer process's composition root: `ConsumerServer` loads the model, builds the engine
(consumer/engine/), the producer link (consumer/link/), the probes (consumer/auto/) and wires both
fronts onto one servicer: the gRPC port (consumer/api/servicer.py) and the OpenAI HTTP port
(consumer/api/openai_api.py); then health, readiness and drain. `python -m consumer` runs it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from grpc_health.v1 import health_pb2

from consumer.api.openai_api import OpenAIServer
from consumer.api.servicer import SERVICE_NAME, ConsumerServicer
from consumer.auto import defaults
from consumer.auto.probe import BackgroundProbe
from consumer.engine import paged_attention, prefill_budget
from consumer.engine.batch import BatchEngine
from consumer.engine.kv_admission import KVAdmission
from consumer.engine.kv_pool import KVPool, default_pool_bytes
from consumer.engine.pool_forward import PoolRunner
from consumer.engine.prefix_cache import PrefixCache
from consumer.engine.process import EngineProcess
from consumer.link import readiness
from consumer.link.producer_client import ProducerClient
from shared import grpc_server, handlers, logs, startup
from shared.config import ConsumerConfig
from shared.kv_events import KVEventPublisher
from shared.models import LoadedModel, load_model, warm_up
from shared.pb import consumer_pb2

log = logs.get("consumer")


class ConsumerServer:
    """Bind, load the model (health NOT_SERVING meanwhile), warm up, then SERVING."""

    def __init__(self, config: ConsumerConfig):
        self.config = config
        self.server = grpc_server.Server([SERVICE_NAME], config)
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
        """The model (unless given), the engine and its KV memory, the servicer's parts, the producer
        link, then SERVING and the background probes."""
        cfg = self.config
        if loaded is None:
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="consumer-load") as loader:
                loaded = await logs.run_in(loader, load_model, cfg.model, cfg.dtype, cfg.device)
        pool = KVPool(loaded.info, loaded.device, default_pool_bytes(cfg, loaded), cfg.kv_block_tokens)
        if loaded.device.type == "cpu":  # the decode kernel, loaded (built, if make install did not) off the event loop
            await asyncio.to_thread(paged_attention.kernel)
        batch = self.executor = await self._engine(loaded, pool)
        await logs.run_in(batch, warm_up, loaded)
        prefix, kv_admission = self._kv_memory(pool, batch)
        # liveness from the engine's progress (and its local job thread's), not a place in its queue
        self.server.progress = [batch.progress] + ([batch.local.progress] if isinstance(batch, EngineProcess) else [])
        self.client = ProducerClient.from_config(cfg, loaded.info.weight_digest, self.server.tracing)
        self.servicer.attach(loaded, batch, kv_admission, prefix, self.client)
        self.server.metrics.watch_engine(batch, pool, kv_admission, prefix, self.servicer.pipeline)
        self.server.metrics.watch_router(
            self.servicer.model_name, self.servicer.admission, kv_admission, pool, prefix, self.kv_events
        )
        link = await self._link(loaded, self.client)
        await self.server.serving()
        link.start()
        self._start_probe(loaded, self.client)
        log.info(
            "server.serving",
            model=self.servicer.model_name,
            dtype=loaded.info.dtype,
            dtype_reason=loaded.info.dtype_reason,
            device=loaded.info.device,
            digest=loaded.info.weight_digest[:16],
            kv_pool_bytes=pool.capacity_bytes,
            max_batch=cfg.max_batch,
            decode_attention=self.servicer.decode_attention(),
            prefill_attention=self.servicer.prefill_attention(),
            packed_weights=self.servicer.packed_weights(),
            elementwise_ops=self.servicer.elementwise_ops(),
        )

    async def _engine(self, loaded: LoadedModel, pool: KVPool) -> BatchEngine | EngineProcess:
        """The batch engine: on a thread here, or in a process of its own (--engine-process)."""
        cfg = self.config
        forward: dict[str, Any] = {  # PoolRunner's options
            "decode_attention": cfg.decode_attention,
            "prefill_attention": cfg.prefill_attention,
            "packed": cfg.packed_weights,
            "fused_ops": cfg.fused_ops,
        }
        chunk, total = prefill_budget.resolve(cfg.prefill_chunk, cfg.max_batch_tokens, loaded.device.type)
        log.info("consumer.prefill_budget", prefill_chunk=chunk, max_batch_tokens=total, device=loaded.device.type)
        if not cfg.engine_process:
            runner = functools.partial(PoolRunner, **forward)
            return BatchEngine(loaded, pool, cfg.max_batch, chunk, total, runner=runner)
        loop = asyncio.get_running_loop()

        def exited(why: str) -> None:  # the engine process's reader thread
            loop.call_soon_threadsafe(self._engine_exited, why)

        threads = torch.get_num_threads()  # as this process resolved it (shared.torch_threads.intra_op_threads)
        args = (loaded, pool, cfg.model, threads, cfg.max_batch, chunk, total)
        return await asyncio.to_thread(EngineProcess, *args, on_exit=exited, forward=forward)

    def _kv_memory(self, pool: KVPool, batch: BatchEngine | EngineProcess) -> tuple[PrefixCache | None, KVAdmission]:
        """The prefix cache (--prefix-cache-bytes; its KV events when --kv-events-endpoint is given)
        and admission by KV memory, which asks the engine to make room."""
        cfg = self.config
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

        return prefix, KVAdmission(pool, cfg.max_queue, make_room)

    async def _link(self, loaded: LoadedModel, client: ProducerClient) -> readiness.ProducerLink:
        """The producer link, checked once (readiness and the default mode from what the producer
        says; a naive-reuse default refused at start), with its health service and metric."""
        cfg = self.config
        self.link = link = readiness.ProducerLink(
            client.stub, self.servicer.codecs, client.transport, cfg.producer_check_interval_s, self._link_changed
        )
        self.servicer.link = link
        self.server.health_reasons[readiness.HEALTH_SERVICE] = lambda: f"producer link {link.state.state}: {link.state.reason}"
        self.server.metrics.watch_state(
            "scd_producer_link", "producer link state (1: current)", readiness.LINK_STATES, lambda: link.state.state
        )
        await link.check()
        known = defaults.producer_digest_known(self.servicer.codecs, loaded.info.weight_digest, link.state.producer_digest)
        naive = self.servicer.default.naive_reuse(known, cfg.allow_naive_reuse_default)
        if naive:
            raise startup.StartupError(naive)
        return link

    def _start_probe(self, loaded: LoadedModel, client: ProducerClient) -> None:
        """auto's background probes (consumer.auto.probe), told of every Generate by the servicer."""
        cfg = self.config
        self.probe = BackgroundProbe(
            self.servicer.chooser,
            self.servicer.planner,
            client,
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

    def _engine_exited(self, reason: str) -> None:
        """The engine process died: not ready from now on (liveness already reads it stalled)."""
        self.engine_failure = reason
        asyncio.ensure_future(self.server.set_not_ready(reason))

    async def _link_changed(self, state: readiness.LinkState) -> None:
        """A new producer link state: the default mode for what is now known, the link's own health
        service, then readiness (consumer.link.readiness.not_ready: whether the default can be served now)."""
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
