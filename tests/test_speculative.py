"""consumer/engine/speculative.py: a sampled draft keeps only what the acceptance reads. The bound, per
drafted token: min(8 s, 4 V) bytes (s the top-p nucleus, V the vocabulary) where the whole row
took 4 V (0.6 MB at Qwen's 151936); what the engine process pickles per draft token is that row;
per request, the cap (`--verify-draft-bytes`) stops keeping rows, and so drafting, at its bound;
the acceptance over these rows decides exactly as over whole rows; the check keeps p the same way."""

from __future__ import annotations

import pickle

import pytest
import torch

from consumer.engine.batch import Task
from consumer.engine.decoding import Sampler, Sampling
from consumer.engine.process import _rows
from consumer.engine.speculative import DraftSampler, Nucleus, accept_sampled, row_bytes

QWEN_VOCAB = 151936


def logits(vocab: int, seed: int, sharp: float = 4.0) -> torch.Tensor:
    return sharp * torch.randn(vocab, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.99, 1.0])
def test_a_drafts_row_is_its_nucleus_within_the_bound(top_p):
    """At a Qwen-sized vocabulary: the row's bytes are min(8 s, 4 V) for its nucleus of s tokens
    (the ids and probabilities, or one dense row when that is cheaper), it is q normalized, and
    the drafted token lies in it."""
    sampling = Sampling(1.0, top_p, 3)
    for seed in range(3):
        row_logits = logits(QWEN_VOCAB, seed)
        q = Sampler(sampling, torch.device("cpu")).probs(row_logits)
        s = int((q > 0).sum())
        draft = DraftSampler(sampling, torch.device("cpu"))
        token = draft(row_logits)
        (row,) = draft.rows
        assert row.nbytes == row_bytes(s, QWEN_VOCAB) == min(8 * s, 4 * QWEN_VOCAB) == draft.kept_bytes
        assert (row.ids is None) == (8 * s > 4 * QWEN_VOCAB)
        torch.testing.assert_close(row.dense(), q / q.sum())
        assert row.prob(token) > 0
        if top_p <= 0.9:
            assert row.nbytes < 4 * QWEN_VOCAB / 10  # the nucleus is a small part of the vocabulary here


def test_the_engine_process_pickles_a_drafts_row_not_the_vocabulary():
    """What the child sends with a sampled draft token (consumer.engine.process._rows): its row's
    arrays, pickled to about the row's bytes (the whole row was 4 V)."""
    draft = DraftSampler(Sampling(1.0, 0.9, 3), torch.device("cpu"))
    task = Task(None, [1], lambda _: None, draft)  # type: ignore[arg-type]  (only the sampler is read)
    token = draft(logits(QWEN_VOCAB, 1))
    kept = draft.rows[0].nbytes
    sent = pickle.dumps(_rows(task, token))
    assert len(sent) <= kept + 512 and kept < 4 * QWEN_VOCAB / 10, (len(sent), kept)
    assert draft.rows == [] and draft.kept_bytes == 0  # handed on: the child keeps none
    assert Nucleus(*pickle.loads(sent)).nbytes == kept


def test_the_cap_stops_keeping_rows_at_the_bound():
    """Rows are kept while their bytes fit the cap; the first that does not is dropped, and so is
    every later one (`limited`: drafting stops there)."""
    sampling = Sampling(1.0, 1.0, 3)
    vocab = 1000
    draft = DraftSampler(sampling, torch.device("cpu"), cap=3 * 4 * vocab + 10)
    for seed in range(5):
        draft(logits(vocab, seed))
    assert len(draft.rows) == 3 and draft.limited and draft.kept_bytes == 3 * 4 * vocab
    none = DraftSampler(sampling, torch.device("cpu"), cap=0)
    none(logits(vocab, 0))
    assert none.rows == [] and none.limited
    greedy = DraftSampler(Sampling(), torch.device("cpu"), cap=0)
    assert greedy(logits(vocab, 0)) == int(torch.argmax(logits(vocab, 0))) and greedy.rows == [] and not greedy.limited


def test_the_acceptance_over_nucleus_rows_decides_as_over_whole_rows():
    """The same drafts, p and generator seed: the same (accepted, next) from the drafts' nucleus
    rows as from the whole q rows they stand for, over 300 cases with rejections and residual
    draws."""
    vocab, k = 50, 4
    outcomes = set()
    for case in range(300):
        sampler = Sampler(Sampling(1.0, 0.7, case), torch.device("cpu"))
        q_logits = [logits(vocab, 1000 * case + i, 1.5) for i in range(k)]
        rows, whole, drafts = [], [], []
        for i, row_logits in enumerate(q_logits):
            ids, probs = sampler.nucleus(row_logits)
            rows.append(Nucleus.of(ids, probs, vocab))
            whole.append(Nucleus.of(None, sampler.probs(row_logits), vocab))
            drafts.append(int(ids[i % len(ids)]))
        near = q_logits + [logits(vocab, 500 + case, 1.5)]  # p near q: drafts often stand
        p = [Nucleus.of(*sampler.nucleus(near[i] + logits(vocab, 7000 + 1000 * case + i, 0.6)), vocab) for i in range(k + 1)]
        sparse = accept_sampled(drafts, rows, p, torch.Generator().manual_seed(case))
        dense = accept_sampled(drafts, whole, p, torch.Generator().manual_seed(case))
        assert sparse == dense, case
        assert rows[0].ids is not None and whole[0].ids is None
        outcomes.add(sparse[0])
    assert outcomes == set(range(k + 1))  # every number of drafts standing happened
