"""grpc.health.v1 with a reason: readiness per service name and liveness ("liveness"), and, on a
Check that is not SERVING, one line saying why in the trailing metadata (REASON_KEY; the probe
client shared.healthcheck prints it). What the states are is the server's (shared.grpc_server)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from grpc_health.v1 import health, health_pb2

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
