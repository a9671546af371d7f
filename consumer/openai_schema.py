"""OpenAI's request and response JSON <-> the consumer's GenerateRequest and pipeline items, as
plain functions (consumer.openai_api serves them over HTTP; no aiohttp here).

Owns: reading and checking a /v1/completions or /v1/chat/completions body (errors name the
OpenAI field and its limit), the chat rendering (the tokenizer's chat template, else a plain
"role: content" join), how a prompt's tokens become context + question (`split_prompt`), stop
strings (`StopText`), and the response and stream-chunk objects. Owns no compute.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from consumer.request import GenerateResult
from shared.config import ConsumerConfig
from shared.errors import InvalidArgument
from shared.pb import common_pb2, consumer_pb2

MAX_STOP = 4  # stop strings per request, as OpenAI allows
MAX_STOP_CHARS = 256
COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default max_tokens of /v1/completions (chat: --max-new-tokens)
OPENAI_TEMPERATURE = 1.0  # OpenAI's default temperature (gRPC's is 0, greedy)
_PARAM = re.compile(r"^([A-Za-z_][\w.\[\]]*):")
# the GenerateRequest fields the job builder's errors name, as this API calls them
OPENAI_FIELDS = {"transfer.name": "scd_mode", "transfer.options": "scd_options", "request_id": "x-request-id"}


def param_of(message: str) -> tuple[str | None, str]:
    """The field an error message names first, in this API's words, and the message so worded
    ("transfer.name: unknown codec ..." -> "scd_mode", "scd_mode: unknown codec ...")."""
    m = _PARAM.match(message)
    if m is None:
        return None, message
    name = m.group(1)
    if name in OPENAI_FIELDS:
        return OPENAI_FIELDS[name], OPENAI_FIELDS[name] + message[len(name) :]
    return name, message


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


@dataclass
class Params:
    """A body's generation fields, checked."""

    max_tokens: int
    temperature: float = OPENAI_TEMPERATURE
    top_p: float = 1.0
    seed: int = 0
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False  # vLLM's extension: the generated ids in each choice
    mode: str = ""  # scd_mode; "" the consumer's default mode (auto unless --default-mode)
    options: dict[str, str] = field(default_factory=dict)  # scd_options: the mode's options (auto: its budget)


def read_params(body: Mapping[str, Any], cfg: ConsumerConfig, chat: bool) -> Params:
    """The sampling, stop, stream and SCD fields of a body; InvalidArgument naming the field."""
    limit = cfg.max_new_tokens
    names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    name = next((n for n in names if body.get(n) is not None), names[-1])
    max_tokens = body.get(name)
    if max_tokens is None:
        max_tokens = limit if chat else min(COMPLETIONS_MAX_TOKENS, limit)
    if not _is_int(max_tokens) or max_tokens < 1:
        raise InvalidArgument(f"{name}: must be an integer >= 1, got {max_tokens!r:.40}")
    if max_tokens > limit:
        raise InvalidArgument(f"{name}: {max_tokens} > limit max_new_tokens {limit}")
    p = Params(max_tokens=max_tokens)
    for key, low, high in (("temperature", 0.0, 10.0), ("top_p", 0.0, 1.0)):
        value = body.get(key)
        if value is None:
            continue
        if not _is_number(value) or not low <= value <= high or (key == "top_p" and value == 0):
            span = "(0, 1]" if key == "top_p" else f"[{low:g}, {high:g}]"
            raise InvalidArgument(f"{key}: {value!r:.40} not a number in {span}")
        setattr(p, key, float(value))
    seed = body.get("seed")
    if seed is not None:
        if not _is_int(seed) or not 0 <= seed < 1 << 64:
            raise InvalidArgument(f"seed: {seed!r:.40} not an integer in [0, 2**64)")
        p.seed = seed
    n = body.get("n", 1)
    if n != 1 or isinstance(n, bool):
        raise InvalidArgument(f"n: {n!r:.40} not supported (one choice per request: n = 1)")
    p.stop = read_stop(body.get("stop"))
    for key in ("stream", "return_token_ids"):
        value = body.get(key, False)
        if not isinstance(value, bool):
            raise InvalidArgument(f"{key}: must be true or false, got {value!r:.40}")
        setattr(p, key, value)
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict) or not isinstance(stream_options.get("include_usage", False), bool):
        raise InvalidArgument("stream_options: must be an object {include_usage: true|false}")
    p.include_usage = stream_options.get("include_usage", False)
    mode, options = body.get("scd_mode", ""), body.get("scd_options") or {}
    if not isinstance(mode, str) or len(mode) > 64:
        raise InvalidArgument(f"scd_mode: must be a mode name (a string), got {mode!r:.40}")
    if not isinstance(options, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in options.items()):
        raise InvalidArgument('scd_options: must be an object of string values, e.g. {"max_loss": "0.05"}')
    p.mode, p.options = mode, dict(options)
    return p


def read_stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise InvalidArgument("stop: must be a non-empty string or a list of them")
    if len(stops) > MAX_STOP:
        raise InvalidArgument(f"stop: {len(stops)} strings > limit {MAX_STOP}")
    if max(len(s) for s in stops) > MAX_STOP_CHARS:
        raise InvalidArgument(f"stop: a string longer than {MAX_STOP_CHARS} characters")
    return stops


def read_prompt(body: Mapping[str, Any]) -> str | list[int]:
    """/v1/completions' prompt: one string, or one list of token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        return list(prompt)
    raise InvalidArgument("prompt: required, a non-empty string or one list of token ids (batches of several are not served)")


def render_chat(body: Mapping[str, Any], tokenizer: Any) -> tuple[str, bool]:
    """The messages as one text: the tokenizer's chat template with the generation prompt when it
    has one, else "role: content" lines and "assistant:". Returns (text, add special tokens):
    a template writes its own BOS."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument("messages: required, a non-empty list of {role, content}")
    plain = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidArgument(f"messages[{i}]: must be an object with a string role")
        plain.append({"role": m["role"], "content": _content(m.get("content"), i)})
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True), False
    return "".join(f"{m['role']}: {m['content']}\n" for m in plain) + "assistant:", True


def _content(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidArgument(f"messages[{i}].content[{j}]: only text parts ({{type: text, text: ...}}) are served")
            parts.append(part["text"])
        return "".join(parts)
    raise InvalidArgument(f"messages[{i}].content: must be a string or a list of text parts")


def split_prompt(ids: list[int], cfg: ConsumerConfig, field_name: str) -> tuple[list[int], list[int]]:
    """A prompt's tokens as (context, question). The context is the longest prefix of whole
    chunks (--chunk-tokens) that leaves at least one token: what the producer's chunk store and the
    consumer's prefix cache keep and a transfer can serve, so prompts sharing a prefix (a system
    prompt, a document) reuse it; the rest, under one chunk, is the question, prefilled locally.
    A prompt shorter than a chunk and a token: all but its last token is the context. The question
    never exceeds --max-question-tokens (the context takes the rest)."""
    n = len(ids)
    if n < 2:
        raise InvalidArgument(f"{field_name}: {n} token(s); needs at least 2 (a context and a question)")
    aligned = (n - 1) // cfg.chunk_tokens * cfg.chunk_tokens
    cut = max(aligned if aligned > 0 else n - 1, n - cfg.max_question_tokens)
    if cut > cfg.max_context_tokens:
        raise InvalidArgument(
            f"{field_name}: {n} tokens; its context part {cut} > limit max_context_tokens {cfg.max_context_tokens}"
        )
    return ids[:cut], ids[cut:]


def generate_request(request_id: str, context: list[int], question: list[int], p: Params) -> consumer_pb2.GenerateRequest:
    return consumer_pb2.GenerateRequest(
        request_id=request_id,
        context=consumer_pb2.Prompt(token_ids=consumer_pb2.TokenIds(ids=context)),
        question=consumer_pb2.Prompt(token_ids=consumer_pb2.TokenIds(ids=question)),
        max_new_tokens=p.max_tokens,
        sampling=consumer_pb2.SamplingParams(temperature=p.temperature, top_p=p.top_p, seed=p.seed),
        transfer=common_pb2.CodecSpec(name=p.mode, options=p.options),
    )


class StopText:
    """Stop strings over streamed text: what may be shown now (holding back a tail that could
    begin a stop string) and whether one was met (the text ends before it)."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.pending = ""
        self.hit = False

    def push(self, text: str) -> str:
        self.pending += text
        found = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if found:
            self.hit = True
            out, self.pending = self.pending[: min(found)], ""
            return out
        cut = len(self.pending) - self.hold
        if cut <= 0:
            return ""
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


@dataclass
class Reply:
    """One answer's identity and totals as the response objects need them."""

    id: str
    model: str
    chat: bool
    prompt_tokens: int
    created: int = field(default_factory=lambda: int(time.time()))
    ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    result: GenerateResult | None = None

    def usage(self) -> dict[str, int]:
        done = len(self.ids)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": done, "total_tokens": self.prompt_tokens + done}

    def _envelope(self, streamed: bool) -> dict[str, Any]:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if streamed and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def chunk(self, text: str | None, ids: list[int] | None, finish: str | None = None, role: bool = False) -> dict[str, Any]:
        """One stream chunk: a text delta (None: none), or the last one with its finish reason."""
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
            choice["logprobs"] = None
        choice["finish_reason"] = finish
        if ids is not None:
            choice["token_ids"] = ids
        return {**self._envelope(True), "choices": [choice]}

    def usage_chunk(self) -> dict[str, Any]:
        return {**self._envelope(True), "choices": [], "usage": self.usage()}

    def whole(self, token_ids: bool) -> dict[str, Any]:
        """The non-streaming response, with `usage` and the SCD request's facts under `scd`."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": self.finish_reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": self.text}
        else:
            choice.update(text=self.text, logprobs=None)
        if token_ids:
            choice["token_ids"] = self.ids
        out = {**self._envelope(False), "choices": [choice], "usage": self.usage()}
        if self.result is not None:
            r = self.result
            out["scd"] = {
                "mode": r.codec,
                "context_tokens": r.context_tokens,
                "question_tokens": r.question_tokens,
                "ttft_ms": round(r.ttft_ms, 3),
                "bytes_received": r.bytes_received,
            }
        return out
