"""`python -m bench.serving.gpu_check` (`make gpu-check`): the one-shot check for a machine with a GPU.

Three steps, each printing JSON lines (also written to `--out`, bench/results/gpu.jsonl):

1. `pytest tests/test_gpu.py` (both services on CUDA, every mode; skipped without CUDA):
   {"check": "pytest", "rc", "summary", "seconds"}.
2. Prefill compute of each shape in this process, timed with CUDA events on CUDA (perf_counter
   on CPU), median of 3 after one warm-up: {"check": "prefill", "model", "ctx_tokens",
   "prefill_ms", "timer"}: the compute floor the TTFT rows sit on.
3. The TTFT grid on loopback (`python -m bench.serving.ttft --no-shaping`, interleaved, cold and warm,
   with its own efficiency check) for the Qwen2.5-0.5B shape at 2048 and 8192 tokens and the
   7B shape at 2048 (random weights, bf16, built from configs: no downloads): bench.serving.ttft's rows
   with "check": "ttft".
4. The batch engine's throughput grid (`python -m bench.serving.throughput`: QA pair and the 0.5B shape,
   batched vs --max-batch 1, concurrency 1-64; its rows with "check": "throughput"; skipped with
   --quick and with --no-throughput).

`--device cpu --quick` runs the same three steps on tiny shapes (tiny-llama, 128 tokens) in
under a minute: the CI test of this script. Exit status: non-zero when any step failed.
Pinned host buffers and non-blocking device-to-host copies belong in the producer's layer hook
(producer/prefill.py, shared/), not here: this script measures what the services do.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import provenance, services
from bench.harness.workloads import note

RESULTS = services.ROOT / "bench" / "results"
# (bench.serving.ttft scale, contexts, dtype) per run; the in-process prefill timing uses the same shapes.
FULL = [("qwen05b", [2048, 8192], "bfloat16"), ("qwen7b", [2048], "bfloat16")]
QUICK = [("tiny", [128], "float32")]
MODES = ["oracle", "raw", "quant:bits=8", "quant:bits=4"]


def run_pytest(timeout_s: float) -> dict:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfE", "--tb=line", "-p", "no:cacheprovider", "tests/test_gpu.py"],
                          cwd=services.ROOT, capture_output=True, text=True, timeout=timeout_s)
    lines = [line for line in done.stdout.splitlines() if re.search(r"\d+ (passed|skipped|failed|error)", line)]
    failures = [line[:400] for line in done.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    return {"check": "pytest", "file": "tests/test_gpu.py", "rc": done.returncode,
            "summary": lines[-1].strip("= ") if lines else done.stdout[-300:], "failures": failures,
            "seconds": round(time.monotonic() - started, 1)}


def model_path(scale: str) -> str:
    """The checkpoint a scale runs (built once from its config where it is a random model)."""
    from bench.harness.workloads import RANDOM_MODELS, ensure_random

    if scale == "tiny":
        return "tiny-llama"
    name = f"{scale}-random"
    return str(ensure_random(name, RANDOM_MODELS[name]))


def time_prefill(model: str, ctx: int, dtype: str, device: str, reps: int = 3) -> dict:
    """Median forward time of a `ctx`-token prefill in this process (CUDA events on CUDA)."""
    import torch

    from shared.models import load_model

    loaded = load_model(model, dtype, device)
    ids = torch.randint(4, loaded.info.vocab_size, (1, ctx), device=loaded.device)  # [1, T]
    cuda = loaded.device.type == "cuda"
    times = []
    with torch.inference_mode():
        for rep in range(reps + 1):  # the first is a warm-up
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                loaded.model(ids, use_cache=True)
                end.record()
                torch.cuda.synchronize()
                ms = start.elapsed_time(end)
            else:
                started = time.perf_counter()
                loaded.model(ids, use_cache=True)
                ms = (time.perf_counter() - started) * 1e3
            if rep:
                times.append(ms)
    row = {"check": "prefill", "model": model, "ctx_tokens": ctx, "dtype": dtype, "device": str(loaded.device),
           "prefill_ms": round(statistics.median(times), 2), "timer": "cuda_event" if cuda else "perf_counter"}
    del loaded
    if cuda:
        torch.cuda.empty_cache()
    return row


def run_ttft(scale: str, contexts: list[int], dtype: str, args) -> tuple[int, list[dict]]:
    """bench.serving.ttft on loopback for one scale; (its exit code, its rows)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ttft.jsonl"
        cmd = [sys.executable, "-m", "bench.serving.ttft", "--no-shaping", "--no-plot", "--model-scale", scale,
               "--device", args.device, "--dtype", dtype, "--contexts", *map(str, contexts),
               "--modes", *MODES, *(["scd"] if args.artifacts else []), "--artifacts", args.artifacts,
               "--stores", *(["cold"] if args.quick else ["cold", "warm"]), "--warmup", "1",
               "--runs", str(2 if args.quick else 3), "--timeout-s", str(args.timeout_s), "--out", str(out),
               *(["--profile-dir", str(args.profile_dir)] if args.profile_dir else [])]
        note(" ".join(cmd[1:]))
        done = subprocess.run(cmd, cwd=services.ROOT, stdout=subprocess.DEVNULL, timeout=args.timeout_s * 4)
        rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return done.returncode, [{"check": "ttft", **r} for r in rows]


def run_throughput(args) -> tuple[int, list[dict]]:
    """bench.serving.throughput's full grid; (its exit code, its rows)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "bench.serving.throughput", "--out-dir", tmp]
        note(" ".join(cmd[1:]))
        done = subprocess.run(cmd, cwd=services.ROOT, stdout=subprocess.DEVNULL, timeout=args.timeout_s * 4)
        out = Path(tmp) / "throughput.jsonl"
        rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return done.returncode, [{"check": "throughput", **r} for r in rows]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.serving.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="auto (cuda when present), cuda or cpu")
    p.add_argument("--quick", action="store_true", help=f"tiny shapes {QUICK} instead of {FULL}")
    p.add_argument("--artifacts", default="", help="SCD artifacts for the scales' models (adds the scd mode)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per step")
    p.add_argument("--out", type=Path, default=RESULTS / "gpu.jsonl")
    p.add_argument("--scales", nargs="+", choices=[scale for scale, _, _ in FULL], default=[scale for scale, _, _ in FULL],
                   help="which full-size shapes to run (all by default; ignored with --quick)")
    p.add_argument("--no-throughput", action="store_true", help="skip step 4 (the batch engine's throughput grid)")
    p.add_argument("--profile-dir", type=Path, help="step 3: each TTFT cell's services recorded by py-spy into DIR "
                   "(bench.serving.ttft --profile-dir; read them with `python -m bench.harness.cpu_stages DIR/*`)")
    args = p.parse_args(argv)
    import torch
    import transformers

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("bench.serving.gpu_check: --device cuda but torch sees no CUDA device")
    shapes = QUICK if args.quick else [shape for shape in FULL if shape[0] in args.scales]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    failed = []
    with open(args.out, "w") as out:
        def emit(row: dict) -> None:
            row = {**row, "weights": row.get("weights") or provenance.weights_of(row.get("model", ""))}
            line = json.dumps(row)
            print(line, flush=True)
            out.write(line + "\n")
            out.flush()

        started = time.monotonic()
        emit({"check": "machine", "device": args.device, "gpu": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None,
              "torch": torch.__version__, "transformers": transformers.__version__, "quick": args.quick})
        result = run_pytest(args.timeout_s)
        emit(result)
        if result["rc"] not in (0, 5):  # 5: nothing collected
            failed.append(f"pytest tests/test_gpu.py: {result['summary']}")
        for scale, contexts, dtype in shapes:
            path = model_path(scale)
            for ctx in contexts:
                emit(time_prefill(path, ctx, dtype, args.device))
            rc, rows = run_ttft(scale, contexts, dtype, args)
            for row in rows:
                emit(row)
            if rc != 0 or not rows:
                failed.append(f"bench.serving.ttft {scale}: exit {rc}, {len(rows)} rows")
        if not (args.quick or args.no_throughput):
            rc, rows = run_throughput(args)
            for row in rows:
                emit(row)
            if rc != 0 or not rows:
                failed.append(f"bench.serving.throughput: exit {rc}, {len(rows)} rows")
        emit({"check": "done", "seconds": round(time.monotonic() - started, 1), "failed": failed})
    note(f"-> {args.out}")
    if failed:
        sys.exit("bench.serving.gpu_check FAILED: " + "; ".join(failed))


if __name__ == "__main__":
    main()
