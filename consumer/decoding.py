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

    def __call__(self, logits: torch.Tensor) -> int:
        """logits: [vocab] of the last position -> next token id."""
        if self.generator is None:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.float() / self.sampling.temperature, dim=-1)
        if self.sampling.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < self.sampling.top_p  # always keeps the top token
            probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
        return int(torch.multinomial(probs, 1, generator=self.generator))


class Detokenizer:
    """Turns a growing list of ids into text deltas, holding back an unfinished UTF-8 sequence."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = ""

    def _text(self) -> str:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        assert isinstance(text, str)  # one sequence of ids decodes to one string
        return text

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self._text()
        if text.endswith("\ufffd") or not text.startswith(self.emitted):
            return ""
        delta, self.emitted = text[len(self.emitted) :], text
        return delta

    def flush(self) -> str:
        """Text still held back once generation has ended (e.g. an incomplete byte sequence)."""
        text = self._text()
        delta = text[len(self.emitted) :] if text.startswith(self.emitted) else ""
        self.emitted = text
        return delta
