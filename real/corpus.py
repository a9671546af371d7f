"""The real tasks as a calibration corpus for the real pair:

    python -m calibration --producer smollm2-135m --consumer smollm2-135m-tuned \\
        --corpus real.corpus:calibration_corpus --corpus-arg ctx=512 ...

Everything comes from the train split (real.tasks seeds, real.prose train text), at indices past
the fine-tune's (`FIRST`), so calibration never sees a validation or test seed nor their text:
the moments read `n` examples (context + question + answer), the schedule loss scores the
answers of `heldout` further examples, and learned predictors train on an endless stream of more.
The scored answer is the consumer's format (the bare gold value(s), then `<|im_end|>`), the one
the fine-tune taught C. The serving runtime never sees this module.
"""

from __future__ import annotations

from collections.abc import Iterator

from calibration.corpus import Corpus
from calibration.predictor_training import TrainExample
from calibration.search import HeldOut
from real import tasks

FIRST = 10_000  # train indices below this are the fine-tune's (it uses 0..steps-1)


def heldout_example(tokenizer, example: tasks.Example) -> HeldOut:
    """Context ids, then question + answer ids scored from the answer's first token."""
    answer = tasks.answer_ids(tokenizer, example)
    return HeldOut(example.context_ids, example.question_ids + answer, len(example.question_ids))


def _stream(tokenizer, ctx_tokens: int, first: int) -> Iterator[TrainExample]:
    index = first
    while True:
        held = heldout_example(
            tokenizer, tasks.make(tokenizer, tasks.FAMILIES[index % len(tasks.FAMILIES)], "train", index, ctx_tokens)
        )
        yield TrainExample(held.context_ids, ((held.qa_ids, held.answer_start),))
        index += 1


def calibration_corpus(tokenizer, n: int, heldout: int, ctx: str = "512", heldout_split: str = "train") -> Corpus:
    """n train examples of about `ctx` tokens for the moments, the next `heldout` for the loss
    (or, with heldout_split=validation, the validation split's first `heldout`: a choice made on
    them, such as calibration.distill_keep's, never sees a train or test seed), and the predictor
    stream after those (families in turn throughout)."""
    ctx_tokens = int(ctx)
    held = [heldout_example(tokenizer, e) for e in tasks.examples(tokenizer, "train", n + heldout, ctx_tokens, first=FIRST)]
    if heldout_split != "train":
        held = held[:n] + [heldout_example(tokenizer, e) for e in tasks.examples(tokenizer, heldout_split, heldout, ctx_tokens)]
    sequences = [h.context_ids + h.qa_ids for h in held[:n]]
    return Corpus(
        f"real:train:first={FIRST}:n={n}:ctx={ctx_tokens}" + ("" if heldout_split == "train" else f":heldout={heldout_split}"),
        sequences,
        held[n:],
        _stream(tokenizer, ctx_tokens, FIRST + n + heldout),
    )
