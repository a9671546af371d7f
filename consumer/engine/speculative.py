"""What verified decoding (consumer.exact.verify) keeps of each draft, and its acceptance rules.

A sampled draft keeps only what the speculative-sampling rule reads: the distribution q it was
drawn from over q's support (`Nucleus`: the top-p nucleus as token ids + probabilities, or one
dense row when the nucleus is so wide that ids + probabilities would cost more), normalized. The
bound, per drafted token: `Nucleus.nbytes` = min(8 s, 4 V) bytes (s the nucleus size, V the
vocabulary: int32 ids and float32 probabilities, or a float32 row), in host memory; per request,
at most `cap` bytes (`--verify-draft-bytes`): a draft whose row would pass it is not kept, and
drafting stops there (the answer stays exact, with fewer drafts to check). The check keeps the
exact model's p at its k + 1 positions in the same form (consumer.engine.batch `Task.keep_nucleus`):
(k + 1) x min(8 s, 4 V) bytes, k bounded by the cap through the drafts' rows and by
max_new_tokens. Greedy drafts and checks keep no distribution (argmax ids). With
`--engine-process` each row crosses the pipe once, as these arrays (pickled by value).

Pure torch: knows nothing about the engine, gRPC or codecs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from consumer.engine.decoding import Sampler, Sampling

ID_BYTES, PROB_BYTES = 4, 4  # int32 token id, float32 probability


def row_bytes(support: int, vocab: int) -> int:
    """A Nucleus's bytes for `support` tokens over `vocab`: min(8 s, 4 V)."""
    return min((ID_BYTES + PROB_BYTES) * support, PROB_BYTES * vocab)


@dataclass(frozen=True)
class Nucleus:
    """A sampling distribution over its support, normalized, in host memory: `probs` [s] float32
    over the token ids `ids` [s] int32, or `ids` None and `probs` [vocab] float32 in id order
    (dense: the cheaper form when s > V / 2). A draft's q, or the exact model's p at a checked
    position."""

    probs: np.ndarray
    ids: np.ndarray | None
    vocab: int

    @classmethod
    def of(cls, ids: torch.Tensor | None, probs: torch.Tensor, vocab: int) -> Nucleus:
        """From Sampler.nucleus's output (any device, unnormalized), in the cheaper form."""
        probs = probs.float()
        probs = probs / probs.sum()
        if ids is not None and (ID_BYTES + PROB_BYTES) * len(ids) > PROB_BYTES * vocab:
            probs, ids = torch.zeros(vocab, dtype=probs.dtype, device=probs.device).scatter(0, ids, probs), None
        return cls(probs.cpu().numpy(), None if ids is None else ids.to(torch.int32).cpu().numpy(), vocab)

    @property
    def nbytes(self) -> int:
        return self.probs.nbytes + (0 if self.ids is None else self.ids.nbytes)

    def dense(self) -> torch.Tensor:
        """As a [vocab] float32 row."""
        if self.ids is None:
            return torch.from_numpy(self.probs)
        return torch.zeros(self.vocab).index_put_((torch.from_numpy(self.ids).long(),), torch.from_numpy(self.probs))

    def prob(self, token: int) -> float:
        if self.ids is None:
            return float(self.probs[token])
        at = np.flatnonzero(self.ids == token)
        return float(self.probs[at[0]]) if len(at) else 0.0

    def residual(self, p: torch.Tensor) -> torch.Tensor:
        """max(0, p - this) [vocab] for a normalized p [vocab] float32 on the CPU."""
        if self.ids is None:
            return (p - torch.from_numpy(self.probs)).clamp(min=0)
        out = p.clone()
        out.index_add_(0, torch.from_numpy(self.ids).long(), torch.from_numpy(-self.probs))
        return out.clamp(min=0)

    def draw(self, generator: torch.Generator) -> int:
        at = int(torch.multinomial(torch.from_numpy(self.probs), 1, generator=generator))
        return at if self.ids is None else int(self.ids[at])


class DraftSampler(Sampler):
    """A Sampler that keeps each sampled draft's `Nucleus`, in order, while they fit `cap` bytes
    (None: no cap); the first that does not is dropped and `limited` set (the drafting stops
    there). Engine thread; under --engine-process the child's copy (no cap) hands each row to this
    one (`keep`), which counts them. Greedy drafts keep nothing."""

    def __init__(self, sampling: Sampling, device: torch.device, cap: int | None = None):
        super().__init__(sampling, device)
        self.cap = cap
        self.rows: list[Nucleus] = []
        self.kept_bytes = 0
        self.limited = False

    def __call__(self, logits: torch.Tensor) -> int:
        if self.generator is None:
            return int(torch.argmax(logits))
        ids, probs = self.nucleus(logits)
        at = int(torch.multinomial(probs, 1, generator=self.generator))
        self.keep(Nucleus.of(ids, probs, logits.shape[-1]))
        return at if ids is None else int(ids[at])

    def keep(self, row: Nucleus) -> None:
        if self.limited or (self.cap is not None and self.kept_bytes + row.nbytes > self.cap):
            self.limited = True
            return
        self.rows.append(row)
        self.kept_bytes += row.nbytes

    def take(self) -> Nucleus | None:
        """The last row kept, handed on (the engine process's copy sends each one and keeps none)."""
        if not self.rows:
            return None
        row = self.rows.pop()
        self.kept_bytes -= row.nbytes
        return row


def accept_greedy(drafts: list[int], exact: list[int]) -> tuple[int, int]:
    """exact: k + 1 ids, i the exact model's argmax after the question and drafts[:i]. Returns
    (how many drafts in a row are its argmax, its argmax at the first that is not, or after all)."""
    accepted = next((i for i, d in enumerate(drafts) if exact[i] != d), len(drafts))
    return accepted, exact[accepted]


def accept_sampled(drafts: list[int], q: list[Nucleus], p: list[Nucleus], generator: torch.Generator) -> tuple[int, int]:
    """The speculative-sampling rule. p: the exact model's k + 1 distributions (row i after
    drafts[:i]); q: the k the drafts were drawn from. Returns (drafts that stand, the token that
    follows them). Dense [vocab] rows only for the residual at the first rejection."""
    for i, d in enumerate(drafts):
        u = float(torch.rand((), generator=generator))
        if u * q[i].prob(d) < p[i].prob(d):  # u < p(d) / q(d); q(d) > 0: d was drawn from it
            continue
        residual = q[i].residual(p[i].dense())  # [vocab]
        if float(residual.sum()) > 0:
            return i, int(torch.multinomial(residual, 1, generator=generator))
        return i, p[i].draw(generator)
    return len(drafts), p[len(drafts)].draw(generator)
