"""Reading the committed rows: where they are, one JSON object per line, and the small formatting
helpers every figure uses (value ranges, labels, JSON lines). Measures and computes nothing else."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench/results"


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def cells_of(rows: list[dict], *keys: str) -> dict[tuple, list[dict]]:
    """Rows grouped by the values of `keys`, in first-seen order (a table's cells)."""
    cells: dict[tuple, list[dict]] = {}
    for r in rows:
        cells.setdefault(tuple(r[k] for k in keys), []).append(r)
    return cells


def span(values, fmt: str = "{:g}") -> str:
    """'lo-hi' (or one value) of numbers, each formatted with `fmt`."""
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return lo if lo == hi else f"{lo}-{hi}"


def em_f1(row: dict) -> str:
    return f"{row['em']:.3f} / {row['f1']:.3f}"


def span_words(values) -> str:
    return "/".join(sorted({v for v in values if v})) or "unlabelled"


def json_line(row: dict, drop: tuple[str, ...] = ()) -> str:
    return json.dumps({k: v for k, v in row.items() if k not in drop})


def artifact_meta(path: str) -> dict:
    from shared.scd.artifact import Artifact

    return Artifact.load(ROOT / path).meta
