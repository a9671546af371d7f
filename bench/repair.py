"""`python -m bench.repair`: how often anchor-token repair (consumer/repair.py) makes an SCD answer
the oracle's, by the fraction of context tokens repaired, and at what cost. Through the real
services (spawned, as bench.audit runs them), the heterogeneous QA pair at its headline schedule,
on a few examples of qa.shifted's sets.

Per example: mode "oracle" (the reference; its rebuild_ms is the consumer's own context prefill),
then mode "scd" with the transfer option {"repair": f} for each fraction f (0: no repair). One JSON
line per (set, fraction) on stdout:
  {"set", "repair_fraction", "anchor_choice", "n", "identical_to_oracle", "repair_ms_p50",
   "cost_ratio_vs_prefill", "load_avg_1m"}
identical = greedy tokens equal to the oracle's; cost = median over examples of repair_ms / the
oracle's rebuild_ms. A small probe, not bench.verify's full matrix (issue 30, item 4).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics

from bench import pairs, services
from bench.pairs import PAIRS
from consumer.client import ConsumerClient
from qa.shifted import SETS, examples

ROOT = services.ROOT
FRACTIONS = (0.0, 0.05, 0.1, 0.2, 1.0)


async def run(address: str, names: list[str], n: int, fractions: list[float], schedule: dict, end_id: int) -> None:
    async with ConsumerClient(address) as client:
        warm = next(examples("in_distribution", 1))
        for _ in range(2):  # first calls at these shapes are slow: keep them out of the timings
            await pairs.ask(client, warm.context, warm.question, end_id, "scd", {**schedule, "repair": "0.1"})
        for name in names:
            rows: dict[float, list[tuple[bool, float]]] = {f: [] for f in fractions}
            for ex in examples(name, n):
                oracle = await pairs.ask(client, ex.context, ex.question, end_id, "oracle", {})
                for f in fractions:
                    # str: "1.0" is a fraction ("1" would be a count of one token)
                    options = {**schedule, "repair": str(f)} if f > 0 else dict(schedule)
                    answer = await pairs.ask(client, ex.context, ex.question, end_id, "scd", options)
                    cost = answer.stats.repair_ms / max(oracle.stats.rebuild_ms, 1e-9)
                    rows[f].append((answer.ids == oracle.ids, cost))
            for f, got in rows.items():
                print(
                    json.dumps(
                        {
                            "set": name,
                            "repair_fraction": f,
                            "anchor_choice": "attention" if 0 < f < 1 else ("all" if f else "none"),
                            "n": len(got),
                            "identical_to_oracle": round(statistics.fmean(same for same, _ in got), 3),
                            "cost_ratio_vs_prefill": round(statistics.median(c for _, c in got), 3),
                            "load_avg_1m": round(os.getloadavg()[0], 2),
                        }
                    ),
                    flush=True,
                )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", default="heterogeneous", choices=list(PAIRS))
    p.add_argument("--sets", default="in_distribution,base_question_format,repeated_values", help=f"of {sorted(SETS)}")
    p.add_argument("--n", type=int, default=5, help="examples per set")
    p.add_argument("--fractions", default=",".join(f"{f:g}" for f in FRACTIONS))
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()
    from transformers import AutoTokenizer

    from qa.tokenizer import end_token_id

    pair = PAIRS[args.pair]
    end_id = end_token_id(AutoTokenizer.from_pretrained(ROOT / pair.consumer))
    schedule = {"schedule": pair.headline} if pair.headline else {}
    common = ["--dtype", args.dtype, "--log-level", "WARNING", "--artifacts", str(ROOT / pair.artifact)]
    fractions = [float(f) for f in args.fractions.split(",") if f]
    names = [s for s in args.sets.split(",") if s]
    with services.running(
        ["--model", pair.producer, *common],
        ["--model", pair.consumer, *common, *services.NO_PREFIX_CACHE],
        log_dir=ROOT / "bench/runs/repair",
    ) as (_, consumer):
        asyncio.run(run(consumer.address, names, args.n, fractions, schedule, end_id))


if __name__ == "__main__":
    main()
