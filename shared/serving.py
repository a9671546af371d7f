"""gRPC server lifecycle shared by both services.

Owns: the grpc.aio server with the health service (NOT_SERVING until the model is loaded and
warmed, SERVING after, NOT_SERVING while draining) and server reflection; mapping
`shared.errors` to status codes for servicer methods; running a service under uvloop with
SIGTERM/SIGINT draining in-flight calls for a grace period. Owns no model or codec logic.
"""

from __future__ import annotations

import asyncio
import functools
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from shared import logs
from shared.errors import ServiceError

log = logs.get("serving")

# Payload chunks are <= 4 MiB; leave room for the message envelope.
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 8 << 20),
    ("grpc.max_receive_message_length", 8 << 20),
    ("grpc.so_reuseport", 0),
]


def status_code(exc: ServiceError) -> grpc.StatusCode:
    return grpc.StatusCode[exc.code]


def unary_errors(fn: Callable[..., Awaitable]) -> Callable[..., Awaitable]:
    """Servicer decorator: ServiceError -> its status; anything else -> INTERNAL, logged."""

    @functools.wraps(fn)
    async def wrapper(self, request, context):
        try:
            return await fn(self, request, context)
        except ServiceError as exc:
            await context.abort(status_code(exc), str(exc))
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            log.exception("rpc.internal_error", rpc=fn.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")

    return wrapper


def stream_errors(fn: Callable[..., AsyncIterator]) -> Callable[..., AsyncIterator]:
    """The same for server-streaming handlers written as async generators."""

    @functools.wraps(fn)
    async def wrapper(self, request, context):
        try:
            async for item in fn(self, request, context):
                yield item
        except ServiceError as exc:
            await context.abort(status_code(exc), str(exc))
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            log.exception("rpc.internal_error", rpc=fn.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")

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

    async def drain(self, grace_s: float) -> None:
        """NOT_SERVING, refuse new calls, let in-flight ones finish for grace_s, then stop."""
        started = time.perf_counter()
        await self._set(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.stop(grace_s)
        log.info("server.drained", grace_s=grace_s, took_s=round(time.perf_counter() - started, 3))


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
