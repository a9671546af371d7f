"""Optional OpenTelemetry tracing (`--trace console|memory|otlp`; off by default): the gRPC
instrumentation's aio interceptors on the server and on the consumer's producer channel, so a
Generate and the Prefill it causes are one trace (W3C trace context travels in the call's
metadata). `console` prints finished spans as JSON on stderr; `memory` keeps them in the
provider's exporter (tests); `otlp` batches them to an OpenTelemetry collector over OTLP/gRPC,
configured by the standard variables (OTEL_EXPORTER_OTLP_ENDPOINT, e.g. http://collector:4317
for plaintext, OTEL_EXPORTER_OTLP_HEADERS, OTEL_EXPORTER_OTLP_TIMEOUT, ...). Export runs on the
SDK's own thread, never on the event loop; `shutdown` flushes, bounded by the caller. Knows
nothing about the services.
"""

from __future__ import annotations

import sys
from typing import Any

TRACE_MODES = ("off", "console", "memory", "otlp")


class Tracing:
    """One tracer provider per process role (service name); `exporter` holds spans for `memory`."""

    def __init__(self, service: str, mode: str):
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        if mode not in TRACE_MODES[1:]:
            raise ValueError(f"trace: {mode!r} not in {TRACE_MODES}")
        # shutdown_on_exit=False: the server flushes on drain with a bound (an unreachable
        # collector must not hold the process at exit through the exporter's retries)
        self.provider = TracerProvider(resource=Resource.create({"service.name": service}), shutdown_on_exit=False)
        self.exporter: Any
        if mode == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            self.exporter = OTLPSpanExporter()  # endpoint, headers, TLS, timeout: OTEL_EXPORTER_OTLP_*
            self.provider.add_span_processor(BatchSpanProcessor(self.exporter))
        else:
            self.exporter = InMemorySpanExporter() if mode == "memory" else ConsoleSpanExporter(out=sys.stderr)
            self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))

    def shutdown(self) -> None:
        """Flush what is queued and stop exporting (blocking: call it off the event loop)."""
        self.provider.shutdown()

    def server_interceptor(self) -> Any:
        from opentelemetry.instrumentation.grpc import aio_server_interceptor, filters

        # the API services only: health's Watch is written with context.write, which the
        # instrumentation's streaming wrapper does not support
        return aio_server_interceptor(tracer_provider=self.provider, filter_=filters.service_prefix("scd.v1."))

    def client_interceptors(self) -> list[Any]:
        from opentelemetry.instrumentation.grpc import aio_client_interceptors

        return list(aio_client_interceptors(tracer_provider=self.provider))


def create(service: str, mode: str) -> Tracing | None:
    return None if mode == "off" else Tracing(service, mode)
