"""Token sampling (per request, on the batch engine's thread: logit processors, temperature, top-p,
the log-probabilities a request asked for), stop strings over the streamed text, and incremental
detokenization.

Pure torch + tokenizer. Knows nothing about transfer codecs, batching or gRPC.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

GREEDY_BELOW = 1e-5  # a temperature under this is greedy (vLLM's _SAMPLING_EPS): logits / 1e-40 are inf


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 (or under GREEDY_BELOW): greedy
    top_p: float = 1.0
    seed: int = 0
    # the OpenAI endpoint's logit processors (consumer.api.openai_schema), applied to the logits in this
    # order before temperature and top-p; all off by default (gRPC sets none)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    presence_penalty: float = 0.0  # subtracted once from the logit of every id generated so far
    frequency_penalty: float = 0.0  # subtracted per time an id was generated so far
    top_k: int = 0  # sample among the k most likely ids only (0: all)
    logprobs: int | None = None  # keep each sampled id's log-probability and its top-k alternatives (None: keep none)

    def __post_init__(self) -> None:
        if self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)

    @property
    def processed(self) -> bool:
        """Whether a logit processor is on (the engine then hands every row to the sampler, greedy too)."""
        return bool(self.logit_bias) or bool(self.presence_penalty) or bool(self.frequency_penalty) or self.top_k > 0


@dataclass(frozen=True)
class TokenLogprobs:
    """One sampled id's log-probability under the consumer's own distribution (log-softmax of the
    model's logits, before logit processors, temperature and top-p: vLLM's default `raw_logprobs`)
    and the `logprobs` most likely ids' (most likely first)."""

    id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


class Sampler:
    """Draws a request's next id from a row of logits, with its own generator, processors and
    counts; keeps each drawn id's TokenLogprobs in `kept` when the request asked (the engine
    thread appends before the id is sent; the frontend takes them in order)."""

    def __init__(self, sampling: Sampling, device: torch.device):
        self.sampling = sampling
        self.generator = None
        if sampling.temperature > 0:
            self.generator = torch.Generator(device=device).manual_seed(sampling.seed)
        self.kept: collections.deque[TokenLogprobs] = collections.deque()
        self._counts: torch.Tensor | None = None  # [vocab] times each id was drawn (penalties only)
        self._bias: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids, values) on the logits' device

    @property
    def plain(self) -> bool:
        """Greedy with nothing to process or keep: the engine takes its batched argmax instead."""
        return self.generator is None and not self.sampling.processed and self.sampling.logprobs is None

    def nucleus(self, logits: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """logits: [vocab] -> the distribution a token is drawn from (temperature, then top-p; not
        renormalized) over its support: (token ids [s] int64, their probabilities [s] float32), the
        likeliest first; ids None under top_p 1 (the support is the whole vocabulary, probabilities
        [vocab] in id order). Sampling only."""
        probs = torch.softmax(logits.float() / self.sampling.temperature, dim=-1)
        if self.sampling.top_p >= 1.0:
            return None, probs
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < self.sampling.top_p  # always keeps the top token
        return order[keep], sorted_probs[keep]

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [vocab] -> the distribution a token is drawn from (`nucleus`, zeros outside its
        support; not renormalized: multinomial does not need it), [vocab] float32. Sampling only."""
        ids, probs = self.nucleus(logits)
        if ids is None:
            return probs
        return torch.zeros(logits.shape[-1], dtype=probs.dtype, device=probs.device).scatter(0, ids, probs)

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [vocab] -> [vocab] float32 with logit_bias added, the penalties subtracted and all
        but the top_k ids at -inf (OpenAI's formula: logit - count x frequency - (count > 0) x presence)."""
        s = self.sampling
        out = logits.float().clone()
        if s.logit_bias:
            if self._bias is None:
                ids, values = zip(*s.logit_bias, strict=True)
                self._bias = (torch.tensor(ids, device=out.device), torch.tensor(values, device=out.device))
            out.index_add_(0, *self._bias)
        if self._counts is not None:
            out -= self._counts * s.frequency_penalty + (self._counts > 0).float() * s.presence_penalty
        if 0 < s.top_k < out.shape[-1]:
            cut = torch.topk(out, s.top_k).values[-1]
            out = out.masked_fill(out < cut, float("-inf"))
        return out

    def __call__(self, logits: torch.Tensor) -> int:
        """logits: [vocab] of the last position -> next token id."""
        s = self.sampling
        row = self.process(logits) if s.processed else logits
        if self.generator is None:
            token = int(torch.argmax(row))
        else:
            token = int(torch.multinomial(self.probs(row), 1, generator=self.generator))
        if s.presence_penalty or s.frequency_penalty:
            if self._counts is None:
                self._counts = torch.zeros(logits.shape[-1], dtype=torch.float32, device=logits.device)
            self._counts[token] += 1
        if s.logprobs is not None:
            self.kept.append(token_logprobs(logits, token, s.logprobs))
        return token


def token_logprobs(logits: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    """The log-softmax of `logits` [vocab] at `token`, and its k largest entries."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(logp, k) if k else None
    pairs = tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top is not None else ()
    return TokenLogprobs(token, float(logp[token]), pairs)


class StopText:
    """Stop strings over streamed text: what may be shown now (holding back a tail that could
    begin a stop string) and whether one was met (the text ends before it)."""

    def __init__(self, stops: Sequence[str]):
        self.stops = list(stops)
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.pending = ""
        self.hit = False

    def push(self, text: str) -> str:
        if self.hit:
            return ""
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


def backend_decode(tokenizer: object):
    """The Rust tokenizer's own decode when the Hugging Face wrapper's decode is exactly it (a fast
    tokenizer whose decode and _decode are transformers' own, no clean-up of spaces): the same
    text without the wrapper's per-call conversions; None otherwise."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    if not isinstance(tokenizer, TokenizersBackend):
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    cls = type(tokenizer)
    if (
        backend is None
        or cls._decode is not TokenizersBackend._decode
        or cls.decode is not PreTrainedTokenizerBase.decode
        or getattr(tokenizer, "clean_up_tokenization_spaces", True)
    ):
        return None
    return backend.decode


class Detokenizer:
    """Turns a growing list of ids into text deltas, holding back an unfinished UTF-8 sequence.

    Incremental: each step decodes only a short window, from an earlier emitted token (`prefix`)
    to the end, and emits what that window's text adds to the text of its already-emitted part
    (`read`). A tokenizer that renders a token differently at the start of a sequence (a leading
    space) renders it the same way in both, so the deltas join to the whole sequence's decode; the
    cost per step is the window, not the whole answer so far. The emitted part's text is kept, so
    a step decodes once; the window start moves up to the last emitted step once the window holds
    `WINDOW` tokens (the step after that decodes twice).
    """

    WINDOW = 4  # tokens in the decoded window before its start moves up

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        self.ids: list[int] = []  # the ids so far, special ids left out
        self.prefix = 0  # window start
        self.read = 0  # tokens whose text has been emitted
        self._before: str | None = ""  # the text of ids[prefix:read], None when not decoded yet
        self.special = frozenset(tokenizer.all_special_ids)  # never in the text (skip_special_tokens): never kept
        self._backend = backend_decode(tokenizer)

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend(ids, skip_special_tokens=True)
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        assert isinstance(text, str)  # one sequence of ids decodes to one string
        return text

    def _emitted(self) -> str:
        if self._before is None:
            self._before = self._decode(self.ids[self.prefix : self.read]) if self.read > self.prefix else ""
        return self._before

    def push(self, token_id: int) -> str:
        return self.push_many([token_id])

    def push_many(self, token_ids: list[int]) -> str:
        """The text the new ids add (\"\" while it ends in an unfinished UTF-8 sequence)."""
        special = self.special
        kept = [t for t in token_ids if t not in special]
        if not kept:
            return ""
        self.ids.extend(kept)
        before = self._emitted()
        text = self._decode(self.ids[self.prefix :])
        if len(text) <= len(before) or text.endswith("\ufffd") or not text.startswith(before):
            return ""  # no complete text yet (part of a character)
        if len(self.ids) - self.prefix >= self.WINDOW:
            self.prefix, self._before = self.read, None  # the window starts at the last emitted step
        else:
            self._before = text  # the window keeps its start: its emitted text is this one
        self.read = len(self.ids)
        return text[len(before) :]

    def flush(self) -> str:
        """Text still held back once generation has ended (e.g. an incomplete byte sequence)."""
        if self.read == len(self.ids):
            return ""
        before = self._emitted()
        text = self._decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        self._before = ""
        return text[len(before) :] if text.startswith(before) else ""
