"""The consumer's OpenAI-compatible HTTP port (consumer.api.openai_api) on a real producer/consumer
pair: /v1/completions and /v1/chat/completions, streaming and not, answer with the same tokens as
gRPC Generate for the same prompt and mode (greedy, float32); /v1/models; bad input answers
OpenAI's error JSON with the right status and the field named. Plain HTTP (aiohttp's client) and
the official `openai` Python client (chat.completions.create and completions.create, streamed or
not: the same token ids as gRPC Generate)."""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest
import trustme

from consumer.api import openai_chat
from consumer.api import openai_schema as schema
from consumer.engine.decoding import StopText
from consumer.server import ConsumerServer
from shared.config import ConsumerConfig
from shared.errors import InvalidArgument
from tests.conftest import Pair, prompt, running_pair
from tests.http_api import post, stream, url

PROMPT = "the quick brown fox jumps over the lazy dog while the farmer counts his sheep in the morning light " * 2
NEW = 8


@pytest.fixture(scope="module")
async def pair() -> AsyncIterator[Pair]:
    async with running_pair("tiny-llama", consumer_kw={"http_port": 0, "chunk_tokens": 32}) as p:
        yield p


async def grpc_answer(pair: Pair, text: str, special: bool, mode: str) -> tuple[list[int], list[int], str]:
    """(prompt ids, generated ids, text) of gRPC Generate on the HTTP API's split of `text`."""
    ids = pair.consumer.servicer.loaded.tokenizer(text, add_special_tokens=special)["input_ids"]
    context, question = schema.split_prompt(ids, pair.consumer.config, "prompt")
    out, answer, _ = await pair.generate(
        context=prompt(ids=context), question=prompt(ids=question), max_new_tokens=NEW, mode=mode
    )
    return ids, out, answer


@pytest.mark.numeric
@pytest.mark.parametrize("mode", ["oracle", "raw"])
async def test_completions_answer_as_grpc_generate(pair, mode):
    body = {
        "model": "tiny-llama",
        "prompt": PROMPT,
        "max_tokens": NEW,
        "temperature": 0,
        "scd_mode": mode,
        "return_token_ids": True,
    }
    status, reply = await post(pair, "/v1/completions", body)  # first: a raw context crosses the transfer here
    assert status == 200, reply
    ids, want, want_text = await grpc_answer(pair, PROMPT, True, mode)
    (choice,) = reply["choices"]
    assert choice["token_ids"] == want and choice["text"] == want_text
    assert reply["object"] == "text_completion" and choice["finish_reason"] in ("length", "stop")
    assert reply["usage"] == {"prompt_tokens": len(ids), "completion_tokens": len(want), "total_tokens": len(ids) + len(want)}
    assert reply["scd"]["mode"] == mode and reply["scd"]["context_tokens"] % 32 == 0
    assert (reply["scd"]["bytes_received"] > 0) == (mode == "raw") and len(want) == NEW
    events = await stream(pair, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    assert [t for c in chunks for t in c["choices"][0].get("token_ids", [])] == want
    assert "".join(c["choices"][0]["text"] for c in chunks) == want_text
    assert chunks[-1]["choices"][0]["finish_reason"] == choice["finish_reason"]
    assert events[-2]["usage"]["completion_tokens"] == len(want)


@pytest.mark.numeric
async def test_chat_completions_answer_as_grpc_generate(pair):
    messages = [{"role": "system", "content": "answer briefly"}, {"role": "user", "content": PROMPT}]
    rendered, special = openai_chat.render_chat({"messages": messages}, pair.consumer.servicer.loaded.tokenizer)
    assert rendered.endswith("assistant:") and special  # the tiny tokenizer has no chat template
    _, want, want_text = await grpc_answer(pair, rendered, special, "oracle")
    body = {"messages": messages, "max_tokens": NEW, "temperature": 0, "scd_mode": "oracle", "return_token_ids": True}
    status, reply = await post(pair, "/v1/chat/completions", body)
    assert status == 200, reply
    (choice,) = reply["choices"]
    assert reply["object"] == "chat.completion" and choice["message"] == {"role": "assistant", "content": want_text}
    assert choice["token_ids"] == want
    events = await stream(pair, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]" and events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    assert "".join(d.get("content") or "" for d in deltas) == want_text
    assert [t for e in events[:-1] for t in e["choices"][0].get("token_ids", [])] == want


async def test_a_stop_string_ends_the_text_before_it(pair):
    body = {"prompt": PROMPT, "max_tokens": NEW, "temperature": 0, "scd_mode": "oracle"}
    _, whole = await post(pair, "/v1/completions", body)
    text = whole["choices"][0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    if not stop.strip():
        pytest.skip("the greedy answer has no printable middle to stop at")
    _, stopped = await post(pair, "/v1/completions", {**body, "stop": [stop]})
    assert stopped["choices"][0]["text"] == text[: text.find(stop)]
    assert stopped["choices"][0]["finish_reason"] == "stop"
    events = await stream(pair, "/v1/completions", {**body, "stop": stop})
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == text[: text.find(stop)]


async def test_models_lists_the_served_model(pair):
    async with aiohttp.ClientSession() as session, session.get(url(pair, "/v1/models")) as r:
        assert r.status == 200
        listing = await r.json()
    assert [m["id"] for m in listing["data"]] == [pair.consumer.servicer.loaded.info.model_id]
    assert listing["object"] == "list"


@pytest.mark.parametrize(
    "path, body, status, param, named",
    [
        ("/v1/completions", {"prompt": "hi there", "max_tokens": 100000}, 400, "max_tokens", "limit max_new_tokens 512"),
        ("/v1/completions", {"prompt": "hi there", "temperature": -1}, 400, "temperature", "[0, 10]"),
        ("/v1/completions", {"prompt": "hi there", "n": 2}, 400, "n", "n = 1"),
        ("/v1/completions", {"prompt": 7}, 400, "prompt", "non-empty string"),
        ("/v1/completions", {"prompt": "hi there", "stop": [1]}, 400, "stop", "string"),
        ("/v1/completions", {"prompt": "hi there", "scd_mode": "nope"}, 400, "scd.mode", "unknown codec"),
        ("/v1/completions", {"prompt": "hi there", "model": "gpt-4"}, 404, "model", "not served here"),
        ("/v1/completions", "{not json", 400, "body", "not valid JSON"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages", "non-empty list"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            400,
            "messages[0].content[0]",
            "text",
        ),
        ("/v1/completions", {"prompt": "word " * 9000}, 400, "prompt", "limit max_context_tokens 8192"),
        ("/v1/completions", {"prompt": "x" * (3 << 20)}, 413, "body", "--max-text-bytes"),
    ],
)
async def test_bad_input_is_an_openai_error_naming_the_field(pair, path, body, status, param, named):
    got, reply = await post(pair, path, body)
    assert got == status, reply
    error = reply["error"]
    assert error["param"] == param and named in error["message"], error
    assert error["type"] == "invalid_request_error"


async def test_admission_is_shared_with_grpc(pair):
    admission = pair.consumer.servicer.admission
    admission.inflight += admission.limit  # as if max_inflight gRPC calls were running
    try:
        status, reply = await post(pair, "/v1/completions", {"prompt": "hi there", "max_tokens": 2})
    finally:
        admission.inflight -= admission.limit
    assert status == 429 and "max_inflight 64" in reply["error"]["message"]
    assert reply["error"]["type"] == "rate_limit_error" and reply["error"]["code"] == "resource_exhausted"
    admission.draining = True  # as during a SIGTERM drain
    try:
        status, reply = await post(pair, "/v1/completions", {"prompt": "hi there", "max_tokens": 2})
    finally:
        admission.draining = False
    assert status == 503 and "draining" in reply["error"]["message"]


async def test_the_grpc_bearer_token_guards_the_http_port_too():
    async with running_pair("tiny-llama", consumer_kw={"http_port": 0, "token": "s3cret"}) as pair:
        address = f"http://127.0.0.1:{pair.consumer.http_port}/v1/models"
        async with aiohttp.ClientSession() as session:
            async with session.get(address) as r:
                assert r.status == 401 and (await r.json())["error"]["type"] == "authentication_error"
            async with session.get(address, headers={"Authorization": "Bearer s3cret"}) as r:
                assert r.status == 200


async def test_the_http_port_speaks_the_api_ports_tls_and_is_503_while_loading(tmp_path):
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    ca.cert_pem.write_to_path(tmp_path / "ca.pem")
    cert.private_key_pem.write_to_path(tmp_path / "server.key")
    (tmp_path / "server.pem").write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    tls = dict(tls_cert=str(tmp_path / "server.pem"), tls_key=str(tmp_path / "server.key"))
    consumer = ConsumerServer(ConsumerConfig(port=0, http_port=0, model="tiny-llama", device="cpu", drain_grace_s=0.1, **tls))
    await consumer.start()  # ports open, the model not loaded
    try:
        trusted = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
        async with aiohttp.ClientSession() as session:
            async with session.get(f"https://127.0.0.1:{consumer.http_port}/v1/models", ssl=trusted) as r:
                assert r.status == 503 and "loading" in (await r.json())["error"]["message"]
            with pytest.raises(aiohttp.ClientError):
                async with session.get(f"http://127.0.0.1:{consumer.http_port}/v1/models") as r:
                    await r.read()
    finally:
        await consumer.stop()


def test_the_prompt_split_keeps_whole_chunks_as_the_context():
    cfg = ConsumerConfig(chunk_tokens=32, max_question_tokens=40, max_context_tokens=100)
    assert [len(p) for p in schema.split_prompt(list(range(70)), cfg, "prompt")] == [64, 6]
    assert [len(p) for p in schema.split_prompt(list(range(64)), cfg, "prompt")] == [32, 32]
    assert [len(p) for p in schema.split_prompt(list(range(10)), cfg, "prompt")] == [9, 1]
    with pytest.raises(InvalidArgument, match="prompt: 1 token"):
        schema.split_prompt([5], cfg, "prompt")
    with pytest.raises(InvalidArgument, match="limit max_context_tokens 100"):
        schema.split_prompt(list(range(200)), cfg, "prompt")


def test_stop_text_holds_back_what_could_begin_a_stop_string():
    stop = StopText(["END"])
    assert stop.push("abcE") == "ab" and stop.push("N") == "c" and not stop.hit
    assert stop.push("Dxyz") == "" and stop.hit


async def test_without_scd_mode_the_consumers_default_mode_answers(pair):
    status, reply = await post(pair, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "temperature": 0})
    assert status == 200 and reply["usage"]["completion_tokens"] == 2
    assert reply["scd"]["mode"] in pair.consumer.servicer.codecs or reply["scd"]["mode"] == "oracle"


def sdk(pair: Pair) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url(pair, "/v1"), api_key="unused", max_retries=0)


def token_ids(choice) -> list[int]:
    """vLLM's return_token_ids extension: an extra field the SDK keeps on the choice."""
    return list((choice.model_extra or {}).get("token_ids") or [])


@pytest.mark.numeric
async def test_the_openai_client_answers_as_grpc_generate(pair):
    client = sdk(pair)
    model = pair.consumer.servicer.loaded.info.model_id
    extra = {"scd_mode": "oracle", "return_token_ids": True}
    _, want, want_text = await grpc_answer(pair, PROMPT, True, "oracle")
    reply = await client.completions.create(model=model, prompt=PROMPT, max_tokens=NEW, temperature=0, extra_body=extra)
    assert token_ids(reply.choices[0]) == want and reply.choices[0].text == want_text
    assert reply.usage is not None and reply.usage.completion_tokens == len(want)
    streamed = await client.completions.create(
        model=model, prompt=PROMPT, max_tokens=NEW, temperature=0, stream=True, extra_body=extra
    )
    pieces = [c async for c in streamed]
    assert [t for c in pieces if c.choices for t in token_ids(c.choices[0])] == want
    assert "".join(c.choices[0].text for c in pieces if c.choices) == want_text

    messages = [{"role": "system", "content": "answer briefly"}, {"role": "user", "content": PROMPT}]
    rendered, special = openai_chat.render_chat({"messages": messages}, pair.consumer.servicer.loaded.tokenizer)
    _, want, want_text = await grpc_answer(pair, rendered, special, "oracle")
    chat = await client.chat.completions.create(model=model, messages=messages, max_tokens=NEW, temperature=0, extra_body=extra)
    assert token_ids(chat.choices[0]) == want and chat.choices[0].message.content == want_text
    assert chat.choices[0].message.role == "assistant"
    streamed_chat = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=NEW, temperature=0, stream=True, extra_body=extra
    )
    deltas = [c async for c in streamed_chat]
    assert [t for c in deltas if c.choices for t in token_ids(c.choices[0])] == want
    assert "".join(c.choices[0].delta.content or "" for c in deltas if c.choices) == want_text
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="gpt-4", prompt="hi there", max_tokens=2)
    await client.close()
