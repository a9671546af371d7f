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
    """JSON lines on stderr: timestamp, level, service, event, request_id and fields. Libraries'
    standard-library log records (grpc's, aiohttp's) become the same JSON lines, their tracebacks
    bounded dicts too (they were printed as plain text: multi-line tracebacks among the JSON)."""
    # tracebacks as bounded dicts: no local variables (peer data, tensors), at most 12 frames
    tracebacks = structlog.processors.ExceptionRenderer(
        structlog.tracebacks.ExceptionDictTransformer(show_locals=False, max_frames=12, use_rich=False)
    )
    stamp = structlog.processors.TimeStamper(fmt="iso", utc=True)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[
                structlog.contextvars.merge_contextvars,
                structlog.stdlib.add_logger_name,
                structlog.processors.add_log_level,
                stamp,
            ],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                tracebacks,
                structlog.processors.JSONRenderer(),
            ],
        )
    )
    root = logging.getLogger()  # this function's handler replaced, any other (pytest's caplog) kept
    for old in [h for h in root.handlers if getattr(h, "scd_json", False)]:
        root.removeHandler(old)
    handler.scd_json = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level.upper())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            stamp,
            tracebacks,
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
