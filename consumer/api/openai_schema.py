"""OpenAI's request JSON -> the consumer's GenerateRequest and Extras, as plain functions
(consumer.api.openai_api serves them over HTTP; no aiohttp here).

Owns: which fields each route takes: every field of OpenAI's completions and chat-completions
request schemas is honoured, or accepted only at a value that asks for nothing this server does not
do (`tools: []`, `response_format: {"type": "text"}`, `n: 1`), or answered 400 naming it; a field
OpenAI does not define is 400 "unrecognized request argument", as OpenAI answers, except the
extensions listed in EXTENSIONS (vLLM's and this server's `scd`). Also: the body's nesting bound,
how a prompt's tokens become context + question (`split_prompt`), and the GenerateRequest and
Extras a checked body asks for. Errors name the field and its limit. Owns no compute.
"""

from __future__ import annotations

import re
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from consumer.request.job import Extras
from shared import tenants
from shared.config import ConsumerConfig
from shared.errors import InvalidArgument
from shared.pb import common_pb2, consumer_pb2

MAX_DEPTH = 32  # nesting of a body's objects and lists (OpenAI's own bodies need 5; tools and JSON schemas are refused)
MAX_STOP = 4  # stop strings per request, as OpenAI allows
MAX_STOP_CHARS = 256
MAX_STOP_IDS = 64
MAX_LOGIT_BIAS = 1024  # logit_bias entries
MAX_COMPLETION_LOGPROBS = 5  # /v1/completions' logprobs, as OpenAI allows
MAX_TOP_LOGPROBS = 20  # /v1/chat/completions' top_logprobs, as OpenAI allows
MAX_ID_CHARS = 256  # user, safety_identifier, prompt_cache_key
COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default max_tokens of /v1/completions (chat: --max-new-tokens)
FLOAT32_TINY = 1.1754944e-38  # the smallest normal float32
OPENAI_TEMPERATURE = 1.0  # OpenAI's default temperature (gRPC's is 0, greedy)
SEED_BITS = 63  # an unseeded request's fresh seed: within int64 and uint64 both
_CONTAINERS = {dict, list}  # what JSON nests
_TEXTUAL = {dict, list, str}  # what may hold text
_PARAM = re.compile(r"^([A-Za-z_][\w.\[\]']*):")
# the GenerateRequest fields the job builder's errors name, as this API calls them
OPENAI_FIELDS = {
    "transfer.name": "scd.mode",
    "transfer.options": "scd.options",
    "request_id": "x-request-id",
    "audit_positions": "scd.audit_positions",
}
_short = reprlib.Repr()
_short.maxlevel, _short.maxstring, _short.maxother, _short.maxlist, _short.maxdict = 2, 40, 40, 4, 4

# Both routes: fields accepted only at a value that asks for nothing more (absent and null too),
# with why another value is refused.
NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {"n": ((1,), "one choice per request: n = 1")}
COMPLETIONS_NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    **NEUTRAL,
    "best_of": ((1,), "one candidate per request: best_of = 1"),
    "suffix": (("",), "no insertion (fill-in-the-middle) here"),
}
CHAT_NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    **NEUTRAL,
    "store": ((False,), "nothing is stored here: store = false"),
    "service_tier": (("auto", "default"), "one tier here: auto or default"),
    "tools": (([],), "no tool calling here"),
    "functions": (([],), "no function calling here"),
    "tool_choice": (("none",), "no tool calling here: none"),
    "function_call": (("none",), "no function calling here: none"),
    "response_format": (({"type": "text"},), 'text only: {"type": "text"}'),
    "modalities": ((["text"],), 'text only: ["text"]'),
    "audio": ((), "no audio output here"),
    "prediction": ((), "no predicted outputs here"),
    "reasoning_effort": ((), "not a reasoning model"),
    "verbosity": ((), "not a reasoning model"),
    "web_search_options": ((), "no web search here"),
    "moderation": ((), "no moderation here"),
    "prompt_cache_options": ((), "prefix caching here is automatic (chunks of the prompt's tokens)"),
    "prompt_cache_retention": ((), "prefix caching here is automatic (chunks of the prompt's tokens)"),
}
# the fields honoured (or taken as identifiers) on each route, beyond NEUTRAL ones
COMMON = {"model", "frequency_penalty", "presence_penalty", "logit_bias", "logprobs", "max_tokens", "seed", "stop"}
COMMON |= {"stream", "stream_options", "temperature", "top_p", "user"}
EXTENSIONS = {
    "return_token_ids",
    "stop_token_ids",
    "top_k",
    "cache_salt",
    "scd",
    "scd_mode",
    "scd_options",
}  # vLLM's and this server's
COMPLETIONS = COMMON | {"prompt", "echo"} | EXTENSIONS | set(COMPLETIONS_NEUTRAL)
CHAT = COMMON | {"messages", "max_completion_tokens", "top_logprobs", "metadata", "parallel_tool_calls"}
CHAT |= {"safety_identifier", "prompt_cache_key"} | EXTENSIONS | set(CHAT_NEUTRAL)
# the `scd` extension: how the consumer answers (GenerateRequest's fields of the same meaning)
VERIFY = {"off": consumer_pb2.VERIFY_POLICY_OFF, "verified": consumer_pb2.VERIFY_POLICY_VERIFIED}
AUDIT = {
    "off": consumer_pb2.AUDIT_POLICY_OFF,
    "report": consumer_pb2.AUDIT_POLICY_REPORT,
    "fallback": consumer_pb2.AUDIT_POLICY_FALLBACK,
    "upgrade": consumer_pb2.AUDIT_POLICY_UPGRADE,
    "repair": consumer_pb2.AUDIT_POLICY_REPAIR,
}
ON_FAILURE = {
    "fail": consumer_pb2.TRANSFER_FAILURE_POLICY_FAIL,
    "local_prefill": consumer_pb2.TRANSFER_FAILURE_POLICY_LOCAL_PREFILL,
}
SCD_KEYS = ("mode", "options", "verify", "audit", "audit_positions", "on_transfer_failure", "fallback_to_oracle")


def show(value: Any) -> str:
    """A value as an error message quotes it: short whatever its size or depth."""
    return _short.repr(value)


def param_of(message: str) -> tuple[str | None, str]:
    """The field an error message names first, in this API's words, and the message so worded
    ("transfer.name: unknown codec ..." -> "scd.mode", "scd.mode: unknown codec ...")."""
    m = _PARAM.match(message)
    if m is None:
        return None, message
    name = m.group(1)
    for grpc_name, ours in OPENAI_FIELDS.items():
        if name == grpc_name or name.startswith((grpc_name + ".", grpc_name + "[")):  # transfer.options[...] -> scd.options[...]
            name = ours + name[len(grpc_name) :]
            return name, name + message[len(m.group(1)) :]
    return name, message


def check_depth(body: Any, limit: int = MAX_DEPTH) -> None:
    """InvalidArgument when objects and lists nest deeper than `limit` (iterative: any depth)."""
    stack = [(body, 1)] if isinstance(body, dict | list) else []
    while stack:
        value, depth = stack.pop()
        if depth > limit:
            raise InvalidArgument(f"body: JSON nested deeper than limit {limit}")
        children = list(value.values()) if isinstance(value, dict) else value
        if _CONTAINERS & set(map(type, children)):  # in C: a long list of token ids costs no Python loop
            stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))


def check_unicode(body: Any, raw: bytes) -> None:
    """InvalidArgument naming the first key or string of `body` that is not Unicode text: JSON's
    `\\ud800` escapes (and json.loads' surrogatepass of raw bytes ED A0 80..) give lone surrogates,
    which no tokenizer takes. `raw` is the body's bytes: without an escape or an ED byte there is none."""
    if b"\\u" not in raw and b"\xed" not in raw:
        return
    stack: list[tuple[Any, str]] = [(body, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, dict):
            items = [(k, v, f"{path}.{k}" if path else str(k)) for k, v in value.items()]
            for key, _, where in items:
                _unicode(key, f"{where} (the key)")
            stack.extend((v, where) for _, v, where in reversed(items))
        elif isinstance(value, list):
            if _TEXTUAL & set(map(type, value)):  # in C: a list of token ids costs no Python loop
                stack.extend((v, f"{path}[{i}]") for i, v in reversed(list(enumerate(value))))
        elif isinstance(value, str):
            _unicode(value, path)


def _unicode(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgument(
            f"{where}: not Unicode text (a lone surrogate {text[exc.start]!a} at character {exc.start})"
        ) from None


class BadField(InvalidArgument):
    """An InvalidArgument that names its field outright (`param`: a key of any spelling)."""

    def __init__(self, param: str, message: str):
        self.param = param[:64]
        super().__init__(f"{self.param}: {message}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _number(body: Mapping[str, Any], key: str, low: float, high: float, default: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if not _is_number(value) or not low <= value <= high:
        raise InvalidArgument(f"{key}: {show(value)} not a number in [{low:g}, {high:g}]")
    return float(value)


def _flag(body: Mapping[str, Any], key: str) -> bool:
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidArgument(f"{key}: must be true or false, got {show(value)}")
    return value


def _text(value: Any, key: str, limit: int) -> str:
    if not isinstance(value, str) or len(value) > limit:
        raise InvalidArgument(f"{key}: must be a string of at most {limit} characters, got {show(value)}")
    return value


@dataclass
class Params:
    """A body's generation fields, checked."""

    max_tokens: int
    temperature: float = OPENAI_TEMPERATURE
    top_p: float = 1.0
    seed: int | None = None  # None: the caller sent none (a fresh one is drawn per request)
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False  # vLLM's extension: the generated ids in each choice
    echo: bool = False  # /v1/completions: the prompt before the completion
    logprobs: int | None = None  # alternatives per token (None: no log-probabilities)
    extras: Extras = field(default_factory=Extras)
    scd: dict[str, Any] = field(default_factory=dict)  # the `scd` extension, checked
    cache_salt: str = ""  # vLLM's extension: the tenant whose cached prefixes this request may reuse (shared.tenants)


def read_params(body: Mapping[str, Any], cfg: ConsumerConfig, chat: bool) -> Params:
    """Every field of a body (unknown ones refused first); InvalidArgument naming the field."""
    known, neutral = (CHAT, CHAT_NEUTRAL) if chat else (COMPLETIONS, COMPLETIONS_NEUTRAL)
    unknown = sorted(k for k in body if k not in known)
    if unknown:
        raise BadField(unknown[0], "unrecognized request argument (not in OpenAI's schema of this route)")
    for key, (allowed, why) in neutral.items():
        value = body.get(key)
        if value is not None and not any(value == a and type(value) is type(a) for a in allowed):
            raise InvalidArgument(f"{key}: {show(value)} not served ({why})")
    if body.get("model") is not None:
        _text(body["model"], "model", MAX_ID_CHARS)
    for key in ("user", "safety_identifier", "prompt_cache_key"):
        if body.get(key) is not None:
            _text(body[key], key, MAX_ID_CHARS)
    _metadata(body.get("metadata"))
    _flag(body, "parallel_tool_calls")  # without tools there is nothing to call in parallel
    p = Params(max_tokens=_max_tokens(body, cfg, chat))
    p.temperature = _number(body, "temperature", 0.0, 10.0, OPENAI_TEMPERATURE)
    p.top_p = _number(body, "top_p", 0.0, 1.0, 1.0)
    if p.top_p == 0:
        raise InvalidArgument("top_p: 0 not a number in (0, 1]")
    p.top_p = max(p.top_p, FLOAT32_TINY)  # the wire's float32 reads a smaller one as 0 ("off"): it keeps the top token only
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not 0 <= seed < 1 << 64):
        raise InvalidArgument(f"seed: {show(seed)} not an integer in [0, 2**64)")
    p.seed = seed
    p.stop = read_stop(body.get("stop"))
    p.stream, p.return_token_ids, p.echo = _flag(body, "stream"), _flag(body, "return_token_ids"), _flag(body, "echo")
    p.include_usage = _stream_options(body.get("stream_options"), p.stream)
    p.logprobs = _logprobs(body, chat)
    if p.echo and p.logprobs is not None:
        raise InvalidArgument("echo: not served with logprobs (the prompt's log-probabilities are not computed here)")
    top_k = body.get("top_k")
    if top_k is not None and (not _is_int(top_k) or not -1 <= top_k <= 1 << 20):
        raise InvalidArgument(f"top_k: {show(top_k)} not an integer in [-1, 2**20] (-1 or 0: all tokens)")
    p.extras = Extras(
        stop_strings=tuple(p.stop),
        stop_token_ids=frozenset(_stop_ids(body.get("stop_token_ids"))),
        logit_bias=_logit_bias(body.get("logit_bias")),
        presence_penalty=_number(body, "presence_penalty", -2.0, 2.0, 0.0),
        frequency_penalty=_number(body, "frequency_penalty", -2.0, 2.0, 0.0),
        top_k=max(0, top_k or 0),
        logprobs=p.logprobs,
    )
    p.scd = _scd(body)
    salt = body.get("cache_salt")
    if salt is not None:
        if not isinstance(salt, str) or not salt:
            raise InvalidArgument(f"cache_salt: {show(salt)} not a non-empty string")
        p.cache_salt = tenants.checked_salt(salt)
    return p


def _max_tokens(body: Mapping[str, Any], cfg: ConsumerConfig, chat: bool) -> int:
    """The answer's token limit: chat's max_completion_tokens, else max_tokens (each given one checked)."""
    limit = cfg.max_new_tokens
    names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    given = [n for n in names if body.get(n) is not None]
    for name in given:
        value = body[name]
        if not _is_int(value) or value < 1:
            raise InvalidArgument(f"{name}: must be an integer >= 1, got {show(value)}")
        if value > limit:
            raise InvalidArgument(f"{name}: {value} > limit max_new_tokens {limit}")
    if not given:
        return limit if chat else min(COMPLETIONS_MAX_TOKENS, limit)
    return int(body[given[0]])


def _metadata(metadata: Any) -> None:
    """OpenAI's metadata: at most 16 string pairs (kept with a stored completion; nothing is stored here)."""
    if metadata is None:
        return
    if (
        not isinstance(metadata, dict)
        or len(metadata) > 16
        or not all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in metadata.items())
    ):
        raise InvalidArgument("metadata: must be an object of at most 16 string values (keys <= 64, values <= 512 characters)")


def _stream_options(options: Any, stream: bool) -> bool:
    """stream_options (only with stream: true) -> include_usage."""
    if options is None:
        return False
    if not stream:
        raise InvalidArgument("stream_options: only allowed with stream: true")
    if not isinstance(options, dict):
        raise InvalidArgument(f"stream_options: must be an object {{include_usage: true|false}}, got {show(options)}")
    for key, value in options.items():
        if key not in ("include_usage", "include_obfuscation"):
            raise BadField(f"stream_options.{key}", "unrecognized request argument")
        if value is not None and not isinstance(value, bool):
            raise InvalidArgument(f"stream_options.{key}: must be true or false, got {show(value)}")
    if options.get("include_obfuscation"):
        raise InvalidArgument("stream_options.include_obfuscation: not served (no obfuscation field is sent)")
    return bool(options.get("include_usage"))


def _logprobs(body: Mapping[str, Any], chat: bool) -> int | None:
    """Alternatives per token the caller asked for, None for no log-probabilities. Completions:
    logprobs = 0..5. Chat: logprobs = true, top_logprobs = 0..20 (top_logprobs needs logprobs)."""
    value = body.get("logprobs")
    if not chat:
        if value is not None and (not _is_int(value) or not 0 <= value <= MAX_COMPLETION_LOGPROBS):
            raise InvalidArgument(f"logprobs: {show(value)} not an integer in [0, {MAX_COMPLETION_LOGPROBS}]")
        return value
    on = _flag(body, "logprobs")
    top = body.get("top_logprobs")
    if top is not None and (not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS):
        raise InvalidArgument(f"top_logprobs: {show(top)} not an integer in [0, {MAX_TOP_LOGPROBS}]")
    if top and not on:
        raise InvalidArgument("top_logprobs: needs logprobs: true")
    return (top or 0) if on else None


def _logit_bias(bias: Any) -> tuple[tuple[int, float], ...]:
    """{"token id": bias in [-100, 100]} -> ((id, bias), ...); ids are checked against the model's
    vocabulary by the job builder."""
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise InvalidArgument(f'logit_bias: must be an object {{"token id": bias}}, got {show(bias)}')
    if len(bias) > MAX_LOGIT_BIAS:
        raise InvalidArgument(f"logit_bias: {len(bias)} entries > limit {MAX_LOGIT_BIAS}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10):
            raise InvalidArgument(f"logit_bias: key {show(key)} is not a token id (a decimal integer)")
        if not _is_number(value) or not -100 <= value <= 100:
            raise InvalidArgument(f"logit_bias: {show(value)} for token {key} not a number in [-100, 100]")
        out[int(key)] = float(value)
    return tuple(sorted(out.items()))


def _stop_ids(ids: Any) -> list[int]:
    if ids is None:
        return []
    if not isinstance(ids, list) or not all(_is_int(t) and t >= 0 for t in ids):
        raise InvalidArgument(f"stop_token_ids: must be a list of token ids, got {show(ids)}")
    if len(ids) > MAX_STOP_IDS:
        raise InvalidArgument(f"stop_token_ids: {len(ids)} ids > limit {MAX_STOP_IDS}")
    return ids


def _scd(body: Mapping[str, Any]) -> dict[str, Any]:
    """The `scd` extension (or its older spelling `scd_mode` / `scd_options`, not both), checked:
    {mode, options, verify, audit, audit_positions, on_transfer_failure, fallback_to_oracle}."""
    scd = body.get("scd")
    legacy = {k[4:]: body[k] for k in ("scd_mode", "scd_options") if body.get(k) is not None}
    if scd is not None and legacy:
        raise InvalidArgument("scd_mode: give the mode once, as scd.mode (scd_mode and scd_options are its older spelling)")
    if scd is None:
        scd = legacy
    if not isinstance(scd, dict):
        raise InvalidArgument(f'scd: must be an object, e.g. {{"mode": "scd", "verify": "verified"}}, got {show(scd)}')
    for key in scd:
        if key not in SCD_KEYS:
            raise BadField(f"scd.{key}", f"unrecognized (scd takes {', '.join(SCD_KEYS)})")
    mode, options = scd.get("mode") or "", scd.get("options") or {}
    if not isinstance(mode, str) or len(mode) > 64:
        raise InvalidArgument(f"scd.mode: must be a mode name (a string), got {show(mode)}")
    if not isinstance(options, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in options.items()):
        raise InvalidArgument('scd.options: must be an object of string values, e.g. {"max_loss": "0.05"}')
    out: dict[str, Any] = {"mode": mode, "options": dict(options)}
    for key, table in (("verify", VERIFY), ("audit", AUDIT), ("on_transfer_failure", ON_FAILURE)):
        value = scd.get(key)
        if value == "provisional" and key == "verify":
            raise InvalidArgument("scd.verify: provisional not served over HTTP (it withdraws streamed text); use verified")
        if value is not None and value not in table:
            raise InvalidArgument(f"scd.{key}: {show(value)} not one of {', '.join(table)}")
        if value is not None:
            out[key] = table[value]
    positions = scd.get("audit_positions")
    if positions is not None and (not _is_int(positions) or not 1 <= positions <= 64):
        raise InvalidArgument(f"scd.audit_positions: {show(positions)} not an integer in [1, 64]")
    out["audit_positions"] = positions or 0
    fallback = scd.get("fallback_to_oracle")
    if fallback is not None and not isinstance(fallback, bool):
        raise InvalidArgument(f"scd.fallback_to_oracle: must be true or false, got {show(fallback)}")
    out["fallback_to_oracle"] = bool(fallback)
    return out


def read_stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise InvalidArgument("stop: must be a non-empty string or a list of them")
    if len(stops) > MAX_STOP:
        raise InvalidArgument(f"stop: {len(stops)} strings > limit {MAX_STOP}")
    if max((len(s) for s in stops), default=0) > MAX_STOP_CHARS:
        raise InvalidArgument(f"stop: a string longer than {MAX_STOP_CHARS} characters")
    return stops


def read_prompt(body: Mapping[str, Any]) -> str | list[int]:
    """/v1/completions' prompt: one string, or one list of token ids (a batch of one of either)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str | list) for p in prompt):
        raise InvalidArgument(f"prompt: a batch of {len(prompt)} prompts; one per request is served")
    raise InvalidArgument("prompt: required, a non-empty string or one list of token ids")


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


def generate_request(
    request_id: str, context: list[int], question: list[int], p: Params, seed: int
) -> consumer_pb2.GenerateRequest:
    """The GenerateRequest of a checked body; `seed`: the body's, or the one drawn for it."""
    scd = p.scd
    return consumer_pb2.GenerateRequest(
        request_id=request_id,
        context=consumer_pb2.Prompt(token_ids=consumer_pb2.TokenIds(ids=context)),
        question=consumer_pb2.Prompt(token_ids=consumer_pb2.TokenIds(ids=question)),
        max_new_tokens=p.max_tokens,
        sampling=consumer_pb2.SamplingParams(temperature=p.temperature, top_p=p.top_p, seed=seed),
        transfer=common_pb2.CodecSpec(name=scd.get("mode", ""), options=scd.get("options", {})),
        verify=scd.get("verify", consumer_pb2.VERIFY_POLICY_UNSPECIFIED),
        audit=scd.get("audit", consumer_pb2.AUDIT_POLICY_UNSPECIFIED),
        audit_positions=scd.get("audit_positions", 0),
        on_transfer_failure=scd.get("on_transfer_failure", consumer_pb2.TRANSFER_FAILURE_POLICY_UNSPECIFIED),
        fallback_to_oracle=scd.get("fallback_to_oracle", False),
        cache_salt=p.cache_salt,
    )
