"""`python -m calibration`: calibrate an SCD artifact for a (producer, consumer) pair and write
`<out>.safetensors` (+ a readable `<out>.json`); one JSON line per schedule on stdout.

The corpus is given (calibration.corpus): a .txt / .jsonl file, or a provider such as
`--corpus qa.corpus:calibration_corpus --corpus-arg task=tuned --corpus-arg ctx=256`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from calibration import corpus as corpus_lib
from calibration.distill import distill
from calibration.predictor_training import TrainConfig
from shared.models import load_model


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m calibration", description=__doc__)
    p.add_argument("--producer", required=True, help="path, hub id or builtin tiny name")
    p.add_argument("--consumer", required=True)
    p.add_argument("--dtype", default="float32")
    corpus_lib.add_arguments(p, n=64, heldout=12)
    p.add_argument("--loss-target", type=float, default=0.02)
    p.add_argument("--generations", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--recompute-span",
        default="",
        help="START,END: the recompute baseline's layers [START, END) as given (no profile; on 30 layers the "
        "profile is most of a small calibration's time); default: profiled",
    )
    p.add_argument("--window", type=int, default=1, help="tokens of producer state per code (heterogeneous pairs)")
    p.add_argument(
        "--schedules",
        default="",
        help="measure these schedules instead of searching: comma-separated, "
        "each per-layer text ('R16.R16.P.W') or one action for every layer ('R32*')",
    )
    p.add_argument(
        "--predictor-layers",
        default="none",
        help="heterogeneous pairs: layers with a learned non-linear predictor: none | all | auto | auto:K | '1,3'",
    )
    p.add_argument("--predictor-steps", default="1500,2000", help="predictor training steps: kv-error stage, KL stage")
    p.add_argument("--predictor-mult", type=int, default=2, help="predictor MLP width / hidden size")
    p.add_argument("--predictor-depth", type=int, default=2, help="predictor decoder layers")
    p.add_argument(
        "--predictor-pool",
        default="0",
        help="N[,K]: train predictors on N examples captured once (K of them, default all, with C's cache for "
        "the KL stage) instead of new examples every step (two forwards each); 0: the stream",
    )
    p.add_argument("--predictor-lr", type=float, default=2e-3, help="peak learning rate of the kv-error stage")
    p.add_argument("--predictor-kl-lr", type=float, default=5e-4, help="peak learning rate of the KL stage")
    p.add_argument("--predictor-clip", type=float, default=0.0, help="max gradient norm per predictor step (0: none)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--out", required=True, type=Path, help="output .safetensors path")
    return p


def span(text: str) -> tuple[int, int] | None:
    """'START,END' -> (START, END); '' -> None (profiled)."""
    if not text:
        return None
    start, end = (int(x) for x in text.split(","))
    return start, end


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    producer = load_model(args.producer, args.dtype, "auto")
    consumer = producer if args.consumer == args.producer else load_model(args.consumer, args.dtype, "auto")
    corpus = corpus_lib.load(args.corpus, consumer.tokenizer, args.n, args.heldout, dict(args.corpus_arg))
    mse_steps, kl_steps = (int(x) for x in args.predictor_steps.split(","))
    pool, _, kl_pool = args.predictor_pool.partition(",")
    train_cfg = TrainConfig(
        mse_steps=mse_steps,
        kl_steps=kl_steps,
        seed=args.seed,
        intermediate_mult=args.predictor_mult,
        depth=args.predictor_depth,
        lr=args.predictor_lr,
        kl_lr=args.predictor_kl_lr,
        clip=args.predictor_clip,
        pool=int(pool),
        kl_pool=int(kl_pool or 0),
    )
    layers_n = consumer.info.num_layers
    given = [".".join([t[:-1]] * layers_n) if t.endswith("*") else t for t in args.schedules.split(",") if t]
    art = distill(
        producer,
        consumer,
        corpus.sequences,
        corpus.heldout,
        corpus_name=corpus.name,
        loss_target=args.loss_target,
        generations=args.generations,
        seed=args.seed,
        schedules=given,
        window=args.window,
        recompute_span=span(args.recompute_span),
        predictor_layers=args.predictor_layers,
        predictor_examples=corpus.train_stream,
        predictor_train=train_cfg,
        log=lambda m: print(m, file=sys.stderr),
    )
    art.save(args.out)
    for s in art.meta["schedules"]:
        print(json.dumps({"artifact": art.artifact_id, **s}))
    print(f"wrote {args.out} ({art.artifact_id})", file=sys.stderr)


if __name__ == "__main__":
    main()
