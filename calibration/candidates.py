"""The other transfer modes on an SCD artifact's loss scale, and
`python -m calibration.candidates ARTIFACT`: add them to an existing artifact file.

`measure` gives every non-SCD transfer option (`raw`; `quant` at 8 and 4 bits; `recompute` over
each span the artifact records) the loss its schedules carry: mean KL(oracle || reconstructed)
over the same held-out answer tokens (calibration.search.LossEvaluator.mean_kl), with each option
run through its own codec (shared.codecs: the producer's encoder over P's layer states, the
consumer's decoder into C's cache, as the services run them), and its payload bytes per context
token at the artifact's geometry (shared.scd.schedule's per-action costs). Stored as the
artifact's meta["candidates"]: [{"mode", "options" (as the codec resolves them), "loss",
"bytes_per_token", "how": "measured"}]; measured, not fitted, so the artifact id does not change.

Owns these measurements and the command; not the codecs, the schedule search or the file format.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from calibration import corpus as corpus_lib
from calibration.pair import load_pair
from calibration.search import HeldOut, LossEvaluator
from shared import kv
from shared.codecs import Codec, EncodeRequest, StreamInfo, create_codecs
from shared.errors import FailedPrecondition
from shared.models import DTYPES, LoadedModel
from shared.scd.artifact import Artifact
from shared.scd.schedule import Action, Geometry, Schedule, bytes_per_token

QUANT_BITS = ("8", "4")
# A stored schedule loss and its re-measurement on the same held-out set may differ by this much
# (relative, plus an absolute floor in nats for near-zero losses): code changes since calibration
# moved the shipped 2-layer artifacts' schedule losses by up to 8e-4 relative (a few 1e-8 nats near
# 0); one held-out example more or less moves some of them by percents.
TOLERANCE = (2e-3, 1e-6)


def recorded_spans(meta: Mapping) -> list[tuple[int, int]]:
    """Every recompute span the artifact records: the profiled best of each width
    (meta["recompute_spans"]) and the recompute baseline's own (meta["recompute_span"])."""
    spans = [tuple(s) for s in meta.get("recompute_spans", {}).values()]
    if "recompute_span" in meta:
        spans.append(tuple(meta["recompute_span"]))
    return sorted({(int(s), int(e)) for s, e in spans})


def payload_bytes_per_token(mode: str, options: Mapping[str, str], g: Geometry, num_layers: int) -> float:
    """Payload bytes per context token over all layers, from the per-action costs of shared.scd.schedule."""
    if mode == "raw":
        return Schedule((Action("raw"),) * num_layers).bytes_per_token(g)
    if mode == "quant":
        quant = dataclasses.replace(g, quant_group=int(options["group_size"]))
        return Schedule((Action("quant", int(options["bits"])),) * num_layers).bytes_per_token(quant)
    if mode == "recompute":  # raw K/V outside [start, end), the hidden state entering start (producer dtype)
        start, end = int(options["start"]), int(options["end"])
        return (num_layers - (end - start)) * bytes_per_token(Action("raw"), g) + g.hidden * g.kv_element_bytes
    raise ValueError(mode)


def codec_kv(
    producer: Codec, consumer: Codec, options: Mapping[str, str], states: dict[int, kv.LayerState], num_tokens: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The consumer's cache one context's states make through a codec: every layer encoded by the
    producer's encoder, moved to the CPU as the wire would, decoded by the consumer's decoder;
    per layer (keys, values) [n_kv, T, hd]."""
    info = producer.model.info
    encoder = producer.encoder(options, EncodeRequest(num_tokens))
    stream = StreamInfo(info.num_layers, num_tokens, info.dtype, options, encoder.metadata(), producer_digest=info.weight_digest)
    decoder = consumer.decoder(stream)
    cache = kv.empty_cache(consumer.model)
    decoder.bind(cache)  # as the consumer's engine binds its own KV blocks
    for layer in range(info.num_layers):
        decoder.add_layer(layer, {name: t.detach().cpu().contiguous() for name, t in encoder.encode(states[layer]).items()})
    decoder.finish()
    return [(keys[0], values[0]) for keys, values in (kv.layer_kv(cache, l) for l in range(info.num_layers))]


def codec_loss(ev: LossEvaluator, codecs: tuple[Codec, Codec], options: Mapping[str, str], states: list) -> float:
    """The loss of one codec's option on ev's held-out set; states: P's layer states per example."""
    return ev.mean_kl(lambda i: codec_kv(*codecs, options, states[i], len(ev.heldout[i].context_ids)))


def measure(
    art: Artifact,
    producer: LoadedModel,
    consumer: LoadedModel,
    heldout: list[HeldOut],
    ev: LossEvaluator | None = None,
    log: Callable[[str], None] = lambda m: None,
) -> list[dict]:
    """One entry per non-SCD transfer option (module doc), on the held-out set `ev` scores (made
    from `heldout` when not given)."""
    ev = ev or LossEvaluator(art, producer, consumer, heldout)
    names = ["raw", "quant", "recompute"]
    sides = create_codecs(producer, names), create_codecs(consumer, names)
    asked = [("raw", {}), *(("quant", {"bits": b}) for b in QUANT_BITS)]
    asked += [("recompute", {"start": str(s), "end": str(e)}) for s, e in recorded_spans(art.meta)]
    states = [kv.capture_states(producer, ex.context_ids, kv.Capture.KV | kv.Capture.HIDDEN)[0] for ex in ev.heldout]
    out = []
    for mode, options in asked:
        resolved = sides[1][mode].resolve(options)  # as the consumer resolves a request's options
        loss = codec_loss(ev, (sides[0][mode], sides[1][mode]), resolved, states)
        cost = float(payload_bytes_per_token(mode, resolved, art.geometry, art.num_layers))
        out.append({"mode": mode, "options": resolved, "loss": loss, "bytes_per_token": cost, "how": "measured"})
        log(f"{mode} {resolved}: loss {loss:.6g}, {cost:g} B/token{_profiled(art.meta, mode, resolved, loss)}")
    return out


def _profiled(meta: Mapping, mode: str, options: Mapping[str, str], loss: float) -> str:
    """The recompute profile's own loss for this span, beside the codec's (they should agree)."""
    span = (options.get("start"), options.get("end"))
    rows = [r for r in meta.get("recompute_profile", []) if mode == "recompute" and (str(r["start"]), str(r["end"])) == span]
    return f" (recompute_profile kl {rows[0]['kl']:.6g}, differs by {loss - rows[0]['kl']:.3g})" if rows else ""


def scale_mismatches(art: Artifact, ev: LossEvaluator, tolerance: tuple[float, float] = TOLERANCE) -> list[str]:
    """Each schedule whose loss re-measured on ev's held-out set is not its stored loss (all of
    them, not only the lowest-loss one: that one can be exact, 0, on any held-out set)."""
    out = []
    relative, floor = tolerance
    for entry in art.schedules:
        again = ev.loss(Schedule.parse(entry.schedule, art.num_layers).actions)
        if abs(again - entry.loss) > relative * abs(entry.loss) + floor:
            out.append(f"{entry.name} ({entry.schedule}): stored loss {entry.loss:.6g}, re-measured {again:.6g}")
    return out


def loaded(args: argparse.Namespace) -> tuple[Artifact, LoadedModel, LoadedModel, corpus_lib.Corpus]:
    """The artifact of a command line (--artifact, --dtype, --threads and the corpus flags), its
    pair loaded and checked against its digests, and its corpus (by default the artifact's own
    counts); SystemExit naming what does not match."""
    torch.set_num_threads(args.threads)
    art = Artifact.load(args.artifact)
    if DTYPES[args.dtype].itemsize != art.geometry.kv_element_bytes:
        raise SystemExit(
            f"{args.artifact}: calibrated with {art.geometry.kv_element_bytes}-byte K/V elements; --dtype {args.dtype} has "
            f"{DTYPES[args.dtype].itemsize}"
        )
    try:
        producer, consumer = load_pair(art, args.dtype)
    except FailedPrecondition as exc:
        raise SystemExit(f"{args.artifact}: {exc}") from None
    n = art.meta["corpus"]["sequences"] if args.n is None else args.n  # a file corpus holds out the lines after the n
    heldout = art.meta["calibration"]["heldout_examples"] if args.heldout is None else args.heldout
    return art, producer, consumer, corpus_lib.load(args.corpus, consumer.tokenizer, n, heldout, dict(args.corpus_arg))


def written(art: Artifact, section: str, rows: list[dict]) -> None:
    """rows as the artifact's measured section (its id unchanged), written back to its file and
    printed, one JSON line each."""
    art.meta[section] = rows
    art.rewrite()
    for c in rows:
        print(json.dumps({"artifact": art.artifact_id, **c}))
    print(f"wrote {len(rows)} {section} into {art.path} ({art.artifact_id})", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m calibration.candidates", description=__doc__)
    p.add_argument("artifact", type=Path, help="the .safetensors file, rewritten in place (with its .json)")
    corpus_lib.add_arguments(p, n=None, heldout=None)  # default: the artifact's own counts
    p.add_argument("--dtype", default="float32", help="the dtype the artifact was calibrated in")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = p.parse_args(argv)
    art, producer, consumer, corpus = loaded(args)
    ev = LossEvaluator(art, producer, consumer, corpus.heldout)
    wrong = scale_mismatches(art, ev)
    if wrong:
        raise SystemExit(
            f"{args.artifact}: refused: {len(wrong)} of {len(art.schedules)} schedules re-measure to another loss on this "
            f"held-out set ({len(corpus.heldout)} examples, corpus {corpus.name}), so it is not the one the artifact was "
            f"calibrated on ({art.meta['calibration']['heldout_examples']} examples, corpus {art.meta['corpus']['name']}; "
            "check --corpus, --corpus-arg, --n, --heldout and --dtype): " + "; ".join(wrong)
        )
    written(art, "candidates", measure(art, producer, consumer, corpus.heldout, ev, log=lambda m: print(m, file=sys.stderr)))


if __name__ == "__main__":
    main()
