"""The QA test-bed as a calibration corpus: `python -m calibration --corpus qa.corpus:calibration_corpus`.

Train-split contexts (with their question and answer) for the moments, validation-split
questions for the loss, and an endless deterministic stream of train contexts with several
questions each for predictor training. Depends on the calibration package's types; the
serving runtime never sees this module.
"""

from __future__ import annotations

import random
from typing import Iterator

from calibration.corpus import Corpus
from calibration.predictor_training import TrainExample
from calibration.search import HeldOut
from qa.task import END, Example, examples, render_question


def heldout_example(example: Example, tokenizer) -> HeldOut:
    """A QA example as ids: context (with BOS), question + answer + END, scored from the answer."""

    def ids(text: str, special: bool) -> list[int]:
        return tokenizer(text, add_special_tokens=special)["input_ids"]

    q, a = ids(example.question, False), ids(f"{example.answer} {END}", False)  # the answer and its terminator
    return HeldOut(ids(example.context, True), q + a, len(q))


def train_stream(ctx_tokens: int, task: str, tokenizer, questions: int = 8) -> Iterator[TrainExample]:
    """Endless QA train-split contexts, each with `questions` questions about its facts (the
    example's own first), answers scored; deterministic (predictor training)."""

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    seed = 0
    while True:
        for e in examples("train", 1000, ctx_tokens, task, start=seed):
            rng = random.Random(e.context)
            facts = [e.target] + rng.sample([f for f in e.facts if f != e.target], min(questions, len(e.facts)) - 1)
            conts = []
            for fact in facts:
                q, a = render_question(fact, task)
                q_ids = ids(q)
                conts.append((q_ids + ids(f"{a} {END}"), len(q_ids)))
            yield TrainExample(tokenizer(e.context)["input_ids"], tuple(conts))
        seed += 1000


def calibration_corpus(tokenizer, n: int, heldout: int, task: str = "tuned", ctx: str = "256",
                       predictor_ctx: str = "512") -> Corpus:
    """n train examples (context + question + answer) of `ctx` tokens, `heldout` validation
    examples, and the predictor stream at `predictor_ctx` tokens; `task` is the consumer's."""
    ctx_tokens = int(ctx)
    sequences = [h.context_ids + h.qa_ids for h in (heldout_example(e, tokenizer) for e in examples("train", n, ctx_tokens, task))]
    held = [heldout_example(e, tokenizer) for e in examples("validation", heldout, ctx_tokens, task)]
    return Corpus(f"qa:{task}:train:n={n}:ctx={ctx_tokens}", sequences, held, train_stream(int(predictor_ctx), task, tokenizer))
