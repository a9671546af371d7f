"""The pipeline's items -> OpenAI's response and stream-chunk objects (consumer.api.openai_api sends
them): text (cut before a stop string, after the echoed prompt), token ids, log-probabilities in
each route's own shape, `usage`, and the SCD request's facts under `scd` (the mode that ran, the
seed it sampled with, what verification or the audit did). No aiohttp, no compute.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from consumer.api.token_bytes import CharOffsets, TokenBytes
from consumer.engine.decoding import TokenLogprobs
from consumer.request.job import GenerateResult, TokenOut

MIN_LOGPROB = -9999.0  # what -inf is sent as (JSON has no infinity), as vLLM does


def scd_stats(r: GenerateResult, seed: int) -> dict[str, Any]:
    """The `scd` object of a response: what the consumer did for this request."""
    out: dict[str, Any] = {
        "mode": r.codec,
        "options": dict(r.options),
        "context_tokens": r.context_tokens,
        "question_tokens": r.question_tokens,
        "generated_tokens": r.generated_tokens,
        "ttft_ms": round(r.ttft_ms, 3),
        "total_ms": round(r.total_ms, 3),
        "bytes_received": r.bytes_received,
        "prefix_reused_tokens": r.prefix_reused_tokens,  # from the consumer's prefix cache, this tenant's only
        "seed": seed,
    }
    if r.auto is not None:
        out["auto_reason"] = r.auto.reason
    if r.transfer_failure:
        out["transfer_failure"] = r.transfer_failure
    if r.audit_decision:
        out["audit_decision"] = r.audit_decision
    if r.verify_decision:
        out.update(
            verify_decision=r.verify_decision,
            drafted_tokens=r.drafted_tokens,
            accepted_draft_tokens=r.accepted_tokens,
            time_to_verified_ms=round(r.time_to_verified_ms, 3),
        )
    return out


@dataclass
class Reply:
    """One answer's identity, totals and formatting: `take` each TokenOut, then `whole` or the
    stream's `chunk`s."""

    id: str
    model: str
    chat: bool
    prompt_tokens: int
    tokenizer: Any
    seed: int
    echo: str = ""  # /v1/completions with echo: the prompt, before the completion
    created: int = field(default_factory=lambda: int(time.time()))
    ids: list[int] = field(default_factory=list)
    text: str = ""  # the completion's text so far (the pipeline cuts it before a stop string: request.ending)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    result: GenerateResult | None = None
    include_usage: bool = False  # stream_options.include_usage: every chunk carries usage (null until the last)
    token_bytes: TokenBytes | None = None  # each id's own bytes (logprobs' bytes and text offsets); None: made here
    offsets: CharOffsets = field(init=False)  # completions' text_offset of the next token

    def __post_init__(self) -> None:
        if self.token_bytes is None:
            self.token_bytes = TokenBytes(self.tokenizer)
        self.offsets = CharOffsets(len(self.echo), self.token_bytes)

    def take(self, item: TokenOut) -> str:
        """An item's ids and log-probabilities kept; returns its text (the pipeline's Ending already
        held back a possible stop string's start and cut the text before one)."""
        self.ids += item.ids
        if item.logprobs:
            self.logprobs += item.logprobs
        self.text += item.text
        return item.text

    def end(self, result: GenerateResult) -> str:
        """The result and its finish reason (a stop string's end is "stop": request.ending); no text
        is held back here."""
        self.result = result
        self.finish_reason = result.finish_reason
        return ""

    def usage(self) -> dict[str, int]:
        done = len(self.ids)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": done, "total_tokens": self.prompt_tokens + done}

    def scd(self) -> dict[str, Any] | None:
        return scd_stats(self.result, self.seed) if self.result is not None else None

    def _envelope(self, streamed: bool) -> dict[str, Any]:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if streamed and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def format_logprobs(self, records: list[TokenLogprobs]) -> dict[str, Any]:
        """Completions: {tokens, token_logprobs, top_logprobs (the chosen token among them), text_offset};
        chat: {content: [{token, logprob, bytes, top_logprobs: [...]}], refusal}."""
        if self.chat:
            content = []
            for r in records:
                top = [self._chat_entry(i, lp) for i, lp in r.top]
                content.append({**self._chat_entry(r.id, r.logprob), "top_logprobs": top})
            return {"content": content, "refusal": None}
        tokens = [self._token(r.id) for r in records]
        offsets = [self.offsets.next(r.id) for r in records]
        tops = []
        for token, r in zip(tokens, records, strict=True):
            alternatives = {self._token(i): max(lp, MIN_LOGPROB) for i, lp in r.top}
            alternatives.setdefault(token, max(r.logprob, MIN_LOGPROB))  # the chosen token always among them
            tops.append(alternatives)
        return {
            "tokens": tokens,
            "token_logprobs": [max(r.logprob, MIN_LOGPROB) for r in records],
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def _chat_entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        assert self.token_bytes is not None
        return {
            "token": self._token(token_id),
            "logprob": max(logprob, MIN_LOGPROB),
            "bytes": list(self.token_bytes.of(token_id)),
        }

    def chunk(
        self,
        text: str | None,
        ids: list[int] | None,
        records: list[TokenLogprobs] | None = None,
        finish: str | None = None,
        role: bool = False,
    ) -> dict[str, Any]:
        """One stream chunk: a text delta (None: none) with its ids and log-probabilities when
        asked, or the last one with its finish reason and `scd`."""
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        choice["logprobs"] = self.format_logprobs(records) if records else None
        choice["finish_reason"] = finish
        if ids is not None:
            choice["token_ids"] = ids
        out = {**self._envelope(True), "choices": [choice]}
        if self.include_usage:  # OpenAI: null on every chunk but the usage chunk
            out["usage"] = None
        if finish is not None:
            out["scd"] = self.scd()
        return out

    def usage_chunk(self) -> dict[str, Any]:
        return {**self._envelope(True), "choices": [], "usage": self.usage()}

    def whole(self, token_ids: bool, logprobs: bool) -> dict[str, Any]:
        """The non-streaming response, with `usage` and the SCD request's facts under `scd`."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": self.finish_reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": self.text}
        else:
            choice["text"] = self.echo + self.text
        choice["logprobs"] = self.format_logprobs(self.logprobs) if logprobs else None
        if token_ids:
            choice["token_ids"] = self.ids
        return {**self._envelope(False), "choices": [choice], "usage": self.usage(), "scd": self.scd()}
