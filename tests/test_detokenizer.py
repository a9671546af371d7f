"""Incremental detokenization: the streamed text deltas join to the whole answer's decode, in
any grouping of the ids, and each step decodes a short window, not the answer so far."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from consumer.engine.decoding import Detokenizer
from shared.models import load_model


class Counting:
    """A tokenizer whose decode records how many ids each call was given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.lengths = tokenizer, []

    @property
    def all_special_ids(self):
        return self.tokenizer.all_special_ids

    def decode(self, ids, **kwargs):
        self.lengths.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)


@pytest.fixture(scope="module", params=["byte-level", "qa-words"])
def tokenizer(request):
    if request.param == "byte-level":
        return load_model("tiny-llama", "float32", "cpu").tokenizer
    return AutoTokenizer.from_pretrained("checkpoints/qa-tuned")


@pytest.mark.parametrize("seed", range(12))
def test_deltas_join_to_the_whole_decode_in_any_grouping(tokenizer, seed):
    rng = random.Random(seed)
    vocab = len(tokenizer)
    ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 120))]
    detok = Detokenizer(tokenizer)
    out, i = [], 0
    while i < len(ids):
        n = rng.choice([1, 1, 1, 2, 5])
        out.append(detok.push_many(ids[i : i + n]))
        i += n
    out.append(detok.flush())
    assert "".join(out) == tokenizer.decode(ids, skip_special_tokens=True)


def test_each_step_decodes_a_window_not_the_answer_so_far(tokenizer):
    # words the tokenizer knows (complete characters, so every step can emit) and special ids between them
    words = [t for t in range(len(tokenizer)) if t not in tokenizer.all_special_ids][:50]
    special = tokenizer.all_special_ids
    ids = [t for i in range(300) for t in ([words[i % len(words)]] + ([special[i % len(special)]] if i % 7 == 0 else []))]
    counting = Counting(tokenizer)
    detok = Detokenizer(counting)  # type: ignore[arg-type]
    text = "".join(detok.push(t) for t in ids) + detok.flush()
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
    assert len(ids) > 300 and max(counting.lengths) <= 4, max(counting.lengths)
