"""`python -m bench.serving.ttft` command line: flags, then either the outer process that builds the
shaped link (bench.serving.ttft.links) or the grid run itself (bench.serving.ttft.measure), then the rows'
check, figure and tables (bench.serving.ttft.report). Exit status 3 when a row fails the efficiency check.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

import bench.serving.ttft as package
from bench.harness import services
from bench.harness.workloads import SCALE_DTYPE, note
from bench.serving.ttft import report
from bench.serving.ttft.grid import DEFAULT_MODES, QUICK, parse_bandwidth, parse_mode, resolve
from bench.serving.ttft.links import Loopback, Shaped, run_inside_link
from bench.serving.ttft.measure import run_grid

RESULTS = services.ROOT / "bench" / "results"
EFFICIENCY_FAILED = 3


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.serving.ttft", description=package.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-scale", nargs="+", choices=sorted(SCALE_DTYPE), default=["trained", "qwen05b"],
                   help="trained: checkpoints/qa-base -> qa-tuned; qwen05b / qwen7b: Qwen2.5-0.5B / 7B-config random "
                        "weights; tiny: --producer-model/--consumer-model (default tiny-llama)")
    p.add_argument("--producer-model", help="scale tiny: producer model (path, hub id or builtin tiny name)")
    p.add_argument("--consumer-model", help="scale tiny: consumer model (default: the producer's)")
    p.add_argument("--dtype", help="override the scale's dtype (trained/tiny float32, qwen05b/qwen7b bfloat16)")
    p.add_argument("--artifacts", default="", help="SCD artifact files/directories for both services, comma-separated "
                   "(matched to each pair by weight digest; without one the scd mode is skipped)")
    p.add_argument("--threads", type=int, help="torch threads per service (default on CPU: half the cores each, "
                   "so producer and consumer do not oversubscribe them; on GPU: torch's default)")
    p.add_argument("--device", default="auto", help="services' torch device (auto: cuda:0 when present)")
    p.add_argument("--bandwidths", nargs="+", type=parse_bandwidth,
                   help="Mbit/s values or 'unshaped' (default: the grid of the scale, see bench.serving.ttft.grid.GRIDS)")
    p.add_argument("--contexts", nargs="+", type=int, help="context lengths in tokens (default: the scale's grid)")
    p.add_argument("--modes", nargs="+", type=parse_mode, default=[parse_mode(m) for m in DEFAULT_MODES],
                   help="NAME or NAME:KEY=VALUE,... e.g. quant:bits=4 scd:schedule=r16-p2 (default: %(default)s)")
    p.add_argument("--stores", nargs="+", choices=["cold", "warm"], help="producer store states (default: cold warm)")
    p.add_argument("--runs", type=int, help="measured repetitions per cell, every mode once each (default 5)")
    p.add_argument("--warmup", type=int, help="unmeasured repetitions per cell first (default 1)")
    p.add_argument("--quick", action="store_true", help=f"smoke preset: {QUICK} (explicit flags win)")
    p.add_argument("--no-shaping", action="store_true", help="loopback, no namespaces (no root needed)")
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay each way: netem where the kernel has it, else a userspace relay on the consumer's path")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per request and for service start")
    p.add_argument("--out", type=Path, default=RESULTS / "ttft.jsonl")
    p.add_argument("--append", action="store_true", help="append to --out instead of replacing it")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG and markdown table")
    p.add_argument("--profile-dir", type=Path, help="record each cell's producer and consumer with py-spy "
                   "(bench.harness.cpu_stages.Sampler, raw stacks per thread) into DIR/<model>-<ctx>-<store>-<service>.txt "
                   "(nothing when py-spy is not installed)")
    p.add_argument("--inside-link", choices=["netem", "tbf"], help=argparse.SUPPRESS)  # set by the outer process
    return p


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if not args.no_shaping and not args.inside_link:
        try:
            sys.exit(run_inside_link(argv, args.delay_ms))
        except KeyboardInterrupt:
            sys.exit(130)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args = resolve(args)
    link = Loopback() if args.no_shaping else Shaped(args.inside_link == "netem", args.delay_ms)
    note(f"grid: scales {args.model_scale}, bandwidths {args.bandwidths or 'per scale'}, "
         f"contexts {args.contexts or 'per scale'}, "
         f"modes {[m.label for m in args.modes]}, stores {args.stores}, warm-up {args.warmup} + {args.runs} "
         f"interleaved repetitions, {args.threads or 'default'} torch threads per service; "
         f"client in the consumer's {'namespace' if link.kind != 'loopback' else 'host (loopback)'}")
    writer = report.RowWriter(args.out, args.append)
    try:
        run_grid(args, link, writer)
    except KeyboardInterrupt:
        note("interrupted; services stopped")
        sys.exit(130)
    finally:
        writer.close()
    rows = writer.rows
    note(f"{len(rows)} rows -> {args.out}")
    if rows and not args.no_plot:
        report.tables(rows, args.out.with_suffix(".png"))
    failures = report.check(rows)
    if failures:
        print("bench.serving.ttft: FAILED its own check (efficiency = lower bound / measured must be <= "
              f"{report.EFFICIENCY_LIMIT}):\n  " + "\n  ".join(failures), file=sys.stderr)
        sys.exit(EFFICIENCY_FAILED)
