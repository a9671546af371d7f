"""`python -m bench.ttft`: time to first token per transfer mode, under shaped bandwidth.

Topology (shaped, the default; needs root, `ip`, `tc`):

    root ns: this process builds the link (bench.netns), re-runs itself inside the consumer's
             namespace, and removes the link when that ends (also on failure, Ctrl-C, SIGTERM)
    scd-bench-p (10.99.0.1): producer  ==tc-shaped veth==  scd-bench-c (10.99.0.2): consumer,
                                                           and the benchmark client (this code)

The client runs in the consumer's namespace, next to the consumer, as a decode-side router
would; only producer -> consumer traffic crosses the shaped link. `--no-shaping` runs both
services and the client on loopback (no root; the CI smoke test).

Grid: model scales x bandwidths x contexts x modes x store (cold: every request a context the
producer has never seen; warm: the same context again, counted only when the producer reports a
store hit). Per cell: `--warmup` requests, then `--runs` measured ones. oracle uses no link, so it
is measured once per context and reported with bandwidth_mbit null.

One JSON line per cell, to stdout and to `--out` (bench/results/ttft.jsonl): the keys
model, shaping, bandwidth_mbit, ctx_tokens, mode, schedule, store, ttft_ms_median, ttft_ms_min,
ttft_ms_max, runs, bytes, pipeline_efficiency, then the TTFT breakdown (medians, ms):
producer_prefill_ms, producer_encode_ms, wire_ms (bytes / measured link throughput), transfer_ms
(producer call to last layer rebuilt), rebuild_ms (consumer decode work, overlaps transfer),
question_prefill_ms (its logits give the first token: the "first decode step" is this forward
plus an argmax), first_token_ms (ttft - transfer - question prefill: cache finish, sampling,
request handling), decode_step_ms (one later decode step); and link_mbit, raw_kv_bytes, dtype,
f1/em (trained pair only).

pipeline_efficiency (raw and scd only) = (bytes / link throughput + question_prefill_ms) / TTFT,
from medians: 1.0 means the transfer alone explains the TTFT (prefill, encode and rebuild hidden).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from bench import netns, services
from bench.workloads import Workload, note, workload_for
from consumer.client import ConsumerClient, prompt

RESULTS = services.ROOT / "bench" / "results"
ORACLE = "oracle"
EFFICIENCY_MODES = ("raw", "scd")
DEFAULT_MODES = ["oracle", "raw", "quant:bits=8", "quant:bits=4", "recompute", "scd"]
# Grids: the on an accelerator. On CPU (2 AVX2 cores, bf16) the 0.5B model prefills 128
# tokens in ~10 s and 512 in ~45 s, so its CPU default is one cell per mode (512 tokens, 100 Mbit):
# about 25 min for 5 modes x (1 + 5) requests, plus ~8 min for the trained pair's full grid.
GRIDS = {
    "gpu": {"trained": ([10, 100, 1000, None], [512, 2048, 4096]), "qwen05b": ([10, 100, 1000, None], [512, 2048, 4096])},
    "cpu": {"trained": ([10, 100, 1000, None], [512, 2048, 4096]), "qwen05b": ([100], [512])},
}
QUICK = dict(runs=2, warmup=1, contexts=[256], bandwidths=[100], stores=["cold"])


# --- parsing and statistics ----------------------------------------------------------------

@dataclass(frozen=True)
class Mode:
    name: str
    options: tuple[tuple[str, str], ...] = ()

    @property
    def schedule(self) -> str | None:
        """The options as one label: `r16-p2` for {"schedule": "r16-p2"}, else `bits=8,...`."""
        opts = dict(self.options)
        if set(opts) == {"schedule"}:
            return opts["schedule"]
        return ",".join(f"{k}={v}" for k, v in self.options) or None

    @property
    def label(self) -> str:
        return f"{self.name}({self.schedule})" if self.schedule else self.name


def parse_mode(text: str) -> Mode:
    """'quant:bits=4,group_size=32' -> Mode('quant', (('bits','4'),('group_size','32')))."""
    name, _, rest = text.partition(":")
    options = []
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise argparse.ArgumentTypeError(f"mode option {item!r} in {text!r} is not KEY=VALUE")
        options.append((key.strip(), value.strip()))
    if not name:
        raise argparse.ArgumentTypeError(f"mode {text!r} has no name")
    return Mode(name.strip(), tuple(sorted(options)))


def parse_bandwidth(text: str) -> float | None:
    """'10' / '10mbit' / '1gbit' / '1.5g' -> Mbit/s; 'unshaped' / 'none' / 'inf' -> None."""
    t = text.strip().lower()
    if t in ("unshaped", "none", "inf", "max"):
        return None
    scale = 1.0
    for suffix, factor in (("gbit", 1e3), ("mbit", 1.0), ("g", 1e3), ("m", 1.0)):
        if t.endswith(suffix):
            t, scale = t[: -len(suffix)], factor
            break
    try:
        value = float(t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"bandwidth {text!r}: use e.g. 10, 100mbit, 1gbit or unshaped") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"bandwidth {text!r} must be > 0")
    return value


def summarize(values: list[float]) -> dict:
    """{"median", "min", "max"} of a non-empty list."""
    if not values:
        raise ValueError("no values to summarize")
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def pipeline_efficiency(payload_bytes: float, link_mbit: float, question_prefill_ms: float, ttft_ms: float) -> float:
    """(payload / link throughput + question prefill) / measured TTFT."""
    floor_ms = payload_bytes * 8 / (link_mbit * 1e3) + question_prefill_ms
    return floor_ms / ttft_ms


# --- models and workloads ------------------------------------------------------------------

# --- measuring -----------------------------------------------------------------------------

def _row(w: Workload, shaping: str, bw: float | None, link_mbit: float | None, ctx: int, mode: Mode, store: str,
         answers: list, golds: list) -> dict:
    stats = [a.stats for a in answers]
    med = lambda xs: round(statistics.median(xs), 2)  # noqa: E731
    ttft = summarize([s.ttft_ms for s in stats])
    payload = statistics.median([s.bytes_received for s in stats])
    qprefill = statistics.median([s.question_prefill_ms for s in stats])
    steps = [s.decode_ms / (s.generated_tokens - 1) for s in stats if s.generated_tokens > 1]
    eff = None
    if mode.name in EFFICIENCY_MODES and link_mbit:
        eff = round(pipeline_efficiency(payload, link_mbit, qprefill, ttft["median"]), 3)
    row = {
        "model": w.name, "shaping": shaping, "bandwidth_mbit": bw, "ctx_tokens": ctx, "mode": mode.name,
        "schedule": mode.schedule, "store": store, "ttft_ms_median": round(ttft["median"], 2),
        "ttft_ms_min": round(ttft["min"], 2), "ttft_ms_max": round(ttft["max"], 2), "runs": len(stats),
        "bytes": int(payload), "pipeline_efficiency": eff,
        "producer_prefill_ms": med([s.producer_prefill_ms for s in stats]),
        "producer_encode_ms": med([s.producer_encode_ms for s in stats]),
        "wire_ms": round(payload * 8 / (link_mbit * 1e3), 2) if link_mbit and mode.name != ORACLE else 0.0,
        "transfer_ms": med([s.transfer_ms for s in stats]), "rebuild_ms": med([s.rebuild_ms for s in stats]),
        "question_prefill_ms": round(qprefill, 2),
        "first_token_ms": med([s.ttft_ms - s.transfer_ms - s.question_prefill_ms
                               - (s.rebuild_ms if mode.name == ORACLE else 0.0) for s in stats]),
        "decode_step_ms": med(steps) if steps else None,
        "link_mbit": round(link_mbit, 2) if link_mbit and mode.name != ORACLE else None,
        "raw_kv_bytes": int(statistics.median([s.raw_kv_bytes for s in stats])), "dtype": w.dtype,
    }
    if any(g is not None for g in golds):
        from qa.metrics import score

        quality = score((a.text.replace(" .", "").strip(), g) for a, g in zip(answers, golds))
        row.update(f1=round(quality["f1"], 4), em=round(quality["em"], 4))
    return row


class ModeRefused(Exception):
    pass


async def _ask(client: ConsumerClient, w: Workload, mode: Mode, ctx: int, warm: bool, timeout_s: float):
    context, question, gold = w.request(ctx, warm)
    try:
        answer = await client.generate(timeout=timeout_s, mode=mode.name, options=dict(mode.options),
                                       context=prompt(ids=context), question=prompt(ids=question),
                                       max_new_tokens=w.max_new_tokens, stop_token_ids=w.stop_ids)
    except grpc.aio.AioRpcError as err:
        if err.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                          grpc.StatusCode.UNIMPLEMENTED):
            raise ModeRefused(f"{err.code().name}: {err.details()}") from None
        raise
    return answer, gold


async def measure_cell(client, w: Workload, mode: Mode, ctx: int, store: str, args) -> tuple[list, list]:
    """Warm-up requests, then `runs` measured ones; returns (answers, golds)."""
    warm = store == "warm"
    for _ in range(args.warmup):
        await _ask(client, w, mode, ctx, warm, args.timeout_s)
    answers, golds = [], []
    for i in range(args.runs):
        answer, gold = await _ask(client, w, mode, ctx, warm, args.timeout_s)
        if warm and not answer.stats.producer_store_hit:
            raise ModeRefused("warm store requested but the producer reported no store hit")
        answers.append(answer)
        golds.append(gold)
        s = answer.stats
        note(f"  {mode.label} ctx {ctx} {store} run {i + 1}/{args.runs}: ttft {s.ttft_ms:.1f} ms, "
             f"{s.bytes_received} B, producer prefill {s.producer_prefill_ms:.1f} ms")
    return answers, golds


class Loopback:
    """No shaping: services and client on 127.0.0.1."""
    kind = "loopback"
    producer_host = consumer_host = "127.0.0.1"
    producer_prefix: list[str] = []
    consumer_prefix: list[str] = []

    def shape(self, rate_mbit):
        return {"kind": "loopback", "rate_mbit": None, "delay_ms": None}

    def measure(self, rate_mbit):
        return netns.measure_throughput(64 << 20, "127.0.0.1")


class Shaped:
    """The link built by the outer process; this process runs in the consumer's namespace."""

    def __init__(self, netem: bool, delay_ms: float, names: netns.LinkNames = netns.LinkNames()):
        self.names, self.netem, self.delay_ms = names, netem, delay_ms
        self.kind = "netem" if netem else "tbf"
        self.producer_host, self.consumer_host = names.producer_ip, names.consumer_ip
        self.producer_prefix = names.exec_prefix(names.producer_ns)
        self.consumer_prefix = names.exec_prefix(names.consumer_ns)

    def shape(self, rate_mbit):
        return netns.shape(self.names, rate_mbit, self.delay_ms, self.netem)

    def measure(self, rate_mbit):
        return netns.measure_link(self.names, rate_mbit)


async def bench_scale(w: Workload, consumer_address: str, link, args, grid, emit) -> None:
    bandwidths, contexts = grid
    async with ConsumerClient(consumer_address) as client:
        advertised = {c.name for c in (await client.describe()).codecs}
        modes = []
        for mode in args.modes:
            if mode.name in advertised:
                modes.append(mode)
            else:
                note(f"skip mode {mode.label}: the consumer does not advertise codec {mode.name!r} "
                     f"(advertised: {', '.join(sorted(advertised))})")
        stores = list(args.stores)
        if "warm" in stores:
            first, _ = await _ask(client, w, Mode("raw"), 64, True, args.timeout_s)
            again, _ = await _ask(client, w, Mode("raw"), 64, True, args.timeout_s)
            if not again.stats.producer_store_hit:
                note("skip store=warm: the producer reported no store hit for a repeated context (no context store)")
                stores.remove("warm")
        refused: set[Mode] = set()
        oracle_done: set[int] = set()
        for bw in bandwidths:
            qdisc = link.shape(bw)
            link_mbit = link.measure(bw)
            shaping = qdisc["kind"] if bw is not None or link.kind == "loopback" else "none"
            note(f"[{w.name}] link {bw or 'unshaped'} Mbit: qdisc {qdisc}, measured {link_mbit:.1f} Mbit/s")
            for ctx in contexts:
                if w.max_ctx and ctx > w.max_ctx:
                    note(f"skip ctx {ctx} for {w.name}: its QA generator makes at most {w.max_ctx}-token contexts")
                    continue
                for mode in modes:
                    if mode in refused or (mode.name == ORACLE and ctx in oracle_done):
                        continue
                    for store in (["cold"] if mode.name == ORACLE else stores):
                        try:
                            answers, golds = await measure_cell(client, w, mode, ctx, store, args)
                        except ModeRefused as err:
                            note(f"skip mode {mode.label} from here on: {err}")
                            refused.add(mode)
                            break
                        except grpc.aio.AioRpcError as err:
                            note(f"skip cell {mode.label} ctx {ctx} {store}: {err.code().name}: {err.details()}")
                            continue
                        if mode.name == ORACLE:
                            oracle_done.add(ctx)
                            emit(_row(w, "n/a", None, None, ctx, mode, store, answers, golds))
                        else:
                            emit(_row(w, shaping, bw, link_mbit, ctx, mode, store, answers, golds))


def run_grid(args, link) -> list[dict]:
    """Every scale in turn: start its services behind `link`, measure, stop them."""
    rows: list[dict] = []
    out = open(args.out, "a" if args.append else "w")

    def emit(row: dict) -> None:
        rows.append(row)
        line = json.dumps(row)
        print(line, flush=True)
        out.write(line + "\n")
        out.flush()

    try:
        for scale in args.model_scale:
            w = workload_for(scale, args)
            if w is None:
                continue
            grid = grid_for(scale, args)
            note(f"[{w.name}] bandwidths {grid[0]}, contexts {grid[1]}")
            common = ["--dtype", w.dtype, "--device", args.device, "--log-level", "WARNING",
                      "--max-context-tokens", str(max(8192, max(grid[1]))), "--artifacts", args.artifacts]
            started = time.monotonic()
            with services.running(["--model", w.producer_model, *common], ["--model", w.consumer_model, *common],
                                  log_dir=services.ROOT / "bench/runs/ttft", producer_host=link.producer_host,
                                  consumer_host=link.consumer_host, producer_prefix=link.producer_prefix,
                                  consumer_prefix=link.consumer_prefix, timeout_s=args.timeout_s) as (_, consumer):
                note(f"[{w.name}] services up in {time.monotonic() - started:.1f}s ({w.dtype}, {args.device})")
                asyncio.run(bench_scale(w, consumer.address, link, args, grid, emit))
    finally:
        out.close()
    return rows


# --- command line --------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.ttft", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-scale", nargs="+", choices=["tiny", "trained", "qwen05b"], default=["trained", "qwen05b"],
                   help="trained: checkpoints/qa-base -> qa-tuned; qwen05b: 0.5B-config random weights; "
                        "tiny: --producer-model/--consumer-model (default tiny-llama)")
    p.add_argument("--producer-model", help="scale tiny: producer model (path, hub id or builtin tiny name)")
    p.add_argument("--consumer-model", help="scale tiny: consumer model (default: the producer's)")
    p.add_argument("--dtype", help="override the scale's dtype (trained/tiny float32, qwen05b bfloat16)")
    p.add_argument("--artifacts", default="", help="SCD artifact files/directories for both services, comma-separated "
                   "(matched to each pair by weight digest; without one the scd mode is skipped)")
    p.add_argument("--threads", type=int, help="torch threads per service (default on CPU: half the cores each, "
                   "so producer and consumer do not oversubscribe them; on GPU: torch's default)")
    p.add_argument("--device", default="auto", help="services' torch device (auto: cuda:0 when present)")
    p.add_argument("--bandwidths", nargs="+", type=parse_bandwidth,
                   help="Mbit/s values or 'unshaped' (default: the grid of the scale, see GRIDS)")
    p.add_argument("--contexts", nargs="+", type=int, help="context lengths in tokens (default: the scale's grid)")
    p.add_argument("--modes", nargs="+", type=parse_mode, default=[parse_mode(m) for m in DEFAULT_MODES],
                   help="NAME or NAME:KEY=VALUE,... e.g. quant:bits=4 scd:schedule=r16-p2 (default: %(default)s)")
    p.add_argument("--stores", nargs="+", choices=["cold", "warm"], help="producer store states (default: cold warm)")
    p.add_argument("--runs", type=int, help="measured requests per cell (default 5)")
    p.add_argument("--warmup", type=int, help="unmeasured requests per cell first (default 1)")
    p.add_argument("--quick", action="store_true", help=f"smoke preset: {QUICK} (explicit flags win)")
    p.add_argument("--no-shaping", action="store_true", help="loopback, no namespaces (no root needed)")
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay (netem kernels only)")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per request and for service start")
    p.add_argument("--out", type=Path, default=RESULTS / "ttft.jsonl")
    p.add_argument("--append", action="store_true", help="append to --out instead of replacing it")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG and markdown table")
    p.add_argument("--inside-link", choices=["netem", "tbf"], help=argparse.SUPPRESS)  # set by the outer process
    return p


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill grid defaults: --quick, then the scale's grid for this machine; explicit flags win."""
    import torch

    gpu = torch.cuda.is_available() or args.device.startswith("cuda")
    args.grids = GRIDS["gpu" if gpu else "cpu"]
    if args.threads is None and not gpu:
        args.threads = max(1, (os.cpu_count() or 2) // 2)
    if args.threads:  # read by torch in the service processes at start-up
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.threads)
    preset = QUICK if args.quick else {}
    args.bandwidths = args.bandwidths or preset.get("bandwidths")  # None: each scale's grid
    args.contexts = args.contexts or preset.get("contexts")
    args.stores = args.stores or preset.get("stores") or ["cold", "warm"]
    args.runs = args.runs if args.runs is not None else preset.get("runs", 5)
    args.warmup = args.warmup if args.warmup is not None else preset.get("warmup", 1)
    if args.no_shaping:
        args.bandwidths = [None]
    if args.runs < 1 or args.warmup < 0:
        raise SystemExit("--runs must be >= 1 and --warmup >= 0")
    oracle = [m for m in args.modes if m.name == ORACLE]
    args.modes = oracle + [m for m in args.modes if m.name != ORACLE]  # oracle first: the table's reference
    return args


def grid_for(scale: str, args) -> tuple[list, list[int]]:
    """(bandwidths, contexts) of one scale: the flags, else this machine's grid for the scale."""
    bws, ctxs = args.grids.get(scale, ([100, None], [512]))
    return args.bandwidths or bws, args.contexts or ctxs


def _outer(argv: list[str], args) -> int:
    """Root namespace: build the link, run the benchmark inside the consumer's namespace, clean up."""
    problems = netns.missing_requirements()
    if problems:
        print("bench.ttft: cannot build the shaped link: " + "; ".join(problems), file=sys.stderr)
        return 2
    with netns.Link(delay_ms=args.delay_ms, log=note) as link:
        cmd = [*link.names.exec_prefix(link.names.consumer_ns), sys.executable, "-m", "bench.ttft", *argv,
               "--inside-link", "netem" if link.netem else "tbf"]
        inner = subprocess.Popen(cmd, cwd=services.ROOT)
        try:
            return inner.wait()
        except BaseException:
            # Ctrl-C reached the inner process too; SIGTERM did not: interrupt it, let it stop its services
            if inner.poll() is None:
                inner.send_signal(signal.SIGINT)
                try:
                    inner.wait(60)
                except subprocess.TimeoutExpired:
                    inner.kill()
                    inner.wait()
            raise


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if not args.no_shaping and not args.inside_link:
        try:
            sys.exit(_outer(argv, args))
        except KeyboardInterrupt:
            sys.exit(130)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args = resolve(args)
    link = Loopback() if args.no_shaping else Shaped(args.inside_link == "netem", args.delay_ms)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    note(f"grid: scales {args.model_scale}, bandwidths {args.bandwidths or 'per scale'}, "
         f"contexts {args.contexts or 'per scale'}, "
         f"modes {[m.label for m in args.modes]}, stores {args.stores}, warm-up {args.warmup} + {args.runs} runs, "
         f"{args.threads or 'default'} torch threads per service; "
         f"client in the consumer's {'namespace' if link.kind != 'loopback' else 'host (loopback)'}")
    try:
        rows = run_grid(args, link)
    except KeyboardInterrupt:
        note("interrupted; services stopped")
        sys.exit(130)
    note(f"{len(rows)} rows -> {args.out}")
    if rows and not args.no_plot:
        from bench import plot

        png = args.out.with_suffix(".png")
        plot.plot(rows, png)
        note(f"plot -> {png}")
        print(plot.markdown(rows), file=sys.stderr)


if __name__ == "__main__":
    main()
