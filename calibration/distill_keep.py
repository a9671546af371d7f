"""Train DistillCache (shared.keep.distill) for a pair with REINFORCE on a per-step KL reward:

    python -m calibration.distill_keep --pair qa --seed 0 --steps 300
    python -m calibration.distill_keep --pair real --seed 0 --inputs normed --warm 100 --steps 200 --lr 1e-4

`--inputs normed` trains a probe over each layer's normed input instead of the attention features;
it is first fitted to the full cache's attention while answering, on `--warm` train examples
after the pool (calibration.keep_attention, `--warm-epochs` passes), and REINFORCE starts from it.

Each step takes one train example (the consumer's own prefill, features and full-cache log-probs,
prepared once for a pool of examples read in turn), a budget drawn from --budgets, `--group` keep
sets sampled from the policy (Gumbel top-k over the unprotected tokens), and rewards each with
minus the mean KL(full cache || kept cache) per scored answer token (teacher-forced); the
advantage is the reward minus the group's mean over the group's spread. Every --eval-every steps
the deterministic policy's mean KL on the validation examples (at 10, 25 and 50 %, beside
streaming, SnapKV and H2O on the same examples) chooses the weights kept: the lowest mean
over the fractions, the initial (SnapKV-like) weights included. Writes the weights beside the
pair's artifact (`<stem>.keep.safetensors`) and the curve (JSON lines: one per step, one per
validation) to --curve. Splits: train for the steps, validation for the choice; the test split is
real.quality's.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from calibration import corpus as corpus_lib
from calibration import keep_attention
from calibration.keep_reinforce import HEURISTICS, Prepared, greedy_keep, prepare, reward, sample_keep
from shared.keep.distill import DistillNet, save, weights_path
from shared.keep.select import Budget
from shared.models import load_model
from shared.scd.artifact import Artifact

PAIRS = {  # pair -> (artifact, corpus provider, its args)
    "qa": (
        "artifacts/qa-base-to-tuned.safetensors",
        "qa.corpus:calibration_corpus",
        {"task": "tuned", "ctx": "256", "predictor_ctx": "256"},
    ),
    "real": (
        "artifacts/smollm2-pc.safetensors",
        "real.corpus:calibration_corpus",
        {"ctx": "1024", "heldout_split": "validation"},
    ),
}
EVAL_FRACTIONS = (0.1, 0.25, 0.5)


def pair_meta(artifact: Path) -> dict:
    """The pair's metadata: its artifact's, or where only the summary calibration writes beside it
    is here (artifacts/<pair>.json, committed; the real pair's 84 MB tensors are built by `make
    real-artifacts`), that summary. Training reads the consumer's id, the layer count and the
    artifact id, never the tensors."""
    if artifact.exists():
        return Artifact.load(artifact).meta
    summary = artifact.with_suffix(".json")
    if not summary.exists():
        raise SystemExit(f"{artifact}: no artifact and no summary {summary.name} beside it")
    return json.loads(summary.read_text())


def validate(consumer, net: DistillNet | None, val: list[Prepared], sinks: int, window: int) -> dict[str, dict[str, float]]:
    """Mean KL (nats per scored token) per policy and fraction on the validation examples;
    net None: the heuristics only."""
    out: dict[str, dict[str, float]] = {}
    names = ["distill"] if net is not None else list(HEURISTICS)
    for name in names:
        out[name] = {}
        for frac in EVAL_FRACTIONS:
            kls = []
            for ex in val:
                if net is not None:
                    with torch.no_grad():
                        layer_scores = list(ex.scores(net).unbind(0))
                else:
                    layer_scores = ex.heuristic[name]
                kls.append(
                    -reward(consumer, ex, greedy_keep(layer_scores, Budget(fraction=frac).kept(ex.num_tokens), sinks, window))
                )
            out[name][str(frac)] = round(statistics.fmean(kls), 5)
    return out


def reinforce_step(
    net: DistillNet,
    opt: torch.optim.Optimizer,
    ex: Prepared,
    score_keep: Callable[[list[torch.Tensor]], float],
    fraction: float,
    group: int,
    sinks: int,
    window: int,
    gen: torch.Generator,
) -> torch.Tensor:
    """One REINFORCE update on one example (what the network reads: Prepared.scores) at one budget:
    `group` keep sets sampled from the policy, each rewarded by `score_keep` (returned, [group]);
    advantage = reward minus the group's mean over its spread."""
    scores = ex.scores(net)  # [L, n_kv, T]
    kept = Budget(fraction=fraction).kept(scores.shape[-1])
    rewards, logps = [], []
    for _ in range(group):
        keep, logp = sample_keep(scores, kept, sinks, window, gen)
        rewards.append(score_keep(keep))
        logps.append(logp.sum())
    r = torch.tensor(rewards, dtype=torch.float64)
    adv = (r - r.mean()) / (r.std() + 1e-6)
    loss = -(adv * torch.stack(logps)).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return r


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", choices=sorted(PAIRS), required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--minutes", type=float, default=0.0, help="stop the steps after this much training time (0: no limit)")
    p.add_argument("--pool", type=int, default=16, help="train examples prepared and read in turn")
    p.add_argument("--val", type=int, default=6, help="validation examples")
    p.add_argument(
        "--questions", type=int, default=4, help="scored continuations per train context (where the corpus has several)"
    )
    p.add_argument("--group", type=int, default=4, help="keep sets sampled per step")
    p.add_argument("--budgets", default="0.1,0.25,0.5,0.75")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--window", type=int, default=64, help="recent tokens always kept (shared.keep.Selection's window)")
    p.add_argument("--inputs", default="features", choices=("features", "normed"), help="what the network reads")
    p.add_argument("--warm", type=int, default=100, help="--inputs normed: train examples of the attention fit")
    p.add_argument("--warm-epochs", type=int, default=12)
    p.add_argument("--warm-lr", type=float, default=1e-3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, help="weights (default: beside the pair's artifact)")
    p.add_argument("--curve", type=Path, help="JSON lines (default: bench/results/keep/distill-PAIR-sSEED.jsonl)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng, gen = random.Random(args.seed), torch.Generator().manual_seed(args.seed)
    start = time.perf_counter()
    art_path, provider, corpus_args = PAIRS[args.pair]
    meta = pair_meta(Path(art_path))
    artifact_id, num_layers = meta["artifact_id"], meta["geometry"]["num_layers"]
    consumer = load_model(meta["consumer"]["model_id"], "float32", "cpu")
    corpus = corpus_lib.load(provider, consumer.tokenizer, 0, args.val, corpus_args)
    normed = args.inputs == "normed"
    train: list[Prepared] = []
    for _, example in zip(range(args.pool), corpus.train_stream):
        train.append(prepare(consumer, example.context_ids, list(example.continuations[: args.questions]), normed))
    val = [prepare(consumer, h.context_ids, [(h.qa_ids, h.answer_start)], normed) for h in corpus.heldout]
    warm: list[keep_attention.Target] = []
    for _, example in zip(range(args.warm if normed else 0), corpus.train_stream):  # the examples after the pool
        warm += [keep_attention.target(consumer, example.context_ids, ids, first) for ids, first in example.continuations[:1]]
    prep_s = time.perf_counter() - start
    print(f"prepared {len(train)} train / {len(val)} validation examples in {prep_s:.0f} s", file=sys.stderr)
    out_path = args.out or weights_path(Path(art_path))
    curve_path = args.curve or Path(f"bench/results/keep/distill-{args.pair}-s{args.seed}.jsonl")
    curve_path.parent.mkdir(parents=True, exist_ok=True)
    curve = open(curve_path, "w")

    def log(row: dict) -> None:
        curve.write(json.dumps(row) + "\n")
        curve.flush()

    header = {"kind": "config", "pair": args.pair, "artifact": artifact_id, "consumer": consumer.info.model_id}
    log({**header, **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "prepare_s": round(prep_s, 1)})
    baseline = validate(consumer, None, val, args.sinks, args.window)
    log({"kind": "validation", "step": 0, "heuristics": baseline})
    if normed:
        net = DistillNet(
            num_layers, inputs=("normed",), d_model=consumer.info.hidden_size, num_kv_heads=consumer.info.num_kv_heads
        )
        held = warm[-max(1, len(warm) // 10) :]
        keep_attention.fit(
            net, warm[: len(warm) - len(held)], held, args.warm_epochs, args.warm_lr, args.sinks, args.window, args.seed, log
        )
        del warm, held
    else:
        net = DistillNet(num_layers)
    opt = torch.optim.Adam(net.parameters(), lr=args.lr)
    budgets = [float(b) for b in args.budgets.split(",")]
    order = list(range(len(train)))

    def choose(step: int, best: tuple) -> tuple:
        kl = validate(consumer, net, val, args.sinks, args.window)["distill"]
        mean = statistics.fmean(kl.values())
        log(
            {
                "kind": "validation",
                "step": step,
                "distill": kl,
                "mean": round(mean, 5),
                "train_s": round(time.perf_counter() - t0, 1),
            }
        )
        print(f"step {step}: validation KL {kl} (heuristics {baseline})", file=sys.stderr)
        return (mean, step, copy.deepcopy(net.state_dict())) if mean < best[0] else best

    t0 = time.perf_counter()
    best: tuple = choose(0, (float("inf"), 0, None))
    step = 0
    for step in range(1, args.steps + 1):
        if step % len(order) == 1:
            rng.shuffle(order)
        ex = train[order[(step - 1) % len(order)]]
        frac = rng.choice(budgets)
        r = reinforce_step(net, opt, ex, partial(reward, consumer, ex), frac, args.group, args.sinks, args.window, gen)
        log(
            {
                "kind": "step",
                "step": step,
                "fraction": frac,
                "reward": round(float(r.mean()), 5),
                "reward_spread": round(float(r.std()), 5),
            }
        )
        if step % args.eval_every == 0:
            best = choose(step, best)
        if args.minutes and time.perf_counter() - t0 > 60 * args.minutes:
            break
    if step % args.eval_every:
        best = choose(step, best)
    net.load_state_dict(best[2])
    train_s = time.perf_counter() - t0
    meta = {
        "pair": args.pair,
        "artifact": artifact_id,
        "consumer": consumer.info.model_id,
        "consumer_digest": consumer.info.weight_digest,
        "seed": args.seed,
        "inputs": args.inputs,
        "warm_examples": args.warm if normed else 0,
        "warm_epochs": args.warm_epochs if normed else 0,
        "steps": step,
        "chosen_step": best[1],
        "validation_kl": round(best[0], 5),
        "budgets": budgets,
        "sinks": args.sinks,
        "window": args.window,
        "train_s": round(train_s, 1),
        "prepare_s": round(prep_s, 1),
        "threads": args.threads,
        "curve": str(curve_path),
    }
    save(net, out_path, meta)
    log({"kind": "done", **meta, "weights": str(out_path)})
    curve.close()
    print(json.dumps({**meta, "weights": str(out_path)}))


if __name__ == "__main__":
    main()
