"""Token sampling (per request, on the batch engine's thread) and incremental detokenization.

Pure torch + tokenizer. Knows nothing about transfer codecs, batching or gRPC.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0


class Sampler:
    def __init__(self, sampling: Sampling, device: torch.device):
        self.sampling = sampling
        self.generator = None
        if sampling.temperature > 0:
            self.generator = torch.Generator(device=device).manual_seed(sampling.seed)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [vocab] -> the distribution a token is drawn from (temperature, then top-p;
        not renormalized: multinomial does not need it), [vocab] float32. Sampling only."""
        probs = torch.softmax(logits.float() / self.sampling.temperature, dim=-1)
        if self.sampling.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < self.sampling.top_p  # always keeps the top token
            probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
        return probs

    def __call__(self, logits: torch.Tensor) -> int:
        """logits: [vocab] of the last position -> next token id."""
        if self.generator is None:
            return int(torch.argmax(logits))
        return int(torch.multinomial(self.probs(logits), 1, generator=self.generator))


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
