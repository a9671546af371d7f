"""RULER-style scored tasks over long contexts of real prose (real.prose), in the consumer's chat
format, and the plain-text windows of the task-free KL measure.

Families (RULER's, arXiv 2404.06654): `niah_single` (one needle: a key's magic number),
`niah_multikey` (four needles, four keys, one asked), `niah_multivalue` (four numbers for one key,
all asked), `variable_tracking` (a chain of `VAR X = VAR Y` assignments from one number, with a
distractor chain: name every variable holding it), `qa` (facts about people placed in the text,
one asked). The needles go between paragraphs at seeded depths; the prose around them is the
split's own text, cut to the context length in tokens.

An example is one seed: `seed = SEED_BASE[split] + index`, so train / validation / test never
share a seed (nor text: real.prose splits it). Its ids split where the producer's cache ends:
`context_ids` is the chat prefix through the context, `question_ids` the rest of the user turn and
the assistant header (tokenized apart, so the context's ids are the same whatever is asked).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from real import prose

FAMILIES = ("niah_single", "niah_multikey", "niah_multivalue", "variable_tracking", "qa")
SEED_BASE = {"train": 0, "validation": 100_000_000, "test": 200_000_000}
CONTEXT_TOKENS = (1024, 2048, 4096)

_ADJECTIVES = (
    "amber ancient brave calm crimson dusty eager faint gentle golden hollow icy jolly keen "
    "lively misty noble olive proud quiet rapid rusty silent tidy urban vivid wild young zesty"
).split()
_NOUNS = (
    "anchor badger canyon dolphin ember falcon glacier harbor island jungle kettle lantern meadow "
    "nectar orchard pebble quarry raven saddle thistle umbrella valley walnut yonder zephyr"
).split()
_PEOPLE = "Alice Bruno Clara Dmitri Elena Farid Greta Hiro Ingrid Jonas Kemal Lucia Mateo Nadia Oskar Priya".split()
_OBJECTS = "violin passport telescope diary compass lantern teapot chessboard camera umbrella".split()
_PLACES = (
    "blue cupboard|attic trunk|garden shed|piano bench|kitchen drawer|hall closet|cellar shelf|"
    "desk drawer|laundry basket|guest room wardrobe|garage cabinet|window seat"
).split("|")


@dataclass(frozen=True)
class Example:
    family: str
    split: str
    seed: int
    context_tokens: int  # the length asked for; len(context_ids) is within a few tokens of it
    context: str  # the prose with the needles placed
    question: str
    answers: tuple[str, ...]  # gold values in the order they appear in the context
    context_ids: list[int]
    question_ids: list[int]
    prose_digest: str

    @property
    def answer(self) -> str:
        """The gold answer as one string: the values, comma-separated."""
        return ", ".join(self.answers)


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _keys(rng: random.Random, n: int) -> list[str]:
    pairs = rng.sample([(a, b) for a in _ADJECTIVES for b in _NOUNS], n)
    return [f"{a}-{b}" for a, b in pairs]


def _magic(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def _variable_names(rng: random.Random, n: int) -> list[str]:
    names: set[str] = set()
    while len(names) < n:
        names.add("".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5)))
    return rng.sample(sorted(names), n)


def needles(family: str, rng: random.Random) -> tuple[list[str], str, tuple[str, ...]]:
    """(sentences to place in order, question, gold answers in placement order) of one example."""
    if family in ("niah_single", "niah_multikey"):
        keys = _keys(rng, 1 if family == "niah_single" else 4)
        values = [_number(rng) for _ in keys]
        asked = rng.randrange(len(keys))
        question = f"What is the special magic number for {keys[asked]} mentioned in the provided text?"
        return [_magic(k, v) for k, v in zip(keys, values)], question, (values[asked],)
    if family == "niah_multivalue":
        key = _keys(rng, 1)[0]
        values = [_number(rng) for _ in range(4)]
        question = f"What are all the special magic numbers for {key} mentioned in the provided text?"
        return [_magic(key, v) for v in values], question, tuple(values)
    if family == "variable_tracking":
        names = _variable_names(rng, 8)
        value, other = rng.sample(range(10_000, 99_999), 2)
        chain, decoy = names[:5], names[5:]
        lines = [(0, f"VAR {chain[0]} = {value}."), (0, f"VAR {decoy[0]} = {other}.")]
        lines += [(i, f"VAR {chain[i]} = VAR {chain[i - 1]}.") for i in range(1, 5)]
        lines += [(i, f"VAR {decoy[i]} = VAR {decoy[i - 1]}.") for i in range(1, 3)]
        lines.sort(key=lambda item: (item[0], rng.random()))  # each assignment after the one it reads
        question = f"Which variables are assigned the value {value}? Name all of them."
        return [text for _, text in lines], question, tuple(chain)
    if family == "qa":
        people = rng.sample(_PEOPLE, 4)
        objects = rng.sample(_OBJECTS, 4)
        places = rng.sample(_PLACES, 4)
        asked = rng.randrange(4)
        facts = [f"{p} keeps the {o} in the {w}." for p, o, w in zip(people, objects, places)]
        return facts, f"Where does {people[asked]} keep the {objects[asked]}?", (f"the {places[asked]}",)
    raise ValueError(f"family: {family!r} is not one of {FAMILIES}")


def _haystack(tokenizer, text: prose.Prose, rng: random.Random, budget: int) -> list[str]:
    """Paragraphs of the split from a seeded start (wrapping), the last one cut so the whole
    is `budget` tokens."""
    start = rng.randrange(len(text.paragraphs))
    out: list[str] = []
    used = 0
    i = start
    while used < budget:
        para = text.paragraphs[i % len(text.paragraphs)]
        ids = tokenizer(para, add_special_tokens=False)["input_ids"]
        take = min(len(ids), budget - used)
        out.append(para if take == len(ids) else tokenizer.decode(ids[:take]).rstrip())
        used += take + 1  # the paragraph break
        i += 1
        if i - start > 4 * len(text.paragraphs):
            raise ValueError(f"prose split {text.split!r} cannot fill {budget} tokens")
    return out


def chat_split(tokenizer, context: str, question: str) -> tuple[list[int], list[int]]:
    """(context_ids, question_ids) of one user turn `context\\n\\nquestion` in the tokenizer's
    chat template, cut where the context ends."""
    full = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"{context}\n\n{question}"}], add_generation_prompt=True, tokenize=False
    )
    cut = full.index(context) + len(context)
    encode = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]
    return encode(full[:cut]), encode(full[cut:])


END = "<|im_end|>"  # the end of a chat turn: greedy answers stop on it


def end_id(tokenizer) -> int:
    """The id of END (one token in the SmolLM2 vocabulary)."""
    return int(tokenizer.convert_tokens_to_ids(END))  # type: ignore[arg-type]  # one token -> one id


def answer_ids(tokenizer, example: Example) -> list[int]:
    """The consumer's answer as ids: the bare gold value(s), then the end of the assistant turn
    (what the fine-tune teaches C and what calibration scores)."""
    return tokenizer(example.answer + END, add_special_tokens=False)["input_ids"]


def make(tokenizer, family: str, split: str, index: int, context_tokens: int) -> Example:
    """Example `index` of `family` in `split` at about `context_tokens` tokens of chat prefix."""
    if split not in SEED_BASE:
        raise ValueError(f"split: {split!r} is not one of {sorted(SEED_BASE)}")
    if not 0 <= index < SEED_BASE["validation"]:
        raise ValueError(f"index: {index} is outside 0..{SEED_BASE['validation'] - 1}")
    seed = SEED_BASE[split] + index
    rng = random.Random(f"{family}:{seed}:{context_tokens}")
    sentences, question, answers = needles(family, rng)
    text = prose.load(split)
    budget = context_tokens - len(chat_split(tokenizer, " ".join(sentences), question)[0]) - 2 * len(sentences)
    state = rng.getstate()
    for _ in range(2):  # the second pass takes off what the first overshot (paragraphs tokenize apart)
        rng.setstate(state)
        paragraphs = _haystack(tokenizer, text, rng, budget)
        depths = sorted(rng.randrange(len(paragraphs) + 1) for _ in sentences)
        for offset, (depth, sentence) in enumerate(zip(depths, sentences)):
            paragraphs.insert(depth + offset, sentence)
        context = "\n\n".join(paragraphs)
        context_ids, question_ids = chat_split(tokenizer, context, question)
        budget -= max(0, len(context_ids) - context_tokens)
    return Example(family, split, seed, context_tokens, context, question, answers, context_ids, question_ids, text.digest)


def examples(tokenizer, split: str, n: int, context_tokens: int, families=FAMILIES, first: int = 0) -> list[Example]:
    """`n` examples, indices first, first+1, ...; index i is family i mod len(families), whatever
    `first` is, so a run resumed at --first N asks the examples a whole run would have (until
    this fixed it, a run resumed at 131 shifted the families of indices 131.. by one)."""
    return [make(tokenizer, families[i % len(families)], split, i, context_tokens) for i in range(first, first + n)]


@dataclass(frozen=True)
class TextWindow:
    split: str
    seed: int
    context_ids: list[int]  # real text, no chat template
    following_ids: list[int]  # the text's next tokens, scored by the KL measure
    prose_digest: str


def text_window(tokenizer, split: str, index: int, context_tokens: int, following: int = 64) -> TextWindow:
    """A window of the split's prose: `context_tokens` tokens and the `following` after them."""
    seed = SEED_BASE[split] + index
    text = prose.load(split)
    rng = random.Random(f"window:{seed}:{context_tokens}")
    ids = tokenizer("\n\n".join(_haystack(tokenizer, text, rng, context_tokens + following + 64)), add_special_tokens=False)[
        "input_ids"
    ]
    if len(ids) < context_tokens + following:
        raise ValueError(f"prose split {split!r}: {len(ids)} tokens, fewer than {context_tokens} + {following}")
    return TextWindow(split, seed, ids[:context_tokens], ids[context_tokens : context_tokens + following], text.digest)


def main(argv: list[str] | None = None) -> None:
    """One JSON line per example (ids left out): what a split holds, for a look or a diff."""
    import argparse
    import json

    from shared import pretrained

    parser = argparse.ArgumentParser(description="Print real.tasks examples as JSON lines.")
    parser.add_argument("--split", default="test", choices=sorted(SEED_BASE))
    parser.add_argument("--n", type=int, default=10)
    parser.add_argument("--context-tokens", type=int, default=1024)
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(pretrained.ensure("smollm2-135m"))
    for ex in examples(tokenizer, args.split, args.n, args.context_tokens):
        fields = {k: getattr(ex, k) for k in ("family", "split", "seed", "question", "answers", "prose_digest")}
        print(json.dumps({**fields, "context_ids": len(ex.context_ids), "question_ids": len(ex.question_ids)}))


if __name__ == "__main__":
    main()
