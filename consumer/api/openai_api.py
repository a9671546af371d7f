"""OpenAI-compatible HTTP beside the consumer's gRPC port (`--http-port`): GET /v1/models and
/v1/models/{model}, POST /v1/completions and /v1/chat/completions, streaming (server-sent events,
`data: {json}` ... `data: [DONE]`) or not; GET /health (live) and /ready (the gRPC readiness rule).

Thin: a body becomes a GenerateRequest and Extras (consumer.api.openai_schema, consumer.api.openai_chat),
which run through the servicer's `generate_items`: the same admission (--max-inflight), job
builder (limits, auto) and pipeline as gRPC Generate, in the same process and on the same engine;
the items become OpenAI's objects (consumer.api.openai_reply). Every non-2xx answer is OpenAI's error
JSON ({"error": {message, type, param, code}}), aiohttp's own too (unknown route 404, method 405,
body over the limit 413, a header over its limit 431, a malformed request 400). Before admission
counts a request, a second Admission (`intake`) bounds those reading or tokenizing their bodies
(--max-inflight at once, more 429; a body not in within the default deadline 408), so slow or large
bodies hold bounded memory. Each request is
counted and timed in the gRPC families (scd_rpc_total{method="POST /v1/completions", code="200"});
a refused token is the `auth.rejected` warning. The same bearer token and TLS as the gRPC port
(--token/--token-file, --tls-cert/--tls-key, --tls-client-ca); the probes need no token.
aiohttp: asyncio-native, so it shares the gRPC server's event loop with no thread hop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import ssl
import time
import uuid
from collections.abc import Callable
from typing import Any, cast

import structlog
from aiohttp import http_exceptions, web

from consumer.api import openai_chat
from consumer.api import openai_schema as schema
from consumer.api.openai_reply import Reply
from consumer.api.token_bytes import TokenBytes
from consumer.request.job import GenerateResult, TokenOut
from shared import admission, health_service, logs, rpc_errors, security
from shared.config import ConsumerConfig
from shared.errors import InvalidArgument, ServiceError, Unavailable
from shared.models import LoadedModel

log = logs.get("openai_api")
STATUS = {
    "INVALID_ARGUMENT": 400,
    "FAILED_PRECONDITION": 400,
    "OUT_OF_RANGE": 400,
    "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403,
    "NOT_FOUND": 404,
    "RESOURCE_EXHAUSTED": 429,
    "CANCELLED": 499,
    "DATA_LOSS": 502,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
}
TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    431: "invalid_request_error",
    429: "rate_limit_error",
}
REQUEST_ID = web.RequestKey("request_id", str)  # the caller's x-request-id, or a fresh one
STREAM_ERROR = web.RequestKey("stream_error", ServiceError)  # an error sent inside a stream (metrics count its status)
PROBES = ("/health", "/ready")  # no token, no request metrics (as gRPC health)
METHODS = ("GET", "POST", "HEAD", "PUT", "DELETE", "PATCH", "OPTIONS")  # the method label's values (else OTHER)
# aiohttp's parser limits (its defaults): a longer request line or header, or more headers, is 431
MAX_LINE_BYTES, MAX_HEADERS = 8190, 128
KEEPALIVE_S = 75.0  # nginx's keepalive_timeout


class NotFound(ServiceError):
    code = "NOT_FOUND"


class Unauthenticated(ServiceError):
    code = "UNAUTHENTICATED"


class PayloadTooLarge(ServiceError):
    code = "PAYLOAD_TOO_LARGE"  # no gRPC status: HTTP only (413)


class RequestTimeout(ServiceError):
    code = "REQUEST_TIMEOUT"  # no gRPC status: HTTP only (408)


def _error(status: int, message: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": TYPES.get(status, "server_error"), "param": param, "code": code}}


def error_body(exc: Exception, request_id: str = "") -> tuple[int, dict[str, Any]]:
    """(HTTP status, OpenAI error JSON) of an exception: a ServiceError by its code, an aiohttp
    HTTP error by its status; anything else is 500."""
    if isinstance(exc, web.HTTPException):
        reason = exc.reason if exc.status != 404 else "no such route (see GET /v1/models, POST /v1/completions, ...)"
        return exc.status, _error(exc.status, f"{reason}", None, exc.reason.lower().replace(" ", "_"))
    if not isinstance(exc, ServiceError):
        return 500, _error(500, f"internal error (request_id={request_id})", None, "internal")
    status = {PayloadTooLarge: 413, RequestTimeout: 408}.get(type(exc)) or STATUS.get(exc.code, 500)
    param, message = schema.param_of(rpc_errors.public_text(str(exc)[:2000]))
    if isinstance(exc, schema.BadField):
        param = exc.param
    code = "model_not_found" if isinstance(exc, NotFound) else exc.code.lower()
    return status, _error(status, message, param, code)


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class _Caller:
    """What shared.outcomes asks of a caller: whether it went away (the connection closed)."""

    def __init__(self, request: web.Request):
        self.request = request

    def cancelled(self) -> bool:
        transport = self.request.transport
        return transport is None or transport.is_closing()


class _JsonErrors(web.RequestHandler):
    """aiohttp's connection handler answering what fails before any route or middleware runs (a
    malformed request, a line or header over the parser's limits) in OpenAI's error JSON."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Past --max-connections open at once: a 503 naming the limit, then the connection closes
        (each held connection costs a file descriptor and a few kB; the time one may take to send
        its first request's headers is the keep-alive timeout)."""
        super().connection_made(transport)
        server = self._manager
        if isinstance(server, _Server) and len(server.connections) > server.max_connections:
            text = f"connections: {len(server.connections) - 1} open >= limit max_connections {server.max_connections}"
            body = json.dumps(_error(503, text, None, "unavailable")).encode()
            head = b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
            cast(asyncio.Transport, transport).write(head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
            self.force_close()
            transport.close()

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None, message: str | None = None):
        if request.writer.output_size > 0:  # a response already begun (a client gone mid-stream): aiohttp drops it
            raise ConnectionError("a response was already sent: no error response")
        transport = request.transport
        if isinstance(exc, ConnectionError) or transport is None or transport.is_closing():
            # the client went away before its response began (e.g. while its body was arriving):
            # an ordinary cancel (recorded 499), no one to answer and no traceback to log
            log.info("http.client_gone", path=request.path[:200], error=type(exc).__name__ if exc is not None else "")
            raise ConnectionError("the client went away: no error response")
        if status == 500:
            super().handle_error(request, status, exc, message)  # logs it with its traceback
        else:
            log.info("http.bad_request", status=status, error=type(exc).__name__ if exc is not None else "")
        too_long = isinstance(exc, http_exceptions.LineTooLong) or "Too many headers" in str(message)
        if status == 500:
            text = "internal error"
        elif too_long:
            status = 431
            text = f"headers: a request line or header over {MAX_LINE_BYTES} bytes, or more than {MAX_HEADERS} headers"
        else:
            text = f"request: not a well-formed HTTP request ({type(exc).__name__ if exc is not None else status})"
        response = web.json_response(_error(status, text, "headers" if too_long else None, None), status=status)
        response.force_close()
        return response


class _Server(web.Server):
    max_connections = 1 << 30  # OpenAIServer.start sets --max-connections

    def __call__(self) -> web.RequestHandler:
        return _JsonErrors(self, loop=self._loop, **self._kwargs)


class _Runner(web.AppRunner):
    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _Server  # the same server; its connections get _JsonErrors
        return server


def ssl_context(cfg: ConsumerConfig) -> ssl.SSLContext | None:
    """The gRPC port's TLS for the HTTP port: its certificate, and client certificates from
    --tls-client-ca (required unless --require-client-cert false)."""
    if not cfg.tls_cert:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cfg.tls_cert, cfg.tls_key)
    if cfg.tls_client_ca:
        ctx.load_verify_locations(cfg.tls_client_ca)
        ctx.verify_mode = ssl.CERT_REQUIRED if cfg.require_client_cert else ssl.CERT_OPTIONAL
    return ctx


class OpenAIServer:
    """The HTTP app over a ConsumerServicer (duck-typed; consumer/server.py wires the two fronts);
    `why_not` answers the gRPC health rule per service ("" serving: shared.grpc_server.Server's)."""

    def __init__(self, servicer: Any, config: ConsumerConfig, why_not: Callable[[str], str] = lambda _: ""):
        self.servicer, self.config, self.why_not = servicer, config, why_not
        self.token = security.load_token(config.token, config.token_file)
        self.rejections = security.Rejections()
        self.started = int(time.time())
        self.max_body = config.http_body_limit
        self._token_bytes: TokenBytes | None = None
        # the requests between their headers and admission (their body read, parsed, tokenized):
        # admission counts a request only from there, so without this many slow or large bodies
        # (each up to max_body) would hold memory without bound
        self.intake = admission.Admission("max_inflight", config.max_inflight, "body: requests being read at once")
        self.app = web.Application(middlewares=[self._middleware], client_max_size=self.max_body)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/v1/models/{model:.+}", self.model_card)
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_post("/v1/chat/completions", self.chat_completions)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/ready", self.ready)
        self.runner: web.AppRunner | None = None
        self.port = -1

    async def start(self) -> int:
        """Listen on --http-port (0: any free port); returns the bound port."""
        # keep-alive: an idle connection closes after it, and a new one must send its first
        # request's headers within it (aiohttp's own default, 3630 s, let a slow sender hold one an hour)
        self.runner = _Runner(self.app, handler_cancellation=True, access_log=None, keepalive_timeout=KEEPALIVE_S)
        await self.runner.setup()
        cast(_Server, self.runner.server).max_connections = self.config.max_connections
        site = web.TCPSite(self.runner, self.config.host, self.config.http_port, ssl_context=ssl_context(self.config))
        await site.start()
        self.port = self.runner.addresses[0][1]
        return self.port

    async def stop(self) -> None:
        """After the gRPC drain (the two share admission, so HTTP calls were drained with it)."""
        if self.runner is not None:
            await self.runner.shutdown()
            await self.runner.cleanup()
            self.runner = None

    # -- every request: id, token, errors, metrics ----------------------------------------------
    @staticmethod
    def _route(request: web.Request) -> str:
        """The method label: 'POST /v1/completions' (the route as registered; unmatched paths one label)."""
        resource = request.match_info.route.resource
        method = request.method if request.method in METHODS else "OTHER"
        return f"{method} {resource.canonical if resource is not None else 'unmatched'}"

    @web.middleware
    async def _middleware(self, request: web.Request, handler) -> web.StreamResponse:
        started = time.perf_counter()
        bad_id: InvalidArgument | None = None
        try:  # the caller's x-request-id when it is printable ASCII (it goes back in a header and the logs)
            rid = rpc_errors.request_id(request.headers.get("x-request-id", ""))
        except InvalidArgument as exc:
            rid, bad_id = uuid.uuid4().hex, exc
        request[REQUEST_ID] = rid
        probe = request.path in PROBES
        status, error_code = 499, ""  # a handler cancelled (the client went away) records 499
        try:
            try:
                if bad_id is not None:
                    raise bad_id
                if self.token and not probe and not self._authorized(request):
                    raise Unauthenticated(
                        "authorization: missing or invalid bearer token (header 'Authorization: Bearer <token>')"
                    )
                response = await handler(request)
            except ConnectionError:  # the client went away mid-stream: recorded as 499, aiohttp drops the connection
                raise
            except Exception as exc:
                if isinstance(exc, web.HTTPException) and exc.status < 400:
                    raise
                response = self._refusal(request, exc, rid)
                error_code = getattr(exc, "code", "")
            failed = request.get(STREAM_ERROR)
            status = STATUS.get(failed.code, 500) if failed is not None else response.status
            error_code = failed.code if failed is not None else error_code
            return response
        finally:
            if not probe:
                self.servicer.metrics.record_http(self._route(request), status, time.perf_counter() - started, error_code)

    def _refusal(self, request: web.Request, exc: Exception, rid: str) -> web.Response:
        status, body = error_body(exc, rid)
        if status == 500:
            log.error(
                "http.internal_error", path=request.path[:200], error=f"{type(exc).__name__}: {str(exc)[:500]}", exc_info=exc
            )
        elif status == 401:
            self.rejections.note(f"{request.method[:16]} {request.path[:200]}", "Authorization" in request.headers)
        else:
            log.info("http.error", path=request.path[:200], status=status, reason=body["error"]["message"][:500])
        headers = {"x-request-id": rid}
        if isinstance(exc, web.HTTPMethodNotAllowed):
            headers["Allow"] = ",".join(sorted(exc.allowed_methods))
        return web.json_response(body, status=status, headers=headers)

    def _authorized(self, request: web.Request) -> bool:
        return security.bearer_matches(request.headers.get("Authorization", ""), self.token)

    # -- probes and models -------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        """Live: the engine progresses (gRPC health service `liveness`)."""
        return self._probe(health_service.LIVENESS)

    async def ready(self, request: web.Request) -> web.Response:
        """Ready: the default mode can be served now (gRPC health service "", the same rule)."""
        return self._probe("")

    def _probe(self, service: str) -> web.Response:
        why = self.why_not(service)
        if why:
            return web.json_response(_error(503, why, None, "not_serving"), status=503)
        return web.json_response({"status": "SERVING"})

    def _loaded(self) -> LoadedModel:
        if self.servicer.loaded is None:
            raise Unavailable("consumer model is still loading")
        return self.servicer.loaded

    def model_id(self) -> str:
        """The served model name (--served-model-name; never a filesystem path)."""
        return self.servicer.model_name

    def _card(self) -> dict[str, Any]:
        self._loaded()
        return {"id": self.model_id(), "object": "model", "created": self.started, "owned_by": "scd"}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._card()]})

    async def model_card(self, request: web.Request) -> web.Response:
        card = self._card()
        self._check_model(request.match_info["model"])
        return web.json_response(card)

    def _check_model(self, model: Any) -> None:
        if model is not None and model != self.model_id():
            raise NotFound(f"model: {schema.show(model)} is not served here; GET /v1/models lists {self.model_id()!r}")

    # -- generation -----------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            raw = await asyncio.wait_for(request.read(), self.config.default_timeout_s)
        except TimeoutError:
            raise RequestTimeout(
                f"body: not received within {self.config.default_timeout_s:g} s (the default deadline)"
            ) from None
        except web.HTTPRequestEntityTooLarge:
            raise PayloadTooLarge(
                f"body: > limit {self.max_body} bytes (--max-text-bytes and --max-context-tokens set it)"
            ) from None
        except (web.RequestPayloadError, http_exceptions.HttpProcessingError) as exc:  # bad chunks, a bad Content-Encoding
            raise InvalidArgument(f"body: cannot be read ({type(exc).__name__})") from None
        try:  # RFC 8259: JSON between systems is UTF-8 (json.loads would also read UTF-16 and UTF-32)
            text = raw.decode("utf-8", "surrogatepass").removeprefix("\ufeff")  # lone surrogates: check_unicode names them
        except UnicodeDecodeError as exc:
            raise InvalidArgument(f"body: not UTF-8 (byte {exc.start}); JSON request bodies must be UTF-8") from None
        try:
            body = json.loads(text)
        except RecursionError:
            raise InvalidArgument(f"body: JSON nested deeper than limit {schema.MAX_DEPTH}") from None
        except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError, or an integer of > 4300 digits
            raise InvalidArgument(f"body: not valid JSON ({str(exc)[:200]})") from None
        if not isinstance(body, dict):
            raise InvalidArgument("body: must be a JSON object")
        schema.check_depth(body)
        schema.check_unicode(body, raw)
        return body

    async def _prompt(self, body: dict[str, Any], chat: bool) -> tuple[list[int], str]:
        """The prompt's token ids, and its text for echo."""
        cfg, loaded = self.config, self._loaded()
        field = "messages" if chat else "prompt"
        if chat:
            text, special = openai_chat.render_chat(body, loaded.tokenizer)
            prompt: str | list[int] = text
        else:
            prompt, special = schema.read_prompt(body), True
        if isinstance(prompt, list):
            bad = next((t for t in prompt if t >= loaded.info.vocab_size), None)
            if bad is not None:
                raise InvalidArgument(f"prompt: token id {bad} >= vocab_size {loaded.info.vocab_size}")
            return prompt, ""
        size = len(prompt.encode("utf-8", "surrogatepass"))
        if size > cfg.max_text_bytes:
            raise InvalidArgument(f"{field}: {size} bytes > limit max_text_bytes {cfg.max_text_bytes}")
        return await self.servicer.jobs.tokenize(prompt, special), prompt

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        received = time.perf_counter()
        with self.intake.slot():  # up to admission: the body, its fields and its tokens
            body = await self._body(request)
            params = schema.read_params(body, self.config, chat)
            loaded = self._loaded()
            self._check_model(body.get("model"))
            with self.servicer.admission.slot():  # full or draining: refused now (429, 503), before tokenizing
                pass
            ids, text = await self._prompt(body, chat)
        context, question = schema.split_prompt(ids, self.config, "messages" if chat else "prompt")
        rid = request[REQUEST_ID]
        seed = params.seed if params.seed is not None else secrets.randbits(schema.SEED_BITS)
        echo = (text or str(loaded.tokenizer.decode(ids))) if params.echo else ""
        kind = "chatcmpl" if chat else "cmpl"
        if self._token_bytes is None or self._token_bytes.tokenizer is not loaded.tokenizer:
            self._token_bytes = TokenBytes(loaded.tokenizer)  # one per model: its cache is bounded by the vocabulary
        reply = Reply(
            f"{kind}-{rid}",
            self.model_id(),
            chat,
            len(ids),
            loaded.tokenizer,
            seed,
            echo,
            include_usage=params.include_usage,
            token_bytes=self._token_bytes,
        )
        generate = schema.generate_request(rid, context, question, params, seed)
        items = self.servicer.generate_items(generate, self.config.default_timeout_s, _Caller(request), received, params.extras)
        with structlog.contextvars.bound_contextvars(request_id=rid):
            async with contextlib.aclosing(items):
                first = await anext(items)  # errors before any output keep their HTTP status
                if params.stream:
                    return await self._stream(request, reply, params, first, items)
                return await self._whole(request, reply, params, first, items)

    async def _whole(self, request: web.Request, reply: Reply, params: schema.Params, first, items) -> web.Response:
        item = first
        while item is not None:  # to the result, past a stop string too (the pipeline ends there: finished, not cancelled)
            if isinstance(item, TokenOut):
                reply.take(item)
            elif isinstance(item, GenerateResult):
                reply.end(item)
            item = await anext(items, None)
        body = reply.whole(params.return_token_ids, params.logprobs is not None)
        return web.json_response(body, headers={"x-request-id": request[REQUEST_ID]})

    async def _stream(self, request: web.Request, reply: Reply, params: schema.Params, first, items) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "x-request-id": request[REQUEST_ID]}
        )
        await response.prepare(request)
        if reply.chat:
            await response.write(sse(reply.chunk("", [] if params.return_token_ids else None, role=True)))
        if reply.echo:
            await response.write(sse(reply.chunk(reply.echo, None)))
        item: Any = first
        try:
            while item is not None:
                if isinstance(item, TokenOut):
                    text = reply.take(item)  # (the pipeline sends nothing past a stop string: request.ending)
                    if text or item.logprobs or (item.ids and params.return_token_ids):
                        ids = item.ids if params.return_token_ids else None
                        await response.write(sse(reply.chunk(text, ids, item.logprobs)))
                elif isinstance(item, GenerateResult):
                    rest = reply.end(item)
                    await response.write(sse(reply.chunk(rest or None, None, None, reply.finish_reason)))
                item = await anext(items, None)
            if params.include_usage:
                await response.write(sse(reply.usage_chunk()))
        except ConnectionError:  # the client went away: nothing to write to
            raise
        except Exception as exc:  # after the headers went out: the error as a chunk, as vLLM does
            if not isinstance(exc, ServiceError):  # never a second response inside the stream's body
                log.error("http.stream_failed", error=f"{type(exc).__name__}: {str(exc)[:300]}")
                exc = ServiceError("internal error")
            request[STREAM_ERROR] = exc
            await response.write(sse(error_body(exc, request[REQUEST_ID])[1]))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
