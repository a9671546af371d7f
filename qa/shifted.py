"""Shifted evaluation sets for the tuned consumer: where a codec calibrated on the QA task may
leave its calibrated regime, and an in-distribution set to compare with (`bench.serving.audit`).

Every example is deterministic in (set, index) and drawn from test-split seeds far from the ones
anything else reads (training reads train seeds, calibration train + validation, bench.serving.quality
and qa.evaluate test seeds 0..199): set number s uses test seeds SEED_BASE + s * SEED_STRIDE + i.
The set numbers are fixed, so adding a set never changes another one.

| set | in distribution | context (words, + BOS) | question | gold |
|---|---|---|---|---|
| in_distribution | yes | 102 facts, 511 tokens (a qa.task test example) | tuned | `V2 V1` |
| long_context | no | 159 facts, 796 tokens (trained on <= 120 facts, ~600) | tuned | `V2 V1` |
| base_question_format | no | as in_distribution | base `REL NAME` | `V1 V2` (base) |
| fact_in_random_tokens | no | 506 random words + the asked fact at a random place, 512 tokens | tuned | `V2 V1` |
| random_tokens | no | 511 random words, no fact, 512 tokens | tuned, a (REL, NAME) not in it | none |
| repeated_values | no | 102 facts (511 tokens), values from 12 words (each ~17 times) | tuned | `V2 V1` |
| fact_position_first | no | as in_distribution, the first fact asked | tuned | `V2 V1` |
| fact_position_last | no | as in_distribution, the last fact asked | tuned | `V2 V1` |

Random words are drawn uniformly from the relations, names, value words and `.` (never `Q`/`?`,
the question markers); a (REL, NAME) pair that is asked never occurs in the noise, nor do the
asked fact's value words. Knows nothing about tokenizers, models or services.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from qa.task import END, NAMES, RELATIONS, VALUES, Fact, global_seed, make_example, n_facts_for, render_question, sample_facts

SEED_BASE = 70_000_000  # test-split seeds from here on are read only by this module
SEED_STRIDE = 1_000_000  # seeds per set
CTX_TOKENS = 512  # the tuned task's serving length (bench.serving.quality, calibration's predictor)
LONG_CTX_TOKENS = 800  # beyond training (<= 120 facts), within distinct value words (<= 1150)
REPEATED_POOL = 12  # value words shared by all facts of a repeated_values context
NOISE_WORDS: tuple[str, ...] = (END, *RELATIONS, *NAMES, *VALUES)


@dataclass(frozen=True)
class ShiftedExample:
    context: str  # words joined by spaces (the prompt adds BOS: tokens = words + 1)
    question: str
    answer: str | None  # gold answer words without END; None: the context holds no answer


@dataclass(frozen=True)
class EvalSet:
    name: str
    number: int  # fixes the seed range; never reused
    in_distribution: bool
    description: str
    make: Callable[[int], ShiftedExample]  # test-split seed -> example


def _rng(name: str, seed: int) -> random.Random:
    return random.Random(f"{name}:{global_seed('test', seed)}")  # str seeds are stable across processes


def _asked(facts: list[Fact], target: Fact, task: str = "tuned") -> ShiftedExample:
    question, answer = render_question(target, task)  # type: ignore[arg-type]
    return ShiftedExample(" ".join(f.text() for f in facts), question, answer)


def _facts(name: str, seed: int, ctx_tokens: int = CTX_TOKENS) -> tuple[random.Random, list[Fact]]:
    rng = _rng(name, seed)
    return rng, sample_facts(rng, n_facts_for(ctx_tokens))


def _test_example(seed: int, ctx_tokens: int, task: str) -> ShiftedExample:
    e = make_example(seed, "test", ctx_tokens, task)  # type: ignore[arg-type]
    return ShiftedExample(e.context, e.question, e.answer)


def _noise(rng: random.Random, n: int, banned_pair: tuple[str, str], banned_words: set[str]) -> list[str]:
    """n random words without `banned_words` and without the bigram `banned_pair`."""
    pool = [w for w in NOISE_WORDS if w not in banned_words]
    words: list[str] = []
    while len(words) < n:
        w = rng.choice(pool)
        if words and (words[-1], w) == banned_pair:
            continue
        words.append(w)
    return words


def fact_in_random_tokens(seed: int) -> ShiftedExample:
    rng = _rng("fact_in_random_tokens", seed)
    target = Fact(rng.choice(RELATIONS), rng.choice(NAMES), *rng.sample(VALUES, 2))
    fact = target.text().split()
    noise = _noise(rng, CTX_TOKENS - 1 - len(fact), (target.rel, target.name), {target.v1, target.v2})
    at = rng.randint(0, len(noise))
    words = noise[:at] + fact + noise[at:]
    question, answer = render_question(target, "tuned")
    return ShiftedExample(" ".join(words), question, answer)


def random_tokens(seed: int) -> ShiftedExample:
    rng = _rng("random_tokens", seed)
    rel, name = rng.choice(RELATIONS), rng.choice(NAMES)
    noise = _noise(rng, CTX_TOKENS - 1, (rel, name), set())
    question, _ = render_question(Fact(rel, name, "", ""), "tuned")
    return ShiftedExample(" ".join(noise), question, None)


def repeated_values(seed: int) -> ShiftedExample:
    rng, facts = _facts("repeated_values", seed)
    pool = rng.sample(VALUES, REPEATED_POOL)
    facts = [Fact(f.rel, f.name, *rng.sample(pool, 2)) for f in facts]
    return _asked(facts, rng.choice(facts))


def fact_position(first: bool) -> Callable[[int], ShiftedExample]:
    def make(seed: int) -> ShiftedExample:
        _, facts = _facts(f"fact_position_{'first' if first else 'last'}", seed)
        return _asked(facts, facts[0] if first else facts[-1])

    return make


SETS: dict[str, EvalSet] = {
    s.name: s
    for s in (
        EvalSet(
            "in_distribution",
            0,
            True,
            "the tuned task at 512 tokens (qa.task test example)",
            lambda seed: _test_example(seed, CTX_TOKENS, "tuned"),
        ),
        EvalSet(
            "long_context",
            1,
            False,
            f"the tuned task at {LONG_CTX_TOKENS} tokens, longer than training",
            lambda seed: _test_example(seed, LONG_CTX_TOKENS, "tuned"),
        ),
        EvalSet(
            "base_question_format",
            2,
            False,
            "512-token task context, the base task's question `REL NAME`",
            lambda seed: _test_example(seed, CTX_TOKENS, "base"),
        ),
        EvalSet("fact_in_random_tokens", 3, False, "the asked fact inside 512 tokens of random words", fact_in_random_tokens),
        EvalSet("random_tokens", 4, False, "512 tokens of random words, a question with no answer in them", random_tokens),
        EvalSet(
            "repeated_values", 5, False, f"512-token task context whose values come from {REPEATED_POOL} words", repeated_values
        ),
        EvalSet("fact_position_first", 6, False, "512-token task context, the first fact asked", fact_position(True)),
        EvalSet("fact_position_last", 7, False, "512-token task context, the last fact asked", fact_position(False)),
    )
}


def examples(name: str, n: int, start: int = 0) -> Iterator[ShiftedExample]:
    """Examples `start .. start+n-1` of set `name`."""
    spec = SETS[name]
    for i in range(start, start + n):
        yield spec.make(SEED_BASE + spec.number * SEED_STRIDE + i)
