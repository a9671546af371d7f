"""Admission of calls: a limit on calls in flight, closed while the server drains (both services'
`--max-inflight`; shared.metrics counts its refusals)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from shared.errors import ResourceExhausted, Unavailable


class Admission:
    """A limit on calls in flight, released on every path (a context manager around the whole
    handler), and closed while draining. `inflight` is what is running now; `counted` names it in
    a refusal's message."""

    def __init__(self, limit_name: str, limit: int, counted: str = "calls in flight"):
        self.limit_name, self.limit, self.counted = limit_name, limit, counted
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
            raise ResourceExhausted(f"{self.counted}: {self.inflight} >= {self.limit_name} {self.limit}")
        self.inflight += 1
        self.idle.clear()
        try:
            yield
        finally:
            self.inflight -= 1
            if self.inflight == 0:
                self.idle.set()
