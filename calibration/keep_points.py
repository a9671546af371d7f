"""Token selection on an SCD artifact's loss scale, and
`python -m calibration.keep_points --artifact PATH [--policies ...] [--fractions ...] [--codecs ...]`:
add keep points to an existing artifact file.

A keep point is one codec point (raw, quant:BITS, scd:SCHEDULE) sent with one keep set (policy at
a fraction of the context's tokens, shared.keep), measured as the services run it: the producer's
KeptEncoder over P's layer states (scored per layer by the policy, the codec's payloads of the
kept tokens), payloads moved to the CPU as the wire would, the consumer's KeptDecoder into C's
cache of the kept tokens at their original positions; loss = mean KL(oracle || C on that cache)
over the same held-out answer tokens as the schedules and candidates (calibration.search
.LossEvaluator.mean_kl). Bytes per context token = the payloads measured (the codec's bytes of
the kept tokens plus each layer's keep set, shared.codecs.keep_set), i.e. the codec point's bytes
x the kept share + the index bytes for the per-token codecs.

A learned policy (`distill`) scores with the pair's keep weights, the file beside the artifact
(`<artifact stem>.keep.safetensors`, shared.keep.distill), as the producer serving this artifact
does; its points name those weights' digest ("keep_weights"), and auto offers them only while the
producer says it holds the same weights for this artifact (Describe's keep_weights_digest).

Stored as meta["keep_points"]: [{"mode", "options" (the codec's, resolved), "keep" (the
selection's label, resolved for the codec), "loss", "bytes_per_token", "kept_share", "how":
"measured", "keep_weights" (learned policies only)}]; measured, not fitted (shared.scd.artifact.MEASURED), so the artifact id and digests
do not change, and an artifact without the section has no keep points. Before writing, each codec
point is measured without a keep set and must give the loss the artifact stores for it (the same
held-out set), else the command refuses.

Owns these measurements and the command; not the codecs, the policies or the file format.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from calibration import corpus as corpus_lib
from calibration.candidates import TOLERANCE, codec_loss, loaded, written
from calibration.search import HeldOut, LossEvaluator
from shared import kv
from shared.codecs import Codec, EncodeRequest, StreamInfo, create_codecs
from shared.codecs.kept import KeepRequest, KeptDecoder, KeptEncoder
from shared.keep import distill
from shared.keep.distill import LEARNED, DistillCache
from shared.keep.policy import Policy
from shared.models import LoadedModel
from shared.scd.artifact import Artifact

POLICIES = ("streaming", "snapkv")
FRACTIONS = ("0.25", "0.5", "0.75")
CODECS = ("raw", "scd:DEFAULT")


def codec_points(art: Artifact, asked: list[str]) -> list[tuple[str, dict[str, str], float]]:
    """(mode, options, stored loss) of each asked codec point: `raw`, `quant:BITS`, `scd:NAME`
    (a schedule name or `DEFAULT`: Artifact.default_entry); SystemExit naming one the artifact lacks."""
    stored = {(c["mode"], c["options"].get("bits", "")): c["loss"] for c in art.meta.get("candidates", [])}
    out = []
    for text in asked:
        mode, _, arg = text.partition(":")
        if mode == "scd":
            entry = art.default_entry() if arg in ("", "DEFAULT") else next((e for e in art.schedules if e.name == arg), None)
            if entry is None:
                raise SystemExit(f"--codecs: {text!r}: no schedule {arg!r} in artifact {art.artifact_id}")
            out.append(("scd", {"artifact": art.artifact_id, "schedule": entry.name}, entry.loss))
        elif mode in ("raw", "quant") and (mode, arg) in stored:
            out.append((mode, {"bits": arg} if arg else {}, stored[(mode, arg)]))
        else:
            raise SystemExit(f"--codecs: {text!r} is not raw | quant:BITS | scd:NAME measured in the artifact's candidates")
    return out


def kept_kv(
    codecs: tuple[Codec, Codec],
    options: Mapping[str, str],
    keep: KeepRequest,
    state: dict[int, kv.LayerState],
    num_tokens: int,
    policy: Policy | None = None,
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int]:
    """The consumer's cache of the kept tokens a keep transfer makes (the services' KeptEncoder
    and KeptDecoder around the codec), per layer (keys, values) [n_kv, n, hd], and the payload
    bytes it sent. `policy`: a learned policy's pair weights (None: the registry's heuristic)."""
    producer, consumer = codecs
    info = producer.model.info
    encoder = KeptEncoder(producer.encoder(options, EncodeRequest(num_tokens)), keep, producer.model, num_tokens, policy)
    stream = StreamInfo(
        info.num_layers,
        num_tokens,
        info.dtype,
        options,
        encoder.metadata(),
        producer_digest=info.weight_digest,
        kept_tokens=keep.kept(num_tokens),
    )
    decoder = KeptDecoder(consumer.decoder(stream), stream, keep, consumer.model.info.num_kv_heads)
    cache = kv.empty_cache(consumer.model)
    decoder.bind(cache)
    sent = 0
    for layer in range(info.num_layers):
        payloads = {name: t.detach().cpu().contiguous() for name, t in encoder.encode(state[layer]).items()}
        sent += sum(t.numel() * t.element_size() for t in payloads.values())
        for name, t in payloads.items():
            decoder.check(layer, name, t)
        decoder.add_layer(layer, payloads)
    decoder.finish()
    return [(keys[0], values[0]) for keys, values in (kv.layer_kv(cache, l) for l in range(info.num_layers))], sent


def keep_point(
    ev: LossEvaluator,
    pair: tuple[Codec, Codec],
    options: Mapping[str, str],
    keep: KeepRequest,
    states: list,
    policy: Policy | None = None,
) -> dict:
    """One keep point's loss on ev's held-out set, its payload bytes per context token and kept share."""
    sent, shares = [], []

    def rebuilt(i: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        T = len(ev.heldout[i].context_ids)
        layer_kv, nbytes = kept_kv(pair, options, keep, states[i], T, policy)
        sent.append(nbytes / T)
        shares.append(keep.kept(T) / T)
        return layer_kv

    loss = ev.mean_kl(rebuilt)
    return {
        "loss": loss,
        "bytes_per_token": sum(sent) / len(sent),
        "kept_share": round(sum(shares) / len(shares), 6),
        "how": "measured",
    }


def measure(
    art: Artifact,
    producer: LoadedModel,
    consumer: LoadedModel,
    heldout: list[HeldOut],
    policies: list[str],
    fractions: list[str],
    asked: list[str],
    ev: LossEvaluator | None = None,
    log: Callable[[str], None] = lambda m: None,
) -> list[dict]:
    """One entry per (codec point x policy x fraction) (module doc); SystemExit when a codec point
    without a keep set does not re-measure to its stored loss (another held-out set)."""
    ev = ev or LossEvaluator(art, producer, consumer, heldout)
    points = codec_points(art, asked)
    learned = {name: pair_weights(art, name) for name in policies if name in LEARNED}
    names = sorted({mode for mode, _, _ in points})
    sides = create_codecs(producer, names, [art]), create_codecs(consumer, names, [art])
    needs = kv.Capture.KV | kv.Capture.NORMED | kv.Capture.HIDDEN
    states = [kv.capture_states(producer, ex.context_ids, needs)[0] for ex in ev.heldout]
    out = []
    relative, floor = TOLERANCE
    for mode, options, stored in points:
        pair = (sides[0][mode], sides[1][mode])
        resolved = pair[1].resolve(options)
        whole = codec_loss(ev, pair, resolved, states)
        if abs(whole - stored) > relative * abs(stored) + floor:
            raise SystemExit(
                f"artifact {art.artifact_id}: refused: {mode} {resolved} re-measures to loss {whole:.6g}, the artifact stores"
                f" {stored:.6g}: not the held-out set it was calibrated on (check --corpus, --corpus-arg, --n, --heldout, --dtype)"
            )
        for policy in policies:
            for fraction in fractions:
                keep = KeepRequest.parse(f"{policy}:{fraction}").for_codec(pair[1])
                weights = learned.get(policy)
                row = {
                    "mode": mode,
                    "options": resolved,
                    "keep": keep.label,
                    **keep_point(ev, pair, resolved, keep, states, weights),
                }
                if weights is not None:
                    row["keep_weights"] = weights.digest
                out.append(row)
                log(
                    f"{mode} {resolved} keep {keep.label}: loss {row['loss']:.6g} (without: {whole:.6g}), {row['bytes_per_token']:g} B/token"
                )
    return out


def pair_weights(art: Artifact, policy: str) -> DistillCache:
    """A learned policy's weights for this artifact's pair: the file beside it (SystemExit naming
    it where there is none or it is not a keep weights file)."""
    if art.path is None:
        raise SystemExit(f"--policies: {policy!r} reads the keep weights beside the artifact file; this artifact has no path")
    try:
        return distill.load(distill.weights_path(art.path))
    except ValueError as e:
        raise SystemExit(f"--policies: {e}") from None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m calibration.keep_points", description=__doc__)
    p.add_argument("--artifact", type=Path, required=True, help="the .safetensors file, rewritten in place (with its .json)")
    p.add_argument("--policies", default=",".join(POLICIES), help="shared.keep policies, comma-separated")
    p.add_argument(
        "--fractions",
        default=",".join(FRACTIONS),
        help="kept fractions of the context, comma-separated (each may carry the policy's options: 0.25:window=16)",
    )
    p.add_argument("--codecs", default=",".join(CODECS), help="codec points: raw, quant:BITS, scd:NAME or scd:DEFAULT")
    corpus_lib.add_arguments(p, n=None, heldout=None)  # default: the artifact's own counts
    p.add_argument("--dtype", default="float32", help="the dtype the artifact was calibrated in")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = p.parse_args(argv)
    art, producer, consumer, corpus = loaded(args)
    policies = [x for x in args.policies.split(",") if x]
    fractions = [x for x in args.fractions.split(",") if x]
    asked = [x for x in args.codecs.split(",") if x]
    rows = measure(art, producer, consumer, corpus.heldout, policies, fractions, asked, log=lambda m: print(m, file=sys.stderr))
    written(art, "keep_points", rows)


if __name__ == "__main__":
    main()
