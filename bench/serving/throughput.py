"""`python -m bench.serving.throughput` (`make bench-throughput`): the consumer's batch engine under
closed-loop load, batched against `--max-batch 1` (one row per forward: the behaviour before
batching), in the same run, cell by cell interleaved.

One producer and two consumers run as real processes (bench.harness.services), identical but for
--max-batch. For each (model, mode, output, concurrency) cell, `concurrency` clients each send
requests back to back until the cell's request count is reached, first against the max-batch-1
consumer, then against the batched one. Request i of a cell is the same in both runs (example i of
a fixed set whose contexts are warm in the producer's store after a warm-up pass, so the cells
measure the consumer; its prefix cache is off, so every request is transferred and rebuilt), which
gives `identical_to_batch1_rate`: the share of requests whose greedy
tokens are the same under batching. Outputs: `answer` (the task's own stop token, a few tokens:
TTFT-heavy; random-weight models stop at 8 tokens) and `long` (64 tokens, no stop: decode-heavy).

`--engine-process on` gives both consumers `--engine-process` (the engine in a child process);
`both` runs four consumers, a max-batch-1 and a batched one in one process and split, all
interleaved cell by cell, so the split is compared side by side with the single process.

`--baseline DIR` (a worktree of an earlier commit, its protos generated) runs that checkout's producer
and batched consumer(s) beside this one's, interleaved cell by cell on the same requests: the before
/ after of a change in one run. Its rows say `build: baseline` and its code, and its
`identical_to_batch1_rate` compares it with this checkout's max-batch-1 consumer (the same answers
as before the change). Such a run's rows go to throughput_ab.jsonl, not throughput.jsonl.

`--repeat N` runs each cell's pair N times, alternating which consumer goes first; every run is a
row pair with the invocation's `run` id and its `rep`, and the figures quote the median over the
repetitions of the latest run of a cell, with their range.

`forward_ceiling_tokens_per_s` is the bare model forward, timed in this process (with the
services' torch thread count, `forward_ceiling_threads`) just before and just after each cell's
pair of runs: one decode step at batch = concurrency over a Hugging Face DynamicCache of the cell's
context length, tokens/s = batch / median of CEILING_STEPS step times, the faster of the two
timings (noise on a shared machine only ever slows a forward down). It is the engine's ceiling on
this machine (no sampling, no gRPC, no scheduling).

Each row also carries the CPU milliseconds per request of the producer, the consumer, the
consumer's main thread (its asyncio event loop: gRPC calls, stream parsing, the servicer), from
/proc, and of the client (this process, every thread); and `cpu_bound_requests_per_s`: the
machine's cores divided by the three processes' CPU per request, the rate at which this pipeline
would saturate every core. What batching can amortize (the forward) and what it cannot
(per-request work in every process) can be read from them. The services run at `--log-level`
(default INFO, what they ship with; the row says `log_level`).

The consumer's CPU per request is also split (bench.harness.cpu_stages): `consumer_engine_cpu_ms_per_request`
(the batch engine's thread, and the engine process under --engine-process),
`consumer_other_threads_cpu_ms_per_request` (gRPC's poller, tokenizer, torch workers), and, when py-spy
is installed (`--stages auto`, the default; it samples the consumer from outside, `--nonblocking`, so
the consumer runs no extra code), its event loop's CPU by stage: `consumer_loop_<stage>_cpu_ms_per_request`
for grpc, loop_native (uvloop's C loop, gRPC's Cython core and waits for the interpreter lock: no
Python frame), stream_parsing, rebuild_dispatch, answer_streaming, logging_metrics, request_setup,
other (`cpu_stages_by` names the sampler and `consumer_loop_samples` its samples; null without it;
the sampled stacks are kept under <out-dir>/cpu_stages/).

One JSON line per cell to bench/results/throughput.jsonl (--out-dir to change), a table on stdout
and a plot (tokens/s and p95 TTFT vs concurrency). `--quick`: the QA pair in float32, modes raw
and scd, both outputs, concurrency 1 and 32.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from bench.harness import cpu_stages, services
from shared.pb import common_pb2, consumer_pb2, consumer_pb2_grpc

RESULTS = services.ROOT / "bench" / "results"
LONG_TOKENS = 64
CEILING_STEPS = 24  # timed decode steps per ceiling measurement (after two warm-up steps)
WARM_CONCURRENCY = 4  # streams of the warm-up pass (every context once through each consumer)


@dataclass(frozen=True)
class Model:
    name: str
    producer: str
    consumer: str
    dtype: str
    weights: str  # "trained" | "random"
    artifact: str  # "" when none: scd is skipped
    ctx_tokens: int


def qa_model() -> Model:
    return Model("qa-base->qa-tuned", "checkpoints/qa-base", "checkpoints/qa-tuned", "float32", "trained",
                 "artifacts/qa-base-to-tuned.safetensors", 512)


def qwen05b_model() -> Model:
    from bench.harness.workloads import ensure_qwen05b, resolved_dtype

    path = str(ensure_qwen05b())
    return Model("qwen05b-random", path, path, resolved_dtype("auto"), "random", "", 512)  # the services' default


def requests_for(model: Model, n: int) -> tuple[list[tuple[list[int], list[int]]], int | None]:
    """n distinct (context ids, question ids) and the stop id of the `answer` output."""
    if model.weights == "trained":
        from qa.task import make_example
        from qa.tokenizer import end_token_id, load_tokenizer

        tok = load_tokenizer(Path(model.consumer))
        out = []
        for i in range(n):
            ex = make_example(seed=i, split="test", ctx_tokens=model.ctx_tokens, task="tuned")
            out.append((tok(ex.context)["input_ids"], tok(ex.question, add_special_tokens=False)["input_ids"]))
        return out, end_token_id(tok)
    import random

    rng = random.Random(0)
    vocab = json.loads((Path(model.consumer) / "config.json").read_text())["vocab_size"]
    return [([rng.randrange(4, vocab) for _ in range(model.ctx_tokens)], [rng.randrange(4, vocab) for _ in range(16)])
            for _ in range(n)], None


def generate_request(ctx, question, mode, options, output, stop_id) -> consumer_pb2.GenerateRequest:
    answer = output == "answer"
    return consumer_pb2.GenerateRequest(
        context=consumer_pb2.Prompt(token_ids=consumer_pb2.TokenIds(ids=ctx)),
        question=consumer_pb2.Prompt(token_ids=consumer_pb2.TokenIds(ids=question)),
        max_new_tokens=(8 if answer else LONG_TOKENS),
        stop_token_ids=([stop_id] if answer and stop_id is not None else []),
        transfer=common_pb2.CodecSpec(name=mode, options=options),
    )


async def one(stub, req) -> dict:
    started = time.perf_counter()
    ids, first, stats = [], None, None
    async for msg in stub.Generate(req, timeout=600):
        if msg.WhichOneof("kind") == "token":
            first = first or time.perf_counter()
            ids += list(msg.token.ids)
        else:
            stats = msg.stats
    done = time.perf_counter()
    ttft = ((first or done) - started) * 1e3
    tpot = (done - (first or done)) * 1e3 / max(1, len(ids) - 1)
    return {"ids": ids, "ttft": ttft, "tpot": tpot, "queue": stats.queue_wait_ms if stats else 0.0,
            "bytes": stats.bytes_received if stats else 0, "question_prefill": stats.question_prefill_ms if stats else 0.0,
            "stats": stats}


async def closed_loop(address: str, reqs: list, concurrency: int) -> tuple[list[dict], float]:
    """`concurrency` clients pull the next request index until all are sent; results by index."""
    results: list[dict | None] = [None] * len(reqs)
    next_index = 0
    async with grpc.aio.insecure_channel(address) as channel:
        stub = consumer_pb2_grpc.ConsumerServiceStub(channel)

        async def client():
            nonlocal next_index
            while next_index < len(reqs):
                i = next_index
                next_index += 1
                results[i] = await one(stub, reqs[i])

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    return [r for r in results if r is not None], wall


def forward_ceiling(loaded, batch: int, ctx_tokens: int, steps: int = CEILING_STEPS) -> float:
    """Tokens/s of the bare model's decode step at `batch` rows over ctx_tokens of cache."""
    import torch
    from transformers import DynamicCache

    with torch.inference_mode():
        ids = torch.randint(4, loaded.info.vocab_size, (batch, ctx_tokens), device=loaded.device)
        cache = DynamicCache(config=loaded.model.config)
        loaded.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        step = torch.randint(4, loaded.info.vocab_size, (batch, 1), device=loaded.device)
        times = []
        for _ in range(steps + 2):  # the first two warm up
            t = time.perf_counter()
            loaded.model(input_ids=step, cache=cache, use_cache=True, logits_to_keep=1)
            if loaded.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        times = times[2:]
    return batch / statistics.median(times)


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))] if s else 0.0


def cpu_s(pid: int, tid: int | None = None) -> float:
    """CPU seconds (user + system) a process, or one of its threads, has used."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_split(producer_pid: int, consumer_pid: int) -> dict[str, float]:
    """CPU seconds so far: the producer, the consumer with its child processes (the engine
    process under --engine-process), and the consumer's main thread (its asyncio event loop: gRPC,
    stream parsing, the servicer; the rest is the engine, torch's workers, gRPC's poller)."""
    consumer = cpu_s(consumer_pid)
    for child in services.children(consumer_pid):
        try:
            consumer += cpu_s(child)
        except OSError:  # exited meanwhile
            pass
    return {"producer": cpu_s(producer_pid), "consumer": consumer, "consumer_loop": cpu_s(consumer_pid, consumer_pid)}


def consumer_split(pid: int, threads_before: dict[int, float], used: dict[str, float], n: int,
                   profile: cpu_stages.Sampler | None) -> dict:
    """The consumer's CPU ms per request by thread (engine, other threads; the loop is
    consumer_loop_cpu_ms_per_request) and the loop's by stage (None without a sampler)."""
    after = cpu_stages.thread_cpu_s(pid)
    names = cpu_stages.thread_names(pid)
    delta = {tid: after[tid] - threads_before.get(tid, 0.0) for tid in after}
    engine = sum(d for tid, d in delta.items() if names.get(tid) == cpu_stages.ENGINE_THREAD)
    engine += used["consumer"] - sum(delta.values())  # child processes (the engine process), threads gone
    other = sum(d for tid, d in delta.items() if tid != pid and names.get(tid) != cpu_stages.ENGINE_THREAD)
    cols: dict = {
        "consumer_engine_cpu_ms_per_request": round(engine * 1e3 / n, 2),
        "consumer_other_threads_cpu_ms_per_request": round(other * 1e3 / n, 2),
        "cpu_stages_by": None,
        "consumer_loop_samples": None,
        **{f"consumer_loop_{s}_cpu_ms_per_request": None for s in cpu_stages.STAGES},
    }
    got = profile.stages() if profile is not None else None
    if got is not None:
        samples, _ = got
        cols["cpu_stages_by"] = f"py-spy {profile.rate}Hz nonblocking" if profile is not None else None
        cols["consumer_loop_samples"] = sum(samples.values())
        for stage, ms in cpu_stages.split_ms(used["consumer_loop"] * 1e3 / n, samples).items():
            cols[f"consumer_loop_{stage}_cpu_ms_per_request"] = round(ms, 3)
    return cols


def own_cpu_s() -> float:
    """CPU seconds (user + system) this process has used, every thread (the closed-loop client)."""
    t = os.times()
    return t.user + t.system


def torch_threads_now() -> int:
    import torch

    return torch.get_num_threads()


def hwm_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def describe_pool(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await consumer_pb2_grpc.ConsumerServiceStub(channel).Describe(consumer_pb2.ConsumerServiceDescribeRequest(), timeout=10)
    return reply.stats.kv_pool_bytes


def run_model(model: Model, modes, outputs, concurrencies, max_batch: int, requests: int | None, out, log_dir: Path,
              torch_threads: int = 0, repeat: int = 1, engine_process: str = "off", log_level: str = "INFO",
              stages: str = "auto", baseline: Path | None = None) -> list[dict]:
    from shared.models import load_model

    n_distinct = 16
    examples, stop_id = requests_for(model, n_distinct)
    codes = {"head": services.code_version()}  # what every row of this run measured
    builds = {"head": ()}
    if baseline is not None:
        codes["baseline"], builds["baseline"] = services.code_version(baseline), services.checkout_prefix(baseline)
    run_id = time.strftime("%Y%m%dT%H%M%S")  # the rows of one invocation (repetitions of a cell share it)
    limit = str(max(*concurrencies, WARM_CONCURRENCY) * 2)  # the warm-up pass runs WARM_CONCURRENCY streams
    common = ["--model", "{m}", "--dtype", model.dtype, "--max-inflight", limit, "--log-level", log_level,
              "--torch-threads", str(torch_threads)]
    if model.artifact:
        common += ["--artifacts", model.artifact]
    producers: dict[str, services.Service] = {}
    consumers: dict[tuple[str, bool, int], services.Service] = {}  # (build, split, max batch)
    rows = []
    try:
        splits = {"off": (False,), "on": (True,), "both": (False, True)}[engine_process]
        for build, prefix in builds.items():
            pport = services.free_port()
            producers[build] = services.spawn("producer", ["--port", str(pport), *[a.replace("{m}", model.producer) for a in common]],
                                              f"127.0.0.1:{pport}", log_dir / build, prefix)
            for split in splits:
                for mb in (1, max_batch) if build == "head" else (max_batch,):
                    cport = services.free_port()
                    # the prefix cache off: the cells repeat 16 contexts, and this measures the engine and the transfer
                    args = ["--port", str(cport), "--producer", f"127.0.0.1:{pport}", "--max-batch", str(mb),
                            *services.NO_PREFIX_CACHE, *[a.replace("{m}", model.consumer) for a in common],
                            *(["--engine-process"] if split else [])]
                    name = f"{build}-max-batch-{mb}" + ("-engine-process" if split else "")
                    consumers[(build, split, mb)] = services.spawn("consumer", args, f"127.0.0.1:{cport}", log_dir / name, prefix)
        for service in [*producers.values(), *consumers.values()]:
            services.wait_healthy(service, 300)
        reference = load_model(model.consumer, model.dtype, "auto")
        sample = stages == "on" or (stages == "auto" and cpu_stages.py_spy() is not None)
        if stages == "on" and cpu_stages.py_spy() is None:
            raise SystemExit("--stages on: py-spy is not installed (pip install py-spy)")
        for mode in modes:
            if mode == "scd" and not model.artifact:
                continue
            # warm-up: every context once through each consumer (producer store, lazy init)
            warm = [generate_request(c, q, mode, {}, "answer", stop_id) for c, q in examples]
            for service in consumers.values():
                asyncio.run(closed_loop(service.address, warm, WARM_CONCURRENCY))
            for output in outputs:
                for concurrency in concurrencies:
                    n = requests or max(16, 2 * concurrency)
                    reqs = [generate_request(*examples[i % n_distinct], mode, {}, output, stop_id) for i in range(n)]
                    ctx = model.ctx_tokens + len(examples[0][1])
                    for rep in range(repeat):  # the pair again: the figures quote the median over repetitions
                        ceiling = forward_ceiling(reference, concurrency, ctx)
                        by_batch = {}
                        order = list(consumers.items())
                        for (build, split, mb), service in order[::-1] if rep % 2 else order:  # alternate which runs first
                            pid, producer = service.process.pid, producers[build]
                            cell = f"{run_id}-{model.name.replace('>', '')}-{mode}-{output}-c{concurrency}-mb{mb}-r{rep}"
                            cell += ("-ep" if split else "") + ("-baseline" if build == "baseline" else "")
                            raw = Path(out.name).parent / "cpu_stages" / f"{cell}.raw"  # the stacks, kept to read
                            profile = cpu_stages.Sampler(pid, raw) if sample else None
                            threads_before = cpu_stages.thread_cpu_s(pid)
                            before = cpu_split(producer.process.pid, pid)
                            client_before = own_cpu_s()
                            if profile is not None:
                                with profile:
                                    results, wall = asyncio.run(closed_loop(service.address, reqs, concurrency))
                            else:
                                results, wall = asyncio.run(closed_loop(service.address, reqs, concurrency))
                            used = {k: v - before[k] for k, v in cpu_split(producer.process.pid, pid).items()}
                            split_cols = consumer_split(pid, threads_before, used, len(results), profile)
                            used["client"] = own_cpu_s() - client_before
                            total_ms = (used["producer"] + used["consumer"] + used["client"]) * 1e3 / len(results)
                            by_batch[(build, split, mb)] = results
                            tokens = sum(len(r["ids"]) for r in results)
                            row = {
                                "bench": "throughput", "model": model.name, "weights": model.weights, "dtype": model.dtype,
                                "mode": mode, "output": output, "concurrency": concurrency, "max_batch": mb,
                                "requests": len(results), "requests_per_s": round(len(results) / wall, 3),
                                "output_tokens_per_s": round(tokens / wall, 2),
                                "ttft_p50_ms": round(pct([r["ttft"] for r in results], 0.5), 2),
                                "ttft_p95_ms": round(pct([r["ttft"] for r in results], 0.95), 2),
                                "tpot_p50_ms": round(pct([r["tpot"] for r in results if len(r["ids"]) > 1], 0.5), 3),
                                "queue_wait_p50_ms": round(pct([r["queue"] for r in results], 0.5), 2),
                                "identical_to_batch1_rate": None,
                                "kv_pool_bytes": asyncio.run(describe_pool(service.address)),
                                "peak_rss_mb": round(hwm_mb(service.process.pid), 1),
                                "forward_ceiling_tokens_per_s": None,  # set below, once timed after the pair as well
                                "forward_ceiling_threads": torch_threads_now(),
                                "max_inflight": int(limit), "ctx_tokens": model.ctx_tokens, "torch_threads": torch_threads,
                                "engine_process": split,
                                "build": build, "code": codes[build], "run": run_id, "rep": rep,
                                "load_avg_1m": round(os.getloadavg()[0], 2),
                                # CPU per request: where a closed loop's time goes (2 cores shared by all)
                                **{f"{k}_cpu_ms_per_request": round(v * 1e3 / len(results), 2) for k, v in used.items()},
                                "cpus": os.cpu_count(),
                                "cpu_bound_requests_per_s": round((os.cpu_count() or 1) * 1e3 / total_ms, 1) if total_ms else None,
                                "log_level": log_level,
                                **split_cols,
                            }
                            rows.append(row)
                        ceiling = max(ceiling, forward_ceiling(reference, concurrency, ctx))
                        rates = {}
                        # each batched consumer (the baseline's too) against this build's max-batch-1 one of its kind
                        for build, split, mb in consumers:
                            pairs = list(zip(by_batch[("head", split, 1)], by_batch[(build, split, mb)]))
                            rates[build, split, mb] = round(sum(a["ids"] == b["ids"] for a, b in pairs) / len(reqs), 4)
                            diffs = [i for i, (a, b) in enumerate(pairs) if a["ids"] != b["ids"]]
                            if diffs:
                                print(f"# {mode}/{output}/c{concurrency}{' engine-process' if split else ''} {build} max-batch {mb}:"
                                      f" requests differing from max-batch 1: {diffs}", file=sys.stderr)
                        for row in rows[-len(consumers):]:
                            row["identical_to_batch1_rate"] = rates[row["build"], row["engine_process"], row["max_batch"]]
                            row["forward_ceiling_tokens_per_s"] = round(ceiling, 1)
                            print(json.dumps(row), flush=True)
                            out.write(json.dumps(row) + "\n")
                            out.flush()
    finally:
        for service in [*consumers.values(), *producers.values()]:
            services.stop(service)
    return rows


def table(rows: list[dict]) -> str:
    head = "| model | build | mode | output | conc | max_batch | req/s | tok/s | ceiling tok/s | TTFT p50 | TTFT p95 | identical |"
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        lines.append(
            f"| {r['model']} ({r['weights']}, {r['dtype']}) | {r['build']} {r['code']} | {r['mode']} | {r['output']} | {r['concurrency']}"
            f" | {r['max_batch']} |"
            f" {r['requests_per_s']} | {r['output_tokens_per_s']} | {r['forward_ceiling_tokens_per_s']} |"
            f" {r['ttft_p50_ms']} | {r['ttft_p95_ms']} | {r['identical_to_batch1_rate']} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    def key_of(r: dict) -> tuple:
        return r["model"], r["mode"], r["output"], r["max_batch"], r.get("torch_threads", 0), r.get("engine_process", False)

    keys = sorted({key_of(r) for r in rows})
    for key in keys:
        by_conc = {r["concurrency"]: r for r in rows if key_of(r) == key}  # a rerun of a cell replaces it
        sel = [by_conc[c] for c in sorted(by_conc)]
        label = f"{key[0]} {key[1]} {key[2]} mb={key[3]}" + (f" threads={key[4]}" if key[4] else "") + (" engine-process" if key[5] else "")
        style = "-" if key[3] > 1 else "--"
        axes[0].plot([r["concurrency"] for r in sel], [r["output_tokens_per_s"] for r in sel], style, marker="o", label=label)
        axes[1].plot([r["concurrency"] for r in sel], [r["ttft_p95_ms"] for r in sel], style, marker="o", label=label)
    axes[0].set(xlabel="concurrent streams", ylabel="output tokens/s", xscale="log")
    axes[1].set(xlabel="concurrent streams", ylabel="p95 TTFT (ms)", xscale="log", yscale="log")
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--quick", action="store_true", help="QA pair, float32, raw+scd, both outputs, concurrency 1 and 32")
    parser.add_argument("--models", default="qa,qwen05b", help="comma-separated: qa, qwen05b")
    parser.add_argument("--modes", default="oracle,raw,scd")
    parser.add_argument("--outputs", default="answer,long")
    parser.add_argument("--concurrency", default="1,4,16,32,64")
    parser.add_argument("--max-batch", type=int, default=64, help="the batched consumer's --max-batch")
    parser.add_argument("--requests", type=int, default=None, help="requests per cell (default max(16, 2 x concurrency))")
    parser.add_argument("--out-dir", default=str(RESULTS), help="where throughput.jsonl and the plot go")
    parser.add_argument("--torch-threads", type=int, default=0, help="every service's --torch-threads (0: torch's default)")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each cell's pair, one after another (rows per run)")
    parser.add_argument("--log-level", default="INFO", help="every service's --log-level (INFO: as shipped)")
    parser.add_argument("--stages", choices=("auto", "on", "off"), default="auto",
                        help="the consumer loop's CPU by stage from py-spy (auto: when installed)")
    parser.add_argument("--engine-process", choices=("off", "on", "both"), default="off",
                        help="the consumers' --engine-process (the engine in a child process; rows say engine_process);"
                        " both: a max-batch-1 and a batched consumer of each kind, all interleaved cell by cell")
    parser.add_argument("--baseline", type=Path,
                        help="another checkout (a worktree of an earlier commit, its protos generated): its producer and"
                        " batched consumer run beside this one's, rows marked build=baseline, into throughput_ab.jsonl")
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.modes, args.concurrency, args.max_batch = "qa", "raw,scd", "1,32", 32
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)  # the forward ceiling under the services' thread count
    builders = {"qa": qa_model, "qwen05b": qwen05b_model}
    rows = []
    rows_file = "throughput_ab.jsonl" if args.baseline else "throughput.jsonl"  # a before / after run keeps to its own file
    with open(out_dir / rows_file, "a") as out, tempfile.TemporaryDirectory() as logs:
        for name in args.models.split(","):
            rows += run_model(builders[name](), args.modes.split(","), args.outputs.split(","),
                              [int(c) for c in args.concurrency.split(",")], args.max_batch, args.requests, out, Path(logs),
                              args.torch_threads, args.repeat, args.engine_process, args.log_level, args.stages,
                              args.baseline)
    print(table(rows))
    if rows and not args.baseline:
        plot(rows, out_dir / "throughput.png")


if __name__ == "__main__":
    main()
