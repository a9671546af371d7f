"""A small async client of the consumer service, for orchestrators, the demo, benchmarks and
tests: one `generate` call collected into an `Answer`. TLS when given a CA (a client
certificate too under mTLS), a bearer token on every call when given one."""

from __future__ import annotations

from dataclasses import dataclass

from shared import security
from shared.pb import common_pb2, consumer_pb2, consumer_pb2_grpc


@dataclass
class Answer:
    ids: list[int]
    text: str
    stats: consumer_pb2.GenerateStats


def prompt(text: str | None = None, ids: list[int] | None = None) -> consumer_pb2.Prompt:
    if ids is not None:
        return consumer_pb2.Prompt(token_ids=consumer_pb2.TokenIds(ids=ids))
    return consumer_pb2.Prompt(text=text)


class ConsumerClient:
    def __init__(
        self, address: str, token: str = "", tls_ca: str = "", tls_cert: str = "", tls_key: str = "", options: list | None = None
    ):
        credentials = security.channel_credentials(tls_ca, tls_cert, tls_key)
        self.channel = security.aio_channel(address, options or (), credentials, token)
        self.stub = consumer_pb2_grpc.ConsumerServiceStub(self.channel)

    async def __aenter__(self) -> ConsumerClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.channel.close()

    async def describe(self) -> consumer_pb2.ConsumerServiceDescribeResponse:
        return await self.stub.Describe(consumer_pb2.ConsumerServiceDescribeRequest(), timeout=10)

    async def generate(self, timeout: float = 300.0, mode: str | None = None, options: dict | None = None, **fields) -> Answer:
        """Collect one Generate stream; `mode`/`options` fill `transfer` when given."""
        if mode is not None:
            fields["transfer"] = common_pb2.CodecSpec(name=mode, options=options or {})
        ids: list[int] = []
        text, stats = "", None
        async for msg in self.stub.Generate(consumer_pb2.GenerateRequest(**fields), timeout=timeout):
            if msg.WhichOneof("kind") == "token":
                ids += msg.token.ids
                text += msg.token.text
            else:
                stats = msg.stats
        assert stats is not None, "Generate ended without stats"  # the consumer always ends with them
        return Answer(ids, text, stats)
