"""gRPC server lifecycle shared by both services.

Owns: the grpc.aio server with TLS / mTLS and bearer-token auth (shared.security), the metrics
interceptor and endpoint (shared.metrics), the health service, optional server reflection (v1
and v1alpha), an optional plaintext health-only port for kubelet probes; mapping `shared.errors`
to status codes for servicer methods; running a service under uvloop with SIGTERM/SIGINT
draining in-flight calls for a grace period. Owns no model or codec logic.

Health: readiness is the overall service "" and each API service name (NOT_SERVING until the
model is loaded and warmed, SERVING after, NOT_SERVING while draining or when `not_ready` says
why); liveness is the service "liveness", from progress (`watch(progress=...)`: the producer's
forward and encode loops, the consumer's batch engine): NOT_SERVING only while some iteration of
a watched loop has made no progress for `liveness_timeout_s` (shared.liveness), checked every
`liveness_interval_s`; a long queue is not a hang. As Kubernetes
gRPC probes (the kubelet speaks plaintext, so point them at `--health-port`):
    readinessProbe: {grpc: {port: 50060, service: scd.v1.ProducerService}}
    livenessProbe:  {grpc: {port: 50060, service: liveness}}
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import re
import signal
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2

from shared import liveness, logs, security, tracing
from shared.config import ServerConfig
from shared.errors import InvalidArgument, ResourceExhausted, ServiceError, Unavailable
from shared.metrics import Metrics

log = logs.get("serving")

# Payload chunks are <= 4 MiB; leave room for the message envelope.
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 8 << 20),
    ("grpc.max_receive_message_length", 8 << 20),
    ("grpc.so_reuseport", 0),
]
# servers also accept the consumers' keepalive pings (every >= 10 s, idle connections included)
SERVER_OPTIONS = [
    *GRPC_OPTIONS,
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 0),
]


def status_code(exc: ServiceError) -> grpc.StatusCode:
    return grpc.StatusCode[exc.code]


REQUEST_ID_MAX = 128


def request_id(value: str) -> str:
    """The caller's request id (printable ASCII, at most REQUEST_ID_MAX characters: it travels as
    gRPC metadata and into logs) or a fresh one; InvalidArgument otherwise."""
    if not value:
        return uuid.uuid4().hex
    if len(value) > REQUEST_ID_MAX or not all(" " <= ch <= "~" for ch in value):
        raise InvalidArgument(
            f"request_id: must be 1..{REQUEST_ID_MAX} printable ASCII characters (0x20-0x7E), got {len(value)} characters"
        )
    return value


REQUEST_ID_HEADER = "x-request-id"  # metadata: the caller's request id in, and on every error status out
_TAG = "scd_request_id"  # the attribute request_scope sets on the exception that ends a call


@contextlib.contextmanager
def request_scope(request_id: str) -> Iterator[None]:
    """The call's request id on every log line it writes (structlog contextvars) and on the
    exception that ends it: the error wrappers (`_abort`) run after this binding is gone, and read
    the id from the exception for the status and the log line."""
    with structlog.contextvars.bound_contextvars(request_id=request_id):
        try:
            yield
        except BaseException as exc:
            if not getattr(exc, _TAG, ""):
                with contextlib.suppress(AttributeError, TypeError):
                    setattr(exc, _TAG, request_id)
            raise


class Admission:
    """A limit on calls in flight, released on every path (a context manager around the whole
    handler), and closed while draining. `inflight` is what is running now."""

    def __init__(self, limit_name: str, limit: int):
        self.limit_name, self.limit = limit_name, limit
        self.inflight = 0
        self.rejected = {"limit": 0, "draining": 0}  # refusals by reason (shared.metrics reads them)
        self.draining = False
        self.idle = asyncio.Event()
        self.idle.set()

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        if self.draining:
            self.rejected["draining"] += 1
            raise Unavailable("server is draining; retry on another replica")
        if self.inflight >= self.limit:
            self.rejected["limit"] += 1
            raise ResourceExhausted(f"calls in flight: {self.inflight} >= {self.limit_name} {self.limit}")
        self.inflight += 1
        self.idle.clear()
        try:
            yield
        finally:
            self.inflight -= 1
            if self.inflight == 0:
                self.idle.set()


# an absolute path's directories ("/models/checkpoints/qa-base" -> "qa-base"); "5/26",
# "dns:///host:port" and the HTTP API's routes ("GET /v1/models") are left alone
_PATH_DIRS = re.compile(r"(?<![\w.:/])(?!/v1/)(?:/[^\s/'\"(),]+)+/(?=[^\s/'\"(),]+)")


def public_text(text: str) -> str:
    """`text` without filesystem directories: what a caller may see in a status message."""
    return _PATH_DIRS.sub("", text)


async def _abort(context: grpc.aio.ServicerContext, exc: Exception, rpc: str) -> None:
    """The one place an exception becomes a status: ServiceError -> its code and message (without
    filesystem directories); anything else -> INTERNAL "internal error" with the request id,
    logged once (bounded, no locals). Every error status carries the request id in its trailing
    metadata (REQUEST_ID_HEADER) and every such log line names it (`request_scope`)."""
    rid = getattr(exc, _TAG, "") or structlog.contextvars.get_contextvars().get("request_id", "")
    trailer = ((REQUEST_ID_HEADER, rid),) if rid else ()
    if isinstance(exc, ServiceError):
        log.info("rpc.error", rpc=rpc, code=exc.code, reason=str(exc)[:500], request_id=rid)
    else:
        log.error("rpc.internal_error", rpc=rpc, error=f"{type(exc).__name__}: {str(exc)[:500]}", exc_info=exc, request_id=rid)
    if isinstance(exc, ServiceError):
        await context.abort(status_code(exc), public_text(str(exc)[:2000]), trailer)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error (request_id={rid})", trailer)


def unary_errors(fn: Callable[..., Awaitable]) -> Callable[..., Awaitable]:
    """Servicer decorator: errors -> status codes (see _abort)."""

    @functools.wraps(fn)
    async def wrapper(self, request, context):
        try:
            return await fn(self, request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            await _abort(context, exc, fn.__name__)

    return wrapper


def stream_errors(fn: Callable[..., AsyncGenerator]) -> Callable[..., AsyncGenerator]:
    """The same for server-streaming handlers written as async generators (closed on every path)."""

    @functools.wraps(fn)
    async def wrapper(self, request, context):
        try:
            async with contextlib.aclosing(fn(self, request, context)) as items:
                async for item in items:
                    yield item
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            await _abort(context, exc, fn.__name__)

    return wrapper


async def stop_task(task: asyncio.Task | None) -> None:
    """Cancel a background task and wait for it to end (whatever it raised)."""
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


def remaining_s(context: grpc.aio.ServicerContext, default: float) -> float:
    """Seconds left before the caller's deadline (default when the caller set none)."""
    left = context.time_remaining()
    return default if left is None else left


LIVENESS = "liveness"  # health service name of the compute-thread heartbeat
REASON_KEY = "scd-health-reason"  # trailing metadata of a health Check that is not SERVING: why (shared.healthcheck prints it)


class HealthServicer(health.aio.HealthServicer):
    """grpc.health.v1 as grpc_health serves it, plus, on a Check that is not SERVING, one line
    saying why in the trailing metadata (REASON_KEY)."""

    def __init__(self, why: Callable[[str], str]):
        super().__init__()
        self._why = why

    async def Check(self, request, context):
        reply: Any = await super().Check(request, context)  # type: ignore[func-returns-value]  # annotated None upstream
        if reply is not None and reply.status != health_pb2.HealthCheckResponse.SERVING:
            why = " ".join(self._why(request.service).split())
            if why:
                context.set_trailing_metadata(((REASON_KEY, why.encode("ascii", "replace").decode()[:500]),))
        return reply


TRACE_FLUSH_S = 5.0  # how long a drain waits for queued spans to reach the collector
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


class Server:
    """A grpc.aio server whose port is bound before the model is ready (loaded by `main` before
    the bind, so that a wrong artifact fails first; warmed and attached after it), so health
    can say so.

    From `config`: TLS (tls_cert/tls_key, client certificates with tls_client_ca), a bearer
    token (token/token_file; health exempt), reflection, the health-only plaintext port and the
    metrics port. `metrics` is this server's own registry."""

    def __init__(self, service_names: Sequence[str], config: ServerConfig):
        self.service_names = list(service_names)
        self.config = config
        self.metrics = Metrics(self.service_names[0] if self.service_names else "scd")
        interceptors: list[grpc.aio.ServerInterceptor] = [self.metrics.interceptor()]
        self.tracing = tracing.create(self.service_names[0] if self.service_names else "scd", config.trace)
        if self.tracing is not None:  # outermost: its span covers the whole call, and it wraps handlers as they are
            interceptors.insert(0, self.tracing.server_interceptor())
        token = security.load_token(config.token, config.token_file)
        if token:
            interceptors.append(security.BearerTokenAuth(token))
        self.auth = "token" if token else "none"
        self.server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors)
        self.health = HealthServicer(self.why_not_serving)
        self.health_reasons: dict[str, Callable[[], str]] = {}  # other health services: why one is not SERVING
        self._draining = False
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if config.reflection:
            self._enable_reflection()
        credentials = security.server_credentials(
            config.tls_cert, config.tls_key, config.tls_client_ca, config.require_client_cert
        )
        self.tls = "none" if credentials is None else ("mtls" if config.tls_client_ca else "tls")
        bind = f"{config.host}:{config.port}"
        self.port = self.server.add_insecure_port(bind) if credentials is None else self.server.add_secure_port(bind, credentials)
        if self.port == 0:
            raise OSError(f"could not bind {bind}")
        self.address = f"{config.host}:{self.port}"
        # plaintext health-only server for probes that cannot speak TLS (the kubelet's)
        self.health_server: grpc.aio.Server | None = None
        self.health_port = -1
        if config.health_port >= 0:
            self.health_server = grpc.aio.server(options=GRPC_OPTIONS)
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            self.health_port = self.health_server.add_insecure_port(f"{config.host}:{config.health_port}")
        self.metrics_port = -1
        self.progress: list[liveness.Progress] = []
        self._liveness_task: asyncio.Task | None = None
        self._stopping = False  # the heartbeat loop's exit condition (a cancel alone can be lost, see drain)
        self.alive = True
        self.not_ready: str = ""  # why readiness is NOT_SERVING though the model is loaded
        self._ready_phase = False  # serving() ran and drain() did not: readiness follows not_ready

    def _enable_reflection(self) -> None:
        """Reflection under both v1alpha and v1 (their messages are the same on the wire)."""
        names = [*self.service_names, reflection.SERVICE_NAME, REFLECTION_V1, health.SERVICE_NAME]
        servicer = reflection.aio.ReflectionServicer(names)
        handlers = {
            "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
                servicer.ServerReflectionInfo,
                request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
                response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
            )
        }
        for name in (reflection.SERVICE_NAME, REFLECTION_V1):
            self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))

    def why_not_serving(self, service: str) -> str:
        """Why a health service is not SERVING, in one line (for REASON_KEY)."""
        if service == LIVENESS:
            return "" if self.alive else f"no progress for --liveness-timeout-s {self.config.liveness_timeout_s:g} s"
        if service in self.health_reasons:
            return self.health_reasons[service]()
        if self._draining:
            return "draining (SIGTERM)"
        if not self._ready_phase:
            return "the model is loading"
        return self.not_ready

    def watch(
        self,
        admission: Admission | None = None,
        store=None,
        progress: Sequence[liveness.Progress] = (),
    ) -> None:
        """Metrics of `admission` and the producer's context `store`; liveness from the
        `progress` of worker loops."""
        if admission is not None:
            self.metrics.watch_admission(admission)
        if store is not None:
            self.metrics.watch_store(store)
        self.progress = list(progress)

    async def start(self) -> None:
        await self._set(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.health.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
        await self.server.start()
        if self.health_server is not None:
            await self.health_server.start()
        if self.config.metrics_port >= 0:
            self.metrics_port = self.metrics.serve(self.config.metrics_port, self.config.host)
        log.info(
            "server.security",
            tls=self.tls,
            auth=self.auth,
            reflection=self.config.reflection,
            health_port=self.health_port,
            metrics_port=self.metrics_port,
        )

    async def serving(self) -> None:
        """Ready (unless `not_ready` says why not); the liveness heartbeat starts."""
        if self.not_ready:
            log.warning("server.not_ready", reason=self.not_ready)
        await self._set(health_pb2.HealthCheckResponse.NOT_SERVING if self.not_ready else health_pb2.HealthCheckResponse.SERVING)
        self._ready_phase = True
        if self._liveness_task is None:
            if self.progress:
                self._liveness_task = asyncio.create_task(self._watchdog(self.progress))

    async def set_not_ready(self, reason: str) -> None:
        """Readiness from now on: NOT_SERVING with `reason` logged, or SERVING for "" (only between
        serving() and drain(): loading and draining keep NOT_SERVING)."""
        if reason == self.not_ready:
            return
        self.not_ready = reason
        if self._ready_phase:
            if reason:
                log.warning("server.not_ready", reason=reason)
            else:
                log.info("server.ready")
            await self._set(health_pb2.HealthCheckResponse.NOT_SERVING if reason else health_pb2.HealthCheckResponse.SERVING)

    async def _watchdog(self, progress: list[liveness.Progress]) -> None:
        """Every liveness_interval_s: "liveness" NOT_SERVING while an iteration of one of the
        watched loops has not advanced for liveness_timeout_s, SERVING again once it does."""
        cfg = self.config
        while not self._stopping:
            stuck = liveness.stalled(progress, cfg.liveness_timeout_s)
            if stuck is not None and self.alive:
                self.alive = False
                await self.health.set(LIVENESS, health_pb2.HealthCheckResponse.NOT_SERVING)
                log.error("server.compute_stalled", loop=stuck.name, stalled_s=round(stuck.stalled_s(), 3))
            elif stuck is None and not self.alive:
                self.alive = True
                await self.health.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
                log.warning("server.compute_recovered")
            await asyncio.sleep(cfg.liveness_interval_s)

    async def _set(self, status) -> None:
        for name in ["", *self.service_names]:
            await self.health.set(name, status)

    async def drain(self, grace_s: float, admission: Admission | None = None) -> None:
        """NOT_SERVING; refuse new work (UNAVAILABLE); let the admitted calls finish for up to
        grace_s, then stop, cancelling what is left (health watches included, so an open Watch
        never holds the process once the work is done)."""
        started = time.perf_counter()
        self._ready_phase = False
        self._draining = True
        await self._set(health_pb2.HealthCheckResponse.NOT_SERVING)
        inflight = 0
        if admission is not None:
            admission.draining = True
            inflight = admission.inflight
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(admission.idle.wait(), grace_s)
        self._stopping = True
        if self._liveness_task is not None:
            # Python 3.11's asyncio.wait_for can swallow a cancel that races with its inner future
            # completing (the heartbeat's no-op answering just then): the loop would go on forever
            # and awaiting it would hold the stop. It also checks _stopping, so wait a bounded time.
            self._liveness_task.cancel()
            await asyncio.wait({self._liveness_task}, timeout=1.0)
        await self.server.stop(0 if admission is not None else grace_s)
        if self.health_server is not None:
            await self.health_server.stop(0)
        self.metrics.stop()
        if self.tracing is not None:  # flush queued spans off the loop, bounded: the collector may be gone
            flush = threading.Thread(target=self.tracing.shutdown, name="trace-flush", daemon=True)
            flush.start()  # a daemon thread, so a hung export cannot hold the process at exit either
            await asyncio.to_thread(flush.join, TRACE_FLUSH_S)
        log.info(
            "server.drained",
            grace_s=grace_s,
            inflight_at_start=inflight,
            unfinished=admission.inflight if admission else None,
            took_s=round(time.perf_counter() - started, 3),
        )


def run(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run main(stop_event) under uvloop; SIGTERM/SIGINT set stop_event."""
    import uvloop

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    uvloop.run(runner())


def main(service: str, config_cls: type[ServerConfig], server_cls: type, argv: list[str] | None) -> None:
    """`python -m <service>`: config from flags/env, logs, start-up checks (shared.startup), the
    model loaded and the artifacts chosen for its weights (so a wrong artifact fails before the
    server binds or logs anything), then start -> load(loaded) -> serve until SIGTERM/SIGINT ->
    drain. `server_cls(config)` has async start(), load(loaded) and stop(). Any start-up failure:
    one JSON log line, one sentence on stderr, exit 2."""
    from shared import config as config_lib
    from shared import core_log, startup

    core_log.install(service)  # gRPC core's own stderr lines become JSON lines (failed TLS handshakes counted)
    try:
        cfg = config_lib.load(config_cls, service, argv)
    except ValueError as exc:
        logs.configure(service, "INFO")
        startup.fail(service, f"configuration: {exc}")
    logs.configure(service, cfg.log_level)
    from shared import malloc_tuning

    logs.get(service).info("startup.malloc", setting=malloc_tuning.tune(cfg.malloc_mmap_threshold))
    from shared import kernel_cache  # before the model loads: oneDNN reads its cache sizes at its first kernel

    logs.get(service).info("startup.kernel_cache", setting=kernel_cache.bound(cfg.onednn_cache_entries))
    threads, why = intra_op_threads(cfg.torch_threads, cfg.device, os.environ)
    if threads:
        import torch

        torch.set_num_threads(threads)  # before any forward: the pool torch sizes its parallel regions for
    logs.get(service).info("startup.threads", torch_threads=threads or "torch's default", reason=why)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # stderr carries JSON log lines only
    try:
        startup.check(cfg)
    except startup.StartupError as exc:
        startup.fail(service, str(exc))
    try:
        loaded, cfg = _load_checked(service, cfg)
    except startup.StartupError as exc:
        startup.fail(service, str(exc))
    except Exception as exc:  # one line, not a traceback: the message says what to fix
        startup.fail(service, f"{type(exc).__name__}: {exc}")
    failed: list[str] = []

    async def serve(stop: asyncio.Event) -> None:
        from shared import heap_trace  # a diagnostic: SCD_HEAP_TRACE=<dir> turns it on, SIGUSR2 dumps

        if heap_trace.install(service, asyncio.get_running_loop()):
            logs.get(service).warning("startup.heap_trace", directory=os.environ[heap_trace.ENV], note="diagnostic: slow")
        server = server_cls(cfg)
        try:
            await server.start()
            await server.load(loaded)
            startup.loaded_artifacts(service, server.servicer)
        except Exception as exc:  # one line, not a traceback: the message says what to fix
            failed.append(str(exc) if isinstance(exc, startup.StartupError) else f"{type(exc).__name__}: {exc}")
            with contextlib.suppress(Exception):
                await server.stop(0)
            return
        await stop.wait()
        await server.stop()

    run(serve)
    if failed:
        startup.fail(service, failed[0])


def intra_op_threads(configured: int, device: str, env: Mapping[str, str]) -> tuple[int, str]:
    """torch's intra-op threads for a service (0: torch's default, one per core) and why.

    On a GPU the model computes on the device, and what torch still does on the CPU is small
    (cutting a layer's K/V into chunks, a copy, a check over quantization scales). On an H200 box
    (16 cores, load 5-10) such ops, the producer's per-chunk clones of the 7B shape's K/V and the
    consumer's finiteness checks, took most of both services' time (bench.serving.ttft --profile-dir); our
    reading, not measured, is that each one above torch's grain size woke an OpenMP team of one
    thread per core. vLLM's GPU workers likewise set torch to one thread unless OMP_NUM_THREADS
    says otherwise."""
    from shared.models import resolve_device

    if configured:
        return configured, "--torch-threads"
    if env.get("OMP_NUM_THREADS"):
        return 0, "OMP_NUM_THREADS is set: torch follows it"
    if resolve_device(device).type == "cuda":
        return 1, "the model runs on CUDA: CPU-side ops are small, one thread each (--torch-threads N to change)"
    return 0, "the model runs on the CPU: torch's default, one thread per core"


def _load_checked(service: str, cfg: ServerConfig):
    """The model loaded, and `cfg` with --artifacts narrowed to the artifact files calibrated for
    its weights in this role (others logged as skipped: shared.startup.select_artifacts)."""
    import dataclasses

    from shared import startup
    from shared.models import load_model

    loaded = load_model(cfg.model, cfg.dtype, cfg.device)
    if cfg.artifact_paths:
        info = loaded.info
        kept = startup.select_artifacts(service, info.weight_digest, info.model_id, cfg.artifact_paths)
        cfg = dataclasses.replace(cfg, artifacts=",".join(kept))
    return loaded, cfg
