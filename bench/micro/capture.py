"""`python -m bench.micro.capture`: the producer's prefill capture on our own forward against the
Hugging Face modules', side by side (issue 47).

Per model (`--models`, comma separated: checkpoint paths or registry short names) and context
(`--ctx`, comma separated), one seeded random-token context captured at batch 1 with what a Patch
or Reuse encoder asks (K/V and the normalized inputs, every layer):
- `own_ms`: shared.kv.batch_capture, the producer's serving capture (shared.model, fused
  projections);
- `hf_ms`: the Hugging Face modules' own forward with capture hooks (shared.kv.layer_capture over
  shared.kv.prefill_context), the reference and what the producer's capture ran before issue 47
  (the same modules, called layer by layer), on a second copy of the weights loaded as they were
  then (unfused).
Interleaved repeat by repeat (hf then own, own then hf, ...), medians of `--repeats` after one warm-up each;
the row also checks that both captured the same K/V (`kv_max_diff`). One JSON line per (model,
ctx, round) to stdout and bench/results/capture.jsonl, with torch's threads, glibc's mmap threshold
(the services' by default, shared.malloc_tuning: without it fresh mmaps and their page faults
weigh on whichever forward allocates more, measured ~5% of a layer) and the 1-minute load average
at the row's start and end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from bench.harness import services

RESULTS = services.ROOT / "bench" / "results"
NEEDS_DOC = "KV|NORMED"


def _time(fn) -> float:
    started = time.perf_counter()
    fn()
    return (time.perf_counter() - started) * 1e3


def compare(own_loaded, hf_loaded, ctx: int, repeats: int) -> dict:
    """One interleaved comparison at this context length."""
    from shared import kv

    needs = kv.Capture.KV | kv.Capture.NORMED
    ids = torch.randint(4, own_loaded.info.vocab_size, (ctx,), generator=torch.Generator().manual_seed(ctx)).tolist()
    got: dict[str, dict[int, kv.LayerState]] = {"own": {}, "hf": {}}

    def own() -> None:
        kv.batch_capture(own_loaded, [ids], [needs], lambda _, s: got["own"].__setitem__(s.index, s))

    @torch.inference_mode()
    def hf() -> None:
        cache = kv.empty_cache(hf_loaded)
        with kv.layer_capture(hf_loaded, cache, needs, lambda s: got["hf"].__setitem__(s.index, s)):
            kv.prefill_context(hf_loaded, torch.tensor([ids], device=hf_loaded.device), cache)

    times: dict[str, list[float]] = {"own": [], "hf": []}
    for i in range(repeats + 1):  # the first of each warms up; the order alternates
        for name, fn in (("own", own), ("hf", hf))[:: 1 if i % 2 else -1]:
            ms = _time(fn)
            if i:
                times[name].append(ms)
    diff = max(float((a - b).abs().max()) for index in got["own"] for a, b in zip(got["own"][index].kv(), got["hf"][index].kv()))
    own_ms, hf_ms = statistics.median(times["own"]), statistics.median(times["hf"])
    return {
        "own_ms": round(own_ms, 1),
        "hf_ms": round(hf_ms, 1),
        "own_over_hf": round(own_ms / hf_ms, 3),
        "own_ms_all": [round(t, 1) for t in times["own"]],
        "hf_ms_all": [round(t, 1) for t in times["hf"]],
        "kv_max_diff": diff,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--models", default="smollm2-135m")
    parser.add_argument("--ctx", default="1024,2048")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--out-dir", default=str(RESULTS))
    parser.add_argument("--malloc-mmap-threshold", type=int, default=None, help="bytes; default: the services' (shared.config)")
    args = parser.parse_args(argv)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    from shared import malloc_tuning
    from shared.config import ProducerConfig

    mmap_threshold = ProducerConfig().malloc_mmap_threshold if args.malloc_mmap_threshold is None else args.malloc_mmap_threshold
    print(f"malloc: {malloc_tuning.tune(mmap_threshold)}", flush=True)
    from shared.model import of as forward_of
    from shared.models import load_model

    code = services.code_version()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "capture.jsonl", "a") as out:
        for model in [m for m in args.models.split(",") if m]:
            path = services.ROOT / model
            name = str(path) if path.exists() else model
            own_loaded = load_model(name, args.dtype, args.device)
            forward_of(own_loaded)  # fused once, as the producer's warm-up does
            hf_loaded = load_model(name, args.dtype, args.device)  # never fused: the modules as loaded
            setting = {"bench": "capture", "model": Path(model).name, "dtype": args.dtype, "device": str(own_loaded.device)}
            setting["malloc_mmap_threshold"] = mmap_threshold
            for round_ in range(args.rounds):
                for ctx in [int(c) for c in args.ctx.split(",") if c]:
                    load_before = round(os.getloadavg()[0], 2)
                    result = compare(own_loaded, hf_loaded, ctx, args.repeats)
                    load = {"load_avg_1m": load_before, "load_avg_1m_end": round(os.getloadavg()[0], 2)}
                    row = setting | {"ctx_tokens": ctx, "needs": NEEDS_DOC, "round": round_} | result
                    row |= {"torch_threads": torch.get_num_threads(), **load, "code": code}
                    print(json.dumps(row), flush=True)
                    out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
