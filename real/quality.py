"""Answer quality and bytes of every transfer on the real pair, over real.tasks examples:

    python -m real.quality --artifact artifacts/smollm2-pc.safetensors --split test --n 200 \\
        --context-tokens 1024 --modes oracle,naive,scd:s4,quant:2,quant:4,recompute --out rows.jsonl

Per example, the producer P prefills the context once (its layer states), the consumer C prefills
it once (the oracle's cache); each mode's cache is C's rebuild of P's states through that mode's
codec, the code the services run (calibration.candidates.codec_kv: P's encoder, payloads moved
to the CPU as the wire would, C's decoder), and C answers greedily on it (the question's ids, then
up to --max-new-tokens). Modes: `oracle` (C's own cache), `naive` (P's K/V as they are: the raw
codec), `quant:B` (KIVI-style, B in 8/4/2 bits), `recompute` (DroidSpeak-style over the artifact's
profiled span), `scd:S` (schedule S of the artifact: a name or its per-layer text). Any mode may
end in `@POLICY:BUDGET` (shared.keep: `oracle@snapkv:0.25`, `scd:s11@h2o:0.5`, `naive@knorm:256`):
the mode's cache, then only the tokens that policy keeps at that budget (a fraction or a count per
layer and KV head), at their original positions, the question continuing at the context's
length. An scd mode's selection is one keep set per layer for all its KV heads, as the services
send it (its label then names `heads=shared`; rows of runs before 2026-12-06 kept per KV head). Policies: shared.keep's heuristics, `distill` (DistillCache: its weights are the
artifact's `<stem>.keep.safetensors`, calibration.distill_keep) and `snapkv-q` (SnapKV with the
question's queries as its window: the keep set serves that question only; no KL rows, the text
windows have no question). The side that holds the cache before any transfer scores its tokens from its own prefill:
C for the oracle's cache, P for every codec (the producer chooses what it sends; selection after
the per-token codecs raw and scd is what sending only the kept tokens gives; quant's token groups
and recompute's spans would see only kept tokens on the wire: there it is an approximation).
Bytes per context token are the mode's times the kept share, plus the keep set (per layer and
head set: a bitmap or 2-byte positions, whichever is smaller).

One JSON line per example and mode (scores: real.score; identical = same text as the oracle's),
then with `--windows K` the task-free measure per mode (mean next-token KL of C over the 64 real
tokens after K text windows, real.kl), then one summary line per mode: mean EM / F1 / recall /
identical, the F1 and the paired F1 gap to the oracle with 95 % bootstrap intervals, bytes per
context token and the ratio to raw K/V in the run's dtype and in bfloat16. Every line names the
pair (weights, digests, dtype, origin), the artifact and the split. Offline on purpose: one
prefill per side per example serves every mode (the services would repeat them per mode);
tests/test_real_quality.py checks that the services give the same answers.
`python -m real.quality summarize ROWS.jsonl [ARTIFACT]` writes the summaries of a run stopped early
or of runs over other example ranges joined in one file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from calibration import candidates
from calibration.kl import layer_cache
from qa.metrics import bootstrap_ci
from real import kl, score, tasks
from real.reuse_gap import answer, model_row
from shared import kv
from shared.codecs import create_codecs
from shared.keep import Selection, distill, kept_cache, parse_selection
from shared.keep.policy import layer_scores, parse_fields
from shared.keep.question import QuestionSnapKV, question_scores
from shared.models import LoadedModel, load_model
from shared.scd.artifact import Artifact


def parse_mode(text: str) -> tuple[str, str, dict[str, str], Selection | None]:
    """'quant:4' -> (label, codec, options, None); `oracle` has no codec (""); a suffix
    '@POLICY:BUDGET' gives the token selection (shared.keep)."""
    base, at, keep = text.partition("@")
    selection = None
    if at:
        try:
            selection = parse_selection(keep)
        except ValueError as e:
            raise SystemExit(f"--modes: {text!r}: {e}") from None
    head, _, arg = base.partition(":")
    if head == "oracle":
        return text, "", {}, selection
    if head == "naive":
        return text, "raw", {}, selection
    if head == "quant" and arg:
        return text, "quant", {"bits": arg}, selection
    if head == "recompute":
        return text, "recompute", {}, selection
    if head == "scd" and arg:
        if selection is not None and not selection.shared:  # as the services resolve it (KeepRequest.for_codec)
            if parse_fields(keep)[2].get("shared") is False:  # heads=each, named
                raise SystemExit(f"--modes: {text!r}: scd sends one row per token for all KV heads: heads=shared only")
            selection = dataclasses.replace(selection, shared=True)
            text = f"{base}@{selection.label}"  # names heads=shared, as no per-head row of an earlier run does
        return text, "scd", {"schedule": arg}, selection
    raise SystemExit(
        f"--modes: {text!r} is not oracle | naive | quant:BITS | recompute | scd:SCHEDULE, then @POLICY:BUDGET or not"
    )


def index_bytes_per_token(selection: Selection, kept_share: float, layers: int, kv_heads: int) -> float:
    """Bytes per context token of the keep sets: per layer and head set, a bitmap (1 bit per
    context token) or 2-byte positions of the kept ones, whichever is smaller."""
    sets = layers * (1 if selection.shared else kv_heads)
    return sets * min(1 / 8, 2 * kept_share)


class Modes:
    """Each mode's codec pair, resolved options and bytes per context token."""

    def __init__(self, art: Artifact, producer: LoadedModel, consumer: LoadedModel, asked: list[str]):
        self.asked = [parse_mode(m) for m in asked]
        self.producer, self.consumer = producer, consumer
        self.needs_normed = any(sel is not None and sel.policy.needs for _, _, _, sel in self.asked)
        names = sorted({codec for _, codec, _, _ in self.asked if codec})
        sides = create_codecs(producer, names, [art]), create_codecs(consumer, names, [art])
        g, layers = art.geometry, art.num_layers
        self.layers, self.kv_heads = layers, producer.info.num_kv_heads
        self.raw_bytes = candidates.payload_bytes_per_token("raw", {}, g, layers)
        self.raw_bf16 = layers * g.kv_width * 2
        self.codecs, self.options, self.bytes = {}, {}, {}
        for label, codec, options, _ in self.asked:
            if not codec:
                continue  # the oracle sends nothing
            if codec == "scd":
                options = {**options, "artifact": art.artifact_id}
            if codec == "recompute":
                start, end = art.meta["recompute_span"]
                options = {"start": str(start), "end": str(end)}
            resolved = sides[1][codec].resolve(options)
            self.codecs[label], self.options[label] = (sides[0][codec], sides[1][codec]), resolved
            self.bytes[label] = (
                art.pick(resolved["schedule"]).bytes_per_token
                if codec == "scd"
                else candidates.payload_bytes_per_token(codec, resolved, g, layers)
            )

    def caches(self, consumer: LoadedModel, states, own: tuple, ids: list[int], question_ids: list[int] | None = None):
        """(label, cache) per mode for one context `ids`: `states` are P's, `own` is C's (states,
        cache), the oracle's cache. A mode with a selection gets a kept cache (shared.keep), scored
        by the side holding the cache before any transfer: C for the oracle's, P for every codec's.
        A question-aware selection (snapkv-q) scores with `question_ids` (one more prefill of
        context + question on that side); without a question (the KL windows) its modes are left out."""
        own_states, own_cache = own
        num_tokens = len(ids)
        scored: dict[tuple[str, str], list] = {}  # (side, policy) -> scores per layer, for every budget
        rebuilt: dict[tuple, list] = {}  # (codec, options) -> C's rebuild, for every selection of that mode
        for label, codec, _, selection in self.asked:
            if not codec and selection is None:
                yield label, own_cache
                continue
            asks_question = selection is not None and isinstance(selection.policy, QuestionSnapKV)
            if asks_question and not question_ids:
                continue
            if codec:
                key_kv = (codec, tuple(sorted(self.options[label].items())))
                if key_kv not in rebuilt:
                    rebuilt[key_kv] = candidates.codec_kv(*self.codecs[label], self.options[label], states, num_tokens)
                layer_kv = rebuilt[key_kv]
            else:
                layer_kv = [own_states[layer].kv() for layer in range(consumer.info.num_layers)]
            if selection is None:
                yield label, layer_cache(consumer, layer_kv)
                continue
            side, model, side_states = ("C", self.consumer, own_states) if not codec else ("P", self.producer, states)
            key = (side, selection.policy.name)
            if key not in scored and asks_question:
                scored[key] = question_scores(model, ids, question_ids or [])
            elif key not in scored:
                scored[key] = layer_scores(selection.policy, model, side_states)
            yield label, kept_cache(consumer, layer_kv, selection.select(scored[key]))

    def selection(self, label: str) -> Selection | None:
        return next(sel for lab, _, _, sel in self.asked if lab == label)

    def weights(self, label: str) -> dict | None:
        """The learned policy's weights a mode ran with (inputs, file digest); None for a heuristic."""
        sel = self.selection(label)
        return getattr(sel.policy, "weights", None) if sel is not None else None


def _states(producer: LoadedModel, ids: list[int]):
    return kv.capture_states(producer, ids, kv.Capture.KV | kv.Capture.NORMED | kv.Capture.HIDDEN)[0]


def _own(consumer: LoadedModel, ids: list[int], normed: bool = False):
    """C's own prefill: (its layer states, its cache); the normed inputs where a selection needs them."""
    states = kv.capture_states(consumer, ids, kv.Capture.KV | (kv.Capture.NORMED if normed else kv.Capture.NONE))[0]
    return states, layer_cache(consumer, [states[layer].kv() for layer in range(consumer.info.num_layers)])


def mode_caches(
    producer: LoadedModel, consumer: LoadedModel, modes: Modes, ids: list[int], question_ids: list[int] | None = None
):
    """(label, C's cache) per mode for one context: one prefill per side serves every mode (and one
    of context + question per side for a question-aware selection)."""
    states = _states(producer, ids) if modes.codecs else {}  # P's prefill only where a codec reads it
    yield from modes.caches(consumer, states, _own(consumer, ids, modes.needs_normed), ids, question_ids)


def answers(producer: LoadedModel, consumer: LoadedModel, modes: Modes, example: tasks.Example, max_new_tokens: int) -> dict:
    """{mode label: C's greedy answer text} for one example."""
    return answered(producer, consumer, modes, example, max_new_tokens)[0]


def answered(producer: LoadedModel, consumer: LoadedModel, modes: Modes, example: tasks.Example, max_new_tokens: int):
    """({mode label: C's greedy answer text}, {mode label: context tokens its cache stores})."""
    stop = tasks.end_id(consumer.tokenizer)
    said, kept = {}, {}
    for label, cache in mode_caches(producer, consumer, modes, example.context_ids, example.question_ids):
        said[label] = answer(consumer, cache, example.question_ids, stop, max_new_tokens)
        kept[label] = cache.get_seq_length()
    return said, kept


def run(art: Artifact, producer: LoadedModel, consumer: LoadedModel, modes: Modes, args, emit) -> list[dict]:
    tok = consumer.tokenizer
    rows = []
    for example in tasks.examples(tok, args.split, args.n, args.context_tokens, first=args.first):
        said, kept = answered(producer, consumer, modes, example, args.max_new_tokens)
        for label, text in said.items():
            row = {
                "kind": "task",
                "family": example.family,
                "seed": example.seed,
                "context_tokens": len(example.context_ids),
                "kept_tokens": kept[label],
                "mode": label,
                "gold": example.answer,
                "prediction": text,
                **score.score(text, example, said["oracle"]),
            }
            weights = modes.weights(label)
            if weights:
                row["keep_weights"] = weights
            rows.append(row)
            emit(row)
    for i in range(args.windows):
        window = tasks.text_window(tok, args.split, args.first + i, args.context_tokens)
        ids = window.context_ids
        states, own = _states(producer, ids) if modes.codecs else {}, _own(consumer, ids, modes.needs_normed)
        for label, cache in modes.caches(consumer, states, own, ids):
            value = 0.0 if cache is own[1] else kl.mean_kl(consumer, own[1], cache, window.following_ids)
            row = {"kind": "kl", "seed": window.seed, "context_tokens": len(ids), "kept_tokens": cache.get_seq_length()}
            rows.append({**row, "mode": label, "mean_kl": value})
            emit(rows[-1])
    return rows


def _bytes(modes: Modes, label: str, kept_share: float) -> dict:
    """Bytes per context token and the ratios to raw K/V; none for the oracle (it sends nothing).
    With a selection: the mode's bytes times the kept share, plus the keep sets."""
    if label not in modes.bytes:
        return {"bytes_per_token": None, "bytes_ratio_vs_raw": None, "bytes_ratio_vs_bf16_raw": None}
    b = modes.bytes[label]
    selection = modes.selection(label)
    if selection is not None:
        b = b * kept_share + index_bytes_per_token(selection, kept_share, modes.layers, modes.kv_heads)
    return {
        "bytes_per_token": round(b, 2),
        "bytes_ratio_vs_raw": round(modes.raw_bytes / b, 2),
        "bytes_ratio_vs_bf16_raw": round(modes.raw_bf16 / b, 2),
    }


def summaries(rows: list[dict], modes: Modes) -> list[dict]:
    task = [r for r in rows if r["kind"] == "task"]
    oracle = {r["seed"]: r["f1"] for r in task if r["mode"] == "oracle"}
    out = []
    for label, _, _, selection in modes.asked:
        mine = [r for r in task if r["mode"] == label]
        kl_rows = [r for r in rows if r["kind"] == "kl" and r["mode"] == label]
        kls = [r["mean_kl"] for r in kl_rows]
        weights = modes.weights(label)
        if not mine and not kls:
            continue
        measured = mine + kl_rows
        kept_share = sum(r.get("kept_tokens", r["context_tokens"]) / r["context_tokens"] for r in measured) / len(measured)
        out.append(
            {
                "kind": "summary",
                "mode": label,
                "options": modes.options.get(label, {}),
                "keep": None
                if selection is None
                else {
                    "selection": selection.label,
                    "kept_share": round(kept_share, 4),
                    "scored_by": "P" if label in modes.bytes else "C",
                    **({"weights": weights} if weights else {}),
                },
                **_task_summary(mine, oracle),
                "windows": len(kls),
                "mean_kl": round(sum(kls) / len(kls), 5) if kls else None,
                "mean_kl_ci95": [round(x, 5) for x in bootstrap_ci(kls)] if kls else None,
                **_bytes(modes, label, kept_share),
            }
        )
    return out


def _task_summary(mine: list[dict], oracle: dict) -> dict:
    """One mode's task scores: means, the F1 and its paired gap to the oracle with 95 % intervals,
    F1 by family; n 0 and no scores for a KL-only run."""
    if not mine:
        return {"n": 0}
    gaps = [oracle[r["seed"]] - r["f1"] for r in mine]
    return {
        "n": len(mine),
        **{k: round(sum(float(r[k]) for r in mine) / len(mine), 4) for k in ("em", "f1", "recall", "identical_to_oracle")},
        "f1_ci95": [round(x, 4) for x in bootstrap_ci([float(r["f1"]) for r in mine])],
        "f1_gap": round(sum(gaps) / len(gaps), 4),
        "f1_gap_ci95": [round(x, 4) for x in bootstrap_ci(gaps)],
        "by_family": {
            f: round(sum(r["f1"] for r in mine if r["family"] == f) / max(1, sum(r["family"] == f for r in mine)), 4)
            for f in tasks.FAMILIES
        },
    }


def summarize(path: Path, artifact: Path | None = None) -> None:
    """Append the summary lines (marked summarized_from_rows) to a rows file whose run was stopped
    early, or that joins the rows of runs over other example ranges (its task and KL rows are kept,
    an example asked twice in the same mode counts once; n is what was measured): the modes, pair
    and bytes come from the rows and the artifact they name (`artifact`, else the one in artifacts/ whose `<stem>.json`
    has that id; its summary where the tensors are not built and every mode is the oracle's)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["kind"] != "summary"]
    seen: set[tuple] = set()
    unique = []
    for r in rows:
        if r["kind"] == "task":
            key = (r["family"], r["seed"], r["mode"])
            if key in seen:
                continue
            seen.add(key)
        unique.append(r)
    rows = unique
    first = rows[0]
    art_path = artifact or next(
        f.with_suffix(".safetensors")
        for f in sorted((Path(__file__).parents[1] / "artifacts").glob("*.json"))
        if json.loads(f.read_text()).get("artifact_id") == first["artifact"]
    )
    asked = list(dict.fromkeys(r["mode"] for r in rows if r["kind"] == "task"))
    art = pair_artifact(art_path, asked)
    if art.artifact_id != first["artifact"]:
        raise SystemExit(f"summarize: {art_path} is artifact {art.artifact_id}, the rows name {first['artifact']}")
    distill.register(art_path)
    seeds = [r["seed"] for r in rows if r["kind"] == "task" and r["mode"] == asked[-1]]  # examples with every mode
    rows = [r for r in rows if r["kind"] != "task" or r["seed"] in seeds]
    producer = load_model(art.meta["producer"]["model_id"], dtype=first["consumer_model"]["dtype"], device="cpu")
    modes = Modes(art, producer, producer, asked)
    common = {k: first[k] for k in ("pair", "producer_model", "consumer_model", "artifact", "split", "first")}
    median = statistics.median(r["context_tokens"] for r in rows if r["kind"] == "task")
    ctx = min(tasks.CONTEXT_TOKENS, key=lambda c: abs(c - median))
    with open(path, "w") as out:
        for r in rows:
            out.write(json.dumps(r) + "\n")
        for s in summaries(rows, modes):
            out.write(json.dumps({**common, **s, "context_tokens_asked": int(ctx), "summarized_from_rows": True}) + "\n")


def pair_artifact(path: Path, modes: list[str]) -> Artifact:
    """The pair's artifact. Where its tensors are not built (the real pair's 84 MB: `make
    real-artifacts`) and every mode is the oracle's (C's own cache, a selection or not: no code is
    sent, no tensor read), the metadata calibration writes beside it (`<stem>.json`, committed)
    stands in, so the rows still name the pair's artifact and check its models' digests."""
    summary = path.with_suffix(".json")
    if not path.exists() and summary.exists() and all(m.partition("@")[0] == "oracle" for m in modes):
        return Artifact({}, json.loads(summary.read_text()), path)
    return Artifact.load(path)


def main(argv: list[str] | None = None) -> None:
    if argv is None and sys.argv[1:2] == ["summarize"]:
        return summarize(Path(sys.argv[2]), Path(sys.argv[3]) if len(sys.argv) > 3 else None)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", type=Path, required=True, help="the pair's SCD artifact (.safetensors)")
    parser.add_argument("--modes", default="oracle,naive,quant:8,quant:4,quant:2,recompute")
    parser.add_argument("--split", default="test", choices=sorted(tasks.SEED_BASE))
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--context-tokens", type=int, default=1024)
    parser.add_argument("--windows", type=int, default=0, help="text windows for the task-free KL")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, help="JSON lines (also printed)")
    args = parser.parse_args(argv)
    if "oracle" not in args.modes.split(","):
        raise SystemExit("--modes: oracle is needed (gaps and identical are against it)")
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    art = pair_artifact(args.artifact, args.modes.split(","))
    producer = load_model(art.meta["producer"]["model_id"], dtype=args.dtype, device="cpu")
    same = art.meta["consumer"]["model_id"] == art.meta["producer"]["model_id"]
    consumer = producer if same else load_model(art.meta["consumer"]["model_id"], dtype=args.dtype, device="cpu")
    art.check_model("producer", producer.info)
    art.check_model("consumer", consumer.info)
    distill.register(args.artifact)  # "distill" reads <artifact stem>.keep.safetensors beside it
    modes = Modes(art, producer, consumer, args.modes.split(","))
    common = {
        "pair": "P->P" if same else "P->C",
        "producer_model": model_row(producer.info),
        "consumer_model": model_row(consumer.info),
        "artifact": art.artifact_id,
        "split": args.split,
        "first": args.first,
    }
    out = open(args.out, "w") if args.out else None  # rows are written as they come

    def emit(row: dict) -> None:
        line = json.dumps({**common, **row})
        print(line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()

    rows = run(art, producer, consumer, modes, args, emit)
    for s in summaries(rows, modes):
        emit({**s, "context_tokens_asked": args.context_tokens, "wall_s": round(time.perf_counter() - start, 1)})
    if out:
        out.close()
    print(f"{len(rows)} rows in {time.perf_counter() - start:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
