"""`python -m bench.serving.ttft.plot`: the TTFT figure and README table from bench/results/ttft.jsonl.

Owns presentation only: a PNG of TTFT vs link bandwidth (one panel per model x context, one
line per mode, oracle dashed; unshaped points sit at the measured link throughput) and a
markdown table of TTFT ms and the ratio to oracle per mode x store x bandwidth x context (every
row labelled cold or warm; the oracle and the cached-consumer reference as rows without a link, the
latter labelled derived when its row says so;
`*` marks a cell measured with the load average above the core count), followed by where each
mode wins and the lowest measured bandwidth at which it beats oracle. Reads rows as bench.serving.ttft
writes them (bench.figures quotes its table); measures nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from shared.labels import mode_label

ORACLE = "oracle"
CACHED = "cached"
REFERENCES = (ORACLE, CACHED)  # rows without a link


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def label(row: dict) -> str:
    """'raw cold', 'quant(bits=8) warm', 'oracle cold', 'cached warm'."""
    name = mode_label(row["mode"], row.get("schedule") or "")
    return f"{name} {row.get('store') or 'cold'}"


def _ms(row: dict) -> str:
    return f"{row['ttft_ms_median']:.0f}" + ("*" if row.get("load_above_cores") else "")


def bw_label(bw: float | None) -> str:
    if bw is None:
        return "unshaped"
    return f"{bw / 1e3:g} Gbit" if bw >= 1000 else f"{bw:g} Mbit"


def _bw_key(bw: float | None) -> float:
    return float("inf") if bw is None else bw


def _groups(rows: list[dict]) -> dict[tuple[str, int], list[dict]]:
    groups: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for row in rows:
        groups[(row["model"], row["ctx_tokens"])].append(row)
    return dict(sorted(groups.items()))


def markdown(rows: list[dict]) -> str:
    """Per model and context: TTFT ms (x oracle) per mode and bandwidth, then winners/crossovers."""
    out = []
    for (model, ctx), group in _groups(rows).items():
        oracle = next((r for r in group if r["mode"] == ORACLE), None)
        cached = next((r for r in group if r["mode"] == CACHED), None)
        linked = [r for r in group if r["mode"] not in REFERENCES]
        bws = sorted({r["bandwidth_mbit"] for r in linked}, key=_bw_key) or [None]
        shaping = sorted({r["shaping"] for r in linked}) or ["n/a"]
        out.append(f"**{model}, {ctx}-token context** (median TTFT ms, ratio to oracle; link: {', '.join(shaping)})\n")
        out.append("| mode | " + " | ".join(bw_label(b) for b in bws) + " |")
        out.append("|---" * (len(bws) + 1) + "|")
        if oracle:
            out.append(f"| {label(oracle)} (no link) | " + " | ".join(f"{_ms(oracle)} (1.00)" for _ in bws) + " |")
        if cached:
            ratio = f" ({cached['ttft_ms_median'] / oracle['ttft_ms_median']:.2f})" if oracle else ""
            what = "derived, not measured: the oracle's TTFT minus its context prefill" if cached.get("derived") \
                else "context cached in the consumer: question prefill only"
            out.append(f"| {label(cached)} ({what}) | "
                       + " | ".join(f"{_ms(cached)}{ratio}" for _ in bws) + " |")
        by_label: dict[str, dict] = defaultdict(dict)
        for r in linked:
            by_label[label(r)][r["bandwidth_mbit"]] = r
        for name, cells in by_label.items():
            texts = []
            for b in bws:
                r = cells.get(b)
                if r is None:
                    texts.append("-")
                    continue
                ratio = f" ({r['ttft_ms_median'] / oracle['ttft_ms_median']:.2f})" if oracle else ""
                texts.append(f"{_ms(r)}{ratio}")
            out.append(f"| {name} | " + " | ".join(texts) + " |")
        wins = []
        for b in bws:
            cands = [r for r in linked if r["bandwidth_mbit"] == b] + ([oracle] if oracle else [])
            best = min(cands, key=lambda r: r["ttft_ms_median"])
            wins.append(f"{bw_label(b)}: {label(best)}")
        out.append("\nFastest: " + "; ".join(wins) + ".")
        if any(r.get("load_above_cores") for r in group):
            out.append("`*`: measured with the 1-minute load average above the core count.")
        if oracle:
            cross = []
            for name, cells in by_label.items():
                beating = [b for b in sorted(cells, key=_bw_key) if cells[b]["ttft_ms_median"] < oracle["ttft_ms_median"]]
                cross.append(f"{name} from {bw_label(beating[0])}" if beating else f"{name} never")
            out.append("Beats oracle: " + "; ".join(cross) + ".")
        out.append("")
    return "\n".join(out)


def plot(rows: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = _groups(rows)
    fig, axes = plt.subplots(1, len(groups), figsize=(5.2 * len(groups), 4.2), squeeze=False)
    for ax, ((model, ctx), group) in zip(axes[0], groups.items()):
        by_label: dict[str, list[dict]] = defaultdict(list)
        for r in group:
            if r["mode"] not in REFERENCES:
                by_label[label(r)].append(r)
        for name, rs in sorted(by_label.items()):
            rs.sort(key=lambda r: _bw_key(r["bandwidth_mbit"]))
            xs = [r["bandwidth_mbit"] or r.get("link_mbit") or 1e5 for r in rs]
            ys = [r["ttft_ms_median"] for r in rs]
            err = [[y - r["ttft_ms_min"] for y, r in zip(ys, rs)], [r["ttft_ms_max"] - y for y, r in zip(ys, rs)]]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=name)
        for r in group:
            if r["mode"] == ORACLE:
                ax.axhline(r["ttft_ms_median"], color="black", linestyle="--", label="oracle cold (own prefill)")
            elif r["mode"] == CACHED:
                ax.axhline(r["ttft_ms_median"], color="grey", linestyle=":", label="cached warm (question only)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("link bandwidth, Mbit/s (unshaped: measured)")
        ax.set_ylabel("TTFT, ms (median; bars min-max)")
        ax.set_title(f"{model}, {ctx} tokens", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.serving.ttft.plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("--in", dest="path", type=Path, default=Path(__file__).parents[1] / "results" / "ttft.jsonl")
    parser.add_argument("--png", type=Path, help="default: next to --in, .png")
    parser.add_argument("--no-png", action="store_true")
    args = parser.parse_args(argv)
    rows = load(args.path)
    if not rows:
        sys.exit(f"no rows in {args.path}")
    if not args.no_png:
        plot(rows, args.png or args.path.with_suffix(".png"))
    print(markdown(rows))


if __name__ == "__main__":
    main()
