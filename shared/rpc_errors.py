"""A call's identity and its errors, for the servicers of both services: the request id (the
caller's, checked, or a fresh one) bound to every log line of the call and to the exception that
ends it; the one mapping of `shared.errors` to gRPC status codes (`unary_errors`,
`stream_errors`: a ServiceError -> its code and a message without filesystem directories,
anything else -> INTERNAL with the request id, logged once); the caller's deadline. Owns no
server lifecycle (shared.grpc_server) and no model logic."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator

import grpc
import structlog

from shared import logs
from shared.errors import InvalidArgument, ServiceError

log = logs.get("serving")


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


def remaining_s(context: grpc.aio.ServicerContext, default: float) -> float:
    """Seconds left before the caller's deadline (default when the caller set none)."""
    left = context.time_remaining()
    return default if left is None else left
