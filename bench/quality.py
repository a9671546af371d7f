"""`make bench-quality`: answer quality vs bytes on the wire for every transfer mode, through the
real services, on the trained pair's test split.

Pairs: heterogeneous (P = qa-base, C = qa-tuned) and homogeneous (P = C = qa-tuned); the task is
the consumer's (tuned). Per mode/schedule one JSON line
  {"pair", "mode", "schedule", "ctx_tokens", "bytes_per_token", "bytes_ratio_vs_raw", "f1", "em",
   "f1_gap_vs_oracle", "identical_to_oracle"}   (f1, em and the gap in points, 0-100; ratio = raw
   bf16 KV bytes / bytes; identical = share of answers token-identical to the oracle's)
also written to bench/results/quality.jsonl, plus a bytes-vs-F1 Pareto plot (quality.png) and a
markdown table (quality.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

from bench import services
from calibration.search import evenly_spaced
from consumer.client import ConsumerClient, prompt
from qa.metrics import exact_match, f1_score
from qa.task import END, examples
from shared.labels import options_label
from shared.scd.artifact import Artifact

ROOT = services.ROOT
RESULTS = ROOT / "bench/results"
PAIRS = {
    "heterogeneous": ("checkpoints/qa-base", "checkpoints/qa-tuned", "artifacts/qa-base-to-tuned.safetensors"),
    "homogeneous": ("checkpoints/qa-tuned", "checkpoints/qa-tuned", "artifacts/qa-tuned-to-tuned.safetensors"),
}


def modes_for(artifact: Artifact, max_schedules: int) -> list[tuple[str, dict]]:
    """(mode, options) to run: baselines, then the artifact's Pareto schedules."""
    span = artifact.meta.get("recompute_span")
    runs = [("oracle", {}), ("raw", {}), ("quant", {"bits": "8"}), ("quant", {"bits": "4"})]
    runs.append(("recompute", {"start": str(span[0]), "end": str(span[1])} if span else {}))
    runs += [("scd", {"schedule": e.name}) for e in evenly_spaced(artifact.schedules, max_schedules)]
    return runs


def schedule_label(mode: str, options: dict, stats_options: dict) -> str:
    if mode == "scd":
        return stats_options.get("schedule", options.get("schedule", ""))
    return options_label(options) or "-"


async def run_pair(pair: str, address: str, artifact: Artifact, n: int, ctx: int, max_schedules: int, end_id: int,
                   element_bytes: int) -> list[dict]:
    rows, oracle_f1, oracle_ids = [], None, []
    data = list(examples("test", n, ctx, "tuned"))
    async with ConsumerClient(address) as client:
        for mode, options in modes_for(artifact, max_schedules):
            f1s, ems, sent, tokens, raw_bf16, label, same = [], [], 0, 0, 0, "", 0
            for i, ex in enumerate(data):
                answer = await client.generate(mode=mode, options=options, context=prompt(ex.context),
                                               question=prompt(ex.question), max_new_tokens=8, stop_token_ids=[end_id])
                text = answer.text.strip().removesuffix(END).strip()
                f1s.append(f1_score(text, ex.answer))
                ems.append(exact_match(text, ex.answer))
                s = answer.stats
                sent += s.bytes_received if mode != "oracle" else 0
                tokens += s.context_tokens
                raw_bf16 += s.raw_kv_bytes * 2 // element_bytes  # the same K/V in bf16
                label = schedule_label(mode, options, dict(s.transfer.options))
                if mode == "oracle":
                    oracle_ids.append(answer.ids)
                same += answer.ids == oracle_ids[i]  # greedy tokens equal to the consumer's own prefill
            f1, em = 100 * statistics.fmean(f1s), 100 * statistics.fmean(ems)
            oracle_f1 = f1 if mode == "oracle" else oracle_f1
            row = {"pair": pair, "mode": mode, "schedule": label, "ctx_tokens": round(tokens / len(data)),
                   "bytes_per_token": round(sent / tokens, 2), "bytes_ratio_vs_raw": round(raw_bf16 / sent, 2) if sent else None,
                   "f1": round(f1, 2), "em": round(em, 2), "f1_gap_vs_oracle": round(oracle_f1 - f1, 2),
                   "identical_to_oracle": round(same / len(data), 4)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = sorted({r["pair"] for r in rows})
    fig, axes = plt.subplots(1, len(pairs), figsize=(6 * len(pairs), 4.5), squeeze=False)
    for ax, pair in zip(axes[0], pairs):
        sub = [r for r in rows if r["pair"] == pair]
        oracle = next(r for r in sub if r["mode"] == "oracle")
        ax.axhline(oracle["f1"], color="k", ls="--", lw=1, label=f"oracle (C prefills) F1 {oracle['f1']:.1f}")
        for mode, marker in (("raw", "s"), ("quant", "^"), ("recompute", "D"), ("scd", "o")):
            pts = sorted((r["bytes_per_token"], r["f1"]) for r in sub if r["mode"] == mode)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=mode, ls="-" if mode == "scd" else "none")
        ax.set_xscale("log")
        ax.set_xlabel("bytes per context token on the wire (log)")
        ax.set_ylabel("F1 (0-100)")
        ax.set_title(f"{pair} pair, ctx {sub[0]['ctx_tokens']} tokens")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(rows: list[dict]) -> str:
    lines = ["| pair | mode | schedule | bytes/token | x fewer than raw bf16 | F1 | EM | F1 gap vs oracle | identical to oracle |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ratio = "-" if r["bytes_ratio_vs_raw"] is None else f"{r['bytes_ratio_vs_raw']:.1f}"
        lines.append(f"| {r['pair']} | {r['mode']} | `{r['schedule']}` | {r['bytes_per_token']:g} | {ratio} | "
                     f"{r['f1']:.1f} | {r['em']:.1f} | {r['f1_gap_vs_oracle']:+.1f} | {100 * r['identical_to_oracle']:.1f}% |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", default="heterogeneous,homogeneous")
    p.add_argument("--n", type=int, default=200, help="test examples per point")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-schedules", type=int, default=8)
    p.add_argument("--artifact", action="append", default=[], metavar="PAIR=PATH",
                   help="use this artifact for a pair instead of the shipped one (repeatable)")
    p.add_argument("--out-dir", type=Path, default=RESULTS, help="where quality.{jsonl,md,png} go")
    args = p.parse_args()
    overrides = dict(a.split("=", 1) for a in args.artifact)
    from transformers import AutoTokenizer

    from qa.tokenizer import end_token_id

    args.out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for pair in args.pairs.split(","):
        producer, consumer, artifact_path = PAIRS[pair]
        artifact_path = overrides.get(pair, artifact_path)
        artifact = Artifact.load(ROOT / artifact_path)
        end_id = end_token_id(AutoTokenizer.from_pretrained(ROOT / consumer))
        common = ["--dtype", args.dtype, "--log-level", "WARNING", "--artifacts", str(ROOT / artifact_path)]
        with services.running(["--model", producer, *common], ["--model", consumer, *common],
                              log_dir=ROOT / "bench/runs/quality") as (_, c):
            rows += asyncio.run(run_pair(pair, c.address, artifact, args.n, args.ctx, args.max_schedules, end_id,
                                         4 if args.dtype == "float32" else 2))
    (args.out_dir / "quality.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plot(rows, args.out_dir / "quality.png")
    (args.out_dir / "quality.md").write_text(table(rows) + "\n")
    print(table(rows), file=sys.stderr)


if __name__ == "__main__":
    main()
