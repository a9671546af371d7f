"""`make bench-quality`: answer quality vs bytes on the wire for every transfer mode, through the
real services, on the trained pair's test split.

Pairs: heterogeneous (2 layers: P = qa-base, C = qa-tuned), homogeneous (P = C = qa-tuned), and
the 6-layer pairs deep-full (C = full fine-tune of P) and deep-lora (C = P + merged LoRA); the task
is the consumer's (tuned). Per pair, context length and mode/schedule one JSON line
  {"pair", "layers", "mode", "schedule", "ctx_tokens", "bytes_per_token", "bytes_ratio_vs_raw",
   "f1", "em", "f1_gap_vs_oracle", "identical_to_oracle", "encode_ms", "consumer_prefill_ms",
   "encode_cost_ratio", "predictor_flops_ratio", "consumer_flops_ratio", "load"}
(f1, em and the gap in points, 0-100; ratio = raw bf16 KV bytes / bytes; identical = share of
answers token-identical to the oracle's; encode_ms = median producer encode time per request,
consumer_prefill_ms = median of the oracle's own context prefill, encode_cost_ratio their ratio;
predictor_flops_ratio = the producer's learned-predictor FLOPs / the consumer's prefill FLOPs,
consumer_flops_ratio = the consumer's rebuild FLOPs / its prefill FLOPs, both from bench.harness.flops;
load = the 1-minute load average, the higher of the pair's start and the row's end).
Also written to bench/results/quality.jsonl (`--merge` keeps the other pairs' rows there), plus a
bytes-vs-F1 Pareto plot (quality.png) and a markdown table (quality.md). The recompute baseline
runs at every span width the artifact profiled (its best span of each). Default n = 200 test examples per point.

Choose on validation, report on test: before the test rows, every SCD schedule and the oracle run
on `--n-validation` examples of the validation split (seeds from VALIDATION_START on, past the
few that calibration holds out) at the pair's first context length; the headline schedule is the
cheapest one whose validation F1 gap to the oracle is within the pair's target (`pick_headline`,
Pair.max_gap). Its test rows carry `headline: true`; every row carries `split`, `n`,
`selected_on` (the split the headline was chosen on: "validation"; "calibration" for the
recompute spans, which the artifact's profile chose; null for fixed baselines), `f1_ci95` and
`f1_gap_ci95` (95% percentile bootstrap of the mean F1 and of the paired per-example gap to the
oracle, qa.metrics.bootstrap_ci), `weights` and the artifact with its calibration corpus.
The validation rows go to quality_validation.jsonl, and each pair's headline is written into its
artifact as the default schedule (`Artifact.set_default`: what `scd` without options gets, and
mode auto's default budget); `--record-defaults-from FILE` writes only that, from committed rows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
from pathlib import Path

from bench.harness import flops, pairs, provenance, services
from bench.harness.pairs import PAIRS, pick_headline
from calibration.search import evenly_spaced
from consumer.api.client import ConsumerClient
from qa.metrics import bootstrap_ci, exact_match, f1_score
from qa.task import examples
from shared.codecs.recompute import span as recompute_span
from shared.labels import options_label
from shared.scd.artifact import Artifact

ROOT = services.ROOT
RESULTS = ROOT / "bench/results"
VALIDATION_START = 10_000  # validation seeds from here: calibration holds out the first few


def _ci(values: list[float]) -> list[float]:
    return [round(100 * v, 2) for v in bootstrap_ci(values)]


def modes_for(artifact: Artifact, max_schedules: int) -> list[tuple[str, dict]]:
    """(mode, options) to run: baselines, then the artifact's Pareto schedules."""
    spans = artifact.meta.get("recompute_spans") or {"": artifact.meta.get("recompute_span")}
    runs = [("oracle", {}), ("raw", {}), ("quant", {"bits": "8"}), ("quant", {"bits": "4"})]
    for span in spans.values():
        runs.append(("recompute", {"start": str(span[0]), "end": str(span[1])} if span else {}))
    runs += [("scd", {"schedule": e.name}) for e in evenly_spaced(artifact.schedules, max_schedules)]
    return runs


def schedule_label(mode: str, options: dict, stats_options: dict) -> str:
    if mode == "scd":
        return stats_options.get("schedule", options.get("schedule", ""))
    return options_label(options) or "-"


def compute_costs(mode: str, options: dict, artifact: Artifact, config: dict, tokens: float) -> dict:
    """The producer's predictor FLOPs and the consumer's rebuild FLOPs, as fractions of the
    consumer's own prefill FLOPs over the same context (bench.harness.flops)."""
    own = flops.prefill(config, tokens)
    predictor_flops, rebuild = 0.0, 0.0
    if mode == "scd":
        actions = options["schedule"].split(".")
        rebuild = flops.scd_rebuild(config, tokens, actions)
        pconf = artifact.meta.get("predictor", {}).get("config")
        used = [l for l in artifact.predictor_layers if flops.uses_predictor(actions[l])]
        predictor_flops = flops.predictors(pconf, tokens, len(used)) if pconf and used else 0.0
    elif mode == "recompute":
        start, end = recompute_span(options, config["num_hidden_layers"], "")
        rebuild = flops.prefill(config, tokens, end - start)
    elif mode == "oracle":
        rebuild = own
    return {"predictor_flops_ratio": round(predictor_flops / own, 4), "consumer_flops_ratio": round(rebuild / own, 4)}


async def run_pair(
    pair: str,
    address: str,
    artifact: Artifact,
    n: int,
    ctx: int,
    max_schedules: int,
    end_id: int,
    element_bytes: int,
    config: dict,
    split: str = "test",
    only: tuple[str, ...] = (),
) -> list[dict]:
    """One row per mode/schedule over n examples of `split` (`only`: these modes; the oracle runs
    first in any case, the reference of the gap and of `identical_to_oracle`)."""
    rows, oracle_f1, oracle_ids, oracle_ms, oracle_f1s = [], None, [], 0.0, []
    load = os.getloadavg()[0]
    data = list(examples(split, n, ctx, "tuned", start=VALIDATION_START if split == "validation" else 0))
    async with ConsumerClient(address) as client:
        for mode, options in modes_for(artifact, max_schedules):
            if only and mode not in only and mode != "oracle":
                continue
            f1s, ems, sent, tokens, raw_bf16, label, same, encode_ms, prefill_ms = [], [], 0, 0, 0, "", 0, [], []
            resolved: dict = {}
            for i, ex in enumerate(data):
                answer = await pairs.ask(client, ex.context, ex.question, end_id, mode, options)
                text = answer.text
                f1s.append(f1_score(text, ex.answer))
                ems.append(exact_match(text, ex.answer))
                s = answer.stats
                sent += s.bytes_received if mode != "oracle" else 0
                tokens += s.context_tokens
                raw_bf16 += s.raw_kv_bytes * 2 // element_bytes  # the same K/V in bf16
                label = schedule_label(mode, options, dict(s.transfer.options))
                resolved = dict(s.transfer.options)
                encode_ms.append(s.producer_encode_ms)
                prefill_ms.append(s.rebuild_ms)
                if mode == "oracle":
                    oracle_ids.append(answer.ids)
                same += answer.ids == oracle_ids[i]  # greedy tokens equal to the consumer's own prefill
            f1, em = 100 * statistics.fmean(f1s), 100 * statistics.fmean(ems)
            oracle_f1 = f1 if mode == "oracle" else oracle_f1
            oracle_f1s = f1s if mode == "oracle" else oracle_f1s
            oracle_ms = statistics.median(prefill_ms) if mode == "oracle" else oracle_ms
            encode = statistics.median(encode_ms)
            costs = compute_costs(mode, resolved, artifact, config, tokens / len(data))
            row = {
                "pair": pair,
                "layers": config["num_hidden_layers"],
                "ctx": ctx,
                "mode": mode,
                "schedule": label,
                "ctx_tokens": round(tokens / len(data)),
                "bytes_per_token": round(sent / tokens, 2),
                "bytes_ratio_vs_raw": round(raw_bf16 / sent, 2) if sent else None,
                "f1": round(f1, 2),
                "em": round(em, 2),
                "f1_gap_vs_oracle": round(oracle_f1 - f1, 2),
                "identical_to_oracle": round(same / len(data), 4),
                "encode_ms": round(encode, 2),
                "consumer_prefill_ms": round(oracle_ms, 2),
                "load": round(max(load, os.getloadavg()[0]), 2),
                "encode_cost_ratio": round(encode / oracle_ms, 4) if oracle_ms else None,
                **costs,
                "split": split,
                "n": len(data),
                "f1_ci95": _ci(f1s),
                "f1_gap_ci95": _ci([o - m for o, m in zip(oracle_f1s, f1s)]),
                "weights": provenance.TRAINED,
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def label(rows: list[dict], headline: str | None, select_on: str, artifact_path: str) -> list[dict]:
    """Test rows of one pair with what chose them: `selected_on`, `headline` and the artifact."""
    chosen_on = None if select_on == "none" else select_on
    ran_on = provenance.artifact_fields(artifact_path)
    for r in rows:
        if r["mode"] in ("scd", "recompute"):
            r.update(ran_on)
        r["selected_on"] = {"scd": chosen_on, "recompute": "calibration"}.get(r["mode"])
        r["headline"] = r["mode"] == "scd" and r["schedule"] == headline
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = list(dict.fromkeys((r["pair"], r["ctx"]) for r in rows))
    cols = min(3, len(pairs))
    nrows = -(-len(pairs) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(6 * cols, 4.5 * nrows), squeeze=False)
    for ax in axes.flat[len(pairs) :]:
        ax.set_visible(False)
    for ax, (pair, ctx) in zip(axes.flat, pairs):
        sub = [r for r in rows if (r["pair"], r["ctx"]) == (pair, ctx)]
        oracle = next(r for r in sub if r["mode"] == "oracle")
        ax.axhline(oracle["f1"], color="k", ls="--", lw=1, label=f"oracle (C prefills) F1 {oracle['f1']:.1f}")
        for mode, marker in (("raw", "s"), ("quant", "^"), ("recompute", "D"), ("scd", "o")):
            pts = sorted((r["bytes_per_token"], r["f1"]) for r in sub if r["mode"] == mode)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=mode, ls="-" if mode == "scd" else "none")
        ax.set_xscale("log")
        ax.set_xlabel("bytes per context token on the wire (log)")
        ax.set_ylabel("F1 (0-100)")
        ax.set_title(f"{pair} pair ({sub[0]['layers']} layers), ctx {sub[0]['ctx_tokens']} tokens")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _interval(ci: list[float] | None, signed: bool = False) -> str:
    if not ci:
        return "-"
    return f"{ci[0]:+.1f}..{ci[1]:+.1f}" if signed else f"{ci[0]:.1f}-{ci[1]:.1f}"


def table(rows: list[dict]) -> str:
    """The rows as markdown; the headline schedule in bold with the split it was chosen on."""
    lines = [
        "| pair | layers | ctx | n | mode | schedule | bytes/token | x fewer than raw bf16 | F1 | F1 95% CI | EM "
        "| F1 gap vs oracle | gap 95% CI | identical to oracle | producer encode / C prefill (ms) "
        "| predictor FLOPs / C prefill | C rebuild FLOPs / C prefill | headline chosen on |",
        "|---|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        ratio = "-" if r["bytes_ratio_vs_raw"] is None else f"{r['bytes_ratio_vs_raw']:.1f}"
        encode = "-" if r["mode"] == "oracle" or r["encode_cost_ratio"] is None else f"{r['encode_cost_ratio']:.1%}"
        schedule = f"**`{r['schedule']}`**" if r.get("headline") else f"`{r['schedule']}`"
        chosen = (r.get("selected_on") or "-") if r.get("headline") else "-"
        lines.append(
            f"| {r['pair']} | {r['layers']} | {r['ctx_tokens']} | {r.get('n', '-')} | {r['mode']} | {schedule} "
            f"| {r['bytes_per_token']:g} | {ratio} | {r['f1']:.1f} | {_interval(r.get('f1_ci95'))} | {r['em']:.1f} "
            f"| {r['f1_gap_vs_oracle']:+.1f} | {_interval(r.get('f1_gap_ci95'), True)} "
            f"| {100 * r['identical_to_oracle']:.1f}% | {encode} | {r['predictor_flops_ratio']:.1%} "
            f"| {r['consumer_flops_ratio']:.1%} | {chosen} |"
        )
    return "\n".join(lines)


def record_default(artifact_path: str, schedule: str | None, max_gap: float) -> None:
    """Write the headline chosen on validation into the artifact as its default schedule (the one
    a request naming `scd` without options gets, and whose loss is mode auto's default budget)."""
    if schedule is None:
        return
    art = Artifact.load(ROOT / artifact_path)
    art.set_default(schedule, f"validation split: the cheapest schedule within {max_gap:g} F1 points of the oracle (bench.serving.quality)")
    art.rewrite()


def record_defaults(validation_path: Path) -> None:
    """`--record-defaults-from`: the committed validation rows' headlines into the artifacts."""
    rows = [json.loads(line) for line in validation_path.read_text().splitlines() if line.strip()]
    for name, spec in PAIRS.items():
        first = [r for r in rows if r["pair"] == name and r["ctx"] == spec.ctxs[0]]
        if first:
            record_default(spec.artifact, pick_headline(first, spec.max_gap), spec.max_gap)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", default=",".join(PAIRS), help=f"comma-separated, of: {', '.join(PAIRS)}")
    p.add_argument("--n", type=int, default=200, help="test examples per point")
    p.add_argument("--ctx", type=int, nargs="*", default=[], help="context lengths (default: each pair's own)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-schedules", type=int, default=8)
    p.add_argument(
        "--artifact",
        action="append",
        default=[],
        metavar="PAIR=PATH",
        help="use this artifact for a pair instead of the shipped one (repeatable)",
    )
    p.add_argument("--out-dir", type=Path, default=RESULTS, help="where quality.{jsonl,md,png} go")
    p.add_argument("--merge", action="store_true", help="keep the other pairs' rows of an existing quality.jsonl")
    p.add_argument(
        "--select-on",
        choices=["validation", "none"],
        default="validation",
        help="choose each pair's headline schedule on the validation split (none: no headline)",
    )
    p.add_argument("--n-validation", type=int, default=100, help="validation examples per schedule for the choice")
    p.add_argument(
        "--record-defaults-from",
        type=Path,
        help="only write each pair's headline, chosen on these validation rows, into its artifact as the default schedule",
    )
    args = p.parse_args()
    if args.record_defaults_from:
        record_defaults(args.record_defaults_from)
        return
    unknown = [name for name in args.pairs.split(",") if name not in PAIRS]
    if unknown:
        p.error(f"--pairs: unknown {unknown}; known: {list(PAIRS)}")
    overrides = dict(a.split("=", 1) for a in args.artifact)
    from transformers import AutoTokenizer

    from qa.tokenizer import end_token_id

    args.out_dir.mkdir(parents=True, exist_ok=True)
    rows, validation = [], []
    for pair in args.pairs.split(","):
        spec = PAIRS[pair]
        producer, consumer, ctxs = spec.producer, spec.consumer, args.ctx or spec.ctxs
        artifact_path = overrides.get(pair, spec.artifact)
        artifact = Artifact.load(ROOT / artifact_path)
        end_id = end_token_id(AutoTokenizer.from_pretrained(ROOT / consumer))
        config = json.loads((ROOT / consumer / "config.json").read_text())
        common = ["--dtype", args.dtype, "--log-level", "WARNING", "--artifacts", str(ROOT / artifact_path)]
        fixed = dict(
            pair=pair,
            artifact=artifact,
            max_schedules=args.max_schedules,
            end_id=end_id,
            element_bytes=4 if args.dtype == "float32" else 2,
            config=config,
        )
        with services.running(
            ["--model", producer, *common], ["--model", consumer, *common, *services.NO_PREFIX_CACHE], log_dir=ROOT / "bench/runs/quality"
        ) as (_, c):
            chosen = None
            if args.select_on == "validation":  # choose on validation at the pair's first length
                validation += asyncio.run(
                    run_pair(address=c.address, n=args.n_validation, ctx=ctxs[0], split="validation", only=("scd",), **fixed)
                )
                chosen = pick_headline([r for r in validation if r["pair"] == pair], spec.max_gap)
                record_default(artifact_path, chosen, spec.max_gap)
            pair_rows = [row for ctx in ctxs for row in asyncio.run(run_pair(address=c.address, n=args.n, ctx=ctx, **fixed))]
        ran_on = {"producer_model": producer, "consumer_model": consumer, "dtype": args.dtype}  # what every row ran on
        rows += [{**r, **ran_on} for r in label(pair_rows, chosen, args.select_on, artifact_path)]
        validation = [{**r, **ran_on} if r["pair"] == pair else r for r in validation]
    done = {r["pair"] for r in rows}
    if args.merge and (args.out_dir / "quality.jsonl").exists():
        kept = [json.loads(line) for line in (args.out_dir / "quality.jsonl").read_text().splitlines() if line.strip()]
        rows += [r for r in kept if r["pair"] not in done]
        order = list(PAIRS)
        rows.sort(key=lambda r: order.index(r["pair"]) if r["pair"] in order else len(order))  # stable within a pair
    (args.out_dir / "quality.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if validation:
        vpath = args.out_dir / "quality_validation.jsonl"
        if args.merge and vpath.exists():  # the other pairs' validation rows stay with their test rows
            seen = {r["pair"] for r in validation}
            validation += [r for r in map(json.loads, vpath.read_text().splitlines()) if r["pair"] not in seen]
        vpath.write_text("".join(json.dumps(r) + "\n" for r in validation))
    plot(rows, args.out_dir / "quality.png")
    (args.out_dir / "quality.md").write_text(table(rows) + "\n")
    print(table(rows), file=sys.stderr)


if __name__ == "__main__":
    main()
