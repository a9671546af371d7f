"""Training batches: multi-query QA sequences and the auxiliary copy task, as id tensors + loss masks.

Owns what a training step sees. A QA sequence (one train-split seed each) is a context from `qa.task` followed by several
queries, each `question answer .`; the loss mask covers the answer words and the terminator.
A copy sequence is `<s> w1..wL g1..gG w1..wL` (random words, random gap) with loss on the
repeat after its first word; the random gap is what teaches induction instead of a fixed
look-back. Every sequence is encoded with the real tokenizer. Knows nothing about models.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from qa.task import END, NAMES, VALUES, Task, global_seed, render_question, sample_facts


@dataclass
class Batch:
    ids: torch.Tensor  # [B, T] int64, right-padded with the pad id
    loss_mask: torch.Tensor  # [B, T] bool: position t is a target (predicted from t-1)


def _encode(tokenizer, words: list[str]) -> list[int]:
    return tokenizer(" ".join(words), add_special_tokens=False)["input_ids"]


def qa_sequence(seed: int, tokenizer, n_facts: int, tasks: list[Task]) -> tuple[list[int], list[bool]]:
    """One context of `n_facts` facts, then one query per entry of `tasks` (distinct facts; as
    many as there are facts)."""
    rng = random.Random(global_seed("train", seed) * 8191 + 1)  # train split only
    facts = sample_facts(rng, n_facts)
    context = " ".join(f.text() for f in facts)
    ids = tokenizer(context)["input_ids"]  # with BOS, exactly as at inference
    mask = [False] * len(ids)
    for fact, task in zip(rng.sample(facts, min(len(tasks), n_facts)), tasks):
        question, answer = render_question(fact, task)
        q_ids = _encode(tokenizer, question.split())
        a_ids = _encode(tokenizer, [*answer.split(), END])
        ids += q_ids + a_ids
        mask += [False] * len(q_ids) + [True] * len(a_ids)
    return ids, mask


def copy_sequence(rng: random.Random, tokenizer, min_len: int = 8, max_len: int = 48, max_gap: int = 40):
    words = NAMES + VALUES
    seq = [rng.choice(words) for _ in range(rng.randint(min_len, max_len))]
    gap = [rng.choice(words) for _ in range(rng.randint(0, max_gap))]
    ids = [tokenizer.bos_token_id] + _encode(tokenizer, seq + gap + seq)
    mask = [False] * (1 + len(seq) + len(gap) + 1) + [True] * (len(seq) - 1)
    return ids, mask


def collate(rows: list[tuple[list[int], list[bool]]], pad_id: int) -> Batch:
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, (row_ids, row_mask) in enumerate(rows):
        ids[i, : len(row_ids)] = torch.tensor(row_ids)
        mask[i, : len(row_mask)] = torch.tensor(row_mask)
    return Batch(ids, mask)


def qa_batch(seeds: range, tokenizer, n_facts: int, tasks: list[Task]) -> Batch:
    """One QA sequence per train-split seed in `seeds`, all with `n_facts` facts."""
    rows = [qa_sequence(seed, tokenizer, n_facts, tasks) for seed in seeds]
    return collate(rows, tokenizer.pad_token_id)


def copy_batch(rng: random.Random, tokenizer, batch_size: int) -> Batch:
    return collate([copy_sequence(rng, tokenizer) for _ in range(batch_size)], tokenizer.pad_token_id)
