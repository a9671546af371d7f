"""Each token id's own bytes, for OpenAI's log-probabilities (`bytes` joins back into the text where
one character spans several tokens; text offsets count whole characters).

A byte-level BPE vocabulary (GPT-2's alphabet: the Llama 3, Qwen and SmolLM families) maps each
character of a token back to its byte; a SentencePiece byte-fallback piece `<0xNN>` is that byte;
anything else (special tokens, other vocabularies) is its decoded text in UTF-8. No aiohttp, no
compute.
"""

from __future__ import annotations

import codecs
import functools
import re
from typing import Any

from transformers.convert_slow_tokenizer import bytes_to_unicode

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_of() -> dict[str, int]:
    return {char: byte for byte, char in bytes_to_unicode().items()}


class TokenBytes:
    """`of(id)`: a token's bytes under one tokenizer (cached per id)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        self.special = frozenset(getattr(tokenizer, "all_special_ids", ()))
        self._cache: dict[int, bytes] = {}

    def of(self, token_id: int) -> bytes:
        out = self._cache.get(token_id)
        if out is None:
            out = self._cache[token_id] = self._bytes(token_id)
        return out

    def _bytes(self, token_id: int) -> bytes:
        if token_id not in self.special:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str):
                fallback = _BYTE_FALLBACK.fullmatch(piece)
                if fallback is not None:
                    return bytes([int(fallback.group(1), 16)])
                table = _byte_of()
                if self.byte_level and all(c in table for c in piece):
                    return bytes(table[c] for c in piece)
        return self.tokenizer.decode([token_id]).encode("utf-8")


class CharOffsets:
    """Text offsets of a run of tokens: the characters their bytes completed before each (a token
    that begins inside a character points at that character)."""

    def __init__(self, start: int, token_bytes: TokenBytes):
        self.chars, self.token_bytes = start, token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def next(self, token_id: int) -> int:
        """The offset of `token_id`, then its bytes counted."""
        at = self.chars
        self.chars += len(self._decoder.decode(self.token_bytes.of(token_id)))
        return at
