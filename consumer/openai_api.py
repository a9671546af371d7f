"""OpenAI-compatible HTTP beside the consumer's gRPC port (`--http-port`): GET /v1/models, POST
/v1/completions and /v1/chat/completions, streaming (server-sent events, `data: {json}` ... `data:
[DONE]`) or not.

Thin: a body becomes a GenerateRequest (consumer.openai_schema), which runs through the
servicer's `generate_items`: the same admission (--max-inflight), job builder (limits, auto) and
pipeline as gRPC Generate, in the same process and on the same engine. Errors become OpenAI's
error JSON ({"error": {message, type, param, code}}) with the HTTP status of their code (400
invalid, 401 token, 404 unknown model, 429 resource exhausted, 503 unavailable, 504 deadline).
The same bearer token and TLS as the gRPC port (--token/--token-file, --tls-cert/--tls-key,
--tls-client-ca). aiohttp: asyncio-native, so it shares the gRPC server's event loop with no
thread hop; a server and a client in one well-kept library.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import ssl
import time
import uuid
from typing import Any

import structlog
from aiohttp import web

from consumer import openai_schema as schema
from consumer.request import Commit, GenerateResult, TokenOut
from shared import logs, security, serving
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
REQUEST_ID = web.RequestKey("request_id", str)  # the caller's x-request-id, or a fresh one
TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    429: "rate_limit_error",
}


class NotFound(ServiceError):
    code = "NOT_FOUND"


class Unauthenticated(ServiceError):
    code = "UNAUTHENTICATED"


def error_body(exc: Exception, request_id: str = "") -> tuple[int, dict[str, Any]]:
    """(HTTP status, OpenAI error JSON) of an exception; anything not a ServiceError is 500."""
    if not isinstance(exc, ServiceError):
        return 500, {
            "error": {
                "message": f"internal error (request_id={request_id})",
                "type": "server_error",
                "param": None,
                "code": "internal",
            }
        }
    status = STATUS.get(exc.code, 500)
    param, message = schema.param_of(serving.public_text(str(exc)[:2000]))
    code = "model_not_found" if isinstance(exc, NotFound) else exc.code.lower()
    return status, {"error": {"message": message, "type": TYPES.get(status, "server_error"), "param": param, "code": code}}


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class _Caller:
    """What shared.outcomes asks of a caller: whether it went away (the connection closed)."""

    def __init__(self, request: web.Request):
        self.request = request

    def cancelled(self) -> bool:
        transport = self.request.transport
        return transport is None or transport.is_closing()


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
    """The HTTP app over a ConsumerServicer (duck-typed: consumer.server imports this module)."""

    def __init__(self, servicer: Any, config: ConsumerConfig):
        self.servicer, self.config = servicer, config
        self.token = security.load_token(config.token, config.token_file)
        self.started = int(time.time())
        self.max_body = 2 * config.max_text_bytes + (64 << 10)  # a prompt's text, JSON-escaped, and the other fields
        self.app = web.Application(middlewares=[self._errors], client_max_size=self.max_body)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_post("/v1/chat/completions", self.chat_completions)
        self.runner: web.AppRunner | None = None
        self.port = -1

    async def start(self) -> int:
        """Listen on --http-port (0: any free port); returns the bound port."""
        self.runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
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

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        rid = request.headers.get("x-request-id", "") or uuid.uuid4().hex
        request[REQUEST_ID] = rid
        try:
            if self.token and not self._authorized(request):
                raise Unauthenticated("authorization: missing or invalid bearer token (header 'Authorization: Bearer <token>')")
            return await handler(request)
        except web.HTTPException:
            raise
        except Exception as exc:
            status, body = error_body(exc, rid)
            if status == 500:
                log.error("http.internal_error", path=request.path, error=f"{type(exc).__name__}: {str(exc)[:500]}", exc_info=exc)
            else:
                log.info("http.error", path=request.path, status=status, reason=body["error"]["message"][:500])
            return web.json_response(body, status=status, headers={"x-request-id": rid})

    def _authorized(self, request: web.Request) -> bool:
        got = request.headers.get("Authorization", "").encode()
        return hmac.compare_digest(got, f"Bearer {self.token}".encode())

    def _loaded(self) -> LoadedModel:
        if self.servicer.loaded is None:
            raise Unavailable("consumer model is still loading")
        return self.servicer.loaded

    def model_id(self) -> str:
        return self._loaded().info.model_id

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self.model_id(), "object": "model", "created": self.started, "owned_by": "scd"}
        return web.json_response({"object": "list", "data": [card]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise InvalidArgument(f"body: not valid JSON ({exc})") from None
        except web.HTTPRequestEntityTooLarge:
            raise InvalidArgument(f"body: > limit {self.max_body} bytes (2 x max_text_bytes + 64 KiB)") from None
        if not isinstance(body, dict):
            raise InvalidArgument("body: must be a JSON object")
        return body

    async def _prompt_ids(self, body: dict[str, Any], chat: bool) -> list[int]:
        cfg, loaded = self.config, self._loaded()
        field = "messages" if chat else "prompt"
        if chat:
            text, special = schema.render_chat(body, loaded.tokenizer)
            prompt: str | list[int] = text
        else:
            prompt, special = schema.read_prompt(body), True
        if isinstance(prompt, list):
            bad = next((t for t in prompt if t >= loaded.info.vocab_size), None)
            if bad is not None:
                raise InvalidArgument(f"prompt: token id {bad} >= vocab_size {loaded.info.vocab_size}")
            return prompt
        size = len(prompt.encode("utf-8", "surrogatepass"))
        if size > cfg.max_text_bytes:
            raise InvalidArgument(f"{field}: {size} bytes > limit max_text_bytes {cfg.max_text_bytes}")
        return await self.servicer.jobs.tokenize(prompt, special)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        received = time.perf_counter()
        body = await self._body(request)
        model = body.get("model")
        if model is not None and model not in (self.model_id(), self.config.model):
            raise NotFound(f"model: {str(model)[:128]!r} is not served here; GET /v1/models lists {self.model_id()!r}")
        params = schema.read_params(body, self.config, chat)
        with self.servicer.admission.slot():  # full or draining: refused now (429, 503), before tokenizing
            pass
        ids = await self._prompt_ids(body, chat)
        context, question = schema.split_prompt(ids, self.config, "messages" if chat else "prompt")
        rid = request[REQUEST_ID]
        reply = schema.Reply(f"{'chatcmpl' if chat else 'cmpl'}-{rid}", self.model_id(), chat, len(ids))
        generate = schema.generate_request(rid, context, question, params)
        items = self.servicer.generate_items(generate, self.config.default_timeout_s, _Caller(request), received)
        with structlog.contextvars.bound_contextvars(request_id=rid):
            async with contextlib.aclosing(items):
                first = await anext(items)  # errors before any output keep their HTTP status
                if params.stream:
                    return await self._stream(request, reply, params, first, items)
                return await self._whole(request, reply, params, first, items)

    async def _whole(self, request: web.Request, reply: schema.Reply, params: schema.Params, first, items) -> web.Response:
        stop = schema.StopText(params.stop)
        item = first
        while True:
            if isinstance(item, TokenOut):
                reply.ids += item.ids
                reply.text += stop.push(item.text)
            elif isinstance(item, GenerateResult):
                reply.result, reply.finish_reason = item, item.finish_reason
            if stop.hit:
                reply.finish_reason = "stop"
                break
            item = await anext(items, None)
            if item is None:
                break
        reply.text += "" if stop.hit else stop.flush()
        return web.json_response(reply.whole(params.return_token_ids), headers={"x-request-id": request[REQUEST_ID]})

    async def _stream(self, request: web.Request, reply: schema.Reply, params: schema.Params, first, items) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "x-request-id": request[REQUEST_ID]}
        )
        await response.prepare(request)
        stop = schema.StopText(params.stop)
        if reply.chat:
            await response.write(sse(reply.chunk("", [] if params.return_token_ids else None, role=True)))
        item: TokenOut | Commit | GenerateResult | None = first
        try:
            while item is not None:
                if isinstance(item, TokenOut):
                    reply.ids += item.ids
                    text = stop.push(item.text)
                    if text or (item.ids and params.return_token_ids):
                        await response.write(sse(reply.chunk(text, item.ids if params.return_token_ids else None)))
                elif isinstance(item, GenerateResult):
                    reply.finish_reason = item.finish_reason
                if stop.hit:
                    reply.finish_reason = "stop"
                    break
                item = await anext(items, None)
            rest = "" if stop.hit else stop.flush()
            await response.write(sse(reply.chunk(rest or None, None, reply.finish_reason)))
            if params.include_usage:
                await response.write(sse(reply.usage_chunk()))
        except ServiceError as exc:  # after the headers went out: the error as a chunk, as vLLM does
            await response.write(sse(error_body(exc, request[REQUEST_ID])[1]))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
