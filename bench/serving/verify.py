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

Part 1 on the real pair (`--real smollm2-pc`, bench.harness.question_sets.RealSets): the same
policies over real.tasks examples of one split (`--split`, `--context-tokens`, the examples
real.quality scores), asked as token ids in the consumer's chat format, greedy up to `<|im_end|>`
or 48 new tokens, F1 by real.score; one row per example and policy as each example is done (kind
"verify_example"), then the summaries (kind "verify", with the paired F1 gap to the oracle) and
the audit's recall and precision on the same examples (`--audit-out`, kind "audit":
bench.serving.audit.flag_summary). `python -m bench.serving.verify summarize ROWS [--audit-out A]`
writes the summaries of a run stopped early.

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

from bench.harness import services
from bench.harness.pairs import PAIRS
from bench.harness.question_sets import REAL_PAIRS, QaSets, RealSets
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


def quality_policies(fractions: list[float], error_anchors=ERROR_ANCHORS, audit_repair: bool = True) -> list[Policy]:
    """The oracle first (every other policy is compared with it), then the SCD policies."""
    fallback = {"audit": consumer_pb2.AUDIT_POLICY_FALLBACK}
    verify = {"verify": consumer_pb2.VERIFY_POLICY_VERIFIED}
    repaired = {"audit": consumer_pb2.AUDIT_POLICY_REPAIR}
    return [
        Policy("oracle", "oracle"),
        Policy("scd", "scd"),
        *(Policy("scd+repair", "scd", {"repair": str(f)}, repair_fraction=f) for f in fractions),
        *(
            Policy("scd+repair", "scd", {"repair": str(f), "repair_anchors": how}, repair_fraction=f, anchors=how)
            for how, at in error_anchors
            for f in fractions
            if f in at
        ),
        Policy("scd+audit_fallback", "scd", fields=fallback),
        *([Policy("scd+audit_repair", "scd", fields=repaired, repair_fraction=0.1)] if audit_repair else []),
        Policy("scd+verify", "scd", fields=verify),
    ]


def speed_policies() -> list[Policy]:
    return [
        Policy("raw", "raw"),
        Policy("oracle", "oracle"),
        Policy("quant+verify", "quant", {"bits": "8"}, {"verify": consumer_pb2.VERIFY_POLICY_VERIFIED}),
    ]


SAMPLE_KEYS = (  # what `sample` records per answer
    "policy", "repair_fraction", "anchor_choice", "ids", "prediction", "identical_to_oracle", "f1", "completion_ms", "cost",
    "ttft_ms", "time_to_verified_ms", "drafted_tokens", "accepted_draft_tokens", "audit_decision", "audit_layer_errors",
    "verify_decision", "repair_tokens",
)


def sample(policy: Policy, answer: Answer, ms: float, oracle: Answer) -> dict:
    """One answer's record: its tokens and text, identical to the oracle's (greedy tokens equal),
    its times, its cost over the oracle's context prefill of the same example, and what the
    audit, repair and verification did."""
    s = answer.stats
    return {
        "policy": policy.name,
        "repair_fraction": policy.repair_fraction,
        "anchor_choice": policy.anchor_choice,
        "ids": list(answer.ids),
        "prediction": answer.text,
        "identical_to_oracle": answer.ids == oracle.ids,
        "f1": None,
        "completion_ms": round(ms, 1),
        "cost": round(policy.cost_ms(s) / max(oracle.stats.rebuild_ms, 1e-9), 4),
        "ttft_ms": round(s.ttft_ms, 1),
        "time_to_verified_ms": round(s.time_to_verified_ms or s.ttft_ms, 1),
        "drafted_tokens": s.drafted_tokens,
        "accepted_draft_tokens": s.accepted_draft_tokens,
        "audit_decision": s.audit_decision,
        "audit_layer_errors": [round(e, 5) for e in s.audit_layer_errors],
        "verify_decision": s.verify_decision,
        "repair_tokens": s.repair_tokens,
    }


async def timed(coro) -> tuple[Answer, float]:
    started = time.perf_counter()
    answer = await coro
    return answer, (time.perf_counter() - started) * 1e3


def row(base: dict, samples: list[dict], oracle: list[dict] | None = None) -> dict:
    """One policy's summary over its samples; with `oracle` (the oracle's samples of the same
    examples, in the same order) the paired F1 gap to it and its 95% bootstrap interval too."""
    drafted = sum(s["drafted_tokens"] for s in samples)
    f1s = [s["f1"] for s in samples if s["f1"] is not None]
    gap = {}
    if oracle is not None and f1s:
        from qa.metrics import bootstrap_ci

        gaps = [100 * (o["f1"] - s["f1"]) for s, o in zip(samples, oracle, strict=True)]
        gap = {"f1_gap": round(statistics.fmean(gaps), 2), "f1_gap_ci95": [round(x, 2) for x in bootstrap_ci(gaps)]}
    return {
        **base,
        "kind": "verify",
        "policy": samples[0]["policy"],
        "repair_fraction": samples[0]["repair_fraction"],
        "anchor_choice": samples[0]["anchor_choice"],
        "n": len(samples),
        "identical_to_oracle": round(statistics.fmean(s["identical_to_oracle"] for s in samples), 3),
        "identical_count": sum(s["identical_to_oracle"] for s in samples),
        "f1": round(100 * statistics.fmean(f1s), 2) if f1s else None,
        "accepted_draft_fraction": round(sum(s["accepted_draft_tokens"] for s in samples) / drafted, 3) if drafted else None,
        "ttft_ms_p50": round(statistics.median(s["ttft_ms"] for s in samples), 1),
        "time_to_verified_ms_p50": round(statistics.median(s["time_to_verified_ms"] for s in samples), 1),
        "completion_ms_p50": round(statistics.median(s["completion_ms"] for s in samples), 1),
        "cost_ratio_vs_prefill": round(statistics.median(s["cost"] for s in samples), 3),
        **gap,
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }


def emit(out, line: dict, echo: bool = True) -> None:
    text = json.dumps(line)
    if echo:
        print(text, flush=True)
    out.write(text + "\n")
    out.flush()


async def quality(
    address: str, source, sets: list[str], n: int, policies: list[Policy], out, seed: int, per_example: bool = False
) -> list[dict]:
    """Every example of every set asked under every policy (a seeded order per example); one row
    per (set, policy) when the set is done and, with `per_example`, one row per (example, policy)
    as soon as the example is done (kind "verify_example": a stopped run keeps them). `source`:
    bench.harness.question_sets (QaSets | RealSets). Returns the per-example rows."""
    schedule = source.schedule()
    rng = random.Random(seed)
    base = source.base()
    records: list[dict] = []

    async def ask(client: ConsumerClient, q, policy: Policy) -> tuple[Answer, float]:
        options = {**schedule, **policy.options} if policy.mode != "oracle" else {}
        return await timed(source.ask(client, q, policy.mode, options, **policy.fields))

    async with ConsumerClient(address) as client:
        warm = source.warm()
        for policy in policies:  # first calls at these shapes are slow: keep them out of the timings
            await ask(client, warm, policy)
        for name in sets:
            got: dict[Policy, list[dict]] = {p: [] for p in policies}
            for q in source.asked(name, n):
                order = policies[:]
                rng.shuffle(order)
                answers = {p: await ask(client, q, p) for p in order}
                oracle = answers[policies[0]][0]
                for policy in policies:
                    answer, ms = answers[policy]
                    one = sample(policy, answer, ms, oracle)
                    one["f1"] = source.f1(answer.text, q)
                    got[policy].append(one)
                    if per_example:
                        records.append({**base, "kind": "verify_example", "set": name, "index": q.index, **q.labels,
                                        "gold": q.gold, **one})
                        emit(out, records[-1], echo=False)
                if per_example:
                    done = ", ".join(f"{_label(p)} {'=' if got[p][-1]['identical_to_oracle'] else 'x'}" for p in policies)
                    print(f"# {name} #{q.index} ({time.strftime('%H:%M:%S')}): {done}", file=sys.stderr, flush=True)
            for samples in got.values():
                emit(out, row({**base, **source.set_fields(name)}, samples, got[policies[0]] if per_example else None))
    return records


def _label(policy: Policy) -> str:
    return policy.name + (f"@{policy.repair_fraction:g}/{policy.anchor_choice}" if policy.name == "scd+repair" else "")


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
        got: dict[Policy, list[dict]] = {p: [] for p in policies}
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
                if run:
                    got[policy].append(sample(policy, answer, ms, oracle))
            print(f"# run {run}: " + ", ".join(f"{p.name} {ms:.0f} ms" for p, (_, ms) in answers.items()), file=sys.stderr)
        for samples in got.values():  # each run's completion too: runs pair up across policies
            emit(out, {**row(base, samples), "completion_ms_each": [s["completion_ms"] for s in samples]})


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
    p.add_argument("--real", default="", choices=["", *REAL_PAIRS],
                   help="instead: this real pair over real.tasks examples (question_sets.RealSets), one row per "
                   "example and policy, then the summaries and the audit's (bench.serving.audit.flag_summary)")
    p.add_argument("--split", default="test", help="--real: the real.tasks split")
    p.add_argument("--context-tokens", type=int, default=1024, help="--real: tokens of chat prefix")
    p.add_argument("--schedule", default="", help="--real: the SCD schedule ('' = the pair's headline)")
    p.add_argument("--no-error-anchors", action="store_true", help="repair with attention anchors only")
    p.add_argument("--no-audit-repair", action="store_true", help="leave out the scd+audit_repair policy")
    p.add_argument("--audit-out", default="", help="--real: where the audit's summary row goes ('' = not written)")
    p.add_argument("--inside-link", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.real:
        return run_real(args)
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
            source = QaSets(name)
            common = ["--dtype", "float32", "--log-level", "WARNING", "--artifacts", str(ROOT / source.artifact)]
            with services.running(
                ["--model", source.producer, *common],
                ["--model", source.consumer, *common, *services.NO_PREFIX_CACHE],
                log_dir=ROOT / "bench/runs/verify",
            ) as (_, consumer):
                sets = [s for s in args.sets.split(",") if s]
                asyncio.run(quality(consumer.address, source, sets, args.n, _policies(args), out, args.seed))
        if args.scale:
            run_speed(args, out)
    return 0


def _policies(args) -> list[Policy]:
    fractions = [float(f) for f in args.fractions.split(",") if f]
    return quality_policies(fractions, () if args.no_error_anchors else ERROR_ANCHORS, not args.no_audit_repair)


def run_real(args) -> int:
    """The real pair through the services (float32, one torch thread each): every example's rows
    as it is done, then the summaries, then the audit's recall and precision on the same examples."""
    source = RealSets(args.real, args.context_tokens, args.schedule)
    common = ["--dtype", source.dtype, "--log-level", "WARNING", "--torch-threads", "1",
              "--artifacts", str(ROOT / source.artifact)]
    with open(args.out, "a" if args.append else "w") as out, services.running(
        ["--model", source.producer, *common],
        ["--model", source.consumer, *common, *services.NO_PREFIX_CACHE],
        log_dir=ROOT / "bench/runs/verify",
    ) as (producer, consumer):
        asyncio.run(source.describe(consumer.address, producer.address))
        records = asyncio.run(
            quality(consumer.address, source, [args.split], args.n, _policies(args), out, args.seed, per_example=True)
        )
    if args.audit_out:
        write_audit(records, Path(args.audit_out))
    return 0


EXAMPLE_KEYS = ("kind", "set", "index", "gold", "split", "family", "seed", "context_tokens")


def summarize(path: Path, audit_out: Path | None) -> None:
    """Rewrite a --real run's rows file (stopped early or not) as its per-example rows then one
    summary per (set, policy) over the examples every policy answered; the audit's row to
    `audit_out`. The summaries carry `stopped_early` when n is short of what was asked."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    records = [r for r in rows if r.get("kind") == "verify_example"]
    finished = {r["set"] for r in rows if r.get("kind") == "verify"}  # sets whose run wrote its summaries
    load = {(r["set"], r["policy"], r["repair_fraction"], r["anchor_choice"]): r["load_avg_1m"] for r in rows if r.get("kind") == "verify"}
    per_key: dict[tuple, list[dict]] = {}
    for r in records:
        per_key.setdefault((r["set"], r["policy"], r["repair_fraction"], r["anchor_choice"]), []).append(r)
    base = {k: v for k, v in records[0].items() if k not in EXAMPLE_KEYS and k not in SAMPLE_KEYS}
    with open(path, "w") as out:
        for r in records:
            emit(out, r, echo=False)
        for name in dict.fromkeys(r["set"] for r in records):
            oracle = per_key[(name, "oracle", 0.0, "none")]
            for key, samples in per_key.items():
                if key[0] == name:  # the load the run measured, none for a run stopped before its summaries
                    fields = {k: samples[0][k] for k in ("set", "split") if k in samples[0]}
                    line = {**row({**base, **fields}, samples, oracle), "load_avg_1m": load.get(key)}
                    emit(out, {**line, "stopped_early": name not in finished})
    if audit_out:
        write_audit(records, audit_out)


def write_audit(records: list[dict], path: Path) -> None:
    """The audit's recall and precision on these examples (bench.serving.audit.flag_summary) as one row."""
    from bench.serving.audit import flag_summary

    first = records[0]
    base = {k: v for k, v in first.items() if k not in EXAMPLE_KEYS and k not in SAMPLE_KEYS}
    line = flag_summary(records, {**base, **{k: first[k] for k in ("set", "split") if k in first}})
    print(json.dumps(line), flush=True)
    path.write_text(json.dumps(line) + "\n")


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
    if sys.argv[1:2] == ["summarize"]:
        parser = argparse.ArgumentParser(prog="python -m bench.serving.verify summarize", description=summarize.__doc__)
        parser.add_argument("rows", type=Path)
        parser.add_argument("--audit-out", type=Path, default=None)
        a = parser.parse_args(sys.argv[2:])
        summarize(a.rows, a.audit_out)
        sys.exit(0)
    sys.exit(main())
