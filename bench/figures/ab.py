"""`python -m bench.figures.ab --before FILE... --after FILE...`: two sets of bench.serving.throughput rows (runs of one
commit against runs of another, taken alternately on one machine) compared cell by cell: per
(model, mode, output, concurrency, max_batch) the median over runs of requests/s or output
tokens/s, p50 TTFT and the CPU ms per request of the producer, the consumer, the client and the
three together, each side's range, and after/before.
A markdown table on stdout; the rows say which code and load they ran at. Knows nothing about the
services: it reads the JSON lines bench.serving.throughput wrote.
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics


def load(patterns: list[str]) -> list[dict]:
    paths = sorted({path for pattern in patterns for path in glob.glob(pattern)})
    return [json.loads(line) for path in paths for line in open(path) if line.strip()]


def cell(r: dict) -> tuple:
    return (r["model"], r["mode"], r["output"], r["concurrency"], r["max_batch"])


CPU = ("producer_cpu_ms_per_request", "consumer_cpu_ms_per_request", "client_cpu_ms_per_request")
TOTAL_CPU = "total_cpu_ms_per_request"  # the three processes together (the measure)


def value(r: dict, metric: str) -> float | None:
    if metric == TOTAL_CPU:
        parts = [r.get(m) for m in CPU]
        return None if any(p is None for p in parts) else sum(parts)  # type: ignore[arg-type]
    return r.get(metric)


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]"


def table(before: list[dict], after: list[dict]) -> str:
    lines = [
        "| model | mode | output | streams | max_batch | metric | before median [range] | after median [range] | after/before |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key in sorted({cell(r) for r in before} & {cell(r) for r in after}):
        rate = "requests_per_s" if key[2] == "answer" else "output_tokens_per_s"
        for metric in (rate, "ttft_p50_ms", *CPU, TOTAL_CPU):
            b = [v for r in before if cell(r) == key for v in [value(r, metric)] if v is not None]
            a = [v for r in after if cell(r) == key for v in [value(r, metric)] if v is not None]
            if b and a:
                ratio = statistics.median(a) / statistics.median(b) if statistics.median(b) else float("nan")
                lines.append(f"| {' | '.join(map(str, key))} | {metric} | {summary(b)} | {summary(a)} | {ratio:.2f} |")
    codes = lambda rows: sorted({r.get("code", "?") for r in rows})
    loads = lambda rows: f"{min(r['load_avg_1m'] for r in rows):.2f}-{max(r['load_avg_1m'] for r in rows):.2f}"
    lines.append("")
    lines.append(f"before: code {codes(before)}, {len({r['run'] for r in before})} runs, load_avg_1m {loads(before)}")
    lines.append(f"after: code {codes(after)}, {len({r['run'] for r in after})} runs, load_avg_1m {loads(after)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--before", required=True, nargs="+", help="throughput.jsonl files (paths or quoted globs)")
    parser.add_argument("--after", required=True, nargs="+", help="throughput.jsonl files (paths or quoted globs)")
    args = parser.parse_args(argv)
    print(table(load(args.before), load(args.after)))


if __name__ == "__main__":
    main()
