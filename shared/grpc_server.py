"""The gRPC server lifecycle shared by both services.

Owns: the grpc.aio server with TLS / mTLS and bearer-token auth (shared.security), the metrics
interceptor and endpoint (shared.metrics), the health service, optional server reflection (v1
and v1alpha), an optional plaintext health-only port for kubelet probes, what a port holds before
any handler runs (connections, calls in progress, request size; `server_options`); start, ready, drain
(refuse new calls, let the admitted ones finish for a grace period, stop). Owns no model or codec
logic; errors -> status codes are shared.rpc_errors', the process around it shared.service_main.

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
import threading
import time
from collections.abc import Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2

from shared import liveness, logs, security, tracing
from shared.admission import Admission
from shared.config import ServerConfig
from shared.health_service import LIVENESS, HealthServicer
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
HEALTH_REQUEST_BYTES = 64 << 10  # a health check names a service
HEALTH_CONNECTIONS = 64  # the health-only port: probes and a few watchers
HEALTH_CALLS = 256  # its calls in progress (Check and Watch)


def server_options(max_request_bytes: int, max_connections: int) -> list[tuple[str, int]]:
    """SERVER_OPTIONS with the receive limit set to the largest request the port serves (grpc-core
    holds a call's request until it is whole, before any handler and admission see it) and a cap on
    open connections (one more is closed before its handshake; each idle HTTP/2 connection holds
    ~8 kB and a file descriptor)."""
    options = [(k, max_request_bytes if k == "grpc.max_receive_message_length" else v) for k, v in SERVER_OPTIONS]
    return [*options, ("grpc.max_allowed_incoming_connections", max_connections)]


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
        # Bounded before admission: calls in progress (each held request <= request_bytes_limit);
        # past max_calls grpc answers RESOURCE_EXHAUSTED "Concurrent RPC limit exceeded!" unread.
        self.server = grpc.aio.server(
            options=server_options(config.request_bytes_limit, config.max_connections),
            interceptors=interceptors,
            maximum_concurrent_rpcs=config.calls_limit,
        )
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
            self.health_server = grpc.aio.server(
                options=server_options(HEALTH_REQUEST_BYTES, HEALTH_CONNECTIONS), maximum_concurrent_rpcs=HEALTH_CALLS
            )
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
