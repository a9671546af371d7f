"""`python -m shared.scd.distill`: calibrate an SCD artifact for a (producer, consumer) pair.

Library entry point `distill(...)`; the CLI loads the models, builds the calibration corpus
(default: the QA generator's train split; or a text / JSONL file) and held-out question/answer
set, fits, trains learned predictors where asked (`--predictor-layers`, heterogeneous pairs;
shared.scd.predictor) and refits on them, searches schedules and writes `<out>.safetensors`
(+ a readable `<out>.json`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Iterator

import torch

from shared.models import LoadedModel, load_model
from shared.scd import calibrate, ops, predictor, search
from shared.scd.artifact import Artifact
from shared.scd.predictor import TrainConfig, TrainExample
from shared.scd.schedule import Action, Geometry, Schedule


def geometry(info) -> Geometry:
    element = 2 if info.dtype in ("bfloat16", "float16") else 4
    return Geometry(hidden=info.hidden_size, kv_width=2 * info.num_kv_heads * info.head_dim, kv_element_bytes=element)


def distill(producer: LoadedModel, consumer: LoadedModel, corpus: list[list[int]], heldout: list[search.HeldOut], *,
            corpus_name: str, loss_target: float = 0.02, generations: int = 30, seed: int = 0, ridge_rel: float = 1e-3,
            max_schedules: int = 12, schedules: list[str] | None = None, window: int = 1,
            predictor_layers: str = "none", predictor_examples: Iterator[TrainExample] | None = None,
            predictor_train: TrainConfig = TrainConfig(), log=print) -> Artifact:
    """Fit an artifact and measure its schedules: searched (default), or exactly the given
    schedule texts (`schedules`, e.g. for a timing-only model where a search costs too much).

    predictor_layers (heterogeneous pairs): "none", "all", "auto" (the layers whose Patch through
    the linear map alone loses more than loss_target) or comma-separated layer indices; those
    layers get a learned predictor (shared.scd.predictor) trained on `predictor_examples`, and the
    linear maps are refitted on its output."""
    torch.manual_seed(seed)
    started = time.perf_counter()
    same = producer.info.weight_digest == consumer.info.weight_digest
    window = 1 if same else window  # P == C: the token's own state determines its K/V exactly
    moments = calibrate.collect(producer, consumer, corpus, total=len(corpus), window=window)
    g = geometry(producer.info)
    meta = {
        "producer": {"model_id": producer.info.model_id, "weight_digest": producer.info.weight_digest},
        "consumer": {"model_id": consumer.info.model_id, "weight_digest": consumer.info.weight_digest},
        "corpus": {"name": corpus_name, "digest": calibrate.corpus_digest(corpus), "sequences": len(corpus),
                   "tokens": sum(map(len, corpus))},
        "geometry": {"num_layers": consumer.info.num_layers, "hidden": g.hidden, "kv_width": g.kv_width,
                     "kv_element_bytes": g.kv_element_bytes, "quant_group": g.quant_group},
        "calibration": {"seed": seed, "ridge_rel": ridge_rel, "homogeneous": same, "window": window, "loss_target": loss_target,
                        "heldout_examples": len(heldout), "loss": "mean KL(oracle || reconstructed), nats per answer token"},
    }
    art = Artifact(calibrate.fit(moments, consumer, same, ridge_rel), meta)
    log(f"fitted {consumer.info.num_layers} layers in {time.perf_counter() - started:.1f}s")
    chosen, linear_loss = ([], {}) if same else _predictor_layers(predictor_layers, art, producer, consumer, heldout, loss_target, log)
    if chosen:
        if predictor_examples is None:
            raise ValueError("predictor_layers needs predictor_examples to train on")
        models, reports = {}, {}
        train_p, train_c = predictor.as_float32(producer), predictor.as_float32(consumer)  # one fp32 copy for all layers
        for layer in chosen:
            models[layer], reports[str(layer)] = predictor.train(train_p, train_c, layer, predictor_examples, predictor_train, log)
        moments = calibrate.collect(producer, consumer, corpus, total=len(corpus), window=window, predictors=models)
        tensors = calibrate.fit(moments, consumer, same, ridge_rel, predicted=frozenset(models))
        for layer, model in models.items():
            tensors.update(predictor.to_tensors(layer, model))
        meta["predictor"] = {"config": reports[str(chosen[0])]["config"], "layers": reports, "patch_loss_linear": linear_loss}
        art = Artifact(tensors, meta)
        log(f"refitted with learned predictors on layers {chosen}")
    ev = search.LossEvaluator(art, producer, consumer, heldout)
    if schedules:
        given = [Schedule.parse(text, consumer.info.num_layers) for text in schedules]
        front = sorted((search.Point(s, s.bytes_per_token(g), ev.loss(s.actions)) for s in given), key=lambda p: p.bytes_per_token)
        report = {"given": [str(s) for s in given]}
    else:
        lattice = search.action_lattice(g, with_quant=ops.quantize is not None)
        front, report = search.search(ev, lattice, g, loss_target, generations=generations, seed=seed, log=log)
    front = search.evenly_spaced(front, max_schedules)
    meta["schedules"] = [{"name": f"s{i}", "schedule": str(p.schedule), "loss": p.loss, "bytes_per_token": p.bytes_per_token}
                         for i, p in enumerate(front)]
    meta["search"] = report
    # the recompute baseline's span, chosen by profiling on the same held-out set (DroidSpeak-style)
    from shared.codecs.recompute import default_span
    from shared.recompute_profile import profile_span

    start, end = default_span(consumer.info.num_layers)
    if same:  # recomputing from the true hidden state is exact for any span: keep the default
        meta["recompute_span"] = [start, end]
    else:
        spans = profile_span(producer, consumer, [h.context_ids for h in heldout], [h.qa_ids[: h.answer_start] for h in heldout],
                             [h.qa_ids[h.answer_start :] for h in heldout], end - start)
        meta["recompute_span"] = [spans[0]["start"], spans[0]["end"]]
        meta["recompute_profile"] = spans
    meta["calibration"]["wall_s"] = round(time.perf_counter() - started, 1)
    return art


def _predictor_layers(spec: str, art: Artifact, producer: LoadedModel, consumer: LoadedModel, heldout, loss_target: float,
                      log) -> tuple[list[int], dict[str, float]]:
    """(layers to give a predictor, Patch loss per layer with the linear map alone if measured)."""
    n = consumer.info.num_layers
    if spec == "none":
        return [], {}
    if spec == "all":
        return list(range(n)), {}
    if spec != "auto":
        return sorted({int(x) for x in spec.split(",")}), {}
    ev = search.LossEvaluator(art, producer, consumer, heldout)
    losses = {l: ev.loss([Action("patch") if i == l else None for i in range(n)]) for l in range(n)}
    log(f"patch loss with the linear map alone, per layer: {losses}")
    return [l for l, v in losses.items() if v > loss_target], {str(l): v for l, v in losses.items()}


def qa_heldout(example, tokenizer) -> search.HeldOut:
    """A QA example as ids: context (with BOS), question + answer + END, scored from the answer."""
    from qa.task import END

    def ids(text: str, special: bool) -> list[int]:
        return tokenizer(text, add_special_tokens=special)["input_ids"]

    q, a = ids(example.question, False), ids(f"{example.answer} {END}", False)  # the answer and its terminator
    return search.HeldOut(ids(example.context, True), q + a, len(q))


def qa_stream(ctx_tokens: int, task: str, tokenizer, questions: int = 8) -> Iterator[TrainExample]:
    """Endless QA train-split contexts, each with `questions` questions about its facts (the
    example's own first), answers scored; deterministic (predictor training)."""
    import random

    from qa.task import END, examples, render_question

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    seed = 0
    while True:
        for e in examples("train", 1000, ctx_tokens, task, start=seed):
            rng = random.Random(e.context)
            facts = [e.target] + rng.sample([f for f in e.facts if f != e.target], min(questions, len(e.facts)) - 1)
            conts = []
            for fact in facts:
                q, a = render_question(fact, task)
                q_ids = ids(q)
                conts.append((q_ids + ids(f"{a} {END}"), len(q_ids)))
            yield TrainExample(tokenizer(e.context)["input_ids"], tuple(conts))
        seed += 1000


def text_stream(corpus: list[list[int]]) -> Iterator[TrainExample]:
    """Endless (first 80% | last 20%, all scored) splits of the corpus sequences, in order."""
    while True:
        for s in corpus:
            cut = max(1, int(len(s) * 0.8))
            yield TrainExample(s[:cut], ((s[cut:], 0),))


def qa_corpus(n: int, heldout: int, ctx_tokens: int, task: str, tokenizer) -> tuple[list[list[int]], list[search.HeldOut]]:
    from qa.task import examples

    corpus = [h.context_ids + h.qa_ids for h in (qa_heldout(e, tokenizer) for e in examples("train", n, ctx_tokens, task))]
    return corpus, [qa_heldout(e, tokenizer) for e in examples("validation", heldout, ctx_tokens, task)]


def text_corpus(path: Path, n: int, heldout: int, tokenizer) -> tuple[list[list[int]], list[search.HeldOut]]:
    """Lines of a text file, or JSONL records with "text" or pre-tokenized "ids"; the last
    `heldout` sequences are split into context (first 80%) / question (next 10%) / answer (last 10%)."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines] if path.suffix == ".jsonl" else [{"text": line} for line in lines]
    seqs = [r["ids"] if "ids" in r else tokenizer(r["text"])["input_ids"] for r in records]
    if any(len(s) < 10 for s in seqs):
        raise ValueError(f"{path}: every sequence needs >= 10 tokens (the tokenizer may not know its words)")
    corpus, rest = seqs[:n], seqs[n : n + heldout]
    held = [search.HeldOut(s[: int(len(s) * 0.8)], s[int(len(s) * 0.8) :], max(1, int(len(s) * 0.1))) for s in rest]
    return corpus, held


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--producer", required=True, help="path, hub id or builtin tiny name")
    p.add_argument("--consumer", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--corpus", default="qa", help="'qa' (QA generator train split), a .txt file, or .jsonl with text or ids")
    p.add_argument("--task", default="tuned", help="QA task of the calibration corpus (the consumer's)")
    p.add_argument("--n", type=int, default=64, help="calibration sequences")
    p.add_argument("--heldout", type=int, default=12, help="held-out question/answer examples for the loss")
    p.add_argument("--ctx", type=int, default=256, help="context tokens of QA calibration examples")
    p.add_argument("--loss-target", type=float, default=0.02)
    p.add_argument("--generations", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--window", type=int, default=1, help="tokens of producer state per code (heterogeneous pairs)")
    p.add_argument("--schedules", default="", help="measure these schedules instead of searching: comma-separated, "
                   "each per-layer text ('R16.R16.P.W') or one action for every layer ('R32*')")
    p.add_argument("--predictor-layers", default="none",
                   help="heterogeneous pairs: layers with a learned non-linear predictor: none | all | auto | '1,3'")
    p.add_argument("--predictor-steps", default="1500,2000", help="predictor training steps: kv-error stage, KL stage")
    p.add_argument("--predictor-ctx", type=int, default=512, help="context tokens of QA predictor training examples")
    p.add_argument("--predictor-mult", type=int, default=2, help="predictor MLP width / hidden size")
    p.add_argument("--predictor-depth", type=int, default=2, help="predictor decoder layers")
    p.add_argument("--predictor-kl-lr", type=float, default=5e-4, help="peak learning rate of the KL stage")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--out", required=True, type=Path, help="output .safetensors path")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    producer = load_model(args.producer, args.dtype, "auto")
    consumer = producer if args.consumer == args.producer else load_model(args.consumer, args.dtype, "auto")
    if args.corpus == "qa":
        corpus, held = qa_corpus(args.n, args.heldout, args.ctx, args.task, consumer.tokenizer)
        name = f"qa:{args.task}:train:n={args.n}:ctx={args.ctx}"
    else:
        corpus, held = text_corpus(Path(args.corpus), args.n, args.heldout, consumer.tokenizer)
        name = f"file:{args.corpus}"
    stream = qa_stream(args.predictor_ctx, args.task, consumer.tokenizer) if args.corpus == "qa" else text_stream(corpus)
    mse_steps, kl_steps = (int(x) for x in args.predictor_steps.split(","))
    train_cfg = TrainConfig(mse_steps=mse_steps, kl_steps=kl_steps, seed=args.seed, intermediate_mult=args.predictor_mult,
                            depth=args.predictor_depth, kl_lr=args.predictor_kl_lr)
    layers_n = consumer.info.num_layers
    given = [".".join([t[:-1]] * layers_n) if t.endswith("*") else t for t in args.schedules.split(",") if t]
    art = distill(producer, consumer, corpus, held, corpus_name=name, loss_target=args.loss_target,
                  generations=args.generations, seed=args.seed, schedules=given, window=args.window, predictor_layers=args.predictor_layers, predictor_examples=stream,
                  predictor_train=train_cfg, log=lambda m: print(m, file=sys.stderr))
    art.save(args.out)
    for s in art.meta["schedules"]:
        print(json.dumps({"artifact": art.artifact_id, **s}))
    print(f"wrote {args.out} ({art.artifact_id})", file=sys.stderr)


if __name__ == "__main__":
    main()
