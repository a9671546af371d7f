"""gRPC client of the producer's Prefill stream: the consumer's `TransferSource`.

The channel (`ProducerClient.from_config`) takes any gRPC target (`host:port`,
`dns:///producer:50051`, `ipv4:10.0.0.1:50051,10.0.0.2:50051`) and leaves the choice of producer
to gRPC's own load balancing: `ring_hash` keyed by the `x-context-hash` header (a hash of the
context's first chunk of token ids, shared.chunks.route_key), so a context, the next turns of its
conversation and other questions about its document land on the same producer and its chunk
store hits survive scale-out, or `round_robin` / `pick_first`. TLS / mTLS and a bearer token come
from shared.security; keepalive pings find a dead producer between calls.

Feeds every message, as its received bytes, to a `StreamReader` (the stream contract, consumer.link.stream_reader) and yields
its events; maps the producer's statuses to the consumer's documented ones, without the
producer's address. The channel's service config retries UNAVAILABLE and RESOURCE_EXHAUSTED
before the first response (gRPC's own retry policy: nothing was received, so it is safe).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import AsyncGenerator

import grpc

from consumer.link.readiness import failure
from consumer.link.stream_reader import Event, Expectation, StreamReader
from shared import chunks, keep_wire, logs, security, tracing
from shared.errors import DataLoss, DeadlineExceeded, FailedPrecondition, ServiceError, Unavailable
from shared.grpc_server import GRPC_OPTIONS
from shared.pb import common_pb2, producer_pb2, producer_pb2_grpc

log = logs.get("consumer.link.producer_client")
# gRPC reads this once, when it initializes: without it ring_hash ignores requestHashHeader and
# picks a random producer per call. Set here, at import, before any channel exists.
os.environ.setdefault("GRPC_EXPERIMENTAL_RING_HASH_SET_REQUEST_HASH_KEY", "true")

SERVICE = "scd.v1.ProducerService"
HASH_HEADER = "x-context-hash"
RETRY_CONFIG = {
    "methodConfig": [
        {
            "name": [{"service": SERVICE}],
            "retryPolicy": {
                "maxAttempts": 4,
                "initialBackoff": "0.05s",
                "maxBackoff": "1s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE", "RESOURCE_EXHAUSTED"],
            },
        }
    ]
}

OWN_DEADLINE_SLACK_S = 0.05  # a DEADLINE_EXCEEDED with more of our deadline left is the producer's own
# producer status -> (consumer error, what it means for the caller)
_MAPPED: dict[grpc.StatusCode, tuple[type[ServiceError], str]] = {
    grpc.StatusCode.RESOURCE_EXHAUSTED: (Unavailable, "producer overloaded"),
    grpc.StatusCode.UNAVAILABLE: (Unavailable, "producer unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (DeadlineExceeded, "deadline passed during the transfer"),
    # the caller's own cancel arrives as asyncio cancellation, never as this status: a CANCELLED
    # status means the producer side ended the call (draining, restarted), so it is retryable
    grpc.StatusCode.CANCELLED: (Unavailable, "producer cancelled the transfer"),
    grpc.StatusCode.INVALID_ARGUMENT: (FailedPrecondition, "producer refused the request"),
    grpc.StatusCode.FAILED_PRECONDITION: (FailedPrecondition, "producer cannot serve this codec for this pair"),
    grpc.StatusCode.DATA_LOSS: (DataLoss, "producer reported data loss"),
}


# the producer's own refusals (its message names the field and limit) are passed on, with any
# address-like text removed; for transport-level codes the details (connection errors, peers,
# internal messages) only go to the consumer's log.
_PASS_DETAILS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.DATA_LOSS}
_ADDRESS = re.compile(
    r"\b[a-z][a-z0-9+.\-]*://\S+"  # a URL: http://internal.corp/x, unix:///var/run/p.sock
    r"|\bunix(?:-abstract)?:\S+"  # a unix socket target: unix:/path, unix:relative
    # host:port, [v6]:port, ipv4:a.b.c.d:port: a host with a letter or a dot ('1:2' is no address), a port
    # not followed by a decimal part ('snapkv:0.25' is a keep label)
    r"|(?:(?:ipv[46]|dns):/*)?(?:\[[0-9a-fA-F:.]+\]|(?=[\w.-]*[A-Za-z.])[\w.-]+):\d{1,5}\b(?!\.\d)"
    r"|\b\d{1,3}(?:\.\d{1,3}){3}\b"  # a bare IPv4 address
    r"|\[[0-9a-fA-F.]*:[0-9a-fA-F.]*:[0-9a-fA-F:.]*\]",  # a bracketed IPv6 address (two colons at least: not '[8]')
    re.IGNORECASE,
)
# grpc's own words for a message past a receive limit, on either side of the call
_TOO_LARGE = re.compile(r"received message larger than max \((\d+) vs\. (\d+)\)", re.IGNORECASE)
RECEIVE_LIMIT = dict(GRPC_OPTIONS)["grpc.max_receive_message_length"]


def upstream_error(
    exc: grpc.aio.AioRpcError,
    transport: str = "plaintext",
    link_problem: str = "",
    mid_stream: bool = False,
    left_s: float | None = None,
) -> ServiceError:
    """The consumer's error for a failed producer call (never the producer's address); a rejected
    token or a failed TLS handshake is named as such (consumer.link.readiness.failure), and an
    unavailable producer carries the cause the last link check found, if any. `mid_stream`: the
    producer had sent part of its stream, so the connection was set up (a closed socket is then a
    producer gone, not a TLS mismatch). `left_s`: what was left of the call's own deadline when it
    failed; a DEADLINE_EXCEEDED with time left is the producer's own limit, not the caller's."""
    cls, what = _MAPPED.get(exc.code(), (Unavailable, "producer failed"))
    if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and left_s is not None and left_s > OWN_DEADLINE_SLACK_S:
        log.warning("producer.call_failed", code=exc.code().name, details=(exc.details() or "")[:300])
        return Unavailable(
            f"producer ended the transfer at its own time limit (DEADLINE_EXCEEDED with {left_s:.1f} s of this"
            " request's deadline left; see the producer's --max-timeout-s)"
        )
    if mid_stream and exc.code() == grpc.StatusCode.UNAVAILABLE:
        log.warning("producer.call_failed", code=exc.code().name, details=(exc.details() or "")[:300])
        return Unavailable("producer connection lost mid-stream (UNAVAILABLE)")
    details = (exc.details() or "")[:300]
    log.warning("producer.call_failed", code=exc.code().name, details=details)
    too_large = _TOO_LARGE.search(details) if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else None
    if too_large is not None:  # a broken peer, not a busy one: never retried as "overloaded"
        size, limit = int(too_large.group(1)), int(too_large.group(2))
        if limit == RECEIVE_LIMIT:  # this channel's own limit: the producer's message
            return DataLoss(
                f"producer sent a message of {size} bytes, past this consumer's receive limit of {limit} bytes"
                " (grpc.max_receive_message_length; a producer's payload chunks are <= 4 MiB)"
            )
        return FailedPrecondition(f"producer refused a request of {size} bytes: its receive limit is {limit} bytes")
    named = failure(exc.code(), details, transport)
    if named is not None:
        return named
    if exc.code() == grpc.StatusCode.UNAVAILABLE and link_problem:
        return cls(f"{what} ({exc.code().name}); last producer link check: {link_problem}")
    if exc.code() not in _PASS_DETAILS:
        return cls(f"{what} ({exc.code().name})")
    return cls(f"{what} ({exc.code().name}): {_ADDRESS.sub('<address>', details)}")


def context_hash(token_ids) -> str:
    """The ring_hash key of a context: a hash of its first chunk (shared.chunks.route_key: the
    first 256 token ids, all of a shorter context), so contexts sharing that opening share a
    producer."""
    return chunks.route_key(list(token_ids))


def service_config(lb: str = "ring_hash") -> dict:
    """The channel's service config: load-balancing policy plus the retry policy."""
    policy = {"ring_hash_experimental": {"requestHashHeader": HASH_HEADER}} if lb == "ring_hash" else {lb: {}}
    return {"loadBalancingConfig": [policy], **RETRY_CONFIG}


def channel_options(lb: str = "ring_hash", keepalive_s: float = 30.0, server_name: str = "") -> list[tuple[str, object]]:
    options = [
        *GRPC_OPTIONS,
        ("grpc.service_config", json.dumps(service_config(lb))),
        ("grpc.enable_retries", 1),
        ("grpc.keepalive_time_ms", int(keepalive_s * 1000)),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        # a producer that comes (back) up is reached within a second or two, not gRPC's default
        # reconnect backoff of up to 120 s (then requests would fail UNAVAILABLE meanwhile)
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2000),
        ("grpc.http2.max_pings_without_data", 0),
    ]
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    return options


class ProducerClient:
    def __init__(
        self, target: str, consumer_digest: str = "", channel: grpc.aio.Channel | None = None, transport: str = "plaintext"
    ):
        self.target = target
        self.transport = transport  # plaintext | tls | mtls: what a failed connection's cause is read against
        self.link_problem = ""  # the last producer link check's reason when it was not ok (consumer.link.readiness)
        self.consumer_digest = consumer_digest
        self.streams_open = 0  # Prefill streams being read now (consumer.auto.probe: the link is idle at 0)
        self.channel = channel or grpc.aio.insecure_channel(target, options=channel_options())
        self.stub = producer_pb2_grpc.ProducerServiceStub(self.channel)
        # Prefill's responses as received bytes: the stream reader takes payloads from them in place
        self.prefill = self.channel.unary_stream(
            f"/{SERVICE}/Prefill", request_serializer=producer_pb2.PrefillRequest.SerializeToString, response_deserializer=None
        )

    @classmethod
    def from_config(cls, cfg, consumer_digest: str = "", tracer: tracing.Tracing | None = None) -> ProducerClient:
        """The channel a ConsumerConfig describes: target, balancing, TLS/mTLS, token, keepalive,
        and the tracing interceptors (trace context to the producer) when tracing is on."""
        credentials = security.channel_credentials(cfg.producer_tls_ca, cfg.producer_tls_cert, cfg.producer_tls_key)
        token = security.load_token(cfg.producer_token, cfg.producer_token_file)
        options = channel_options(cfg.producer_lb, cfg.keepalive_s, cfg.producer_tls_server_name)
        extra = tracer.client_interceptors() if tracer is not None else []
        transport = "mtls" if cfg.producer_tls_cert else ("tls" if cfg.producer_tls_ca else "plaintext")
        channel = security.aio_channel(cfg.producer, options, credentials, token, extra)
        return cls(cfg.producer, consumer_digest, channel, transport)

    async def close(self) -> None:
        await self.channel.close()

    async def open(
        self, request_id: str, context_ids: list[int], expect: Expectation, timeout_s: float
    ) -> AsyncGenerator[Event, None]:
        request = producer_pb2.PrefillRequest(
            request_id=request_id,
            token_ids=context_ids,
            codec=common_pb2.CodecSpec(name=expect.codec.name, options=dict(expect.options)),
            consumer_weight_digest=self.consumer_digest,
            first_token=expect.first_token,
            prefix_key=expect.prefix_key,
            cache_salt=expect.cache_salt,
            keep=keep_wire.to_pb(expect.keep) if expect.keep is not None else None,
            accept_layer_chunks=True,
            accept_batches=True,
        )
        reader = StreamReader(expect)
        ends_at = time.monotonic() + timeout_s
        call = self.prefill(
            request, timeout=timeout_s, metadata=(("x-request-id", request_id), (HASH_HEADER, context_hash(context_ids)))
        )
        self.streams_open += 1
        received = False
        try:
            async for message in call:
                received = True
                for event in reader.feed(message):
                    yield event
            reader.end()
        except grpc.aio.AioRpcError as exc:
            left_s = ends_at - time.monotonic()
            raise upstream_error(exc, self.transport, self.link_problem, mid_stream=received, left_s=left_s) from None
        finally:
            self.streams_open -= 1
            call.cancel()  # a no-op once the call ended; stops the producer on any error here
