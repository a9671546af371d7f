"""Tests for qa.task and qa.tokenizer: determinism per seed, disjoint splits, answers present in
the context, and the separate-tokenization invariant the services rely on."""

from __future__ import annotations

import pytest

from qa.task import (
    FACT_TOKENS, SPLIT_OFFSET, SPLIT_SIZE, examples, global_seed, make_example, n_facts_for, vocabulary,
)
from qa.tokenizer import build_tokenizer, end_token_id


def test_same_seed_same_example_and_different_seeds_differ():
    for task in ("base", "tuned"):
        a, b = make_example(7, "test", 512, task), make_example(7, "test", 512, task)
        assert a == b
    assert make_example(7, "test", 512).context != make_example(8, "test", 512).context
    assert make_example(7, "test", 512).context != make_example(7, "validation", 512).context


def test_base_and_tuned_share_context_and_target():
    base, tuned = make_example(3, "validation", 256, "base"), make_example(3, "validation", 256, "tuned")
    assert base.context == tuned.context and base.target == tuned.target
    assert base.question == f"{base.target.rel} {base.target.name}"
    assert base.answer == f"{base.target.v1} {base.target.v2}"
    assert tuned.question == f"Q {base.target.rel} {base.target.name} ?"
    assert tuned.answer == f"{base.target.v2} {base.target.v1}"


def test_split_seed_ranges_are_disjoint():
    ranges = sorted((off, off + SPLIT_SIZE) for off in SPLIT_OFFSET.values())
    assert all(hi <= lo2 for (_, hi), (lo2, _) in zip(ranges, ranges[1:]))
    assert global_seed("train", SPLIT_SIZE - 1) < global_seed("validation", 0) < global_seed("test", 0)
    with pytest.raises(ValueError):
        global_seed("test", SPLIT_SIZE)
    train = {make_example(s, "train", 128).context for s in range(200)}
    test = {make_example(s, "test", 128).context for s in range(200)}
    assert not train & test


@pytest.mark.parametrize("ctx", [128, 256, 512, 1024, 2048])
def test_gold_answer_is_in_context_and_facts_are_unambiguous(ctx):
    for ex in examples("test", 20, ctx, "base"):
        assert f"{ex.question} {ex.answer} ." in ex.context
        assert ex.context.count(f" {ex.target.name} ") >= 1
        keys = [(f.rel, f.name) for f in ex.facts]
        values = [v for f in ex.facts for v in (f.v1, f.v2)]
        assert len(set(keys)) == len(keys) == n_facts_for(ctx)
        if ctx <= 1024:  # the value pool keeps words distinct up to ~1150 tokens
            assert len(set(values)) == len(values)
        else:
            assert max(values.count(v) for v in set(values)) <= 2
    for ex in examples("test", 20, ctx, "tuned"):
        v2, v1 = ex.answer.split()
        assert f"{ex.target.rel} {ex.target.name} {v1} {v2} ." in ex.context


@pytest.mark.parametrize("ctx", [128, 512, 2048])
def test_context_token_count_fits(ctx):
    tok = build_tokenizer()
    ids = tok(make_example(0, "test", ctx).context)["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert ctx - FACT_TOKENS < len(ids) <= ctx


def test_separate_tokenization_equals_joint_prompt():
    tok = build_tokenizer()
    for task in ("base", "tuned"):
        for ex in examples("test", 10, 256, task):
            ctx = tok(ex.context)["input_ids"]
            q = tok(ex.question, add_special_tokens=False)["input_ids"]
            assert ctx + q == tok(f"{ex.context} {ex.question}")["input_ids"]
            assert tok.unk_token_id not in ctx + q
            ans = tok(f"{ex.answer} .", add_special_tokens=False)["input_ids"]
            assert ans[-1] == end_token_id(tok)
            assert " ".join(tok.decode(ans[:-1]).split()) == ex.answer


def test_tokenizer_round_trips_through_save(tmp_path):
    from transformers import AutoTokenizer

    build_tokenizer().save_pretrained(str(tmp_path))
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(tok) == 4 + len(vocabulary())
    ex = make_example(1, "test", 128, "tuned")
    ids = tok(ex.context)["input_ids"]
    assert tok.decode(ids, skip_special_tokens=True) == ex.context
