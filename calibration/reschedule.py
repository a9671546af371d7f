"""Search an artifact's schedules again over the maps and predictors it already has:
`python -m calibration.reschedule`.

Fitting a real pair's maps and predictors is most of a calibration's time (an hour on the 30-layer
pair with four predictors); the schedule search is the rest, and it changes when the lattice does
(a new action such as `P8`) or the loss target does. This runs only the search (calibration.search,
the same lattice and loss as `python -m calibration`) on the artifact's own held-out examples, which
the same corpus flags rebuild (the corpus digest must match the artifact's), then the cache audit's
thresholds for the new schedules, and writes a new artifact: the same tensors, new schedules, the
search's report naming the artifact it came from, and so a new id (the report is hashed with the
fitted content: a schedule name such as s3 never means two schedules under one artifact id).
`--schedules` measures given texts instead.

    python -m calibration.reschedule --artifact A.safetensors --corpus real.corpus:calibration_corpus \\
        --corpus-arg ctx=512 --n 96 --heldout 8 --loss-target 0.02 --out B.safetensors
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

from calibration import audit_thresholds, moments, search
from calibration import corpus as corpus_lib
from calibration.pair import load_pair
from shared.models import LoadedModel
from shared.scd.artifact import Artifact


def reschedule(
    art: Artifact,
    producer: LoadedModel,
    consumer: LoadedModel,
    heldout: list[search.HeldOut],
    *,
    loss_target: float,
    generations: int = 30,
    seed: int = 0,
    max_schedules: int = 12,
    schedules: list[str] | None = None,
    log=print,
) -> Artifact:
    """A new artifact with `art`'s tensors and schedules searched (or `schedules` measured) on `heldout`."""
    g = art.geometry
    ev = search.LossEvaluator(art, producer, consumer, heldout)
    front, report = search.schedule_front(ev, g, loss_target, schedules=schedules, generations=generations, seed=seed, log=log)
    meta = copy.deepcopy(art.meta)
    meta.pop("artifact_id", None)
    meta["schedules"] = search.entries(search.evenly_spaced(front, max_schedules))
    meta["search"] = {**report, "from_artifact": art.artifact_id, "lattice": [str(a) for a in search.action_lattice(g, True)]}
    meta["calibration"]["loss_target"] = loss_target
    out = Artifact(art.tensors, meta)
    meta["audit"] = audit_thresholds.thresholds(out, producer, consumer, heldout)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m calibration.reschedule", description=__doc__)
    p.add_argument("--artifact", type=Path, required=True)
    corpus_lib.add_arguments(p, n=64, heldout=12)
    p.add_argument("--loss-target", type=float, default=0.02)
    p.add_argument("--generations", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--schedules", default="", help="measure these schedule texts (comma-separated) instead of searching")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    art = Artifact.load(args.artifact)
    producer, consumer = load_pair(art)
    corpus = corpus_lib.load(args.corpus, consumer.tokenizer, args.n, args.heldout, dict(args.corpus_arg))
    digest = moments.corpus_digest(corpus.sequences)
    if digest != art.meta["corpus"]["digest"]:
        raise SystemExit(
            f"--corpus: digest {digest[:16]} is not artifact {art.artifact_id}'s corpus "
            f"({art.meta['corpus']['name']}, {art.meta['corpus']['digest'][:16]}): give the flags it was calibrated with"
        )
    if len(corpus.heldout) != art.meta["calibration"]["heldout_examples"]:
        raise SystemExit(f"--heldout: {len(corpus.heldout)} examples; artifact {art.artifact_id} was searched on "
                         f"{art.meta['calibration']['heldout_examples']}")  # fmt: skip
    new = reschedule(
        art,
        producer,
        consumer,
        corpus.heldout,
        loss_target=args.loss_target,
        generations=args.generations,
        seed=args.seed,
        schedules=[t for t in args.schedules.split(",") if t],
        log=lambda m: print(m, file=sys.stderr),
    )
    new.save(args.out)
    for s in new.meta["schedules"]:
        print(json.dumps({"artifact": new.artifact_id, **s}))
    print(f"wrote {args.out} ({new.artifact_id}, from {art.artifact_id})", file=sys.stderr)


if __name__ == "__main__":
    main()
