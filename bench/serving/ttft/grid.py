"""The TTFT grid: which cells exist and in which order their requests run.

Owns the transfer-mode and bandwidth syntax of the command line (`Mode`, `parse_mode`,
`parse_bandwidth`), the per-machine default grids, the `--quick` preset, filling defaults into
the parsed flags (`resolve`, `grid_for`), and the interleaving order (`rotation`). Measures
nothing and starts nothing.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from shared.labels import mode_label, options_label

ORACLE = "oracle"
CACHED = "cached"  # reference row: a consumer that has the context cached itself
DEFAULT_MODES = ["oracle", "raw", "quant:bits=8", "quant:bits=4", "recompute", "scd"]
# Grids per machine: (bandwidths in Mbit/s, None = unshaped; context lengths in tokens). On this
# 2-core CPU the 0.5B-shaped model prefills 512 tokens in ~1.4 s and 2048 in ~6 s (bf16, quiet).
GRIDS = {
    "gpu": {"trained": ([10, 100, 1000, None], [512, 2048, 4096]), "real": ([100, 1000], [2048, 4096]), "qwen05b": ([10, 100, 1000, None], [512, 2048, 4096]),
            "qwen7b": ([100, 1000, None], [2048])},
    "cpu": {"trained": ([10, 100, 1000, None], [512, 2048, 4096]), "real": ([100, 1000], [2048, 4096]), "qwen05b": ([10, 100, 1000], [512, 2048, 4096]),
            "qwen7b": ([1000], [512])},
}
QUICK = dict(runs=2, warmup=1, contexts=[256], bandwidths=[100], stores=["cold"])


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
        return options_label(self.options) or None

    @property
    def label(self) -> str:
        return mode_label(self.name, self.schedule or "")


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


def rotation(modes: list, repetition: int) -> list:
    """The order of one repetition: every mode once, shifted by one place per repetition, so slow
    drift of the machine (load, thermals) falls on every mode alike. rotation([a,b,c], 1) = [b,c,a]."""
    if not modes:
        return []
    k = repetition % len(modes)
    return modes[k:] + modes[:k]


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
