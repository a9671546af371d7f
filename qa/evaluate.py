"""Evaluation over a split: run any `Predictor` on generated examples and print JSON lines.

Owns the report format (one JSON object per line, em/f1 as fractions 0..1) and the `pair`
report: base P on the base task, tuned C on the tuned task, C on P's context KV ("raw" naive
reuse), and the layer-mixing rows (C with P's KV in some layers, its own in the others).
The per-example prediction is pluggable (`qa.predict.Predictor`), so a service-backed
predictor runs through the same `evaluate` function. Knows nothing about training.

    python -m qa.evaluate pair [--pairs 2-layer,deep-full,deep-lora] [--n 200] [--ctx 512 256 1024]
    python -m qa.evaluate model checkpoints/qa-tuned --task tuned [--ctx 512] [--n 200]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from qa.metrics import score
from qa.predict import Predictor, cross_cache, own_prefill
from qa.task import Split, Task, examples
from qa.tokenizer import load_tokenizer

MAX_NEW_TOKENS = 4  # answers are two words; the '.' terminator stops decoding earlier


def evaluate(
    predict: Predictor, split: Split, n: int, ctx_tokens: int, task: Task,
    max_new_tokens: int = MAX_NEW_TOKENS, start: int = 0,
) -> dict:
    """{"split", "ctx", "task", "n", "em", "f1"} of `predict` on examples start..start+n-1."""
    pairs = [
        (predict(ex.context, ex.question, max_new_tokens), ex.answer)
        for ex in examples(split, n, ctx_tokens, task, start=start)
    ]
    return {"split": split, "ctx": ctx_tokens, "task": task, **score(pairs)}


# pair name -> (producer P, consumer C) checkpoint folders under the checkpoints root
PAIRS = {
    "2-layer": ("qa-base", "qa-tuned"),
    "deep-full": ("deep/qa-deep-base", "deep/qa-deep-tuned"),  # 6 layers, C = full fine-tune of P
    "deep-lora": ("deep/qa-deep-base", "deep/qa-deep-lora"),  # 6 layers, C = P + merged LoRA
}


def load_pair(checkpoints: str | Path, pair: str = "2-layer"):
    """(base model P, tuned model C, tokenizer) of `pair` under `checkpoints`."""
    root = Path(checkpoints)
    producer, consumer = PAIRS[pair]
    base = AutoModelForCausalLM.from_pretrained(root / producer).eval()
    tuned = AutoModelForCausalLM.from_pretrained(root / consumer).eval()
    return base, tuned, load_tokenizer(root / producer)


def _emit(row: dict) -> None:
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)


def pair_report(checkpoints: str | Path, n: int, ctxs: list[int], mix_ctx: int, split: Split = "test",
                pair: str = "2-layer") -> None:
    """One JSON line per (model, ctx, cache_from) and per layer mix; `base_layers` names the layers
    whose KV comes from P (the others are C's own): the halves, then with more than two layers
    each single layer ("3") and each layer left out ("all-but-3")."""
    base, tuned, tok = load_pair(checkpoints, pair)
    n_layers = tuned.config.num_hidden_layers
    half = n_layers // 2
    rows: list[tuple[dict, Predictor, Task]] = []
    for ctx in ctxs:
        rows += [
            ({"model": "base", "ctx": ctx}, own_prefill(base, tok), "base"),
            ({"model": "tuned", "ctx": ctx}, own_prefill(tuned, tok), "tuned"),
            ({"model": "tuned", "cache_from": "base", "mode": "raw", "ctx": ctx}, cross_cache(base, tuned, tok), "tuned"),
        ]
    rows.append(({"model": "tuned", "ctx": mix_ctx}, own_prefill(tuned, tok), "base"))  # kept its base skill?
    mixes = {f"0-{half - 1}": range(half), f"{half}-{n_layers - 1}": range(half, n_layers)}
    if n_layers > 2:  # with two layers the halves already are the single layers
        mixes.update({str(i): [i] for i in range(n_layers)})
        mixes.update({f"all-but-{i}": [j for j in range(n_layers) if j != i] for i in range(n_layers)})
    for label, layers in mixes.items():
        pred = cross_cache(base, tuned, tok, producer_layers=layers)
        rows.append(({"model": "tuned", "cache_from": "base", "mode": "raw", "base_layers": label, "ctx": mix_ctx}, pred, "tuned"))
    for head, predict, task in rows:
        t0 = time.time()
        result = evaluate(predict, split, n, head["ctx"], task)
        _emit({"pair": pair, "layers": n_layers, **head, "task": task, "split": split, "n": result["n"], "em": result["em"], "f1": result["f1"],
               "wall_s": round(time.time() - t0, 1)})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m qa.evaluate", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    pair = sub.add_parser("pair", help="base/tuned/naive-reuse/layer-mix report as JSON lines")
    pair.add_argument("--checkpoints", default="checkpoints")
    pair.add_argument("--pairs", default="2-layer", help=f"comma-separated, of: {', '.join(PAIRS)}")
    pair.add_argument("--n", type=int, default=200)
    pair.add_argument("--ctx", type=int, nargs="+", default=[512, 256, 1024])
    pair.add_argument("--mix-ctx", type=int, default=512, help="context length of the layer-mixing rows")
    pair.add_argument("--split", default="test", choices=["train", "validation", "test"])
    one = sub.add_parser("model", help="one checkpoint's own prefill on one task")
    one.add_argument("checkpoint")
    one.add_argument("--task", default="base", choices=["base", "tuned"])
    one.add_argument("--n", type=int, default=200)
    one.add_argument("--ctx", type=int, nargs="+", default=[512])
    one.add_argument("--split", default="test", choices=["train", "validation", "test"])
    for p in (pair, one):
        p.add_argument("--threads", type=int, default=1, help="intra-op threads; 1 is far faster on shared cores")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.command == "pair":
        for name in args.pairs.split(","):
            if name not in PAIRS:
                parser.error(f"--pairs: unknown pair {name!r}; known: {list(PAIRS)}")
        for name in args.pairs.split(","):
            pair_report(args.checkpoints, args.n, args.ctx, args.mix_ctx, args.split, name)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.checkpoint).eval()
        predict = own_prefill(model, load_tokenizer(args.checkpoint))
        for ctx in args.ctx:
            _emit({"model": str(args.checkpoint), **evaluate(predict, args.split, args.n, ctx, args.task)})


if __name__ == "__main__":
    main(sys.argv[1:])
