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


class Detokenizer:
    """Turns a growing list of ids into text deltas, holding back an unfinished UTF-8 sequence.

    Incremental: each step decodes only a short window, from the token before the last emitted
    text (`prefix`) to the end, and emits what that window's text adds to the text of its
    already-emitted part (`read`). A tokenizer that renders a token differently at the start of
    a sequence (a leading space) renders it the same way in both, so the deltas join to the
    whole sequence's decode; the cost per step is the window, not the whole answer so far.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        self.ids: list[int] = []  # the ids so far, special ids left out
        self.prefix = 0  # window start: the last emitted step's first token
        self.read = 0  # tokens whose text has been emitted
        self.special = frozenset(tokenizer.all_special_ids)  # never in the text (skip_special_tokens): never kept

    def _decode(self, ids: list[int]) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        assert isinstance(text, str)  # one sequence of ids decodes to one string
        return text

    def push(self, token_id: int) -> str:
        return self.push_many([token_id])

    def push_many(self, token_ids: list[int]) -> str:
        """The text the new ids add (\"\" while it ends in an unfinished UTF-8 sequence)."""
        kept = [t for t in token_ids if t not in self.special]
        if not kept:
            return ""
        self.ids.extend(kept)
        before = self._decode(self.ids[self.prefix : self.read])
        text = self._decode(self.ids[self.prefix :])
        if len(text) <= len(before) or text.endswith("\ufffd") or not text.startswith(before):
            return ""  # no complete text yet (part of a character)
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before) :]

    def flush(self) -> str:
        """Text still held back once generation has ended (e.g. an incomplete byte sequence)."""
        before = self._decode(self.ids[self.prefix : self.read])
        text = self._decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return text[len(before) :] if text.startswith(before) else ""
