"""gRPC server lifecycle shared by both services.

Owns: the grpc.aio server with the health service (NOT_SERVING until the model is loaded and
warmed, SERVING after, NOT_SERVING while draining) and server reflection; mapping
`shared.errors` to status codes for servicer methods; running a service under uvloop with
SIGTERM/SIGINT draining in-flight calls for a grace period. Owns no model or codec logic.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from shared import logs
from shared.errors import InvalidArgument, ResourceExhausted, ServiceError, Unavailable

log = logs.get("serving")

# Payload chunks are <= 4 MiB; leave room for the message envelope.
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 8 << 20),
    ("grpc.max_receive_message_length", 8 << 20),
    ("grpc.so_reuseport", 0),
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


class Admission:
    """A limit on calls in flight, released on every path (a context manager around the whole
    handler), and closed while draining. `inflight` is what is running now."""

    def __init__(self, limit_name: str, limit: int):
        self.limit_name, self.limit = limit_name, limit
        self.inflight = 0
        self.draining = False
        self.idle = asyncio.Event()
        self.idle.set()

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        if self.draining:
            raise Unavailable("server is draining; retry on another replica")
        if self.inflight >= self.limit:
            raise ResourceExhausted(f"calls in flight: {self.inflight} >= {self.limit_name} {self.limit}")
        self.inflight += 1
        self.idle.clear()
        try:
            yield
        finally:
            self.inflight -= 1
            if self.inflight == 0:
                self.idle.set()


async def _abort(context: grpc.aio.ServicerContext, exc: Exception, rpc: str) -> None:
    """The one place an exception becomes a status: ServiceError -> its code and message;
    anything else -> INTERNAL "internal error" with the request id, logged once (bounded, no locals)."""
    if isinstance(exc, ServiceError):
        log.info("rpc.error", rpc=rpc, code=exc.code, reason=str(exc)[:500])
        await context.abort(status_code(exc), str(exc)[:2000])
    rid = structlog.contextvars.get_contextvars().get("request_id", "")
    log.error("rpc.internal_error", rpc=rpc, error=f"{type(exc).__name__}: {str(exc)[:500]}", exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error (request_id={rid})")


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


def stream_errors(fn: Callable[..., AsyncIterator]) -> Callable[..., AsyncIterator]:
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


def remaining_s(context: grpc.aio.ServicerContext, default: float) -> float:
    """Seconds left before the caller's deadline (default when the caller set none)."""
    left = context.time_remaining()
    return default if left is None else left


class Server:
    """A grpc.aio server whose port is bound before the model loads, so health can say so."""

    def __init__(self, service_names: Sequence[str], host: str, port: int):
        self.service_names = list(service_names)
        self.server = grpc.aio.server(options=GRPC_OPTIONS)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection([*self.service_names, reflection.SERVICE_NAME, health.SERVICE_NAME], self.server)
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"could not bind {host}:{port}")
        self.address = f"{host}:{self.port}"

    async def start(self) -> None:
        await self._set(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()

    async def serving(self) -> None:
        await self._set(health_pb2.HealthCheckResponse.SERVING)

    async def _set(self, status) -> None:
        for name in ["", *self.service_names]:
            await self.health.set(name, status)

    async def drain(self, grace_s: float, admission: Admission | None = None) -> None:
        """NOT_SERVING; refuse new work (UNAVAILABLE); let the admitted calls finish for up to
        grace_s, then stop, cancelling what is left (health watches included, so an open Watch
        never holds the process once the work is done)."""
        started = time.perf_counter()
        await self._set(health_pb2.HealthCheckResponse.NOT_SERVING)
        inflight = 0
        if admission is not None:
            admission.draining = True
            inflight = admission.inflight
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(admission.idle.wait(), grace_s)
        await self.server.stop(0 if admission is not None else grace_s)
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


def main(service: str, config_cls: type, server_cls: type, argv: list[str] | None) -> None:
    """`python -m <service>`: config from flags/env, logs, then start -> load -> serve until
    SIGTERM/SIGINT -> drain. `server_cls(config)` has async start(), load() and stop()."""
    from shared import config as config_lib

    cfg = config_lib.load(config_cls, service, argv)
    logs.configure(service, cfg.log_level)

    async def serve(stop: asyncio.Event) -> None:
        server = server_cls(cfg)
        await server.start()
        await server.load()
        await stop.wait()
        await server.stop()

    run(serve)
