"""What a benchmark row ran on: the weights (`trained` checkpoints or `random` initialisation),
the SCD artifact and the corpus it was calibrated on, and, for a row computed from other
measurements rather than measured, `derived: true` with its formula.

Owns these labels and `python -m bench.harness.provenance`, the one-off migration that added them to the
rows committed before the writers recorded them (issue 18): it labels a row only where its model
makes the answer unambiguous and leaves every measured value as it was. Measures nothing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench/results"

TRAINED, RANDOM, PRETRAINED = "trained", "random", "pretrained"
CACHED_FORMULA = "per oracle request: ttft_ms - rebuild_ms (its context prefill); question prefill only"
# the 0.5B-scale artifact of docs/results.md (built in .cache, not committed) and its corpus
QWEN05B_ARTIFACT = ".cache/artifacts/qwen05b-random-homogeneous.safetensors"
QWEN05B_CORPUS = "random ids: 12 sequences x 320 tokens (seed 0)"


def weights_of(model: str) -> str:
    """`pretrained` for the registry's models by short name (shared.pretrained: SmolLM2 and its
    fine-tunes; the row's model info carries their origin), `trained` for the QA checkpoints (qa-*,
    checkpoints/...), `random` for the builtin tiny models and the *-random scale models,
    `unknown` for anything else (a hub id or a path this repo did not build: the row cannot say)."""
    from shared import pretrained

    name = str(model).rstrip("/").rsplit("/", 1)[-1]
    if name in pretrained.NAMES:
        return PRETRAINED
    if name.startswith("qa-") or "checkpoints/" in str(model):
        return TRAINED
    if name.startswith("tiny-") or name.endswith("-random"):
        return RANDOM
    return "unknown"


def artifact_fields(path: str | Path | None) -> dict:
    """{"artifact", "calibration_corpus"} of an SCD artifact file (its metadata's corpus name)."""
    if not path:
        return {"artifact": None, "calibration_corpus": None}
    from shared.scd.artifact import Artifact

    full = Path(path) if Path(path).is_absolute() else ROOT / path
    corpus = Artifact.load(full).meta.get("corpus", {}).get("name")
    shown = full.relative_to(ROOT) if full.is_relative_to(ROOT) else full
    return {"artifact": str(shown), "calibration_corpus": corpus}


def artifacts_by_id(spec: str) -> dict[str, dict]:
    """artifact_id -> artifact_fields of every SCD artifact in `spec` (the services' --artifacts:
    comma-separated files or directories of .safetensors files)."""
    from shared.scd.artifact import Artifact

    out = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        path = Path(item)
        for file in sorted(path.glob("*.safetensors")) if path.is_dir() else [path]:
            out[Artifact.load(file).artifact_id] = artifact_fields(file.resolve())
    return out


def derived(formula: str) -> dict:
    return {"derived": True, "formula": formula}


# ---- the one-off migration of rows committed before issue 18 ----------------------------------


def _ttft(row: dict, artifacts: dict) -> dict:
    extra = {"weights": weights_of(row["model"])}
    if row["mode"] == "scd":
        extra.update(artifacts[row["model"]])
    if row["mode"] == "cached":
        extra.update(derived(CACHED_FORMULA))
    return extra


def _quality(row: dict, artifacts: dict) -> dict:
    from bench.harness.pairs import PAIRS

    # the committed runs: 2-layer pairs n = 100, deep pairs n = 60 (their commands, docs/results.md);
    # the headline schedules were picked among the rows on these same test examples
    n = 100 if row["layers"] == 2 else 60
    extra = {"weights": TRAINED, "split": "test", "n": n, "f1_ci95": None, "f1_gap_ci95": None}
    extra["selected_on"] = "test" if row["mode"] == "scd" else ("calibration" if row["mode"] == "recompute" else None)
    if row["mode"] in ("scd", "recompute"):
        extra.update(artifacts[PAIRS[row["pair"]].artifact])
    return extra


def _headlines(path: Path) -> set[tuple[str, str]]:
    """(pair, schedule) of each pair's headline, chosen as bench.serving.quality chooses it but on the test
    rows themselves (their selected_on says so): what the committed documents quoted."""
    from bench.harness.pairs import PAIRS, pick_headline

    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    out = set()
    for pair, spec in PAIRS.items():
        first = [r for r in rows if r["pair"] == pair]
        first = [r for r in first if r["ctx"] == min(r["ctx"] for r in first)] if first else []
        chosen = pick_headline(first, spec.max_gap)
        if chosen:
            out.add((pair, chosen))
    return out


def _audit(row: dict, fields: dict) -> dict:
    for scale in row.get("cost_at_scale", []):  # the audit's cost on a scale model (random weights)
        scale.setdefault("weights", weights_of(scale["scale"]))
    return {"weights": TRAINED, **fields}


def migrate(path: Path, label) -> int:
    """Add the labels `label(row)` returns to every row of a JSON-lines file that lacks them."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    changed = 0
    for row in rows:
        extra = {k: v for k, v in label(row).items() if k not in row}
        row.update(extra)
        changed += bool(extra)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return changed


def host_fields() -> dict:
    """{"cpu": the CPU's model name, "cpu_bf16": its native bfloat16 instructions ("amx_bf16+avx512_bf16",
    "avx512_bf16", "none")}: the host a timing row ran on (the hosts this repo's sessions get differ:
    an AMD EPYC with AVX-512 BF16, an Intel Xeon with AMX). Rows written before this field existed say
    nothing of their host."""
    from shared import compute_dtype

    flags = compute_dtype.cpu_flags() or frozenset()
    native = [f for f in ("amx_bf16", "avx512_bf16") if f in flags]
    return {"cpu": compute_dtype.cpu_info(("model name",)) or "unknown", "cpu_bf16": "+".join(native) or "none"}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.harness.provenance", description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    from bench.harness.pairs import PAIRS

    art = {a: artifact_fields(a) for a in {pair.artifact for pair in PAIRS.values()}}
    ttft_artifacts = {
        "qa-base->qa-tuned": art[PAIRS["heterogeneous"].artifact],
        "qwen05b-random": {"artifact": QWEN05B_ARTIFACT, "calibration_corpus": QWEN05B_CORPUS},
    }
    heterogeneous = art[PAIRS["heterogeneous"].artifact]
    deep = {"audit-deep-full": art[PAIRS["deep-full"].artifact], "audit-deep-lora": art[PAIRS["deep-lora"].artifact]}
    r = args.results
    headlines = _headlines(r / "quality.jsonl")
    counts = {
        "ttft": migrate(r / "ttft.jsonl", lambda row: _ttft(row, ttft_artifacts)),
        "quality": migrate(
            r / "quality.jsonl", lambda row: {**_quality(row, art), "headline": (row["pair"], row["schedule"]) in headlines}
        ),
        # load test: tiny-llama (random) with --max-inflight 64 on both services; its head-of-line
        # request was a context the producer had already stored (a store hit)
        "load": migrate(
            r / "load.jsonl",
            lambda row: {
                "weights": RANDOM,
                "producer_max_inflight": 64,
                "consumer_max_inflight": 64,
                "limits": "raised",
                **({"hol_request": "warm"} if "hol_ttft_ratio" in row else {}),
            },
        ),
        "transport": migrate(r / "transport.jsonl", lambda row: {"weights": RANDOM}),
        "pool": migrate(r / "pool.json", lambda row: {"weights": RANDOM}),
    }
    for stem, fields in (("audit", heterogeneous), *deep.items()):
        counts[stem] = migrate(r / f"{stem}.jsonl", lambda row, f=fields: _audit(row, f))
    print(json.dumps(counts))


if __name__ == "__main__":
    main()

