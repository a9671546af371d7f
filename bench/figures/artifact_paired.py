"""Two artifacts' quality rows on the same examples: the task rows of two `real.quality` files (one
per artifact), paired by example (seed, family, gold, context length), each of the new file's modes
against a named mode of the reference file (`--map s1=s7` pairs `scd:s1` with `scd:s7`; equal names
pair by default). Prints, per mode, the F1 gap to the new file's oracle and the paired difference
new - reference with 95 % bootstrap intervals (qa.metrics.bootstrap_ci), the same difference against
each of the reference's modes (`versus`), and how many oracle answers agree between the two files (a check that both runs saw the same examples the same way).
Measures nothing: `python -m bench.figures.artifact_paired NEW.jsonl REFERENCE.jsonl --map s1=s7,s2=s11`.

As a figure (`artifact_paired(root)`): every bench/results/real-pred/*.jsonl against the main P -> C
file of its split and length (bench/results/real/pc-<split>-<tokens>.jsonl), schedules paired by
their text through the two artifacts' committed .json files (artifacts/*.json, by id)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.figures.rows import rows_of
from qa.metrics import bootstrap_ci

Example = tuple[int, str, str, int]


def by_example(path: Path) -> dict[Example, dict[str, dict]]:
    """{example: {mode: task row}} of a quality file (summary lines skipped)."""
    out: dict[Example, dict[str, dict]] = {}
    for r in rows_of(path):
        if r.get("kind") == "task":
            out.setdefault((r["seed"], r["family"], r["gold"], r["context_tokens"]), {})[r["mode"]] = r
    return out


def _ref_mode(mode: str, mapping: dict[str, str], strict: bool) -> str | None:
    """The reference's mode for `mode`: its schedule mapped; unmapped, the same name (None if strict:
    the same name may be another schedule in another artifact)."""
    head, colon, schedule = mode.partition(":")
    if colon and schedule not in mapping:
        return None if strict else mode
    return f"{head}:{mapping[schedule]}" if colon else mode


def paired(new: Path, reference: Path, mapping: dict[str, str], strict: bool = False) -> list[dict]:
    """One row per mode of `new` over the examples where the new file has every one of its modes
    (whole examples) and the reference its counterpart (a mode without one, strict: its gap alone,
    over the whole examples)."""
    mine, ref = by_example(new), by_example(reference)
    modes = sorted({m for per in mine.values() for m in per})
    whole = [e for e, per in mine.items() if set(per) == set(modes) and "oracle" in per]
    out = []
    for mode in modes:
        other = _ref_mode(mode, mapping, strict)
        both = whole if other is None else [e for e in whole if other in ref.get(e, {})]
        if not both:
            continue
        a = [mine[e][mode]["f1"] for e in both]
        gap = [mine[e]["oracle"]["f1"] - x for e, x in zip(both, a)]
        agree = sum(mine[e]["oracle"]["prediction"] == ref.get(e, {}).get("oracle", {}).get("prediction") for e in both)
        row = {
            "mode": mode,
            "reference_mode": other,
            "n": len(both),
            "oracle_answers_agree": agree,
            "f1": round(sum(a) / len(a), 4),
            "f1_gap": round(sum(gap) / len(gap), 4),
            "f1_gap_ci95": [round(v, 4) for v in bootstrap_ci(gap)],
            "new_minus_reference": None,
            "new_minus_reference_ci95": None,
        }
        if other is not None:
            row["new_minus_reference"], row["new_minus_reference_ci95"] = _difference(mine, ref, both, mode, other)
        if mode != "oracle":  # against each of the reference's modes too, on the examples both hold
            row["versus"] = {}
            for theirs in sorted({m for e in whole for m in ref.get(e, {})} - {"oracle"}):
                shared = [e for e in whole if theirs in ref.get(e, {})]
                mean, ci = _difference(mine, ref, shared, mode, theirs)
                row["versus"][theirs] = {"n": len(shared), "new_minus_reference": mean, "new_minus_reference_ci95": ci}
        out.append(row)
    return out


def _difference(mine: dict, ref: dict, examples: list[Example], mode: str, other: str) -> tuple[float, list[float]]:
    """The mean of new - reference F1 over `examples` and its 95 % bootstrap interval."""
    diff = [mine[e][mode]["f1"] - ref[e][other]["f1"] for e in examples]
    return round(sum(diff) / len(diff), 4), [round(v, 4) for v in bootstrap_ci(diff)]


def schedule_names(root: Path) -> dict[str, dict[str, str]]:
    """{artifact id: {schedule name: schedule text}} of every committed artifacts/*.json."""
    out = {}
    for path in sorted((root / "artifacts").glob("*.json")):
        meta = json.loads(path.read_text())
        if "artifact_id" in meta:
            out[meta["artifact_id"]] = {e["name"]: e["schedule"] for e in meta.get("schedules", [])}
    return out


def by_text(new: dict[str, str], reference: dict[str, str]) -> dict[str, str]:
    """New schedule name -> the reference artifact's name of the same schedule text."""
    names = {text: name for name, text in reference.items()}
    return {name: names[text] for name, text in new.items() if text in names}


def table(rows: list[dict]) -> str:
    lines = [
        "| mode | reference's mode | n | oracle answers agree | F1 gap to the oracle (points) | 95% | new - reference (points) | 95% |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["mode"] == "oracle":  # its gap is 0 by definition; its agreement is in every other row
            continue
        g, d = r["f1_gap_ci95"], r["new_minus_reference_ci95"]
        against = f"{100 * r['new_minus_reference']:+.1f} | {100 * d[0]:+.1f}..{100 * d[1]:+.1f}" if d else "- | -"
        lines.append(
            f"| `{r['mode']}` | {'`' + r['reference_mode'] + '`' if r['reference_mode'] else 'none'} | {r['n']} | "
            f"{r['oracle_answers_agree']} | {100 * r['f1_gap']:+.1f} | {100 * g[0]:+.1f}..{100 * g[1]:+.1f} | {against} |"
        )
    return "\n".join(lines)


def artifact_paired(root: Path) -> dict:
    """{file stem: {"table", "rows" by mode, "artifact", "reference_artifact", "reference"}} for
    every bench/results/real-pred/*.jsonl."""
    names, out = schedule_names(root), {}
    for path in sorted((root / "bench/results/real-pred").glob("*.jsonl")):
        first = next(r for r in rows_of(path) if r.get("kind") == "task")
        reference = root / f"bench/results/real/pc-{first['split']}-{first['context_tokens']}.jsonl"
        ref_first = next(r for r in rows_of(reference) if r.get("kind") == "task")
        mapping = by_text(names.get(first["artifact"], {}), names.get(ref_first["artifact"], {}))
        rows = paired(path, reference, mapping, strict=True)
        out[path.stem] = {
            "table": table(rows),
            "rows": {r["mode"]: {**r, **_points(r)} for r in rows},
            "artifact": first["artifact"],
            "reference_artifact": ref_first["artifact"],
            "reference": str(reference.relative_to(root)),
        }
    return out


def _points(r: dict) -> dict:
    """The row's numbers in F1 points, as the results template quotes them."""
    g, d = r["f1_gap_ci95"], r["new_minus_reference_ci95"]
    return {
        "f1_gap_pt": 100 * r["f1_gap"],
        "f1_gap_ci_pt": f"{100 * g[0]:+.1f}..{100 * g[1]:+.1f}",
        "diff_pt": 100 * r["new_minus_reference"] if d else float("nan"),
        "diff_ci_pt": f"{100 * d[0]:+.1f}..{100 * d[1]:+.1f}" if d else "-",
        "versus": {
            mode: {
                "n": v["n"],
                "diff_pt": 100 * v["new_minus_reference"],
                "diff_ci_pt": "{:+.1f}..{:+.1f}".format(*(100 * x for x in v["new_minus_reference_ci95"])),
            }
            for mode, v in r.get("versus", {}).items()
        },
    }


def _mapping(text: str) -> dict[str, str]:
    pairs = [p.split("=", 1) for p in text.split(",") if p]
    if any(len(p) != 2 for p in pairs):
        raise SystemExit(f"--map: expected NEW=REFERENCE[,...], got {text!r}")
    return dict(pairs)  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("new", type=Path)
    parser.add_argument("reference", type=Path)
    parser.add_argument("--map", default="", help="NEW=REFERENCE schedule names, comma-separated (s1=s7,s2=s11)")
    args = parser.parse_args(argv)
    rows = paired(args.new, args.reference, _mapping(args.map))
    print(table(rows))
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
