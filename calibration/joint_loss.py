"""Where a pair's loss sits when every layer is rebuilt at once: `python -m calibration.joint_loss`.

The schedule search's sensitivities change one layer at a time (every other layer C's own). This
measures the other direction on the same loss (calibration.search.LossEvaluator: KL of C's
answers, nats per answer token): every layer rebuilt one way, `W` (P's K/V as they are: naive
reuse) or `P` (Patch through the artifact's linear map, or its learned predictor where it has
one), except the given layers, left C's own: what fixing those layers can buy at most; the given
layers alone rebuilt (`--only`: the search's sensitivity, on these examples); and the artifact's
schedules. One JSON line per row.

    python -m calibration.joint_loss --artifact artifacts/smollm2-pc.safetensors \\
        --corpus real.corpus:calibration_corpus --corpus-arg ctx=512 --corpus-arg heldout_split=validation \\
        --n 0 --heldout 24 --own 23 --own 17,18,23,28 --only 23 --schedules s7,s11,R8.P8.R16...
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from calibration import corpus as corpus_lib
from calibration.pair import load_pair
from calibration.search import LossEvaluator
from shared.scd.artifact import Artifact
from shared.scd.schedule import Action, Schedule


def rows(
    ev: LossEvaluator,
    layers: int,
    bases: list[str],
    owns: list[list[int]],
    schedules: list[tuple[str, Schedule, float]],
    onlys: tuple[list[int], ...] = (),
    schedule_owns: bool = False,
) -> list[dict]:
    """Every base action in every layer, with no layer and then each of `owns` left C's own; each
    base action only in each of `onlys` (every other layer C's own); then each (name, schedule,
    bytes per token), and with `schedule_owns` each schedule with each of `owns` left C's own too
    (where a schedule's loss sits)."""
    out = []
    for base in bases:
        action = Action.parse(base)
        no_layer: list[int] = []
        for own in [no_layer, *owns]:
            actions = [None if layer in own else action for layer in range(layers)]
            out.append({"rebuilt": f"{base} in every layer", "own": own, "loss": ev.loss(actions)})
        for only in onlys:
            actions = [action if layer in only else None for layer in range(layers)]
            own = [layer for layer in range(layers) if layer not in only]
            out.append({"rebuilt": f"{base} only in {','.join(map(str, only))}", "own": own, "loss": ev.loss(actions)})
    for name, s, size in schedules:
        for own in [[], *(owns if schedule_owns else [])]:
            actions = [None if layer in own else a for layer, a in enumerate(s.actions)]
            out.append(
                {
                    "rebuilt": "schedule",
                    "name": name,
                    "schedule": str(s),
                    "bytes_per_token": size,
                    "own": own,
                    "loss": ev.loss(actions),
                }
            )
    return out


def named_schedule(art: Artifact, text: str, layers: int) -> tuple[str, Schedule, float]:
    """(name, schedule, bytes per token) of one of the artifact's schedules by name, or of a
    schedule's text, `LABEL=TEXT` or bare (named as the artifact's schedule of that text, if any,
    else "given")."""
    known = {e.name: e for e in art.schedules}
    label, eq, rest = text.partition("=")
    if eq:
        return label, *named_schedule(art, rest, layers)[1:]
    if text in known:
        return known[text].name, Schedule.parse(known[text].schedule, layers), known[text].bytes_per_token
    if "." not in text:
        raise SystemExit(f"--schedules: {text!r} is neither one of the artifact's ({', '.join(known)}) nor a schedule's text")
    s = Schedule.parse(text, layers)
    name = next((e.name for e in art.schedules if e.schedule == str(s)), "given")
    return name, s, s.bytes_per_token(art.geometry)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m calibration.joint_loss", description=__doc__)
    p.add_argument("--artifact", type=Path, required=True)
    corpus_lib.add_arguments(p, n=0, heldout=24)
    p.add_argument("--bases", default="W,P", help="actions every layer takes: W (P's K/V), P (Patch), Q4, R<rank>, ...")
    p.add_argument("--own", action="append", default=[], help="comma-separated layers left C's own (repeatable)")
    p.add_argument("--only", action="append", default=[], help="comma-separated layers the bases alone rebuild (repeatable)")
    p.add_argument(
        "--schedules",
        default="",
        help="schedules to measure too, comma-separated: the artifact's by name (s0, s7, ...) or any by text (R8.P8..., "
        "or LABEL=R8.P8... to name it)",
    )
    p.add_argument("--schedule-own", action="store_true", help="measure each schedule with each --own set C's own too")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, help="append the rows here too")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    art = Artifact.load(args.artifact)
    producer, consumer = load_pair(art)
    corpus = corpus_lib.load(args.corpus, consumer.tokenizer, args.n, args.heldout, dict(args.corpus_arg))
    ev = LossEvaluator(art, producer, consumer, corpus.heldout)
    layers = consumer.info.num_layers
    schedules = [named_schedule(art, s, layers) for s in args.schedules.split(",") if s]
    owns = [[int(x) for x in o.split(",")] for o in args.own]
    onlys = tuple([int(x) for x in o.split(",")] for o in args.only)
    common = {
        "artifact": art.artifact_id,
        "predictor_layers": art.predictor_layers,
        "heldout": corpus.name,
        "examples": len(corpus.heldout),
        "producer": producer.info.model_id,
        "consumer": consumer.info.model_id,
        "dtype": "float32",
    }
    for row in rows(ev, layers, args.bases.split(","), owns, schedules, onlys, args.schedule_own):
        line = json.dumps({**common, **row})
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")
    print(f"{ev.evaluations} evaluations in {time.perf_counter() - started:.0f}s", file=sys.stderr)


if __name__ == "__main__":
    main()
