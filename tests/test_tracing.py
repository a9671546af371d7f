"""OpenTelemetry tracing (shared.tracing), off by default: with it on, a Generate on the consumer
and the Prefill it causes on the producer are spans of one trace (context across the hop); in
`otlp` mode they reach a real OTLP/gRPC collector, and a dead collector costs neither calls nor
a stuck drain."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from bench.harness.services import free_port
from shared.grpc_server import TRACE_FLUSH_S
from shared.pb import common_pb2
from tests.conftest import prompt, running_pair


async def test_generate_and_its_prefill_share_one_trace():
    async with running_pair("tiny-llama", producer_kw={"trace": "memory"}, consumer_kw={"trace": "memory"}) as pair:
        await pair.generate(
            context=prompt("alpha beta gamma " * 20),
            question=prompt(" delta"),
            max_new_tokens=2,
            transfer=common_pb2.CodecSpec(name="raw"),
        )
        consumer_spans = pair.consumer.server.tracing.exporter.get_finished_spans()
        producer_spans = pair.producer.server.tracing.exporter.get_finished_spans()
    generate = [s for s in consumer_spans if s.name.endswith("ConsumerService/Generate")]
    prefill = [s for s in producer_spans if s.name.endswith("ProducerService/Prefill")]
    assert generate and prefill, ([s.name for s in consumer_spans], [s.name for s in producer_spans])
    assert prefill[0].context.trace_id == generate[0].context.trace_id
    assert prefill[0].resource.attributes["service.name"] == "scd.v1.ProducerService"


async def test_tracing_is_off_by_default(pair_llama):
    assert pair_llama.consumer.server.tracing is None and pair_llama.producer.server.tracing is None


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """A real OTLP/gRPC trace receiver on a loopback port, served by its own threads (not the
    test's event loop, which the services' drain runs on)."""

    def __init__(self):
        self.requests: list = []
        self.server = grpc.server(ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def Export(self, request, context):
        self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[tuple[str, str, bytes]]:
        """(service.name, span name, trace id) of every span received."""
        out = []
        for request in self.requests:
            for resource_spans in request.resource_spans:
                attrs = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    out += [(attrs["service.name"], s.name, s.trace_id) for s in scope_spans.spans]
        return out


async def _one_generate(pair) -> None:
    await pair.generate(
        context=prompt("alpha beta gamma " * 20),
        question=prompt(" delta"),
        max_new_tokens=2,
        transfer=common_pb2.CodecSpec(name="raw"),
    )


async def test_otlp_mode_exports_both_services_spans_to_a_collector(monkeypatch):
    collector = Collector()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{collector.port}")
    try:
        async with running_pair("tiny-llama", producer_kw={"trace": "otlp"}, consumer_kw={"trace": "otlp"}) as pair:
            await _one_generate(pair)
        # the spans are batched; the drain on stop flushed them
        spans = collector.spans()
    finally:
        collector.server.stop(0)
    generate = [s for s in spans if s[0] == "scd.v1.ConsumerService" and s[1].endswith("ConsumerService/Generate")]
    prefill_client = [s for s in spans if s[0] == "scd.v1.ConsumerService" and s[1].endswith("ProducerService/Prefill")]
    prefill_server = [s for s in spans if s[0] == "scd.v1.ProducerService" and s[1].endswith("ProducerService/Prefill")]
    assert generate and prefill_client and prefill_server, spans
    assert {s[2] for s in prefill_client + prefill_server} == {generate[0][2]}  # one trace across the hop


async def test_an_unreachable_collector_neither_fails_calls_nor_holds_the_drain(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nobody listens there
    async with running_pair("tiny-llama", producer_kw={"trace": "otlp"}, consumer_kw={"trace": "otlp"}) as pair:
        await _one_generate(pair)  # status OK: export failures stay on the SDK's thread
        stopping = time.perf_counter()
    assert time.perf_counter() - stopping < 2 * TRACE_FLUSH_S + 5  # two servers, each flush bounded
