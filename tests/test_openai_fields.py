"""Every field of OpenAI's completions and chat-completions request schemas, on a real pair over
HTTP: honoured (log-probabilities against the model's own logits, penalties and logit_bias against
a reference decode loop, seed, echo, stop ids and strings, top_k, max_completion_tokens,
stream_options, the `scd` extension with verified decoding) or answered 400 naming the field, as
OpenAI answers an unknown one. The field lists come from the `openai` client's own request types,
so a field the client learns is a test failure until it is honoured or refused here."""

from __future__ import annotations

import typing

import openai
import pytest
import torch
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from consumer.api import openai_schema as schema
from tests.conftest import Pair, running_pair
from tests.http_api import post, stream, url

PROMPT = "the quick brown fox jumps over the lazy dog while the farmer counts his sheep in the morning light " * 2
NEW = 8


@pytest.fixture(scope="module")
async def pair():
    async with running_pair("tiny-llama", consumer_kw={"http_port": 0, "chunk_tokens": 32}) as p:
        yield p


def greedy_body(**fields) -> dict:
    return {"prompt": PROMPT, "max_tokens": NEW, "temperature": 0, "scd": {"mode": "oracle"}, "return_token_ids": True, **fields}


def sdk_fields(typed_dict) -> set[str]:
    return set(typing.get_type_hints(typed_dict)) | {"stream"}


def test_every_field_of_the_clients_request_types_is_known_to_the_schema():
    """A field the `openai` client sends that this schema does not list would be refused as
    unrecognized: the lists are checked against the client's own types."""
    completions = sdk_fields(completion_create_params.CompletionCreateParamsBase)
    chat = sdk_fields(chat_create_params.CompletionCreateParamsBase)
    assert completions - schema.COMPLETIONS == set()
    assert chat - schema.CHAT == set()
    assert schema.COMPLETIONS - completions == schema.EXTENSIONS  # nothing else is accepted beyond OpenAI's
    assert schema.CHAT - chat == schema.EXTENSIONS


REFUSED = [
    ("/v1/completions", {"best_of": 2}, "best_of"),
    ("/v1/completions", {"suffix": "tail"}, "suffix"),
    ("/v1/completions", {"n": 2}, "n"),
    ("/v1/completions", {"presence_penalty": 99}, "presence_penalty"),
    ("/v1/completions", {"frequency_penalty": -2.5}, "frequency_penalty"),
    ("/v1/completions", {"logprobs": 6}, "logprobs"),
    ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"999999": 1}}, "logit_bias"),  # beyond the vocabulary
    ("/v1/completions", {"logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/completions", {"user": {"id": 1}}, "user"),
    ("/v1/completions", {"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    (
        "/v1/completions",
        {"stream": True, "stream_options": {"continuous_usage_stats": True}},
        "stream_options.continuous_usage_stats",
    ),
    ("/v1/completions", {"echo": True, "logprobs": 1}, "echo"),
    ("/v1/completions", {"wibble": 1}, "wibble"),
    ("/v1/completions", {"top_k": -2}, "top_k"),
    ("/v1/completions", {"stop_token_ids": [999999]}, "stop_token_ids"),
    ("/v1/completions", {"scd": {"verify": "provisional"}}, "scd.verify"),
    ("/v1/completions", {"scd": {"mode": "raw", "verify": "verified"}, "logprobs": 1}, "logprobs"),
    ("/v1/completions", {"scd": {"mode": "raw", "verify": "verified"}, "presence_penalty": 1}, "presence_penalty"),
    ("/v1/completions", {"scd": {"verfy": "verified"}}, "scd.verfy"),
    ("/v1/completions", {"scd": {"mode": "raw"}, "scd_mode": "raw"}, "scd_mode"),
    ("/v1/completions", {"scd": {"audit_positions": 65}}, "scd.audit_positions"),
    ("/v1/completions", {"scd": {"mode": "auto", "options": {"max_loss": "x"}}}, "scd.options['max_loss']"),
    ("/v1/completions", {"scd": {"mode": "nope"}}, "scd.mode"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/v1/chat/completions", {"tool_choice": "auto"}, "tool_choice"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"reasoning_effort": "high"}, "reasoning_effort"),
    ("/v1/chat/completions", {"store": True}, "store"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"echo": True}, "echo"),  # a completions field
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "hi", "tool_call_id": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "mood": "x"}]}, "messages[0].mood"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}, {"role": "user", "content": "x"}]},
        "messages[0].tool_calls",
    ),
]


@pytest.mark.parametrize("path, fields, param", REFUSED)
async def test_a_field_not_honoured_is_400_naming_it(pair, path, fields, param):
    base = {"prompt": "hi there"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    status, reply = await post(pair, path, {**base, "max_tokens": 2, **fields})
    assert status == 400, reply
    assert reply["error"]["param"] == param, reply
    assert reply["error"]["type"] == "invalid_request_error"


NEUTRAL = [
    ("/v1/completions", {"best_of": 1, "suffix": None, "n": 1, "user": "u-1", "echo": False, "logit_bias": {}}),
    (
        "/v1/chat/completions",
        {
            "tools": [],
            "tool_choice": "none",
            "response_format": {"type": "text"},
            "modalities": ["text"],
            "store": False,
            "metadata": {"k": "v"},
            "user": "u-1",
            "safety_identifier": "s",
            "prompt_cache_key": "k",
            "parallel_tool_calls": False,
            "service_tier": "auto",
            "audio": None,
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "ann"},
                {"role": "assistant", "content": None, "refusal": None, "tool_calls": []},
                {"role": "user", "content": "again"},
            ],
        },
    ),
]


@pytest.mark.parametrize("path, fields", NEUTRAL)
async def test_fields_at_values_asking_nothing_more_are_accepted(pair, path, fields):
    base = {"prompt": "hi there"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    status, reply = await post(pair, path, {**base, "max_tokens": 2, **fields})
    assert status == 200, reply
    # sampled (temperature 1, a fresh seed): a stop token may come first; else max_tokens ends it
    tokens, reason = reply["usage"]["completion_tokens"], reply["choices"][0]["finish_reason"]
    assert (tokens, reason) == (2, "length") or (tokens, reason) == (1, "stop"), reply
    assert reply["scd"]["seed"] >= 0


def reference_decode(pair: Pair, prompt_ids: list[int], steps: int, bias=None, presence=0.0, frequency=0.0):
    """Greedy decoding by hand on the Hugging Face model (the design's reference forward), with
    OpenAI's formulas: logit + bias - count x frequency - (count > 0) x presence. Returns the ids
    and each step's raw log-softmax row."""
    model = pair.consumer.servicer.loaded.model
    ids, out, rows = list(prompt_ids), [], []
    counts = torch.zeros(model.config.vocab_size)
    for _ in range(steps):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        rows.append(torch.log_softmax(logits, -1))
        for token, value in (bias or {}).items():
            logits[token] += value
        logits -= counts * frequency + (counts > 0).float() * presence
        token = int(torch.argmax(logits))
        counts[token] += 1
        out.append(token)
        ids.append(token)
        if token == pair.consumer.servicer.loaded.tokenizer.eos_token_id:
            break
    return out, rows


def prompt_ids(pair: Pair) -> list[int]:
    return pair.consumer.servicer.loaded.tokenizer(PROMPT)["input_ids"]


@pytest.mark.numeric
async def test_completion_logprobs_are_the_models_own_log_softmax(pair):
    status, reply = await post(pair, "/v1/completions", greedy_body(logprobs=3))
    assert status == 200, reply
    (choice,) = reply["choices"]
    ids, rows = reference_decode(pair, prompt_ids(pair), NEW)
    assert choice["token_ids"] == ids
    lp = choice["logprobs"]
    tokenizer = pair.consumer.servicer.loaded.tokenizer
    assert lp["tokens"] == [tokenizer.decode([t]) for t in ids]
    assert lp["token_logprobs"] == pytest.approx([float(r[t]) for r, t in zip(rows, ids)], abs=1e-3)
    for top, row, token in zip(lp["top_logprobs"], rows, ids):
        want = torch.topk(row, 3)
        expected = {tokenizer.decode([i]): float(v) for i, v in zip(want.indices.tolist(), want.values.tolist())}
        assert set(expected) <= set(top) and tokenizer.decode([token]) in top  # the chosen one always among them
        assert [top[k] for k in expected] == pytest.approx(list(expected.values()), abs=1e-3)
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    events = await stream(pair, "/v1/completions", greedy_body(logprobs=3))
    streamed = [v for e in events[:-1] for v in (e["choices"][0]["logprobs"] or {}).get("token_logprobs", [])]
    assert streamed == pytest.approx(lp["token_logprobs"], abs=1e-6)


@pytest.mark.numeric
async def test_chat_logprobs_have_the_chat_shape_and_top_logprobs_entries(pair):
    body = {
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": NEW,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        "scd": {"mode": "oracle"},
    }
    status, reply = await post(pair, "/v1/chat/completions", body)
    assert status == 200, reply
    content = reply["choices"][0]["logprobs"]["content"]
    assert len(content) == reply["usage"]["completion_tokens"] == NEW
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"} and len(entry["top_logprobs"]) == 2
        assert entry["bytes"] == list(entry["token"].encode()) and entry["logprob"] <= 0
        assert entry["top_logprobs"][0]["logprob"] >= entry["logprob"] - 1e-6  # greedy: the chosen one is the top
    status, plain = await post(pair, "/v1/chat/completions", {**body, "logprobs": False, "top_logprobs": None})
    assert plain["choices"][0]["logprobs"] is None


@pytest.mark.numeric
async def test_penalties_and_logit_bias_follow_openais_formula(pair):
    ids = prompt_ids(pair)
    want, _ = reference_decode(pair, ids, NEW, presence=1.5, frequency=2.0)
    status, reply = await post(pair, "/v1/completions", greedy_body(presence_penalty=1.5, frequency_penalty=2.0))
    assert status == 200 and reply["choices"][0]["token_ids"] == want
    plain, _ = reference_decode(pair, ids, NEW)
    assert plain != want  # the penalties changed the answer: the test can fail
    banned = plain[0]
    favoured = (banned + 7) % pair.consumer.servicer.loaded.info.vocab_size
    bias = {banned: -100.0, favoured: 5.0}
    want, _ = reference_decode(pair, ids, NEW, bias=bias)
    _, reply = await post(pair, "/v1/completions", greedy_body(logit_bias={str(k): v for k, v in bias.items()}))
    assert reply["choices"][0]["token_ids"] == want and banned not in want


async def test_unseeded_samples_differ_and_the_reported_seed_reproduces_one(pair):
    body = {"prompt": PROMPT, "max_tokens": NEW, "temperature": 1.0, "scd": {"mode": "oracle"}, "return_token_ids": True}
    replies = [(await post(pair, "/v1/completions", body))[1] for _ in range(2)]
    a, b = (r["choices"][0]["token_ids"] for r in replies)
    assert a != b and replies[0]["scd"]["seed"] != replies[1]["scd"]["seed"]
    _, again = await post(pair, "/v1/completions", {**body, "seed": replies[0]["scd"]["seed"]})
    assert again["choices"][0]["token_ids"] == a and again["scd"]["seed"] == replies[0]["scd"]["seed"]


async def test_top_k_one_samples_the_greedy_answer(pair):
    _, greedy = await post(pair, "/v1/completions", greedy_body())
    _, sampled = await post(pair, "/v1/completions", greedy_body(temperature=1.0, top_k=1))
    assert sampled["choices"][0]["token_ids"] == greedy["choices"][0]["token_ids"]


async def test_stop_token_ids_end_the_answer_on_that_id(pair):
    _, whole = await post(pair, "/v1/completions", greedy_body())
    ids = whole["choices"][0]["token_ids"]
    stop_at = next(i for i, t in enumerate(ids) if t not in ids[:i] and i >= 2)
    _, stopped = await post(pair, "/v1/completions", greedy_body(stop_token_ids=[ids[stop_at]]))
    assert stopped["choices"][0]["token_ids"] == ids[: stop_at + 1]
    assert stopped["choices"][0]["finish_reason"] == "stop"


async def test_echo_puts_the_prompt_before_the_completion(pair):
    _, whole = await post(pair, "/v1/completions", greedy_body())
    _, echoed = await post(pair, "/v1/completions", greedy_body(echo=True))
    assert echoed["choices"][0]["text"] == PROMPT + whole["choices"][0]["text"]
    events = await stream(pair, "/v1/completions", greedy_body(echo=True))
    assert events[0]["choices"][0]["text"] == PROMPT
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == PROMPT + whole["choices"][0]["text"]


async def test_max_completion_tokens_and_stream_options(pair):
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_completion_tokens": 3, "temperature": 0}
    _, reply = await post(pair, "/v1/chat/completions", body)
    assert reply["usage"]["completion_tokens"] == 3
    events = await stream(pair, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    assert events[-2]["usage"]["completion_tokens"] == 3 and events[-2]["choices"] == []
    assert all(e["usage"] is None for e in events[:-2])  # as OpenAI sends them: null until the usage chunk
    last = next(e for e in reversed(events[:-1]) if e["choices"])
    assert last["choices"][0]["finish_reason"] == "length" and last["scd"]["generated_tokens"] == 3
    events = await stream(pair, "/v1/chat/completions", body)
    assert all("usage" not in e for e in events[:-1])


async def test_a_stop_string_ends_the_request_as_finished_with_scd_stats(pair):
    _, whole = await post(pair, "/v1/completions", greedy_body())
    text = whole["choices"][0]["text"]
    stop = text[len(text) // 3 : len(text) // 3 + 2]
    assert stop.strip(), text
    outcomes = pair.consumer.servicer.outcomes
    before = (outcomes.completed, outcomes.cancelled)
    _, stopped = await post(pair, "/v1/completions", greedy_body(stop=[stop]))
    assert stopped["choices"][0]["text"] == text[: text.find(stop)] and stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["scd"]["mode"] == "oracle" and stopped["scd"]["generated_tokens"] < NEW  # the engine stopped there
    events = await stream(pair, "/v1/completions", greedy_body(stop=stop))
    assert events[-2]["choices"][0]["finish_reason"] == "stop" and events[-2]["scd"]["mode"] == "oracle"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == text[: text.find(stop)]
    assert (outcomes.completed, outcomes.cancelled) == (before[0] + 2, before[1])


async def test_verified_decoding_over_http_with_the_openai_client(pair):
    """The `scd` extension as the `openai` client's extra_body: raw transfer, verified against the
    consumer's own prefill; the greedy answer is the oracle's and the response says so."""
    client = openai.AsyncOpenAI(base_url=url(pair, "/v1"), api_key="unused", max_retries=0)
    model = (await client.models.list()).data[0].id
    asks = dict(model=model, prompt=PROMPT, max_tokens=NEW, temperature=0)
    oracle = await client.completions.create(**asks, extra_body={"scd": {"mode": "oracle"}, "return_token_ids": True})
    verified = await client.completions.create(
        **asks, extra_body={"scd": {"mode": "raw", "verify": "verified"}, "return_token_ids": True}
    )
    scd = verified.model_extra["scd"]
    assert scd["verify_decision"].startswith("verified:") and scd["mode"] == "raw"
    assert verified.choices[0].model_extra["token_ids"] == oracle.choices[0].model_extra["token_ids"]
    legacy = await client.completions.create(**asks, extra_body={"scd_mode": "raw"})
    assert legacy.model_extra["scd"]["mode"] == "raw"
    with pytest.raises(openai.BadRequestError) as refused:
        await client.completions.create(**asks, logprobs=2, extra_body={"scd": {"mode": "raw", "verify": "verified"}})
    assert refused.value.body["param"] == "logprobs"
    await client.close()


LLAMA2_STYLE = (
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "[INST] {{ m['content'] }} [/INST]{% endfor %}"
)


async def test_a_chat_template_that_refuses_the_messages_is_400_naming_messages(pair):
    tokenizer = pair.consumer.servicer.loaded.tokenizer
    tokenizer.chat_template = LLAMA2_STYLE  # the served tokenizer's, for this test only
    try:
        twice = {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "max_tokens": 2}
        status, reply = await post(pair, "/v1/chat/completions", twice)
        assert status == 400 and reply["error"]["param"] == "messages", reply
        assert "Conversation roles must alternate" in reply["error"]["message"]
        status, reply = await post(pair, "/v1/chat/completions", {**twice, "messages": twice["messages"][:1]})
        assert status == 200, reply
    finally:
        tokenizer.chat_template = None


async def test_logprobs_and_penalties_cross_the_engine_process(pair):
    """Under --engine-process the sampler runs in the child: the same ids and log-probabilities
    come back as from the in-process engine (each id's TokenLogprobs travels beside it)."""
    body = greedy_body(logprobs=2, presence_penalty=1.0, temperature=0.7, seed=5)
    _, want = await post(pair, "/v1/completions", body)
    split = {"engine_process": True, "prefix_cache_bytes": 0, "http_port": 0, "chunk_tokens": 32}
    async with running_pair("tiny-llama", consumer_kw=split) as other:
        status, got = await post(other, "/v1/completions", body)
    assert status == 200, got
    assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
    assert got["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
        want["choices"][0]["logprobs"]["token_logprobs"], abs=1e-5
    )
    assert len(got["choices"][0]["logprobs"]["tokens"]) == NEW
