"""The consumer's link to its producers: reachable, authenticated, compatible, and what it means
for readiness.

`ProducerLink` asks the producer's `Describe` (through the consumer's own channel: balancing,
TLS, token) at start and again every `--producer-check-interval-s` (every second while the link
is down), so a producer that appears later, restarts with other weights or starts refusing our
token is seen without a request failing first. Each check gives a `LinkState`: `ok`, `unreachable`, `tls_failed`,
`unauthenticated`, `incompatible` (another API or codec format version, consumer.link.compat) or
`unverified` (it answers but has no Describe). A change is logged once (`producer.link`), counted
by the metric `scd_producer_link` (1 on the current state) and shown in Describe.

One readiness rule (`not_ready`): ready = the default mode can be served now. `auto` always can
(its candidates include the consumer's own prefill, and it leaves the producer out while the link
is unusable), `oracle` needs no producer, a fixed transfer mode (`--default-mode raw`, `scd`, ...)
needs a usable link (`ok`/`unverified`), and a default that would be naive reuse across different
weights is not served at all. The link is reported apart from readiness: its own health service
(`producer-link`, SERVING while usable), Describe's `producer_link`, the metric and the log line
`producer.link` on each change. `failure` names the cause of a failed producer call for callers:
"producer rejected our token", "TLS handshake with producer failed: unknown CA (...)". Knows
nothing about the servicer.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import grpc

from consumer.link import compat
from shared import background, logs
from shared.errors import FailedPrecondition, ServiceError, Unavailable
from shared.pb import consumer_pb2, producer_pb2

log = logs.get("consumer.link.readiness")

LINK_STATES = ("unknown", "ok", "unverified", "unreachable", "tls_failed", "unauthenticated", "incompatible")
USABLE = ("ok", "unverified")
HEALTH_SERVICE = "producer-link"  # grpc.health.v1 service name of the link's own state (not readiness)
RETRY_S = 1.0  # re-check period while the link is not usable
_TLS = re.compile(r"(?:Tls|Ssl|SSL) handshake failed[^:]*:(?:.*?OPENSSL_internal:)?\s*([A-Z_]+)?:?\s*([^:]*)", re.I)
_TLS_NAMES = {
    "CERTIFICATE_VERIFY_FAILED": "unknown CA",
    "WRONG_VERSION_NUMBER": "the producer does not speak TLS",
    "TLSV1_ALERT_UNKNOWN_CA": "the producer does not trust our client certificate",
    "SSLV3_ALERT_BAD_CERTIFICATE": "the producer refused our client certificate",
    "TLSV1_ALERT_CERTIFICATE_REQUIRED": "the producer requires a client certificate",
}


@dataclass(frozen=True)
class LinkState:
    state: str  # one of LINK_STATES
    reason: str = ""  # one sentence, no addresses
    producer_digest: str = ""  # the producer's weight digest, once it answered Describe
    producer_artifacts: tuple[str, ...] | None = None  # ids of the SCD artifacts it loaded (None: unknown)
    producer_dtype: str = ""  # the dtype it computes its KV in, once it answered Describe
    producer_identity: str = ""  # what shapes its K/V (ModelInfo.identity), once it answered Describe
    producer_keep_weights: tuple[tuple[str, str], ...] = ()  # (artifact id, keep weights digest) it serves learned keep with


def failure(code: grpc.StatusCode, details: str, transport: str = "plaintext") -> ServiceError | None:
    """A caller-facing error naming the cause of a failed producer call when it is an
    authentication or transport-security problem (None otherwise). transport: plaintext | tls | mtls."""
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return FailedPrecondition(
            "producer rejected our token (UNAUTHENTICATED; check --producer-token or --producer-token-file"
            " against the producer's --token-file)"
        )
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return FailedPrecondition("producer refused our credentials (PERMISSION_DENIED)")
    if code != grpc.StatusCode.UNAVAILABLE:
        return None
    m = _TLS.search(details or "")
    if m:
        name, text = (m.group(1) or "").upper(), (m.group(2) or "").strip()
        cause = _TLS_NAMES.get(name, name.lower().replace("_", " ") or "handshake error")
        return Unavailable(f"TLS handshake with producer failed: {cause}" + (f" ({text})" if text and text != "OK" else ""))
    if "Socket closed" in (details or ""):
        hint = {
            "plaintext": "the producer may require TLS (set --producer-tls-ca)",
            "tls": "the producer may require a client certificate (mTLS: --producer-tls-cert/--producer-tls-key)",
            "mtls": "the producer may not trust our client certificate (mTLS)",
        }[transport]
        return Unavailable(f"producer closed the connection during setup: {hint}")
    return None


def classify(exc: grpc.aio.AioRpcError, transport: str) -> LinkState:
    """The link state a failed Describe shows."""
    code, details = exc.code(), exc.details() or ""
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return LinkState("unverified", "the producer answers but has no Describe")
    named = failure(code, details, transport)
    if named is not None:
        state = "unauthenticated" if isinstance(named, FailedPrecondition) else "tls_failed"
        if str(named).startswith("producer closed") and transport != "plaintext":
            state = "unreachable"  # a TLS channel closed during setup: not necessarily the handshake
        return LinkState(state, str(named))
    if "Connection refused" in details:
        return LinkState("unreachable", "producer unreachable: connection refused")
    return LinkState("unreachable", f"producer unreachable ({code.name})")


class ProducerLink:
    """Checks the producer now and every `interval_s`; `on_change(state)` after each change."""

    def __init__(
        self,
        stub,
        codecs: Mapping,
        transport: str,
        interval_s: float,
        on_change: Callable[[LinkState], Awaitable[None]],
        timeout_s: float = 5.0,
    ):
        self.stub, self.codecs, self.transport = stub, codecs, transport
        self.interval_s, self.on_change, self.timeout_s = interval_s, on_change, timeout_s
        self.state = LinkState("unknown", "not checked yet")
        self.changes = 0
        self._task: asyncio.Task | None = None

    async def check(self) -> LinkState:
        """Ask the producer once; report a change."""
        try:
            reply = await self.stub.Describe(producer_pb2.ProducerServiceDescribeRequest(), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            state = classify(exc, self.transport)
        else:
            reason = compat.mismatch(reply, self.codecs)
            digest = reply.model.weight_digest
            arts = tuple(a.artifact_id for a in reply.artifacts)
            weights = tuple((a.artifact_id, a.keep_weights_digest) for a in reply.artifacts if a.keep_weights_digest)
            state = LinkState(
                "incompatible" if reason else "ok", reason, digest, arts, reply.model.dtype, reply.model.identity, weights
            )
        if state != self.state:
            self.state = state
            self.changes += 1
            level = log.info if state.state in USABLE else log.warning
            level("producer.link", state=state.state, reason=state.reason or None, digest=state.producer_digest[:16] or None)
            await self.on_change(state)
        return state

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:  # a link that is down is retried every second (a producer still loading, restarting)
            await asyncio.sleep(self.interval_s if self.state.state in USABLE else min(self.interval_s, RETRY_S))
            with contextlib.suppress(Exception):
                await self.check()

    async def stop(self) -> None:
        await background.stop_task(self._task)
        self._task = None


def not_ready(state: LinkState, default_mode: str, needs_producer: bool, naive_reuse: str = "") -> str:
    """Why readiness is NOT_SERVING ("" when the consumer can serve its default mode now): the
    default is naive reuse (`naive_reuse` says why), or it is a transfer mode and the link is not
    usable. `auto` and `oracle` never need the producer."""
    if naive_reuse:
        return naive_reuse
    if needs_producer and state.state not in USABLE:
        return f"default mode {default_mode} needs the producer: {state.reason or state.state}"
    return ""


def link_to_pb(link: ProducerLink | None) -> consumer_pb2.ProducerLink:
    if link is None:
        return consumer_pb2.ProducerLink(state="unknown")
    state = link.state
    return consumer_pb2.ProducerLink(state=state.state, reason=state.reason, changes=link.changes, usable=state.state in USABLE)
