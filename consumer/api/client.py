"""A small async client of the consumer service, for orchestrators, the demo, benchmarks and
tests: one `generate` call collected into an `Answer`. TLS when given a CA (a client
certificate too under mTLS), a bearer token on every call when given one.

Verified decoding with provisional tokens (GenerateRequest.verify = VERIFY_POLICY_PROVISIONAL):
token deltas before the one `commit` are drafts; the commit keeps the first `accepted_tokens` of
them, appends its `ids` and replaces the text with its `text`; deltas after it are verified.
`generate` applies it (`Answer.ids` is the verified answer; `provisional_ids` what was shown
before the commit):

    answer = await client.generate(context=prompt("..."), question=prompt(" Q ..."), mode="raw",
                                   verify=consumer_pb2.VERIFY_POLICY_PROVISIONAL)
    print(answer.provisional_ids, "->", answer.ids, answer.stats.verify_decision)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared import security
from shared.pb import common_pb2, consumer_pb2, consumer_pb2_grpc


@dataclass
class Answer:
    ids: list[int]
    text: str
    stats: consumer_pb2.GenerateStats
    provisional_ids: list[int] = field(default_factory=list)  # the drafts streamed before a commit
    commit: consumer_pb2.VerifyCommit | None = None


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
        provisional: list[int] = []
        commit: consumer_pb2.VerifyCommit | None = None
        async for msg in self.stub.Generate(consumer_pb2.GenerateRequest(**fields), timeout=timeout):
            kind = msg.WhichOneof("kind")
            if kind == "token":
                ids += msg.token.ids
                text += msg.token.text
            elif kind == "commit":  # the drafts so far were checked: keep the accepted ones, then its ids
                commit, provisional = msg.commit, ids
                ids = ids[: commit.accepted_tokens] + list(commit.ids)
                text = commit.text
            else:
                stats = msg.stats
        assert stats is not None, "Generate ended without stats"  # the consumer always ends with them
        return Answer(ids, text, stats, provisional, commit)
