"""The consumer's HTTP port as HTTP, on real servers (port 0, aiohttp's client and raw sockets):
every non-2xx answer on /v1/ is OpenAI's error JSON (unknown route, wrong method, a body over the
limit, a header over the parser's limit, a malformed request, JSON nested 100,000 deep); random
and malformed bodies never get a 5xx; the served model name everywhere instead of a path; HTTP
requests in the gRPC metric families; the bearer scheme in any case and the `auth.rejected`
warning; /health and /ready by the gRPC health rule; slow bodies bounded (429 past --max-inflight
being read, 408 at the deadline); a lone surrogate anywhere is 400 naming its field."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import grpc
import pytest
import structlog
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest

from consumer.api import openai_api
from consumer.api import openai_schema as schema
from consumer.server import ConsumerServer
from shared import rpc_errors, tiny
from shared.config import ConsumerConfig
from shared.pb import consumer_pb2
from tests.conftest import Pair, running_pair
from tests.http_api import is_openai_error, url


@pytest.fixture(scope="module")
async def pair():
    async with running_pair("tiny-llama", consumer_kw={"http_port": 0, "max_new_tokens": 4}) as p:
        yield p


async def call(pair: Pair, method: str, path: str, data: bytes | str | None = None, headers=None) -> tuple[int, dict, dict]:
    async with aiohttp.ClientSession() as session, session.request(method, url(pair, path), data=data, headers=headers) as r:
        assert r.headers["Content-Type"].startswith("application/json"), (r.status, await r.text())
        return r.status, await r.json(), dict(r.headers)


@pytest.mark.parametrize(
    "method, path, data, status",
    [
        ("GET", "/v1/nowhere", None, 404),
        ("POST", "/v1/embeddings", "{}", 404),
        ("GET", "/v1/completions", None, 405),
        ("DELETE", "/v1/models", None, 405),
        ("POST", "/v1/completions", "[" * 100_000 + "]" * 100_000, 400),
        ("POST", "/v1/completions", '{"prompt": ' + "[" * 40 + "1" + "]" * 40 + "}", 400),
        ("POST", "/v1/completions", '{"prompt": "hi", "seed": ' + "9" * 5000 + "}", 400),
        ("POST", "/v1/completions", b"\xff\xfe{", 400),
        ("POST", "/v1/completions", "x" * (3 << 20), 413),
        ("GET", "/v1/models/gpt-4", None, 404),
    ],
)
async def test_every_error_on_v1_is_openais_shape(pair, method, path, data, status):
    got, body, _ = await call(pair, method, path, data)
    assert got == status and is_openai_error(body), body


async def test_a_deeply_nested_body_names_the_limit(pair):
    got, body, _ = await call(pair, "POST", "/v1/completions", '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert got == 400 and body["error"]["param"] == "body" and f"limit {schema.MAX_DEPTH}" in body["error"]["message"]


async def test_the_wrong_method_says_which_are_allowed(pair):
    _, body, headers = await call(pair, "GET", "/v1/chat/completions")
    assert headers["Allow"] == "POST" and body["error"]["type"] == "invalid_request_error"


async def raw_request(pair: Pair, head: bytes, body: bytes = b"") -> tuple[bytes, dict]:
    """(status line, JSON) of bytes sent as they are on a connection of their own."""
    reader, writer = await asyncio.open_connection("127.0.0.1", pair.consumer.http_port)
    writer.write(head + body)
    await writer.drain()
    raw = await reader.read()
    writer.close()
    headers, _, payload = raw.partition(b"\r\n\r\n")
    assert b"application/json" in headers, raw[:300]
    return headers.split(b"\r\n")[0], json.loads(payload)


async def test_a_header_over_the_limit_and_a_malformed_request_are_openai_errors(pair):
    got, body, _ = await call(pair, "GET", "/v1/models", headers={"X-Big": "a" * 200_000})
    assert got == 431 and is_openai_error(body) and body["error"]["param"] == "headers"
    status, body = await raw_request(pair, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nBad Header Line\r\n\r\n")
    assert status.endswith(b" 400 Bad Request") and is_openai_error(body)
    got, _, _ = await call(pair, "GET", "/v1/models")  # the server serves on
    assert got == 200


POST = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"


async def test_a_client_gone_while_its_body_arrives_is_a_499_without_a_traceback(pair, caplog):
    """Headers and half the declared body, then the connection closed: aiohttp's "Error handling
    request" with two plain-text tracebacks was written for each (an ordinary cancel); it is a 499
    and one info line."""
    before = counted(pair, "scd_rpc_total", code="499", method="POST /v1/completions")
    with caplog.at_level("INFO"):
        for _ in range(2):
            reader, writer = await asyncio.open_connection("127.0.0.1", pair.consumer.http_port)
            writer.write(POST + b"Content-Length: 100\r\n\r\n" + b'{"prompt": "hi"')
            await writer.drain()
            await asyncio.sleep(0.1)
            writer.close()
        for _ in range(100):
            if counted(pair, "scd_rpc_total", code="499", method="POST /v1/completions") == before + 2:
                break
            await asyncio.sleep(0.05)
    assert counted(pair, "scd_rpc_total", code="499", method="POST /v1/completions") == before + 2
    assert not [r for r in caplog.records if r.levelname == "ERROR"], [r.getMessage() for r in caplog.records]
    got, _, _ = await call(pair, "GET", "/v1/models")
    assert got == 200


def counted(pair: Pair, name: str, **labels) -> float:
    return pair.consumer.server.metrics.registry.get_sample_value(name, labels) or 0.0


async def test_bodies_being_read_are_bounded_and_a_stalled_one_times_out():
    """Before admission counts them, at most --max-inflight requests read their bodies: many slow
    senders hold bounded memory (the rest get 429 at once), and a body that stalls gets 408 at the
    default deadline, freeing its place."""
    kw = {"http_port": 0, "max_inflight": 2, "default_timeout_s": 1.5, "max_new_tokens": 4}
    async with running_pair("tiny-llama", consumer_kw=kw) as pair:
        stalled = []
        for _ in range(2):
            reader, writer = await asyncio.open_connection("127.0.0.1", pair.consumer.http_port)
            writer.write(POST + b"Content-Length: 100\r\n\r\n" + b'{"prompt": "hi"')  # the rest never comes
            await writer.drain()
            stalled.append((reader, writer))
        await asyncio.sleep(0.3)  # both are being read
        got, body, _ = await call(pair, "POST", "/v1/completions", '{"prompt": "hi there", "max_tokens": 2}')
        assert got == 429 and body["error"]["param"] == "body" and ">= max_inflight 2" in body["error"]["message"], body
        for reader, writer in stalled:
            raw = await asyncio.wait_for(reader.read(4096), 10)  # (aiohttp then drops what else comes, 10 s at most)
            writer.close()
            assert raw.startswith(b"HTTP/1.1 408") and b"body: not received within 1.5 s" in raw, raw[:300]
        got, body, _ = await call(pair, "POST", "/v1/completions", '{"prompt": "hi there", "max_tokens": 2}')
        assert got == 200, body


async def test_open_connections_are_bounded_and_a_silent_one_closes(monkeypatch):
    """Past --max-connections a new connection gets a 503 naming the limit and is closed; one that
    never finishes its first request's headers is closed at the keep-alive timeout (aiohttp's own
    default held it an hour: 5000 such connections stayed open); then requests are served again."""
    monkeypatch.setattr(openai_api, "KEEPALIVE_S", 1.5)
    kw = {"http_port": 0, "max_connections": 3, "max_new_tokens": 4}
    async with running_pair("tiny-llama", consumer_kw=kw) as pair:
        held = []
        for _ in range(3):
            reader, writer = await asyncio.open_connection("127.0.0.1", pair.consumer.http_port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # the headers never end
            await writer.drain()
            held.append((reader, writer))
        server = pair.consumer.http.runner.server
        while len(server.connections) < 3:  # all three accepted before the fourth comes
            await asyncio.sleep(0.01)
        reader, writer = await asyncio.open_connection("127.0.0.1", pair.consumer.http_port)
        refused = await asyncio.wait_for(reader.read(), 5)  # to EOF: the server closed it
        writer.close()
        assert refused.startswith(b"HTTP/1.1 503"), refused[:200]
        body = json.loads(refused.split(b"\r\n\r\n", 1)[1])
        assert is_openai_error(body) and "open >= limit max_connections 3" in body["error"]["message"], body
        for reader, writer in held:
            assert await asyncio.wait_for(reader.read(), 5) == b""  # closed at 1.5 s, no request ever came
            writer.close()
        got, body, _ = await call(pair, "POST", "/v1/completions", '{"prompt": "hi there", "max_tokens": 2}')
        assert got == 200, body


async def test_a_body_that_cannot_be_decoded_is_400_naming_body(pair):
    status, body = await raw_request(pair, POST + b"Content-Encoding: gzip\r\nContent-Length: 5\r\n\r\n", b"abcde")
    assert status.endswith(b" 400 Bad Request") and body["error"]["param"] == "body"


@pytest.mark.parametrize(
    "path, data, param",
    [
        ("/v1/completions", '{"prompt": "a \\ud800 b", "max_tokens": 2}', "prompt"),
        ("/v1/completions", b'{"prompt": "a \xed\xa0\x80", "max_tokens": 2}', "prompt"),  # json.loads passes surrogates
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages[0].content"),
        ("/v1/completions", '{"prompt": "hi", "stop": ["ok", "\\ud83d"], "max_tokens": 2}', "stop[1]"),
        ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "x\\ud800": 1}', None),  # a key: named in the message
    ],
)
async def test_a_lone_surrogate_is_400_naming_its_field(pair, path, data, param):
    got, body, _ = await call(pair, "POST", path, data)
    assert got == 400 and body["error"]["param"] == param and "lone surrogate" in body["error"]["message"], body


async def test_escaped_text_that_is_unicode_is_served(pair):
    got, body, _ = await call(pair, "POST", "/v1/completions", '{"prompt": "caf\\u00e9 \\ud83d\\ude00", "max_tokens": 2}')
    assert got == 200, body


async def test_a_request_id_that_is_not_printable_ascii_is_400_naming_it(pair):
    sent = b'{"prompt": "hi there", "max_tokens": 2}'
    status, body = await raw_request(pair, POST + b"x-request-id: \xff\xfe\r\nContent-Length: %d\r\n\r\n" % len(sent), sent)
    assert status.endswith(b" 400 Bad Request") and body["error"]["param"] == "x-request-id"


values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(1 << 70), 1 << 70),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(st.characters(exclude_categories=()), max_size=12),  # lone surrogates too
        st.sampled_from(["text", "none", "auto", "user", "assistant", "verified", "raw", "oracle", "stop"]),
    ),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=8,
)
fields = st.sampled_from(sorted(schema.CHAT | schema.COMPLETIONS | {"role", "content", "include_usage", "x"}))
messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "wizard"]), "content": values}), max_size=3
)
bodies = st.dictionaries(fields, values, max_size=6).flatmap(
    lambda d: st.one_of(
        st.just(d),
        st.fixed_dictionaries({"prompt": st.one_of(st.just("hello there"), values)}).map(lambda p: {**d, **p}),
        messages.map(lambda m: {**d, "messages": m}),
    )
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies, chat=st.booleans(), stream=st.booleans())
async def test_random_bodies_get_an_answer_or_a_client_error_never_5xx(pair, body, chat, stream):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {**body, "stream": stream} if stream and "stream" not in body else body
    async with aiohttp.ClientSession() as session, session.post(url(pair, path), data=json.dumps(body)) as r:
        text = await r.text()
    assert r.status < 500, (r.status, text[:500])
    if r.status >= 400:
        assert is_openai_error(json.loads(text)), text[:500]
    elif r.headers["Content-Type"].startswith("text/event-stream"):
        assert text.rstrip().endswith("data: [DONE]") and '"error"' not in text, text[-500:]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=300))
async def test_random_bytes_as_a_body_are_a_client_error(pair, raw):
    got, body, _ = await call(pair, "POST", "/v1/completions", raw)
    assert got == 400 and is_openai_error(body)


def scrape(pair: Pair) -> str:
    return generate_latest(pair.consumer.server.metrics.registry).decode()


def sample(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name}{{{want}}} in the metrics")


async def test_http_requests_are_counted_and_timed_in_the_rpc_families(pair):
    before = scrape(pair)
    seen = 'method="POST /v1/completions",code="200"' in before  # (the HELP text names the route too)
    ok = sample(before, "scd_rpc_total", method="POST /v1/completions", code="200") if seen else 0
    status, _, _ = await call(pair, "POST", "/v1/completions", json.dumps({"prompt": "hi there", "max_tokens": 2}))
    assert status == 200
    await call(pair, "POST", "/v1/completions", json.dumps({"prompt": "hi there", "n": 3}))
    await call(pair, "GET", "/v1/nowhere")
    await call(pair, "GET", "/health")
    after = scrape(pair)
    # >=: a request an earlier test of this module left finishing may land between the two scrapes
    assert sample(after, "scd_rpc_total", method="POST /v1/completions", code="200") >= ok + 1
    assert sample(after, "scd_rpc_total", method="POST /v1/completions", code="400") >= 1
    assert sample(after, "scd_rpc_total", method="GET unmatched", code="404") >= 1
    assert sample(after, "scd_rpc_duration_seconds_count", method="POST /v1/completions") >= ok + 2
    assert "/health" not in after  # probes are not requests, as gRPC health


async def test_health_is_live_and_ready_follows_the_grpc_rule(pair):
    assert (await call(pair, "GET", "/health"))[:2] == (200, {"status": "SERVING"})
    assert (await call(pair, "GET", "/ready"))[0] == 200
    await pair.consumer.server.set_not_ready("producer link unreachable: test")
    try:
        status, body, _ = await call(pair, "GET", "/ready")
        assert status == 503 and body["error"]["message"] == "producer link unreachable: test"
        assert (await call(pair, "GET", "/health"))[0] == 200
    finally:
        await pair.consumer.server.set_not_ready("")


async def test_probes_answer_while_loading_without_a_token():
    consumer = ConsumerServer(ConsumerConfig(port=0, http_port=0, model="tiny-llama", device="cpu", drain_grace_s=0.1, token="t"))
    await consumer.start()
    try:
        base = f"http://127.0.0.1:{consumer.http_port}"
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{base}/health") as r:
                assert r.status == 200
            async with session.get(f"{base}/ready") as r:
                assert r.status == 503 and "loading" in (await r.json())["error"]["message"]
    finally:
        await consumer.stop()


async def test_the_bearer_scheme_is_case_insensitive_and_a_refusal_is_the_auth_warning():
    async with running_pair("tiny-llama", consumer_kw={"http_port": 0, "token": "s3cret"}) as pair:
        address = url(pair, "/v1/models")
        async with aiohttp.ClientSession() as session:
            for scheme in ("Bearer", "bearer", "BEARER"):
                async with session.get(address, headers={"Authorization": f"{scheme} s3cret"}) as r:
                    assert r.status == 200, scheme
            with structlog.testing.capture_logs() as logged:
                async with session.get(address, headers={"Authorization": "bearer nope"}) as r:
                    assert r.status == 401 and is_openai_error(await r.json())
        (warning,) = [e for e in logged if e["event"] == "auth.rejected"]
        assert warning["log_level"] == "warning" and warning["why"] == "wrong bearer token"
        assert not [e for e in logged if e["event"] == "http.error"]
        metadata = (("authorization", "bearer s3cret"),)
        request = consumer_pb2.ConsumerServiceDescribeRequest()
        reply = await pair.stub.Describe(request, metadata=metadata, timeout=10)  # gRPC: the same rule
        assert reply.model.model_id == "tiny-llama"
        with pytest.raises(grpc.aio.AioRpcError):
            await pair.stub.Describe(request, metadata=(("authorization", "bearer wrong"),), timeout=10)


@pytest.mark.parametrize("served", ["", "my-model"])
async def test_the_served_model_name_is_the_same_everywhere_and_no_path(served):
    model_dir = str(tiny.ensure_tiny("tiny-llama"))  # an absolute path, as an operator may start it
    want = served or model_dir.rstrip("/").rsplit("/", 1)[-1]
    async with running_pair(model_dir, consumer_kw={"http_port": 0, "served_model_name": served}) as pair:
        _, listing, _ = await call(pair, "GET", "/v1/models")
        assert [m["id"] for m in listing["data"]] == [want]
        assert (await call(pair, "GET", f"/v1/models/{want}"))[1]["id"] == want
        describe = await pair.stub.Describe(consumer_pb2.ConsumerServiceDescribeRequest(), timeout=10)
        assert describe.model.model_id == want
        metrics = scrape(pair)
        assert f'model_name="{want}"' in metrics and model_dir not in metrics
        status, reply, _ = await call(
            pair, "POST", "/v1/completions", json.dumps({"prompt": "hi there", "max_tokens": 2, "model": want})
        )
        assert status == 200 and reply["model"] == want
        status, reply, _ = await call(pair, "POST", "/v1/completions", json.dumps({"prompt": "hi there", "model": model_dir}))
        assert status == 404 and reply["error"]["code"] == "model_not_found" and model_dir not in json.dumps(reply)
        assert f"GET /v1/models lists '{want}'" in reply["error"]["message"]


def test_the_path_scrubber_keeps_the_apis_routes():
    assert rpc_errors.public_text("GET /v1/models lists 'm'") == "GET /v1/models lists 'm'"
    assert rpc_errors.public_text("no file /models/checkpoints/qa-base here") == "no file qa-base here"
