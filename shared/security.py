"""Transport security and caller authentication for both services and the consumer's channel.

Owns: server TLS credentials (optionally requiring client certificates: mTLS), client channel
credentials, bearer tokens read from a file or the environment, and the two interceptors that
carry them: `BearerTokenAuth` on a server (constant-time compare, health Check exempt) and
`BearerTokenUnary`/`BearerTokenStream` on a client channel. Owns no service logic; a service without TLS or token
settings runs plaintext and open, as before.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from pathlib import Path

import grpc

from shared import logs

HEALTH_PREFIX = "/grpc.health.v1.Health/"
# what a caller without the token may call on a port that asks for one: a probe's one-message
# Check. Not Watch: each is a stream held open, and anyone could open any number of them (the
# plaintext --health-port, reachable only where operators let probes in, serves both)
HEALTH_CHECK = HEALTH_PREFIX + "Check"
AUTH_HEADER = "authorization"


def read_pem(path: str) -> bytes | None:
    return Path(path).read_bytes() if path else None


def load_token(token: str, token_file: str) -> str:
    """The token itself, else the first line of token_file, else "" (no token)."""
    if token:
        return token.strip()
    if token_file:
        text = Path(token_file).read_text().strip()
        if not text:
            raise ValueError("token_file: the file is empty")
        return text.splitlines()[0].strip()
    return ""


def server_credentials(
    cert: str, key: str, client_ca: str = "", require_client_cert: bool = True
) -> grpc.ServerCredentials | None:
    """TLS for a server port, None for plaintext. With client_ca, clients present certificates
    signed by it (required unless require_client_cert is false)."""
    if not cert:
        return None
    return grpc.ssl_server_credentials(
        [(read_pem(key), read_pem(cert))],
        root_certificates=read_pem(client_ca),
        require_client_auth=bool(client_ca) and require_client_cert,
    )


def channel_credentials(ca: str, cert: str = "", key: str = "") -> grpc.ChannelCredentials | None:
    """TLS for a client channel (None: plaintext); cert/key add a client certificate (mTLS)."""
    if not ca:
        return None
    return grpc.ssl_channel_credentials(read_pem(ca), private_key=read_pem(key), certificate_chain=read_pem(cert))


def _refuse(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that answers UNAUTHENTICATED."""

    async def unary(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def streaming(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover  (makes this an async generator)

    kind = next(k for k in ("unary_unary", "unary_stream", "stream_unary", "stream_stream") if getattr(handler, k))
    return handler._replace(**{kind: streaming if kind.endswith("_stream") else unary})


LOG_REJECTIONS = 100
log = logs.get("security")


def bearer_matches(header: str | bytes, token: str) -> bool:
    """Whether an `authorization` value is `Bearer <token>`: the scheme in any case (RFC 7235), one
    or more spaces, the token compared in constant time."""
    value = header.decode("latin-1") if isinstance(header, bytes) else header
    scheme, _, credentials = value.strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(credentials.strip().encode(), token.encode())


class Rejections:
    """Calls refused for their token, counted; each logged as the warning `auth.rejected` (the
    first LOG_REJECTIONS, then 1 in LOG_REJECTIONS: a flood stays bounded)."""

    def __init__(self) -> None:
        self.count = 0

    def note(self, method: str, has_header: bool) -> None:
        self.count += 1
        if self.count <= LOG_REJECTIONS or self.count % LOG_REJECTIONS == 0:
            log.warning(
                "auth.rejected",
                method=method,
                why="wrong bearer token" if has_header else "no bearer token",
                rejected_total=self.count,
            )


class BearerTokenAuth(grpc.aio.ServerInterceptor):
    """Every call except a health Check must carry `authorization: Bearer <token>`; compared in
    constant time. A wrong or missing token is UNAUTHENTICATED and names neither."""

    def __init__(self, token: str, exempt: Sequence[str] = (HEALTH_CHECK,)):
        self.token = token
        self.exempt = tuple(exempt)
        self.rejections = Rejections()

    @property
    def rejected(self) -> int:
        return self.rejections.count

    def allowed(self, metadata) -> bool:
        got = next((v for k, v in metadata or () if k == AUTH_HEADER), "")
        return bearer_matches(got, self.token)

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith(self.exempt) or self.allowed(details.invocation_metadata):
            return handler
        self.rejections.note(details.method, any(k == AUTH_HEADER for k, _ in details.invocation_metadata or ()))
        return _refuse(handler, "missing or invalid bearer token (metadata 'authorization: Bearer <token>')")


def _with_token(details: grpc.aio.ClientCallDetails, header: tuple[str, str]) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*(details.metadata or ()))
    metadata.add(*header)
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials, details.wait_for_ready)


class BearerTokenUnary(grpc.aio.UnaryUnaryClientInterceptor):
    """Adds `authorization: Bearer <token>` to every unary call of a channel (plaintext or TLS)."""

    def __init__(self, token: str):
        self.header = (AUTH_HEADER, f"Bearer {token}")

    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(_with_token(details, self.header), request)


class BearerTokenStream(grpc.aio.UnaryStreamClientInterceptor):
    """The same for server-streaming calls (grpc.aio files an interceptor under one kind only)."""

    def __init__(self, token: str):
        self.header = (AUTH_HEADER, f"Bearer {token}")

    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(_with_token(details, self.header), request)


def aio_channel(
    target: str,
    options: Sequence = (),
    credentials: grpc.ChannelCredentials | None = None,
    token: str = "",
    extra_interceptors: Sequence = (),
) -> grpc.aio.Channel:
    """A grpc.aio channel: TLS when credentials are given, a bearer token on every call when set,
    and `extra_interceptors` (tracing) after it."""
    interceptors = [*([BearerTokenUnary(token), BearerTokenStream(token)] if token else []), *extra_interceptors] or None
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=list(options), interceptors=interceptors)
    return grpc.aio.secure_channel(target, credentials, options=list(options), interceptors=interceptors)
