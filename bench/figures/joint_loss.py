"""Where the real pair's loss sits with every layer rebuilt at once: the rows `python -m
calibration.joint_loss` appends to bench/results/real/joint-loss-*.jsonl, one table per file.
Measures nothing."""

from __future__ import annotations

from pathlib import Path

from bench.figures.rows import rows_of

HEADER = (
    "| rebuilt | C's own layers | bytes/token | loss (nats / answer token) | share of naive reuse's |",
    "|---|---|---|---|---|",
)


def key(r: dict) -> str:
    """'W', 'W+23', 'P+17,18,23,28' (every layer one action, some C's own), 'P@23' (that action in
    layer 23 only), a schedule's name, or its name with layers C's own ('s1+23')."""
    if r["rebuilt"] == "schedule":
        return r["name"] + ("+" + ",".join(map(str, r["own"])) if r["own"] else "")
    base, *rest = r["rebuilt"].split()
    if rest[0] == "only":
        return f"{base}@{rest[-1]}"
    return base + ("+" + ",".join(map(str, r["own"])) if r["own"] else "")


def _line(r: dict, naive: float) -> str:
    base, *rest = r["rebuilt"].split()
    if r["rebuilt"] == "schedule":
        what, own = f"schedule `{r['name']}`", ", ".join(map(str, r["own"])) or "-"
    elif rest[0] == "only":
        what, own = f"`{base}` in layer {rest[-1]} only", "every other"
    else:
        what, own = f"`{base}` in every layer", ", ".join(map(str, r["own"])) or "-"
    size = f"{r['bytes_per_token']:g}" if r.get("bytes_per_token") is not None else "-"
    return f"| {what} | {own} | {size} | {r['loss']:.4f} | {r['loss'] / naive:.0%} |"


def joint_loss(root: Path) -> dict:
    """{file stem: {"table": markdown, "rows": {key: row}, "meta": the rows' common fields}}."""
    out = {}
    for path in sorted((root / "bench/results/real").glob("joint-loss-*.jsonl")):
        rows = rows_of(path)
        by = {key(r): r for r in rows}  # a later row of the same key (a rerun) wins
        naive = by["W"]["loss"]
        first = rows[0]
        meta = {k: first[k] for k in ("artifact", "predictor_layers", "heldout", "examples", "producer", "consumer", "dtype")}
        out[path.stem] = {"table": "\n".join([*HEADER, *(_line(r, naive) for r in by.values())]), "rows": by, "meta": meta}
    return out
