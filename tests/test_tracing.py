"""OpenTelemetry tracing (shared.tracing), off by default: with it on, a Generate on the consumer
and the Prefill it causes on the producer are spans of one trace (context across the hop)."""

from __future__ import annotations

from shared.pb import common_pb2
from tests.conftest import prompt, running_pair


async def test_generate_and_its_prefill_share_one_trace():
    async with running_pair("tiny-llama", producer_kw={"trace": "memory"}, consumer_kw={"trace": "memory"}) as pair:
        await pair.generate(context=prompt("alpha beta gamma " * 20), question=prompt(" delta"), max_new_tokens=2,
                            transfer=common_pb2.CodecSpec(name="raw"))
        consumer_spans = pair.consumer.server.tracing.exporter.get_finished_spans()
        producer_spans = pair.producer.server.tracing.exporter.get_finished_spans()
    generate = [s for s in consumer_spans if s.name.endswith("ConsumerService/Generate")]
    prefill = [s for s in producer_spans if s.name.endswith("ProducerService/Prefill")]
    assert generate and prefill, ([s.name for s in consumer_spans], [s.name for s in producer_spans])
    assert prefill[0].context.trace_id == generate[0].context.trace_id
    assert prefill[0].resource.attributes["service.name"] == "scd.v1.ProducerService"


async def test_tracing_is_off_by_default(pair_llama):
    assert pair_llama.consumer.server.tracing is None and pair_llama.producer.server.tracing is None
