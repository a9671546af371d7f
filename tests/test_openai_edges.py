"""Edges of the OpenAI-compatible endpoint a hostile review found, on a real pair over HTTP: a
temperature so small that logits / temperature overflow is greedy (and one row's failed sampling
never fails the batch it rode in), an error after a stream's headers is an SSE event then
`[DONE]` (never a second HTTP response inside the body), a body that is not UTF-8 is 400, a
top_p below float32's range keeps the top token only, every max-tokens field given is checked,
and log-probabilities' `bytes` and `text_offset` follow tokens that split a character."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from consumer.api import openai_reply
from consumer.api.openai_chat import read_messages
from consumer.api.token_bytes import CharOffsets, TokenBytes
from consumer.engine.decoding import TokenLogprobs
from shared.models import load_model
from tests.conftest import running_pair
from tests.http_api import is_openai_error, post, stream, url

PROMPT = "the quick brown fox jumps over the lazy dog while the farmer counts his sheep"


@pytest.fixture(scope="module")
async def pair():
    async with running_pair("tiny-llama", consumer_kw={"http_port": 0}) as p:
        yield p


def body(**fields) -> dict:
    return {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "scd": {"mode": "oracle"}, "return_token_ids": True, **fields}


async def test_a_temperature_too_small_to_divide_by_is_greedy_and_fails_no_other_request(pair):
    status, greedy = await post(pair, "/v1/completions", body())
    assert status == 200, greedy
    long = post(pair, "/v1/completions", body(max_tokens=200))
    tiny = [post(pair, "/v1/completions", body(temperature=t, seed=s)) for t, s in ((1e-40, 1), (1e-6, 2), (1e-30, 3))]
    results = await asyncio.gather(long, *tiny)
    assert all(status == 200 for status, _ in results), results
    for _, reply in results[1:]:
        assert reply["choices"][0]["token_ids"] == greedy["choices"][0]["token_ids"]


async def test_an_error_after_the_headers_is_an_event_then_done(pair, monkeypatch):
    take = openai_reply.Reply.take
    calls = {"n": 0}

    def failing(self, item):  # a fault inside the server's own formatting, after the first token
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected")
        return take(self, item)

    monkeypatch.setattr(openai_reply.Reply, "take", failing)
    events = await stream(pair, "/v1/completions", body(max_tokens=8))  # aiohttp reads the chunked body whole
    assert events[-1] == "[DONE]" and is_openai_error(events[-2]), events
    assert events[-2]["error"]["message"] == "internal error"
    monkeypatch.setattr(openai_reply.Reply, "take", take)
    status, reply = await post(pair, "/v1/completions", body())
    assert status == 200, reply


async def test_a_body_that_is_not_utf8_is_400_and_a_utf8_bom_is_read(pair):
    text = '{"prompt": "a \\ud800 b", "max_tokens": 2}'
    for encoding in ("utf-16", "utf-32", "utf-16-le"):
        status, reply = await post(pair, "/v1/completions", text.encode(encoding))
        assert status == 400 and reply["error"]["param"] == "body", (encoding, reply)
    status, reply = await post(pair, "/v1/completions", text.encode())  # UTF-8: the lone surrogate is named
    assert status == 400 and reply["error"]["param"] == "prompt", reply
    status, reply = await post(pair, "/v1/completions", '\ufeff{"prompt": "hello", "max_tokens": 2}'.encode())
    assert status == 200, reply


async def test_a_top_p_below_float32s_range_keeps_the_top_token_only(pair):
    status, greedy = await post(pair, "/v1/completions", body())
    for seed in range(3):
        status, reply = await post(pair, "/v1/completions", body(temperature=1.0, top_p=1e-46, seed=seed))
        assert status == 200 and reply["choices"][0]["token_ids"] == greedy["choices"][0]["token_ids"], reply


@pytest.mark.parametrize("value", ["lots", -5, 10**9])
async def test_every_max_tokens_field_given_is_checked(pair, value):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3, "max_tokens": value}
    status, reply = await post(pair, "/v1/chat/completions", chat)
    assert status == 400 and reply["error"]["param"] == "max_tokens", reply


async def test_a_bad_keep_option_names_its_field(pair):
    status, reply = await post(pair, "/v1/completions", body(scd={"mode": "raw", "options": {"keep": "bogus"}}))
    assert status == 400 and reply["error"]["param"] == "scd.options['keep']", reply


async def test_the_stream_framing_survives_a_client_reading_slowly(pair):
    async with aiohttp.ClientSession() as session:
        async with session.post(url(pair, "/v1/completions"), json={**body(max_tokens=4), "stream": True}) as r:
            await asyncio.sleep(0.2)
            raw = await r.read()
    assert raw.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize("model", ["tiny-llama", "smollm2-135m"])
def test_token_bytes_join_into_the_text_and_offsets_point_at_characters(model):
    try:
        tokenizer = load_model(model, "float32", "cpu").tokenizer
    except (FileNotFoundError, OSError) as exc:  # the real pair: make real-model
        pytest.skip(f"{model}: {exc}")
    text = "é€ 日本 x ça"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    token_bytes = TokenBytes(tokenizer)
    assert token_bytes.byte_level
    assert b"".join(token_bytes.of(i) for i in ids) == text.encode()
    assert any(len(tokenizer.decode([i]).encode()) != len(token_bytes.of(i)) for i in ids)  # some token splits a character
    offsets = CharOffsets(0, token_bytes)
    at = [offsets.next(i) for i in ids]
    assert at == sorted(at) and at[0] == 0 and offsets.chars == len(text)
    for n, offset in enumerate(at):  # each offset: the characters whole before the token
        assert offset == len(b"".join(token_bytes.of(j) for j in ids[:n]).decode("utf-8", "ignore"))
    # the reply's formatting: chat `bytes` join into the text; completions' offsets start after the echo
    records = [TokenLogprobs(i, -0.5, ((i, -0.5),)) for i in ids]
    chat = openai_reply.Reply("c", "m", True, 1, tokenizer, 0)
    content = chat.format_logprobs(records)["content"]
    assert bytes(b for entry in content for b in entry["bytes"]) == text.encode()
    completion = openai_reply.Reply("c", "m", False, 1, tokenizer, 0, echo="ab")
    first, rest = completion.format_logprobs(records[:3]), completion.format_logprobs(records[3:])
    assert first["text_offset"] + rest["text_offset"] == [2 + a for a in at]


def test_text_parts_of_one_message_are_joined_by_newlines_as_vllm_joins_them():
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    (message,) = read_messages({"messages": [{"role": "user", "content": parts}]})
    assert message == {"role": "user", "content": "first\nsecond"}
    (one,) = read_messages({"messages": [{"role": "user", "content": parts[:1]}]})
    assert one["content"] == "first"
