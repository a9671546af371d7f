"""What calibration is given to learn from: a `Corpus` of token sequences (for the moments), a
held-out question/answer set (for the loss) and an endless stream of training examples (for
learned predictors).

A corpus comes from a file (`.txt` lines, or `.jsonl` records with "text" or pre-tokenized
"ids") or from a provider named `package.module:function`, called as
`function(tokenizer, n=..., heldout=..., **args)` and returning a Corpus; the QA test-bed
provides `qa.corpus:calibration_corpus`. Calibration itself never imports a provider's package.
"""

from __future__ import annotations

import argparse
import importlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from calibration.predictor_training import TrainExample
from calibration.search import HeldOut


@dataclass
class Corpus:
    name: str  # recorded in the artifact's metadata
    sequences: list[list[int]]  # calibration sequences (moments)
    heldout: list[HeldOut]  # question/answer examples scored by the loss
    train_stream: Iterator[TrainExample]  # endless, for predictor training (read lazily)


def text_stream(sequences: list[list[int]]) -> Iterator[TrainExample]:
    """Endless (first 80% | last 20%, all scored) splits of the sequences, in order."""
    while True:
        for s in sequences:
            cut = max(1, int(len(s) * 0.8))
            yield TrainExample(s[:cut], ((s[cut:], 0),))


def from_file(path: Path, n: int, heldout: int, tokenizer) -> Corpus:
    """Lines of a text file, or JSONL records with "text" or pre-tokenized "ids"; the `heldout`
    sequences after the first n are split into context (first 80%) / question (next 10%) /
    answer (last 10%)."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    records: list[dict[str, Any]] = (
        [json.loads(line) for line in lines] if path.suffix == ".jsonl" else [{"text": line} for line in lines]
    )
    seqs: list[list[int]] = [r["ids"] if "ids" in r else tokenizer(r["text"])["input_ids"] for r in records]
    if any(len(s) < 10 for s in seqs):
        raise ValueError(f"{path}: every sequence needs >= 10 tokens (the tokenizer may not know its words)")
    sequences, rest = seqs[:n], seqs[n : n + heldout]
    held = [HeldOut(s[: int(len(s) * 0.8)], s[int(len(s) * 0.8) :], max(1, int(len(s) * 0.1))) for s in rest]
    return Corpus(f"file:{path}", sequences, held, text_stream(sequences))


def load(spec: str, tokenizer, n: int, heldout: int, args: Mapping[str, str] | None = None) -> Corpus:
    """A corpus from a file path or a `module:function` provider (args go to the provider)."""
    args = dict(args or {})
    if ":" in spec and not Path(spec).exists():
        module, _, function = spec.partition(":")
        provider = getattr(importlib.import_module(module), function)
        return provider(tokenizer, n=n, heldout=heldout, **args)
    if args:
        raise ValueError(f"corpus args {sorted(args)} are for a provider; {spec} is a file")
    return from_file(Path(spec), n, heldout, tokenizer)


def corpus_arg(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE")
    return key, value


def add_arguments(p: argparse.ArgumentParser, n: int | None, heldout: int | None) -> None:
    """The corpus flags of calibration's command lines: --corpus, --corpus-arg, --n, --heldout."""
    p.add_argument("--corpus", required=True, help="a .txt file, a .jsonl file (text or ids), or a provider module:function")
    p.add_argument(
        "--corpus-arg",
        type=corpus_arg,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="argument for a corpus provider (repeatable)",
    )
    p.add_argument("--n", type=int, default=n, help="calibration sequences")
    p.add_argument("--heldout", type=int, default=heldout, help="held-out question/answer examples for the loss")
