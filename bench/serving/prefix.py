"""`python -m bench.serving.prefix` (`make bench-prefix`): prefix reuse, measured end to end.

Workloads (token-level, deterministic):
- (a) `multi-turn`: conversations whose context grows by one QA example's context (~200-300
  tokens) per turn, up to ~`--ctx-tokens`, with that example's question each turn; the
  conversations' turns interleave (turn 1 of each, then turn 2 of each, ...);
- (b) `one-doc`: one document of ~`--ctx-tokens` tokens, many questions;
- (c) `shared-preamble`: many documents behind one long shared preamble.

Variants (`VARIANTS`): `no-store` (the cold reference: every answer is compared with its
answer), `whole` (today's whole-context store, LRU), `producer-chunks` (the producer's chunk
store), and `producer+consumer-chunks` (also the consumer's kept KV per chunk: run only when the
consumer has the flag it names, else skipped with a note). Chunk variants run under both
evictions, `lru` and `cost`. The store budget is ~30% (`--budget-frac`) of the working set,
measured first by a `producer-chunks` pass with an unbounded store (reported as eviction "none",
as is a `producer+consumer-chunks` pass with both stores unbounded: the consumer's at its default,
half its KV pool).

One producer and one consumer run as real processes (bench.harness.services) per pass, requests one at a
time (TTFT without queueing). One JSON line per (workload, variant, eviction) to
bench/results/prefix.jsonl (`--out-dir` to change): model, weights, workload, variant, eviction,
store_budget_bytes, requests, prefill_tokens_computed (the producer's forward, from Describe),
prefill_tokens_saved_pct (of all context tokens requested), transfer_bytes (the consumer's
bytes received), ttft_p50_ms / ttft_p95_ms (client side, every request), ttft_later_p50_ms (turns
2+ / questions 2+ / documents 2+), question_prefill_later_p50_ms (their floor: the question's
prefill alone, from the consumer's stats), identical_to_cold_rate (greedy tokens equal to no-store's),
load_avg_1m. `--quick`: workload (a) on the QA pair in float32, mode raw, short contexts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from bench.harness import services
from bench.serving.throughput import Model, one, pct, qa_model, qwen05b_model
from shared.pb import common_pb2, consumer_pb2, consumer_pb2_grpc, producer_pb2, producer_pb2_grpc

RESULTS = services.ROOT / "bench" / "results"
CHUNK_TOKENS = 256
UNBOUNDED = 1 << 40


@dataclass(frozen=True)
class Variant:
    name: str
    producer_args: tuple[str, ...]
    consumer_args: tuple[str, ...] = ()  # "{budget}" is replaced by the store budget in bytes
    evictions: tuple[str, ...] = ("lru", "cost")
    needs_consumer_flag: str = ""  # skipped (with a note) when `python -m consumer --help` lacks it


# The consumer side: its prefix cache (consumer/engine/prefix_cache.py) at the same budget as the store.
NO_CONSUMER_CACHE = services.NO_PREFIX_CACHE  # the consumer keeps its prefix cache on by default
VARIANTS = (
    Variant("no-store", ("--chunk-tokens", "0", "--store-bytes", "0"), NO_CONSUMER_CACHE, evictions=("none",)),
    Variant("whole", ("--chunk-tokens", "0"), NO_CONSUMER_CACHE, evictions=("lru",)),
    Variant("producer-chunks", ("--chunk-tokens", str(CHUNK_TOKENS)), NO_CONSUMER_CACHE),
    Variant(
        "producer+consumer-chunks",
        ("--chunk-tokens", str(CHUNK_TOKENS)),
        ("--prefix-cache-bytes", "{budget}"),
        needs_consumer_flag="--prefix-cache-bytes",
    ),
)


@dataclass
class Request:
    context: list[int]
    question: list[int]
    later: bool  # turn 2+ / question 2+ / document 2+


@dataclass
class Workload:
    name: str
    requests: list[Request] = field(default_factory=list)

    @property
    def context_tokens(self) -> int:
        return sum(len(r.context) for r in self.requests)


def _pieces(model: Model, n: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """n (context piece ids, question ids), each piece ~one QA example's context (~250 tokens):
    the first piece carries the tokenizer's special tokens, later pieces none (they append)."""
    if model.weights == "trained":
        from qa.task import make_example
        from qa.tokenizer import load_tokenizer

        tok = load_tokenizer(Path(model.consumer))
        out = []
        for i in range(n):
            ex = make_example(seed=seed + i, split="test", ctx_tokens=256, task="tuned")
            out.append(
                (
                    tok(ex.context, add_special_tokens=(i == 0))["input_ids"],
                    tok(ex.question, add_special_tokens=False)["input_ids"],
                )
            )
        return out
    import random

    rng = random.Random(seed)
    vocab = json.loads((Path(model.consumer) / "config.json").read_text())["vocab_size"]
    return [
        ([rng.randrange(4, vocab) for _ in range(rng.randrange(200, 300))], [rng.randrange(4, vocab) for _ in range(16)])
        for _ in range(n)
    ]


def multi_turn(model: Model, conversations: int, ctx_tokens: int) -> Workload:
    turns: list[list[Request]] = []
    for c in range(conversations):
        pieces = _pieces(model, max(1, ctx_tokens // 250), seed=1000 * (c + 1))
        context: list[int] = []
        convo = []
        for t, (piece, question) in enumerate(pieces):
            context = context + piece
            convo.append(Request(context, question, later=t > 0))
        turns.append(convo)
    out = Workload("multi-turn")
    for t in range(max(len(c) for c in turns)):  # interleaved: turn t of every conversation
        out.requests += [c[t] for c in turns if t < len(c)]
    return out


def one_doc(model: Model, questions: int, ctx_tokens: int) -> Workload:
    pieces = _pieces(model, max(1, ctx_tokens // 250) + questions, seed=7)
    n_doc = max(1, ctx_tokens // 250)
    doc = [t for piece, _ in pieces[:n_doc] for t in piece]
    return Workload("one-doc", [Request(doc, q, later=i > 0) for i, (_, q) in enumerate(pieces[n_doc:])])


def shared_preamble(model: Model, documents: int, ctx_tokens: int) -> Workload:
    n_pre = max(1, ctx_tokens // 2 // 250)
    pieces = _pieces(model, n_pre + 2 * documents, seed=11)
    preamble = [t for piece, _ in pieces[:n_pre] for t in piece]
    docs = pieces[n_pre:]
    out = Workload("shared-preamble")
    for d in range(documents):
        (a, q), (b, _) = docs[2 * d], docs[2 * d + 1]
        out.requests.append(Request(preamble + a + b, q, later=d > 0))
    return out


def _request(req: Request, mode: str, stop_id: int | None) -> consumer_pb2.GenerateRequest:
    return consumer_pb2.GenerateRequest(
        context=consumer_pb2.Prompt(token_ids=consumer_pb2.TokenIds(ids=req.context)),
        question=consumer_pb2.Prompt(token_ids=consumer_pb2.TokenIds(ids=req.question)),
        max_new_tokens=8,
        stop_token_ids=[stop_id] if stop_id is not None else [],
        transfer=common_pb2.CodecSpec(name=mode),
    )


async def _pass(consumer: str, producer: str, workload: Workload, mode: str, stop_id) -> tuple[list[dict], object]:
    async with grpc.aio.insecure_channel(consumer) as channel:
        stub = consumer_pb2_grpc.ConsumerServiceStub(channel)
        results = [await one(stub, _request(r, mode, stop_id)) for r in workload.requests]
    async with grpc.aio.insecure_channel(producer) as channel:
        reply = await producer_pb2_grpc.ProducerServiceStub(channel).Describe(
            producer_pb2.ProducerServiceDescribeRequest(), timeout=10
        )
    return results, reply.stats


def consumer_has(flag: str) -> bool:
    help_text = subprocess.run(
        [sys.executable, "-m", "consumer", "--help"], capture_output=True, text=True, cwd=services.ROOT
    ).stdout
    return flag in help_text


def run(model: Model, workload: Workload, mode: str, budget_frac: float, out, log_dir: Path) -> list[dict]:
    stop_id = None
    if model.weights == "trained":
        from qa.tokenizer import end_token_id, load_tokenizer

        stop_id = end_token_id(load_tokenizer(Path(model.consumer)))
    common = ["--dtype", model.dtype, "--log-level", "WARNING"]
    if model.artifact:
        common += ["--artifacts", model.artifact]

    def one_pass(variant: Variant, eviction: str, budget: int) -> tuple[list[dict], object]:
        producer_args = ["--model", model.producer, *common, *variant.producer_args]
        if variant.name != "no-store":
            producer_args += ["--store-bytes", str(budget)]
        if eviction in ("lru", "cost") and variant.name != "whole":
            producer_args += ["--store-eviction", eviction]
        kept = "-1" if budget == UNBOUNDED else str(budget)  # unbounded: the consumer's default, half its KV pool
        consumer_args = ["--model", model.consumer, *common, *(a.replace("{budget}", kept) for a in variant.consumer_args)]
        with services.running(producer_args, consumer_args, log_dir / f"{workload.name}-{variant.name}-{eviction}") as (p, c):
            return asyncio.run(_pass(c.address, p.address, workload, mode, stop_id))

    variants = {v.name: v for v in VARIANTS}
    code = services.code_version()  # what every row of this run measured
    cold, _ = one_pass(variants["no-store"], "none", 0)
    full, stats = one_pass(variants["producer-chunks"], "none", UNBOUNDED)
    working_set = sum(t.bytes for t in stats.store_tiers)
    budget = int(working_set * budget_frac)
    rows = []

    def emit(variant: str, eviction: str, results: list[dict], stats, budget_bytes: int) -> None:
        total = workload.context_tokens
        computed = stats.prefill_tokens_computed
        later = [r["ttft"] for r, q in zip(results, workload.requests) if q.later]
        row = {
            "bench": "prefix",
            "model": model.name,
            "weights": model.weights,
            "dtype": model.dtype,
            "mode": mode,
            "workload": workload.name,
            "variant": variant,
            "eviction": eviction,
            "store_budget_bytes": budget_bytes,
            "working_set_bytes": working_set,
            "requests": len(results),
            "context_tokens": total,
            "prefill_tokens_computed": computed,
            "prefill_tokens_saved_pct": round(100.0 * (1 - computed / total), 2) if total else 0.0,
            "transfer_bytes": sum(r["bytes"] for r in results),
            "ttft_p50_ms": round(pct([r["ttft"] for r in results], 0.5), 2),
            "ttft_p95_ms": round(pct([r["ttft"] for r in results], 0.95), 2),
            "ttft_later_p50_ms": round(pct(later, 0.5), 2),
            # the floor of a later request: its question's prefill alone (the consumer's stats)
            "question_prefill_later_p50_ms": round(
                pct([r["question_prefill"] for r, q in zip(results, workload.requests) if q.later], 0.5), 2
            ),
            "identical_to_cold_rate": round(sum(a["ids"] == b["ids"] for a, b in zip(results, cold)) / len(cold), 4),
            "load_avg_1m": round(os.getloadavg()[0], 2),
            "code": code,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
        out.write(json.dumps(row) + "\n")
        out.flush()

    emit("no-store", "none", cold, _zero_stats(workload), 0)
    emit("producer-chunks", "none", full, stats, UNBOUNDED)
    both = variants["producer+consumer-chunks"]
    if consumer_has(both.needs_consumer_flag):  # what reuse gives without memory pressure
        results, both_stats = one_pass(both, "none", UNBOUNDED)
        emit(both.name, "none", results, both_stats, UNBOUNDED)
    for variant in VARIANTS[1:]:
        if variant.needs_consumer_flag and not consumer_has(variant.needs_consumer_flag):
            print(f"# {variant.name}: skipped, the consumer has no {variant.needs_consumer_flag}", file=sys.stderr)
            continue
        for eviction in variant.evictions:
            results, stats = one_pass(variant, eviction, budget)
            emit(variant.name, eviction, results, stats, budget)
    return rows


class _zero_stats:
    def __init__(self, workload: Workload):
        self.prefill_tokens_computed = workload.context_tokens


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--quick", action="store_true", help="workload (a) on the QA pair, float32, raw, short contexts")
    parser.add_argument("--models", default="qa,qwen05b", help="comma-separated: qa, qwen05b")
    parser.add_argument("--workloads", default="multi-turn,one-doc,shared-preamble")
    parser.add_argument("--mode", default="raw", help="transfer codec (raw continues a prefix on every model)")
    parser.add_argument("--ctx-tokens", type=int, default=2048, help="context length reached")
    parser.add_argument("--size", type=int, default=6, help="conversations / questions / documents per workload")
    parser.add_argument("--budget-frac", type=float, default=0.3, help="store budget as a share of the working set")
    parser.add_argument("--out-dir", default=str(RESULTS), help="where prefix.jsonl goes")
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.workloads, args.ctx_tokens, args.size = "qa", "multi-turn", 1024, 4
    builders = {"qa": qa_model, "qwen05b": qwen05b_model}
    makers = {"multi-turn": multi_turn, "one-doc": one_doc, "shared-preamble": shared_preamble}
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "prefix.jsonl", "a") as out, tempfile.TemporaryDirectory() as logs:
        for name in args.models.split(","):
            model = builders[name]()
            for workload in args.workloads.split(","):
                run(model, makers[workload](model, args.size, args.ctx_tokens), args.mode, args.budget_frac, out, Path(logs))


if __name__ == "__main__":
    main()
