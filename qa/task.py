"""Seeded, deterministic long-context QA task: facts, questions, gold answers, splits.

Owns the text format only. A context is `<n>` facts written as `REL NAME V1 V2 .` (one line of
words each, joined by spaces): names are made-up entities with several relations each, the pair
(REL, NAME) is unique within a context and every value word occurs once per context, so finding
an answer is an induction (copy) pattern. Two renderings of a question about one fact:

- base task  : question `REL NAME`       -> answer `V1 V2`   (trained for model P)
- tuned task : question `Q REL NAME ?`   -> answer `V2 V1`   (the shift model C is tuned on)

The prompt a model sees is `context + " " + question`, and it is trained to continue with
`answer + " ."` ("." terminates every answer). Because the tokenizer is word-level and splits on
whitespace, tokenizing `context` (with BOS) and `question` (no special tokens) separately and
concatenating the ids gives exactly the trained prompt (tests/test_qa_task.py checks this).

The context and the queried fact depend only on (split, seed, ctx_tokens), not on the task, so
the base and tuned examples of one seed share a context (the KV a producer would ship).
Splits draw from disjoint global seed ranges. Knows nothing about tokenizers or models.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterator, Literal

Split = Literal["train", "validation", "test"]
Task = Literal["base", "tuned"]

RELATIONS: tuple[str, ...] = (
    "color", "city", "food", "job", "pet", "sport",
    "tool", "song", "drink", "gem", "tree", "car",
)
END = "."  # terminates every fact and every answer
QUERY_OPEN = "Q"  # tuned-task question opener
QUERY_CLOSE = "?"  # tuned-task question closer
FACT_TOKENS = 5  # REL NAME V1 V2 .
MIN_CTX_TOKENS = 16
MAX_CTX_TOKENS = 4096

SPLIT_SIZE = 100_000_000  # seeds per split; global seed = offset + seed
SPLIT_OFFSET: dict[str, int] = {"train": 0, "validation": SPLIT_SIZE, "test": 2 * SPLIT_SIZE}

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
_N_NAMES = 200
_N_VALUES = 460  # values stay distinct within a context up to 230 facts (~1150 tokens)


def _word_pool(pattern: str, count: int, seed: int) -> tuple[str, ...]:
    """`count` distinct made-up lowercase words spelled by `pattern` (C=consonant, V=vowel)."""
    rng = random.Random(seed)
    words: set[str] = set()
    while len(words) < count:
        words.add("".join(rng.choice(_CONSONANTS if c == "C" else _VOWELS) for c in pattern))
    return tuple(sorted(words))


# Disjoint by spelling: names have five letters, values four; fixed seeds, so the vocabulary
# (and with it the tokenizer) never changes between runs.
NAMES: tuple[str, ...] = _word_pool("CVCVC", _N_NAMES, seed=11)
VALUES: tuple[str, ...] = _word_pool("CVCV", _N_VALUES, seed=12)


def vocabulary() -> list[str]:
    """Every word the task can emit, in a fixed order (the tokenizer's non-special vocab)."""
    return [END, QUERY_OPEN, QUERY_CLOSE, *RELATIONS, *NAMES, *VALUES]


@dataclass(frozen=True)
class Fact:
    rel: str
    name: str
    v1: str
    v2: str

    def text(self) -> str:
        return f"{self.rel} {self.name} {self.v1} {self.v2} {END}"


@dataclass(frozen=True)
class Example:
    context: str  # facts joined by spaces; no leading/trailing space
    question: str  # rendered for the task; starts without a space
    answer: str  # gold answer words, without the END terminator
    facts: tuple[Fact, ...]
    target: Fact  # the fact the question asks about


def n_facts_for(ctx_tokens: int) -> int:
    """Facts that fit in `ctx_tokens` context tokens, counting one BOS token."""
    if not MIN_CTX_TOKENS <= ctx_tokens <= MAX_CTX_TOKENS:
        raise ValueError(f"ctx_tokens must be in [{MIN_CTX_TOKENS}, {MAX_CTX_TOKENS}]: {ctx_tokens}")
    return (ctx_tokens - 1) // FACT_TOKENS


def global_seed(split: Split, seed: int) -> int:
    if split not in SPLIT_OFFSET:
        raise ValueError(f"unknown split {split!r}")
    if not 0 <= seed < SPLIT_SIZE:
        raise ValueError(f"seed must be in [0, {SPLIT_SIZE}): {seed}")
    return SPLIT_OFFSET[split] + seed


def sample_facts(rng: random.Random, n_facts: int) -> list[Fact]:
    """`n_facts` facts: entities with 2-4 relations each (more once names run short), unique
    (REL, NAME), and value words distinct while the pool allows (<= 230 facts); beyond that
    each value word occurs at most ceil(2 * n_facts / len(VALUES)) times."""
    if n_facts > len(NAMES) * len(RELATIONS):
        raise ValueError(f"too many facts: {n_facts}")
    names = rng.sample(NAMES, len(NAMES))
    values: list[str] = []
    while len(values) < 2 * n_facts:
        values += rng.sample(VALUES, min(len(VALUES), 2 * n_facts - len(values)))
    keys: list[tuple[str, str]] = []
    while len(keys) < n_facts:
        name, left = names.pop(), n_facts - len(keys)
        k = min(max(rng.randint(2, 4), -(-left // (len(names) + 1))), len(RELATIONS), left)
        keys.extend((rel, name) for rel in rng.sample(RELATIONS, k))
    rng.shuffle(keys)
    return [Fact(rel, name, values[2 * i], values[2 * i + 1]) for i, (rel, name) in enumerate(keys)]


def render_question(fact: Fact, task: Task) -> tuple[str, str]:
    """(question, answer) for `fact` in the given task's style."""
    if task == "base":
        return f"{fact.rel} {fact.name}", f"{fact.v1} {fact.v2}"
    if task == "tuned":
        return f"{QUERY_OPEN} {fact.rel} {fact.name} {QUERY_CLOSE}", f"{fact.v2} {fact.v1}"
    raise ValueError(f"unknown task {task!r}")


def make_example(seed: int, split: Split, ctx_tokens: int = 512, task: Task = "base") -> Example:
    """The example number `seed` of `split`; deterministic in (seed, split, ctx_tokens, task)."""
    rng = random.Random(global_seed(split, seed) * 8191 + ctx_tokens)
    facts = sample_facts(rng, n_facts_for(ctx_tokens))
    target = rng.choice(facts)
    question, answer = render_question(target, task)
    context = " ".join(f.text() for f in facts)
    return Example(context, question, answer, tuple(facts), target)


def examples(split: Split, n: int, ctx_tokens: int = 512, task: Task = "base", start: int = 0) -> Iterator[Example]:
    """Examples `start .. start+n-1` of `split`."""
    for seed in range(start, start + n):
        yield make_example(seed, split, ctx_tokens, task)
