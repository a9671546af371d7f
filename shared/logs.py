"""structlog JSON logging for both services; `request_id` is bound per request through
contextvars, so every line logged while serving a request carries it (also from worker threads
started with `run_in`). Lines are bounded: tracebacks carry no local variables and at most 12
frames; callers cut peer-controlled strings before logging them."""

import asyncio
import contextvars
import functools
import logging
import sys
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, TypeVar

import structlog

T = TypeVar("T")


def configure(service: str, level: str = "INFO") -> None:
    """JSON lines on stderr: timestamp, level, service, event, request_id and fields."""
    logging.basicConfig(stream=sys.stderr, level=level.upper(), format="%(message)s")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            # tracebacks as bounded dicts: no local variables (peer data, tensors), at most 12 frames
            structlog.processors.ExceptionRenderer(
                structlog.tracebacks.ExceptionDictTransformer(show_locals=False, max_frames=12, use_rich=False)
            ),
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.bind_contextvars(service=service)


def get(name: str) -> Any:
    return structlog.get_logger(name)


async def run_in(executor: Executor | None, fn: Callable[..., T], *args: Any) -> T:
    """Run fn(*args) in executor with the caller's contextvars (request_id) copied in."""
    ctx = contextvars.copy_context()
    return await asyncio.get_running_loop().run_in_executor(executor, functools.partial(ctx.run, fn, *args))
