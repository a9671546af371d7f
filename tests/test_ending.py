"""consumer/request/ending.py: an answer ends at its first stop id, at max_new_tokens, or at the first token
whose text completes a stop string (the text cut before it, a possible start of one held back),
whichever its tokens reach first, however they are split into batches."""

from __future__ import annotations

import pytest

from consumer.request.ending import Ending
from shared.models import load_model


@pytest.fixture(scope="module")
def tokenizer():
    return load_model("tiny-llama", "float32", "cpu").tokenizer


def word_ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def run(ending: Ending, ids: list[int], split: int) -> tuple[list[int], str]:
    """ids fed in batches of `split`, then the flush: (kept ids, whole text)."""
    kept, text = [], []
    for i in range(0, len(ids), split):
        k, t = ending.take(ids[i : i + split])
        kept += k
        text.append(t)
    text.append(ending.flush())
    return kept, "".join(text)


@pytest.mark.parametrize("split", [1, 2, 100])
def test_stop_ids_and_length_end_the_answer_at_their_token(tokenizer, split):
    ids = word_ids(tokenizer, "the producer reads a long context")
    stop = ids[3]
    assert stop not in ids[:3]
    ending = Ending(tokenizer, 100, frozenset([stop]))
    assert run(ending, ids, split) == (ids[:4], tokenizer.decode(ids[:4])) and ending.reason == "stop"
    ending = Ending(tokenizer, 3, frozenset())
    assert run(ending, ids, split)[0] == ids[:3] and ending.reason == "length" and ending.count == 3
    ending = Ending(tokenizer, 3, frozenset([ids[2]]))  # both at once: a stop
    assert run(ending, ids, split)[0] == ids[:3] and ending.reason == "stop"
    ending = Ending(tokenizer, 100, frozenset())
    assert run(ending, ids, split) == (ids, tokenizer.decode(ids)) and ending.reason == ""  # not ended yet


@pytest.mark.parametrize("split", [1, 3, 100])
def test_a_stop_string_ends_the_answer_at_the_token_that_completes_it(tokenizer, split):
    ids = word_ids(tokenizer, "the producer reads a long context and the consumer writes")
    text = tokenizer.decode(ids)
    stop = "long con"  # across tokens
    at = next(i for i in range(len(ids)) if stop in tokenizer.decode(ids[: i + 1]))
    ending = Ending(tokenizer, 100, frozenset(), (stop,))
    kept, shown = run(ending, ids, split)
    assert kept == ids[: at + 1] and ending.reason == "stop"
    assert shown == text[: text.index(stop)]
    # a start of a stop string that stays one is shown at the end
    ending = Ending(tokenizer, 100, frozenset(), ("context!",))
    assert run(ending, ids, split) == (ids, text) and ending.reason == ""


def test_the_text_that_may_begin_a_stop_string_waits_for_the_next_token(tokenizer):
    ids = word_ids(tokenizer, "a long context")
    ending = Ending(tokenizer, 100, frozenset(), (" long story",))
    shown = [ending.take([i])[1] for i in ids]
    assert "".join(shown) + ending.flush() == tokenizer.decode(ids) and ending.reason == ""
    assert " long" not in "".join(shown[:2])  # held while it may be the stop string's start
