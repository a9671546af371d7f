"""TLS, mTLS and bearer tokens on real servers (certificates made at run time by trustme; no key
is committed): a client without the certificate or the token is refused, health stays
reachable, reflection is off unless enabled, and callers never see filesystem paths."""

from __future__ import annotations

import contextlib

import grpc
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2

from consumer.api.client import ConsumerClient, prompt
from consumer.server import ConsumerServer
from producer.server import ProducerServer
from shared import describe, health_service, rpc_errors, security
from shared.config import ConsumerConfig, ProducerConfig
from shared.pb import producer_pb2, producer_pb2_grpc
from tests.conftest import wait_serving

TOKEN = "s3cret-consumer-token"
PRODUCER_TOKEN = "s3cret-producer-token"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate for localhost/127.0.0.1 and a client certificate, as PEM files."""
    root = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    files = {"ca": root / "ca.pem", "token": root / "token", "producer_token": root / "producer_token"}
    ca.cert_pem.write_to_path(files["ca"])
    for name, ident in (("server", ("localhost", "127.0.0.1")), ("client", ("scd-consumer",))):
        cert = ca.issue_cert(*ident)
        files[f"{name}_key"] = root / f"{name}.key"
        files[f"{name}_cert"] = root / f"{name}.pem"
        cert.private_key_pem.write_to_path(files[f"{name}_key"])
        files[f"{name}_cert"].write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    files["token"].write_text(TOKEN + "\n")
    files["producer_token"].write_text(PRODUCER_TOKEN)
    return {k: str(v) for k, v in files.items()}


@contextlib.asynccontextmanager
async def secured_pair(producer_kw: dict, consumer_kw: dict):
    """Producer and consumer with the given security settings; ready when their plaintext
    health-only ports say SERVING."""
    common = dict(port=0, model="tiny-llama", device="cpu", drain_grace_s=0.5, health_port=0)
    producer = ProducerServer(ProducerConfig(**common, **producer_kw))
    await producer.start()
    await producer.load()
    target = f"localhost:{producer.server.port}"
    consumer = ConsumerServer(ConsumerConfig(**common, producer=target, **consumer_kw))
    await consumer.start()
    await consumer.load()
    for server in (producer, consumer):
        await wait_serving(f"127.0.0.1:{server.server.health_port}")
    try:
        yield producer, consumer
    finally:
        await consumer.stop()
        await producer.stop()


@pytest.fixture(scope="module")
async def mtls_pair(pki):
    """Producer: mTLS (client certificates required). Consumer: TLS + bearer token, mTLS to the producer."""
    producer_kw = dict(tls_cert=pki["server_cert"], tls_key=pki["server_key"], tls_client_ca=pki["ca"])
    consumer_kw = dict(
        tls_cert=pki["server_cert"],
        tls_key=pki["server_key"],
        token_file=pki["token"],
        producer_tls_ca=pki["ca"],
        producer_tls_cert=pki["client_cert"],
        producer_tls_key=pki["client_key"],
    )
    async with secured_pair(producer_kw, consumer_kw) as pair:
        yield pair


def consumer_client(pair, pki, **kw) -> ConsumerClient:
    return ConsumerClient(f"localhost:{pair[1].server.port}", **kw)


async def generate(client: ConsumerClient, mode: str):
    async with client:
        return await client.generate(
            timeout=60, mode=mode, context=prompt("a b c d e f"), question=prompt("g h"), max_new_tokens=2
        )


async def test_tls_and_token_serve(mtls_pair, pki):
    for mode in ("oracle", "raw"):  # raw crosses the mTLS hop to the producer
        answer = await generate(consumer_client(mtls_pair, pki, token=TOKEN, tls_ca=pki["ca"]), mode)
        assert answer.stats.generated_tokens == 2 and not answer.stats.transfer_failure
        assert (answer.stats.bytes_received > 0) == (mode == "raw")


@pytest.mark.parametrize("token", ["", "wrong-token", TOKEN + "x"])
async def test_consumer_refuses_missing_or_wrong_token(mtls_pair, pki, token):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(consumer_client(mtls_pair, pki, token=token, tls_ca=pki["ca"]), "oracle")
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert TOKEN not in (err.value.details() or "")
    async with consumer_client(mtls_pair, pki, token=token, tls_ca=pki["ca"]) as client:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.describe()
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_plaintext_client_fails_the_handshake(mtls_pair, pki):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async with ConsumerClient(f"127.0.0.1:{mtls_pair[1].server.port}", token=TOKEN) as client:
            await client.describe()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_health_needs_no_token(mtls_pair, pki):
    creds = security.channel_credentials(pki["ca"])
    async with grpc.aio.secure_channel(f"localhost:{mtls_pair[1].server.port}", creds) as channel:
        for service in ("", "scd.v1.ConsumerService", health_service.LIVENESS):
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_a_health_watch_on_the_api_port_needs_the_token(mtls_pair, pki):
    """A Watch is a stream held open: with a token set, callers without it may not open any
    (before: any number); with the token, and on the plaintext health-only port, they may."""
    creds = security.channel_credentials(pki["ca"])
    request = health_pb2.HealthCheckRequest(service="")
    port = mtls_pair[1].server.port
    async with grpc.aio.secure_channel(f"localhost:{port}", creds) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in health_pb2_grpc.HealthStub(channel).Watch(request, timeout=5):
                break
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    async with security.aio_channel(f"localhost:{port}", (), creds, TOKEN) as channel:
        async for reply in health_pb2_grpc.HealthStub(channel).Watch(request, timeout=5):
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            break
    async with grpc.aio.insecure_channel(f"127.0.0.1:{mtls_pair[1].server.health_port}") as channel:
        async for reply in health_pb2_grpc.HealthStub(channel).Watch(request, timeout=5):
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            break


async def test_producer_requires_a_client_certificate(mtls_pair, pki):
    producer = mtls_pair[0]
    request = producer_pb2.PrefillRequest(token_ids=[5, 6, 7])
    async with grpc.aio.secure_channel(f"localhost:{producer.server.port}", security.channel_credentials(pki["ca"])) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in producer_pb2_grpc.ProducerServiceStub(channel).Prefill(request, timeout=5):
                pass
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # the TLS handshake fails
    # health stays reachable for probes on the plaintext health-only port
    async with grpc.aio.insecure_channel(f"127.0.0.1:{producer.server.health_port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as err:  # and nothing else is served there
            async for _ in producer_pb2_grpc.ProducerServiceStub(channel).Prefill(request, timeout=5):
                pass
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def reflection_services(channel: grpc.aio.Channel, version: str, token: str = "") -> list[str]:
    method = f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo"
    call = channel.stream_stream(
        method,
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    async for reply in call(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5, metadata=metadata):
        return [s.name for s in reply.list_services_response.service]
    return []


async def test_reflection_off_by_default(mtls_pair, pki):
    creds = security.channel_credentials(pki["ca"])
    async with grpc.aio.secure_channel(f"localhost:{mtls_pair[1].server.port}", creds) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await reflection_services(channel, "v1alpha", TOKEN)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_producer_token_without_mtls_and_reflection_v1(pki):
    """Producer on plaintext with a token: the consumer sends it; a caller without it is refused.
    Reflection enabled answers under v1 and v1alpha."""
    async with secured_pair(
        dict(token_file=pki["producer_token"], reflection=True), dict(producer_token=PRODUCER_TOKEN, producer_lb="round_robin")
    ) as (producer, consumer):
        async with ConsumerClient(consumer.address) as client:
            answer = await client.generate(
                timeout=60, mode="raw", context=prompt("a b c d"), question=prompt("e"), max_new_tokens=1
            )
        assert not answer.stats.transfer_failure and answer.stats.bytes_received > 0
        async with grpc.aio.insecure_channel(producer.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in producer_pb2_grpc.ProducerServiceStub(channel).Prefill(
                    producer_pb2.PrefillRequest(token_ids=[5]), timeout=5
                ):
                    pass
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        async with grpc.aio.insecure_channel(producer.address) as channel:
            for version in ("v1", "v1alpha"):
                names = await reflection_services(channel, version, PRODUCER_TOKEN)
                assert "scd.v1.ProducerService" in names and "grpc.health.v1.Health" in names


def test_no_filesystem_paths_for_callers(tmp_path):
    model_dir = tmp_path / "checkpoints" / "qa-base"
    model_dir.mkdir(parents=True)
    assert describe.public_model_id(str(model_dir)) == "qa-base"
    assert describe.public_model_id("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
    assert describe.public_model_id("tiny-llama") == "tiny-llama"
    text = f"artifact calibrated for {model_dir} (digest 1234), chunk 5/26"
    assert rpc_errors.public_text(text) == "artifact calibrated for qa-base (digest 1234), chunk 5/26"


def test_config_reads_security_flags_and_env(pki):
    from shared import config as config_lib

    cfg = config_lib.load(
        ProducerConfig,
        "producer",
        ["--reflection", "--tls-cert", pki["server_cert"]],
        env={
            "SCD_PRODUCER_TLS_KEY": pki["server_key"],
            "SCD_PRODUCER_REQUIRE_CLIENT_CERT": "false",
            "SCD_PRODUCER_METRICS_PORT": "9090",
        },
    )
    assert cfg.reflection and cfg.tls_key == pki["server_key"] and not cfg.require_client_cert and cfg.metrics_port == 9090
    assert "token=" not in repr(cfg)
    with pytest.raises(ValueError, match="tls_cert and tls_key"):
        config_lib.load(ProducerConfig, "producer", ["--tls-cert", pki["server_cert"]], env={})
    with pytest.raises(ValueError, match="producer_lb"):
        config_lib.load(ConsumerConfig, "consumer", ["--producer-lb", "random"], env={})
