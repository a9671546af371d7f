"""Calibrating the cache audit's thresholds (shared.audit) for an artifact's schedules, and
`python -m calibration.audit_thresholds`: add them to an existing artifact file.

For each schedule, the audit runs on the cache that schedule rebuilds for every held-out
(in-distribution) example, through the same encode/decode code the services run
(calibration.search.LossEvaluator). A compressed schedule has a normal, non-zero audit error per
layer (Reuse at low rank is inexact by design), so the threshold is per layer: MARGIN x the
largest error seen on that layer, floored at FLOOR. Stored in the artifact's metadata as
{"audit": {"positions", "margin", "floor", "thresholds": {schedule text: [per layer]},
"heldout_max": {...}}}; the artifact id does not change (it covers fitted tensors, not
measurements).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from calibration import corpus as corpus_lib
from calibration.search import HeldOut, LossEvaluator
from shared import audit, kv
from shared.models import LoadedModel, load_model
from shared.scd.artifact import Artifact
from shared.scd.schedule import Schedule

MARGIN = 1.5
FLOOR = 0.01
POSITIONS = 8


def thresholds(
    art: Artifact, producer: LoadedModel, consumer: LoadedModel, heldout: list[HeldOut], positions: int = POSITIONS
) -> dict:
    """The artifact's "audit" metadata for its schedules over `heldout`."""
    ev = LossEvaluator(art, producer, consumer, heldout)
    worst: dict[str, list[float]] = {}
    for entry in art.schedules:
        schedule = Schedule.parse(entry.schedule, art.num_layers)
        errors = []
        for index, ex in enumerate(heldout):
            cache = kv.empty_cache(consumer)
            for layer, action in enumerate(schedule.actions):
                keys, values = ev.layer_kv(index, layer, action)
                kv.put_layer(cache, layer, keys, values)
            checked = audit.positions(len(ex.context_ids), positions, seed=len(ex.context_ids))
            errors.append(audit.audit(consumer, ex.context_ids, cache, checked).layer_errors)
        worst[entry.schedule] = [max((e[layer] for e in errors), default=0.0) for layer in range(art.num_layers)]
    return {
        "positions": positions,
        "margin": MARGIN,
        "floor": FLOOR,
        "heldout_examples": len(heldout),
        "heldout_max": worst,
        "thresholds": {s: [max(MARGIN * v, FLOOR) for v in per_layer] for s, per_layer in worst.items()},
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m calibration.audit_thresholds", description=__doc__)
    p.add_argument("--producer", required=True)
    p.add_argument("--consumer", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--artifact", required=True, type=Path)
    p.add_argument("--corpus", required=True, help="as for python -m calibration (its held-out set is used)")
    p.add_argument("--corpus-arg", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--heldout", type=int, default=12)
    args = p.parse_args(argv)
    producer = load_model(args.producer, args.dtype, "auto")
    consumer = producer if args.consumer == args.producer else load_model(args.consumer, args.dtype, "auto")
    corpus = corpus_lib.load(args.corpus, consumer.tokenizer, 0, args.heldout, dict(a.split("=", 1) for a in args.corpus_arg))
    art = Artifact.load(args.artifact)
    before = art.artifact_id
    art.meta["audit"] = thresholds(art, producer, consumer, corpus.heldout)
    art.save(args.artifact)
    assert art.artifact_id == before, "the artifact id must not change"
    print(json.dumps({"artifact": art.artifact_id, **art.meta["audit"]}))
    print(f"wrote audit thresholds into {args.artifact}", file=sys.stderr)


if __name__ == "__main__":
    main()
