"""Honest readiness (issue 19, finding 3): the consumer is ready only when it can serve its default
mode; the producer link is re-checked (a producer that appears later is seen), shown in Describe
and a metric; a rejected token or a failed TLS handshake reaches the caller named as such."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.harness.services import free_port
from consumer.server import ConsumerServer
from producer.server import ProducerServer
from shared.config import ConsumerConfig, ProducerConfig
from shared.pb import common_pb2, consumer_pb2
from tests.conftest import ConsumerClient, prompt, wait_serving

FIELDS = dict(context=prompt("a b c d e f"), question=prompt(" g h"), max_new_tokens=2, transfer=common_pb2.CodecSpec(name="raw"))


async def health(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        return reply.status


@contextlib.asynccontextmanager
async def servers(producer_kw: dict | None, consumer_kw: dict, producer_port: int | None = None):
    """A producer (None: none at all) and a consumer of it; the consumer loaded, not awaited SERVING."""
    port = producer_port or free_port()
    producer = None
    if producer_kw is not None:
        producer = ProducerServer(ProducerConfig(port=port, model="tiny-llama", device="cpu", drain_grace_s=0, **producer_kw))
        await producer.start()
        await producer.load()
    consumer = ConsumerServer(
        ConsumerConfig(port=0, model="tiny-llama", device="cpu", producer=f"127.0.0.1:{port}", drain_grace_s=0, **consumer_kw)
    )
    await consumer.start()
    await consumer.load()
    try:
        yield producer, consumer
    finally:
        await consumer.stop(0)
        if producer is not None:
            await producer.stop(0)


async def describe_link(consumer: ConsumerServer) -> consumer_pb2.ProducerLink:
    async with ConsumerClient(consumer.address) as client:
        return (await client.describe()).producer_link


async def generate_error(consumer: ConsumerServer) -> grpc.aio.AioRpcError:
    async with ConsumerClient(consumer.address) as client:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.generate(timeout=20, **FIELDS)
    return err.value


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    ca, other = trustme.CA(), trustme.CA()
    ca.cert_pem.write_to_path(root / "ca.pem")
    other.cert_pem.write_to_path(root / "other-ca.pem")
    cert = ca.issue_cert("localhost", "127.0.0.1")
    cert.private_key_pem.write_to_path(root / "server.key")
    (root / "server.pem").write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    (root / "token").write_text("producer-secret\n")
    rogue = other.issue_cert("scd-consumer")  # a client certificate from a CA the producer does not trust
    rogue.private_key_pem.write_to_path(root / "rogue.key")
    rogue.cert_chain_pems[0].write_to_path(root / "rogue.pem")
    names = ("ca.pem", "other-ca.pem", "server.key", "server.pem", "token", "rogue.key", "rogue.pem")
    return {name: str(root / name) for name in names}


async def test_a_rejected_token_is_not_ready_and_named_for_the_caller(pki):
    async with servers({"token_file": pki["token"]}, {"producer_token": "wrong", "default_mode": "raw"}) as (_, consumer):
        assert await health(consumer.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        link = await describe_link(consumer)
        assert link.state == "unauthenticated" and "rejected our token" in link.reason
        err = await generate_error(consumer)
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "producer rejected our token" in err.details()
        assert consumer.server.metrics.registry.get_sample_value("scd_producer_link", {"state": "unauthenticated"}) == 1


async def test_an_untrusted_producer_certificate_is_named_as_a_tls_failure(pki):
    producer_kw = {"tls_cert": pki["server.pem"], "tls_key": pki["server.key"]}
    async with servers(producer_kw, {"producer_tls_ca": pki["other-ca.pem"], "default_mode": "raw"}) as (_, consumer):
        assert await health(consumer.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        link = await describe_link(consumer)
        assert link.state == "tls_failed" and "unknown CA" in link.reason
        err = await generate_error(consumer)
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        assert "TLS handshake with producer failed: unknown CA" in err.details() and "127.0.0.1" not in err.details()
    async with servers(producer_kw, {"default_mode": "raw"}) as (_, consumer):  # no producer CA at all
        link = await describe_link(consumer)
        assert link.state != "ok" and "--producer-tls-ca" in link.reason


async def test_readiness_follows_the_producer_link_and_rechecks_it():
    port = free_port()
    cfg = {"default_mode": "raw", "producer_check_interval_s": 0.2}
    async with servers(None, cfg, producer_port=port) as (_, consumer):
        assert await health(consumer.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert (await describe_link(consumer)).state == "unreachable"
        producer = ProducerServer(ProducerConfig(port=port, model="tiny-llama", device="cpu", drain_grace_s=0))
        await producer.start()
        await producer.load()
        try:
            await asyncio.wait_for(wait_serving(consumer.address), 30)  # seen by the periodic re-check
            link = await describe_link(consumer)
            assert link.state == "ok" and link.changes >= 2
            async with ConsumerClient(consumer.address) as client:
                answer = await client.generate(timeout=30, **FIELDS)
            assert answer.stats.bytes_received > 0
        finally:
            await producer.stop(0)


async def test_a_consumer_whose_default_needs_no_producer_stays_serving_and_reports_the_link():
    async with servers(None, {}) as (_, consumer):  # producer unknown: the default is the consumer's own prefill
        assert await health(consumer.address) == health_pb2.HealthCheckResponse.SERVING
        async with ConsumerClient(consumer.address) as client:
            described = await client.describe()
        assert described.default_mode == "auto" and described.producer_link.state == "unreachable"
        assert "safest fixed mode now: oracle" in described.default_mode_reason


async def test_a_rogue_client_certificate_is_not_ready_and_hinted(pki):
    producer_kw = {"tls_cert": pki["server.pem"], "tls_key": pki["server.key"], "tls_client_ca": pki["ca.pem"]}
    consumer_kw = {"producer_tls_ca": pki["ca.pem"], "producer_tls_cert": pki["rogue.pem"], "producer_tls_key": pki["rogue.key"],
                   "default_mode": "raw"}
    async with servers(producer_kw, consumer_kw) as (_, consumer):
        assert await health(consumer.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        link = await describe_link(consumer)
        assert link.state != "ok" and "client certificate" in link.reason
        err = await generate_error(consumer)
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "client certificate" in err.details()
