"""Is the real pair's fine-tune a real shift? On real.tasks examples: P's own answer (P on its own
cache), C's own prefill (the oracle) and C decoding on P's cache (naive reuse: raw KV, no
codec), each scored (real.score), and the task-free KL of C on P's cache against its own over
text windows (real.kl). One JSON line per example and mode, then a summary line with the naive
reuse gap to the oracle and its paired 95 % bootstrap interval.

    python -m real.reuse_gap --n 25 --context-tokens 1024 --windows 10 --out checkpoints/smollm2-135m-tuned/reuse_gap.jsonl
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from qa.metrics import bootstrap_ci
from qa.predict import greedy_decode, prefill
from real import kl, score, tasks
from shared.models import LoadedModel, load_model

MODES = ("producer", "oracle", "naive_reuse")  # P on P's cache, C on C's, C on P's


def answer(model: LoadedModel, cache, question_ids: list[int], end_id: int, max_new_tokens: int) -> str:
    """Greedy answer of `model` after `question_ids` on top of `cache` (cropped back after)."""
    length = cache.get_seq_length()
    logits, cache = prefill(model.model, torch.tensor([question_ids]), cache)
    out = str(model.tokenizer.decode(greedy_decode(model.model, cache, logits, end_id, max_new_tokens)))
    kl.crop_to(cache, length)
    return out.strip()


def model_row(info) -> dict:
    return {"model": info.model_id, "weight_digest": info.weight_digest, "dtype": info.dtype, "origin": info.origin}


def run(producer: LoadedModel, consumer: LoadedModel, args) -> list[dict]:
    tok = consumer.tokenizer
    end_id = tasks.end_id(tok)
    rows = []
    for example in tasks.examples(tok, args.split, args.n, args.context_tokens, first=args.first):
        ctx = torch.tensor([example.context_ids])
        _, p_cache = prefill(producer.model, ctx)
        _, c_cache = prefill(consumer.model, ctx)
        oracle = answer(consumer, c_cache, example.question_ids, end_id, args.max_new_tokens)
        said = {
            "producer": answer(producer, p_cache, example.question_ids, end_id, args.max_new_tokens),
            "oracle": oracle,
            "naive_reuse": answer(consumer, p_cache, example.question_ids, end_id, args.max_new_tokens),
        }
        for mode in MODES:
            row = {
                "kind": "task",
                "family": example.family,
                "split": example.split,
                "seed": example.seed,
                "context_tokens": len(example.context_ids),
                "mode": mode,
                "gold": example.answer,
                "prediction": said[mode],
                **score.score(said[mode], example, oracle),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    for i in range(args.windows):
        window = tasks.text_window(tok, args.split, args.first + i, args.context_tokens)
        ctx = torch.tensor([window.context_ids])
        _, p_cache = prefill(producer.model, ctx)
        _, c_cache = prefill(consumer.model, ctx)
        row = {
            "kind": "kl",
            "split": args.split,
            "seed": window.seed,
            "context_tokens": len(window.context_ids),
            "following_tokens": len(window.following_ids),
            "mode": "naive_reuse",
            "mean_kl": kl.mean_kl(consumer, c_cache, p_cache, window.following_ids),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def summary(rows: list[dict]) -> dict:
    """Per mode: mean EM / F1 / recall / identical-to-oracle; the naive reuse F1 gap to the oracle
    (oracle minus naive, per example) with its 95 % interval; the mean KL."""
    task = [r for r in rows if r["kind"] == "task"]
    out: dict = {"kind": "summary", "n": len(task) // len(MODES)}
    for mode in MODES:
        mine = [r for r in task if r["mode"] == mode]
        out[mode] = {
            k: round(sum(float(r[k]) for r in mine) / len(mine), 4) for k in ("em", "f1", "recall", "identical_to_oracle")
        }
    by = {(r["seed"], r["mode"]): r["f1"] for r in task}
    gaps = [by[(s, "oracle")] - by[(s, "naive_reuse")] for s, m in by if m == "oracle"]
    out["naive_reuse_f1_gap"] = round(sum(gaps) / len(gaps), 4)
    out["naive_reuse_f1_gap_ci95"] = [round(x, 4) for x in bootstrap_ci(gaps)]
    kls = [r["mean_kl"] for r in rows if r["kind"] == "kl"]
    if kls:
        out["naive_reuse_mean_kl"] = round(sum(kls) / len(kls), 4)
        out["naive_reuse_kl_ci95"] = [round(x, 4) for x in bootstrap_ci(kls)]
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--producer", default="smollm2-135m")
    parser.add_argument("--consumer", default="smollm2-135m-tuned")
    parser.add_argument("--split", default="test", choices=sorted(tasks.SEED_BASE))
    parser.add_argument("--n", type=int, default=25)
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--context-tokens", type=int, default=1024)
    parser.add_argument("--windows", type=int, default=10, help="text windows for the task-free KL")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    producer = load_model(args.producer, dtype=args.dtype, device="cpu")
    consumer = load_model(args.consumer, dtype=args.dtype, device="cpu")
    rows = run(producer, consumer, args)
    rows.append(
        {
            **summary(rows),
            "producer_model": model_row(producer.info),
            "consumer_model": model_row(consumer.info),
            "context_tokens": args.context_tokens,
            "wall_s": round(time.perf_counter() - start, 1),
        }
    )
    print(json.dumps(rows[-1]), flush=True)
    if args.out:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
