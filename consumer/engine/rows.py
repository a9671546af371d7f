"""A row of one engine forward: a request's new token ids appended at its own positions, and what
it asks back. Shared by the engine (consumer.engine.batch), its forward (consumer.engine.pool_forward)
and the reference runner (consumer.engine.hf_reference)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from consumer.engine.kv_pool import SequenceKV


@dataclass
class Row:
    seq: SequenceKV
    ids: list[int]  # new tokens, appended at positions seq.length ..
    start: int  # = seq.length when the forward is built
    tail_logits: int = 0  # > 0: also the logits after each of the last n new tokens (verification)
    logits: torch.Tensor | None = None  # [tail_logits, vocab] float32, set by forward when asked
