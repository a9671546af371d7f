"""Counting how every call ends, on every path: a wrapper around a handler's message stream that
counts it started, then exactly one of completed / cancelled (the caller cancelled or its
deadline passed) / failed, and logs a failure or cancel once with its reason (bounded).
Both services' Describe counters come from here, so `started == completed + cancelled + failed`
holds once calls settle. Knows nothing about the messages it passes on.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from shared.errors import ServiceError

T = TypeVar("T")
CANCEL_CODES = ("CANCELLED", "DEADLINE_EXCEEDED")


@dataclass
class Outcomes:
    started: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0

    async def track(
        self,
        messages: AsyncGenerator[T, None],
        context: Any,
        log: Any,
        event: str,
        final: Callable[[], bool] | None = None,
    ) -> AsyncGenerator[T, None]:
        """Pass `messages` on; `context` is the grpc servicer context (asked whether the caller
        went away), `event` the log event prefix ("prefill", "generate"). `final()`: whether the
        call's last message (the consumer's GenerateStats, the producer's trailer) was handed over
        to be sent: a caller that cancels after that (as it reads it, before the OK status) is
        counted completed, as everything else counted it (it was counted cancelled)."""
        self.started += 1
        outcome, reason = "failed", ""
        try:
            async with contextlib.aclosing(messages) as items:
                async for item in items:
                    yield item
            outcome = "completed"
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "completed" if final is not None and final() else "cancelled"
            raise
        except ServiceError as exc:
            outcome = "cancelled" if exc.code in CANCEL_CODES else "failed"
            reason = f"{exc.code}: {str(exc)[:300]}"
            raise
        except Exception as exc:
            reason = f"{type(exc).__name__}: {str(exc)[:300]}"
            raise
        finally:
            if outcome == "failed" and context.cancelled():
                outcome = "cancelled"
            if outcome == "completed":
                self.completed += 1
            elif outcome == "cancelled":
                self.cancelled += 1
                log.info(f"{event}.cancelled", reason=reason or "the caller cancelled or its deadline passed")
            else:
                self.failed += 1
                log.warning(f"{event}.failed", reason=reason)
