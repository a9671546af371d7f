"""Real English prose for long contexts: the Python Language Reference's topic texts that CPython
ships in its standard library (`pydoc_data/topics.py`, PSF License 2.0; the same module is in
Debian's libpython3.x-stdlib), so every machine with the interpreter has it and nothing is
downloaded.

Owns picking the prose paragraphs (code, grammar rules and headings dropped), the split of the
topics into train / validation / test (disjoint text, on top of the tasks' disjoint seeds), and
the digest that names the text a row was made from. Knows nothing about tasks or models.
"""

from __future__ import annotations

import hashlib
import re
import sys
import textwrap
from dataclasses import dataclass
from functools import cache

SOURCE = "CPython {v} pydoc_data.topics (Python Language Reference topics), PSF License 2.0"
SPLITS = ("train", "validation", "test")
_HEADING = re.compile(r"[*=\-~^]+")


@dataclass(frozen=True)
class Prose:
    split: str
    paragraphs: tuple[str, ...]  # in document order, each one line of text
    digest: str  # sha256 of this split's paragraphs, joined by blank lines
    source: str


def prose_paragraph(block: str) -> str | None:
    """One paragraph of running text, joined to one line; None for code, grammar, headings,
    tables and fragments."""
    text = textwrap.dedent(block).strip()
    lines = text.split("\n")
    if not text or _HEADING.fullmatch(lines[-1].strip()) or ">>>" in text or "::=" in text or "  # " in text:
        return None
    if not text.endswith((".", ":")) or len(text.split()) < 8:
        return None
    if sum(c.isalpha() or c.isspace() for c in text) / len(text) < 0.85:
        return None
    return " ".join(line.strip() for line in lines)


SHARES = (0.6, 0.2, 0.2)  # of the text's characters, in order: train, validation, test


@cache
def load(split: str) -> Prose:
    """The split's share of the prose: the topics in name order, their paragraphs (each distinct
    one once) concatenated and cut at 60 % and 80 % of the characters (contiguous text, so a
    context reads on)."""
    if split not in SPLITS:
        raise ValueError(f"split: {split!r} is not one of {SPLITS}")
    from pydoc_data.topics import topics

    every = [para for name in sorted(topics) for block in re.split(r"\n\s*\n", topics[name]) if (para := prose_paragraph(block))]
    every = list(dict.fromkeys(every))  # topics repeat some paragraphs: each once, so no text is in two splits
    total, seen, which = sum(map(len, every)), 0, SPLITS.index(split)
    start, end = sum(SHARES[:which]) * total, sum(SHARES[: which + 1]) * total
    mine = []
    for para in every:
        if start <= seen < end:
            mine.append(para)
        seen += len(para)
    paragraphs = tuple(mine)
    digest = hashlib.sha256("\n\n".join(paragraphs).encode()).hexdigest()
    version = ".".join(map(str, sys.version_info[:3]))
    return Prose(split, paragraphs, digest, SOURCE.format(v=version))
