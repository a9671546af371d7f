"""`make bench-verify` (`python -m bench.serving.verify`): what each way of making an SCD answer the
consumer's own costs and buys: scd alone, scd + anchor-token repair (consumer/exact/repair.py) at a few
fractions of the context (anchors by the question's attention; by the audit's per-position error
and by both at 5-20%), scd + the audit's fallback, scd + the audit's repair (a flagged cache
repaired at 10%, audited again, else the own prefill), scd + verified decoding (consumer/exact/verify.py),
and the oracle (the consumer's own prefill), through the real services.

Part 1, quality (`--pairs`, trained QA pairs, float32, greedy, 8-token answers, loopback): per
pair and set of qa.shifted (in distribution and shifted), every example is asked once under every
policy, in a seeded shuffled order per example (no policy always runs after the same other).
Identical = the greedy tokens equal the oracle's for the same example.

Part 2, speed (`--scale qwen05b`, the Qwen2.5-0.5B shape with random weights, one model on both
sides: identical weights; 256-token answers): raw transfer then decoding, the oracle, and a lossy
transfer (quant, 8 bits) + verify, interleaved, over a tc-shaped link at `--rate-mbit` (needs
root; `--link relay`: a userspace relay paces loopback at that rate, where tc cannot run;
`--link loopback`: unpaced). Each run's context is new, and the producer reads it first
(one untimed raw request of one token): every policy then finds it in the producer's store. Speed only: the weights are random, so identical_to_oracle there
says only that verification kept the tokens the exact cache gives.

One JSON line per (pair, set, policy) to OUT (default bench/results/verify.jsonl): pair, weights,
model, dtype, set, policy, repair_fraction, anchor_choice, n, identical_to_oracle, f1 (points,
null without gold), accepted_draft_fraction (verify: accepted / drafted tokens, summed), ttft_ms_p50
(first token streamed), time_to_verified_ms_p50 (verify: first verified token; else = ttft),
completion_ms_p50 (the client's wall time of the whole answer), cost_ratio_vs_prefill (median over
examples of the policy's consumer-side work beyond the transfer's rebuild / the oracle's context
prefill of the same example: repair_ms, audit_ms + local_prefill_ms, verify_ms (wall time of
drafting and the exact prefill together, an upper bound of the verification's cost); scd 0,
oracle 1), link (loopback | tbf N Mbit | relay N Mbit ...), load_avg_1m; the speed rows add
completion_ms_each (every run's completion, in run order: run i of two policies shares a context).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.harness import pairs, services
from bench.harness.pairs import PAIRS
from consumer.api.client import Answer, ConsumerClient, prompt
from shared.pb.scd.v1 import consumer_pb2

ROOT = services.ROOT
OUT = ROOT / "bench/results/verify.jsonl"
FRACTIONS = (0.05, 0.1, 0.2, 0.5, 1.0)
ERROR_ANCHORS = (("audit_error", (0.05, 0.1, 0.2)), ("both", (0.1,)))  # the other anchor choices, at these fractions
DEFAULT_SETS = "in_distribution,base_question_format,repeated_values,long_context,fact_in_random_tokens"


@dataclass(frozen=True, eq=False)  # identity: a key per policy
class Policy:
    """One way of answering: the mode, the transfer options beyond the schedule, the request fields."""

    name: str
    mode: str
    options: dict = field(default_factory=dict)
    fields: dict = field(default_factory=dict)
    repair_fraction: float = 0.0
    anchors: str = "attention"  # consumer.exact.repair ANCHOR_CHOICES

    @property
    def anchor_choice(self) -> str:
        return self.anchors if 0 < self.repair_fraction < 1 else ("all" if self.repair_fraction else "none")

    def cost_ms(self, stats: consumer_pb2.GenerateStats) -> float:
        """The consumer-side work this policy adds beyond the transfer's rebuild, ms."""
        if self.mode == "oracle":
            return stats.rebuild_ms
        return stats.repair_ms + stats.audit_ms + stats.local_prefill_ms + stats.verify_ms


def quality_policies(fractions: list[float]) -> list[Policy]:
    fallback = {"audit": consumer_pb2.AUDIT_POLICY_FALLBACK}
    verify = {"verify": consumer_pb2.VERIFY_POLICY_VERIFIED}
    return [
        Policy("oracle", "oracle"),
        Policy("scd", "scd"),
        *(Policy("scd+repair", "scd", {"repair": str(f)}, repair_fraction=f) for f in fractions),
        *(
            Policy("scd+repair", "scd", {"repair": str(f), "repair_anchors": how}, repair_fraction=f, anchors=how)
            for how, at in ERROR_ANCHORS
            for f in fractions
            if f in at
        ),
        Policy("scd+audit_fallback", "scd", fields=fallback),
        Policy("scd+audit_repair", "scd", fields={"audit": consumer_pb2.AUDIT_POLICY_REPAIR}, repair_fraction=0.1),
        Policy("scd+verify", "scd", fields=verify),
    ]


def speed_policies() -> list[Policy]:
    return [
        Policy("raw", "raw"),
        Policy("oracle", "oracle"),
        Policy("quant+verify", "quant", {"bits": "8"}, {"verify": consumer_pb2.VERIFY_POLICY_VERIFIED}),
    ]


@dataclass
class Sample:
    answer: Answer
    completion_ms: float
    cost: float  # cost_ms / the oracle's rebuild_ms of the same example
    identical: bool = False
    f1: float | None = None


async def timed(coro) -> tuple[Answer, float]:
    started = time.perf_counter()
    answer = await coro
    return answer, (time.perf_counter() - started) * 1e3


def row(base: dict, policy: Policy, samples: list[Sample]) -> dict:
    stats = [s.answer.stats for s in samples]
    drafted = sum(s.drafted_tokens for s in stats)
    verified = [s.time_to_verified_ms or s.ttft_ms for s in stats]
    f1s = [s.f1 for s in samples if s.f1 is not None]
    return {
        **base,
        "policy": policy.name,
        "repair_fraction": policy.repair_fraction,
        "anchor_choice": policy.anchor_choice,
        "n": len(samples),
        "identical_to_oracle": round(statistics.fmean(s.identical for s in samples), 3),
        "f1": round(100 * statistics.fmean(f1s), 2) if f1s else None,
        "accepted_draft_fraction": round(sum(s.accepted_draft_tokens for s in stats) / drafted, 3) if drafted else None,
        "ttft_ms_p50": round(statistics.median(s.ttft_ms for s in stats), 1),
        "time_to_verified_ms_p50": round(statistics.median(verified), 1),
        "completion_ms_p50": round(statistics.median(s.completion_ms for s in samples), 1),
        "cost_ratio_vs_prefill": round(statistics.median(s.cost for s in samples), 3),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }


def emit(out, line: dict) -> None:
    text = json.dumps(line)
    print(text, flush=True)
    out.write(text + "\n")
    out.flush()


async def quality(address: str, pair_name: str, sets: list[str], n: int, fractions: list[float], out, seed: int) -> None:
    from qa.metrics import f1_score
    from qa.shifted import examples
    from qa.task import END

    pair = PAIRS[pair_name]
    schedule = {"schedule": pair.headline} if pair.headline else {}
    policies = quality_policies(fractions)
    end_id = _end_id(pair)
    rng = random.Random(seed)
    base = {
        "pair": pair_name,
        "weights": "trained",
        "model": f"{Path(pair.producer).name}->{Path(pair.consumer).name}",
        "dtype": "float32",
        "link": "loopback",
    }

    async def ask(client: ConsumerClient, context: str, question: str, policy: Policy) -> tuple[Answer, float]:
        return await timed(
            pairs.ask(
                client,
                context,
                question,
                end_id,
                policy.mode,
                {**schedule, **policy.options} if policy.mode != "oracle" else {},
                **policy.fields,
            )
        )

    async with ConsumerClient(address) as client:
        warm = next(examples("in_distribution", 1, start=10_000))
        for policy in policies:  # first calls at these shapes are slow: keep them out of the timings
            await ask(client, warm.context, warm.question, policy)
        for name in sets:
            got: dict[Policy, list[Sample]] = {p: [] for p in policies}
            for ex in examples(name, n):
                order = policies[:]
                rng.shuffle(order)
                answers = {p: await ask(client, ex.context, ex.question, p) for p in order}
                oracle = answers[policies[0]][0]
                for policy, (answer, ms) in answers.items():
                    sample = Sample(answer, ms, policy.cost_ms(answer.stats) / max(oracle.stats.rebuild_ms, 1e-9))
                    sample.identical = answer.ids == oracle.ids
                    if ex.answer is not None:
                        sample.f1 = f1_score(answer.text.removesuffix(END).strip(), ex.answer)
                    got[policy].append(sample)
            for policy, samples in got.items():
                emit(out, row({**base, "set": name}, policy, samples))


def _end_id(pair) -> int:
    from transformers import AutoTokenizer

    from qa.tokenizer import end_token_id

    return end_token_id(AutoTokenizer.from_pretrained(ROOT / pair.consumer))


async def speed(address: str, model: str, ctx_tokens: int, new_tokens: int, runs: int, link: str, out, seed: int) -> None:
    policies = speed_policies()
    rng = random.Random(seed)
    base = {
        "pair": "identical",
        "weights": "random",
        "model": Path(model).name,
        "dtype": "",
        "set": f"random ids x {ctx_tokens}",
        "link": link,
    }

    def request(ctx: list[int], question: list[int], policy: Policy) -> dict:
        return dict(
            mode=policy.mode,
            options=policy.options,
            context=prompt(ids=ctx),
            question=prompt(ids=question),
            max_new_tokens=new_tokens,
            stop_token_ids=[0],
            **policy.fields,
        )

    async with ConsumerClient(address) as client:
        described = (await client.describe()).model
        base["dtype"], base["device"] = described.dtype, described.device  # what --dtype / --device resolved to
        got: dict[Policy, list[Sample]] = {p: [] for p in policies}
        for run in range(runs + 1):  # run 0 warms up
            ctx = [rng.randrange(4, 32000) for _ in range(ctx_tokens)]  # a context nobody has seen: cold
            question = [rng.randrange(4, 32000) for _ in range(16)]
            # the producer holds the context first (a disaggregated prefill: it read it already), so
            # no policy pays or skips its prefill by where it falls in the order
            await client.generate(**{**request(ctx, question, policies[0]), "max_new_tokens": 1})
            order = policies[:]
            rng.shuffle(order)
            answers = {p: await timed(client.generate(**request(ctx, question, p))) for p in order}
            oracle = answers[policies[1]][0]
            for policy, (answer, ms) in answers.items():
                sample = Sample(answer, ms, policy.cost_ms(answer.stats) / max(oracle.stats.rebuild_ms, 1e-9))
                sample.identical = answer.ids == oracle.ids
                if run:
                    got[policy].append(sample)
            print(f"# run {run}: " + ", ".join(f"{p.name} {ms:.0f} ms" for p, (_, ms) in answers.items()), file=sys.stderr)
        for policy, samples in got.items():  # each run's completion too: runs pair up across policies
            emit(out, {**row(base, policy, samples), "completion_ms_each": [round(s.completion_ms, 1) for s in samples]})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", default="heterogeneous,deep-full", help=f"trained QA pairs of {sorted(PAIRS)} ('' = skip)")
    p.add_argument("--sets", default=DEFAULT_SETS, help="qa.shifted sets")
    p.add_argument("--n", type=int, default=20, help="examples per set")
    p.add_argument("--fractions", default=",".join(f"{f:g}" for f in FRACTIONS), help="repair fractions")
    p.add_argument("--scale", default="qwen05b", choices=["qwen05b", ""], help="the speed rows' model ('' = skip)")
    p.add_argument("--link", default="shaped", choices=["shaped", "relay", "loopback"],
                   help="the speed rows' link: tc-shaped veth (root), a userspace relay pacing loopback at "
                   "--rate-mbit (no root, no tc: bench.harness.relay), or plain loopback")
    p.add_argument("--rate-mbit", type=float, default=100.0)
    p.add_argument("--ctx-tokens", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--runs", type=int, default=3, help="speed runs per policy (after one warm-up)")
    p.add_argument("--dtype", default="auto", help="the speed rows' --dtype (auto: what the CPU computes natively)")
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--append", action="store_true", help="append to OUT instead of replacing it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--inside-link", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.scale and args.link == "shaped" and not args.inside_link:
        # quality first, here; then the speed rows from inside the consumer's namespace
        if args.pairs:
            code = main([*(argv if argv is not None else sys.argv[1:]), "--scale", ""])
            if code:
                return code
        from bench.serving.ttft.links import run_inside_link

        inner = [*(argv if argv is not None else sys.argv[1:]), "--pairs", "", "--append"]
        return run_inside_link(inner, 0.0, module="bench.serving.verify")
    with open(args.out, "a" if args.append else "w") as out:
        for name in [s for s in args.pairs.split(",") if s]:
            pair = PAIRS[name]
            common = ["--dtype", "float32", "--log-level", "WARNING", "--artifacts", str(ROOT / pair.artifact)]
            with services.running(
                ["--model", pair.producer, *common],
                ["--model", pair.consumer, *common, *services.NO_PREFIX_CACHE],
                log_dir=ROOT / "bench/runs/verify",
            ) as (_, consumer):
                fractions = [float(f) for f in args.fractions.split(",") if f]
                sets = [s for s in args.sets.split(",") if s]
                asyncio.run(quality(consumer.address, name, sets, args.n, fractions, out, args.seed))
        if args.scale:
            run_speed(args, out)
    return 0


def run_speed(args, out) -> None:
    from bench.harness.workloads import ensure_qwen05b
    from bench.serving.ttft.links import Loopback, Relayed, Shaped

    model = str(ensure_qwen05b())
    link = Shaped(args.inside_link == "netem", 0.0) if args.inside_link else Loopback()
    label = "loopback"
    if args.link == "relay":
        link = Relayed(args.rate_mbit)
        label = link.label()
    elif args.inside_link:
        link.shape(args.rate_mbit)
        label = f"{link.kind} {args.rate_mbit:g} Mbit"
    common = ["--dtype", args.dtype, "--log-level", "WARNING"]
    with services.running(
        ["--model", model, *common],
        ["--model", model, *common, *services.NO_PREFIX_CACHE],
        log_dir=ROOT / "bench/runs/verify",
        producer_host=link.producer_host,
        consumer_host=link.consumer_host,
        producer_prefix=link.producer_prefix,
        consumer_prefix=link.consumer_prefix,
        producer_target=link.producer_target,
    ) as (_, consumer):
        asyncio.run(speed(consumer.address, model, args.ctx_tokens, args.new_tokens, args.runs, label, out, args.seed))
    link.close()


if __name__ == "__main__":
    sys.exit(main())
