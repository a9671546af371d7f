"""`python -m bench.serving.adaptive` (make bench-adaptive): mode `auto` against every fixed candidate, per
link, and a link whose rate steps in the middle of a run.

Topology as bench.serving.ttft: the producer in namespace scd-bench-p, the consumer and this client in
scd-bench-c, joined by a tc-shaped veth (bench.harness.netns; rate by netem where the kernel has it, else
tbf; delay and jitter by netem, else by the userspace relay of bench.harness.relay on the producer
path). Every row says which (`shaping`). `--no-shaping`: loopback only (no root; a smoke test).

Grid: scales (trained: the QA pair qa-base -> qa-tuned, quality; qwen05b: the Qwen2.5-0.5B shape,
random weights, speed only) x delays x bandwidths x stores (cold: a context the producer never
saw; warm: the same context again). Per cell the candidates are measured interleaved (warm-up,
then --runs repetitions, every candidate once each in a seeded shuffled order, so no candidate
always runs right after the same other one, and --gap-ms apart): every fixed candidate the
pair offers within the budget (as the consumer's auto lists them), the extra fixed modes named
by --extra-modes, and `auto` at the budget. The budget: --max-loss, else the calibrated loss of
--budget-schedule (the trained pair's headline schedule), else the pair's default (auto with no
option). Services run with the consumer's prefix cache off (a repeated context is a producer
store hit, not a consumer cache hit).

Then the step run (--step-scale, warm, no delay): --step-requests auto requests at each rate of
--step-rates (100 -> 10 -> 100 Mbit), the rate changed with `tc qdisc change` between phases;
requests_to_adapt counts a phase's requests until every later pick but the probes (auto's
deliberate tries of a remote candidate on a stale link estimate, listed in `probes`) is the one
it settled on.

One JSON line per cell to OUT_DIR/adaptive.jsonl: model, weights, dtype, ctx_tokens,
bandwidth_mbit, delay_ms, shaping, link_mbit (measured), store, mode, options, chosen (auto: the
modes it picked, with counts), max_loss, loss (calibrated loss of the mode; auto: the largest of
its picks), bytes (median), ttft_ms_median/min/max, runs, f1 (trained), identical_to_oracle
(trained: share of answers token-identical to the consumer's own prefill of the same context),
load_avg_1m; step rows add phase, requests_to_adapt, picks. Then OUT_DIR/adaptive.png (TTFT vs
bandwidth, one line per fixed mode, auto on top) and the targets checked on the rows
(`check`): auto's median TTFT <= 1.1x the fastest fixed candidate within the budget in every
cell, its loss never over the budget, and after a step its choice settles within 3 requests on a
candidate within 1.1x of the fastest fixed one in the grid's warm, no-delay cell at that rate
(`settled_too_slow`; not read when the run has no such cell, e.g. --no-grid).

`--mixed`: instead of the grid, the mixed workload of bench.serving.mixed (the trained pair, loopback,
context lengths 16-2048 in random order, no-mode and named requests interleaved): rows and a
summary of auto's TTFT estimates against the measured TTFT, to --out-dir (default
bench/runs/adaptive: not committed). A few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import random
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from bench.harness import netns, services
from bench.harness.workloads import Workload, note, workload_for
from bench.serving.ttft.grid import Mode, parse_bandwidth, parse_mode
from bench.serving.ttft.links import Shaped, run_inside_link
from consumer.api.client import ConsumerClient, prompt

RESULTS = services.ROOT / "bench" / "results"
AUTO = "auto"
TTFT_TARGET = 1.1  # auto's median TTFT at most this x the fastest fixed candidate within the budget
ADAPT_TARGET = 3  # requests after a step within which auto's choice settles
QUICK = dict(scales=["trained"], bandwidths=[10.0, None], delays=[0.0], stores=["cold", "warm"], runs=3, warmup=1,
             step_scale="", contexts={"trained": 256})
CONTEXTS = {"trained": 256, "qwen05b": 2048}
# measured runs per cell by scale (--runs overrides): the QA pair's TTFTs are ~10-20 ms with runs
# spread 8-25 ms, where a median of 9 runs still moves by ~+-10% (at 9 runs auto's median was
# 1.08-1.15x the same schedule named; `--scales trained --bandwidths unshaped --stores warm --runs 40
# --no-shaping` gave 10.44 vs 10.72 ms); a 0.5B cell's cold runs take 3.5-6 s each
RUNS = {"trained": 25, "qwen05b": 5}
ARTIFACTS = {"trained": "artifacts/qa-base-to-tuned.safetensors", "qwen05b": ""}  # per scale; --artifacts overrides


@dataclass
class Sample:
    answer: object  # consumer.api.client.Answer
    gold: str | None
    reference: list[int] | None  # the consumer's own prefill's answer to the same request (trained pair)
    load_1m: float


def mode_of(c) -> Mode:
    """A Mode from a CandidateEstimate of GenerateStats.auto (options left empty dropped)."""
    return Mode(c.mode, tuple(sorted((k, v) for k, v in c.options.items() if v)))


async def ask(client: ConsumerClient, w: Workload, mode: Mode, ctx: int, warm: bool, budget: dict, timeout_s: float):
    context, question, gold = w.request(ctx, warm)
    options = dict(budget) if mode.name == AUTO else dict(mode.options)
    fields = dict(context=prompt(ids=context), question=prompt(ids=question), max_new_tokens=w.max_new_tokens,
                  stop_token_ids=w.stop_ids)
    answer = await client.generate(timeout=timeout_s, mode=mode.name, options=options, **fields)
    reference = None
    if w.qa:  # the same request answered by the consumer's own prefill (unmeasured): the identity reference
        reference = (await client.generate(timeout=timeout_s, mode="oracle", **fields)).ids
    return answer, gold, reference


async def candidates(client: ConsumerClient, w: Workload, ctx: int, budget: dict, timeout_s: float) -> tuple[list, float]:
    """The fixed candidates within the budget, as the consumer's auto lists them, and the budget."""
    answer, _, _ = await ask(client, w, Mode(AUTO), ctx, False, budget, timeout_s)
    a = answer.stats.auto
    note(f"[{w.name}] auto budget {a.max_loss:.4g} ({'exact' if a.exact else a.budget_source}); candidates: "
         + ", ".join(f"{mode_of(c).label} loss {c.calibrated_loss:.4g}{'' if c.within_budget else ' (over)'}"
                     for c in a.candidates))
    return list(a.candidates), a.max_loss


async def measure_cell(client, w: Workload, modes: list[Mode], ctx: int, store: str, budget: dict, args) -> dict:
    warm = store == "warm"
    samples: dict[Mode, list[Sample]] = {m: [] for m in modes}
    active = list(modes)
    runs = args.runs or RUNS[args.scale_of[w.name]]
    for rep in range(-args.warmup, runs):
        order = list(active)
        random.Random(f"{ctx}/{store}/{rep}").shuffle(order)  # no candidate always follows the same one
        for mode in order:
            await asyncio.sleep(args.gap_ms / 1e3)  # the last request's leftover work (store writes) settles
            try:
                answer, gold, reference = await ask(client, w, mode, ctx, warm, budget, args.timeout_s)
            except grpc.aio.AioRpcError as err:
                note(f"  skip {mode.label} in this cell: {err.code().name}: {err.details()[:200]}")
                active.remove(mode)
                continue
            if rep < 0:
                continue
            load = os.getloadavg()[0]
            samples[mode].append(Sample(answer, gold, reference, load))
            s = answer.stats
            picked = f" -> {s.transfer.name}" if mode.name == AUTO else ""
            note(f"  {mode.label}{picked} ctx {ctx} {store} run {rep + 1}/{runs}: ttft {s.ttft_ms:.1f} ms, "
                 f"{s.bytes_received} B, load {load:.2f}")
    return {m: v for m, v in samples.items() if m in active and v}


def loss_of(label: str, table: dict[str, float]) -> float | None:
    value = table.get(label)
    return None if value is None or value != value else value


def row(w: Workload, link: dict, ctx: int, store: str, mode: Mode, samples: list[Sample], max_loss: float,
        losses: dict[str, float]) -> dict:
    stats = [s.answer.stats for s in samples]
    ttft = [s.ttft_ms for s in stats]
    out = {
        "model": w.name, "weights": w.weights, "dtype": w.dtype, "ctx_tokens": ctx, **link, "store": store,
        "mode": mode.name, "options": dict(mode.options), "chosen": None, "max_loss": max_loss,
        "loss": loss_of(mode.label, losses), "bytes": int(statistics.median(s.bytes_received for s in stats)),
        "ttft_ms_median": round(statistics.median(ttft), 2), "ttft_ms_min": round(min(ttft), 2),
        "ttft_ms_max": round(max(ttft), 2), "runs": len(stats), "f1": None, "identical_to_oracle": None,
        "load_avg_1m": round(statistics.median(s.load_1m for s in samples), 2),
        "load_avg_1m_max": round(max(s.load_1m for s in samples), 2), "cores": os.cpu_count(),
        "abandoned": sum(s.transfer_abandoned for s in stats),
    }
    if mode.name == AUTO:
        picks = collections.Counter(mode_of_stats(s).label for s in stats)
        out["chosen"] = dict(picks.most_common())
        picked_losses = [loss_of(label, losses) for label in picks]
        out["loss"] = max((x for x in picked_losses if x is not None), default=None)
        out["probes"] = sum(s.auto.reason.startswith("probe") for s in stats)
        last = stats[-1].auto  # what the last request estimated, per candidate within the budget
        out["estimated_ms"] = {mode_of(c).label: round(c.estimated_ms, 1) for c in last.candidates if c.within_budget}
    if any(s.gold is not None for s in samples):
        from qa.metrics import score

        out["f1"] = round(score((s.answer.text.replace(" .", "").strip(), s.gold) for s in samples)["f1"], 4)
    if any(s.reference is not None for s in samples):
        out["identical_to_oracle"] = round(sum(s.answer.ids == s.reference for s in samples) / len(samples), 3)
    return out


def mode_of_stats(stats) -> Mode:
    """The mode a request was served with (the consumer resolved options, minus what it echoes)."""
    options = {k: v for k, v in stats.transfer.options.items() if k in ("schedule", "bits", "group_size", "start", "end")}
    for c in stats.auto.candidates:
        if c.chosen:
            return mode_of(c)
    return Mode(stats.transfer.name, tuple(sorted(options.items())))


def budget_options(args) -> dict:
    if args.max_loss is not None:
        return {"max_loss": repr(args.max_loss)}
    return {}


async def bench_delay(w: Workload, address: str, link, delay_ms: float, args, emit) -> None:
    ctx = args.contexts[args.scale_of[w.name]]
    async with ConsumerClient(address) as client:
        budget = budget_options(args)
        cands, max_loss = await candidates(client, w, ctx, budget, args.timeout_s)
        if args.budget_schedule and args.max_loss is None:
            described = await client.describe()
            match = [e for a in described.artifacts for e in a.schedules if args.budget_schedule in (e.name, e.schedule)]
            if match:
                budget = {"max_loss": repr(match[0].calibrated_loss)}
                cands, max_loss = await candidates(client, w, ctx, budget, args.timeout_s)
        losses = {mode_of(c).label: c.calibrated_loss for c in cands}
        fixed = [mode_of(c) for c in cands if c.within_budget]
        fixed += [m for m in args.extra_modes if m not in fixed]
        modes = [*fixed, Mode(AUTO)]
        for bw in [] if args.no_grid else args.bandwidths:
            applied = link.set_rate(bw)
            for store in args.stores:
                note(f"[{w.name}] {bw or 'unshaped'} Mbit, delay {delay_ms} ms, {store}: {[m.label for m in modes]}")
                results = await measure_cell(client, w, modes, ctx, store, budget, args)
                for mode, samples in results.items():
                    emit(row(w, {"bandwidth_mbit": bw, "delay_ms": delay_ms, **applied}, ctx, store, mode, samples,
                             max_loss, losses))
        if args.step_scale == args.scale_of[w.name] and delay_ms == 0:
            await step_run(client, w, link, ctx, budget, max_loss, losses, fixed, args, emit)


async def step_run(client, w: Workload, link, ctx: int, budget: dict, max_loss: float, losses: dict, fixed: list[Mode],
                   args, emit) -> None:
    """Auto requests (warm) while the rate steps: --step-rates, --step-requests each. First every
    fixed remote candidate once on the warm context (unmeasured), so the producer holds it."""
    for mode in fixed:
        if mode.name != "oracle":
            await ask(client, w, mode, ctx, True, budget, args.timeout_s)
    for phase, bw in enumerate(args.step_rates):
        applied = link.set_rate(bw, change=phase > 0)
        picks, ttfts, probes, abandoned = [], [], [], []
        for i in range(args.step_requests):
            await asyncio.sleep(args.gap_ms / 1e3)
            answer, _, _ = await ask(client, w, Mode(AUTO), ctx, True, budget, args.timeout_s)
            s = answer.stats
            picks.append(mode_of_stats(s).label)
            ttfts.append(s.ttft_ms)
            if s.auto.reason.startswith("probe"):
                probes.append(i + 1)
            if s.transfer_abandoned:
                abandoned.append(i + 1)
            note(f"  step phase {phase} ({bw} Mbit) request {i + 1}: {picks[-1]}, ttft {s.ttft_ms:.1f} ms, "
                 f"{s.auto.reason[:120]}")
        # a probe (a deliberate try of a remote candidate on a stale link estimate) is not the choice
        # auto settled on: requests_to_adapt counts to the first request from which every other
        # pick is the last non-probe one
        own = [(i + 1, p) for i, p in enumerate(picks) if i + 1 not in probes]
        settled = own[-1][1] if own else picks[-1]
        adapt = next((n for k, (n, _) in enumerate(own) if all(p == settled for _, p in own[k:])), None)
        emit({"model": w.name, "weights": w.weights, "dtype": w.dtype, "ctx_tokens": ctx, "bandwidth_mbit": bw,
              "delay_ms": 0.0, **applied, "store": "warm", "mode": AUTO, "options": budget, "phase": phase,
              "picks": picks, "probes": probes, "abandoned": abandoned,
              "chosen": dict(collections.Counter(picks).most_common()), "settled_on": settled,
              "requests_to_adapt": adapt, "max_loss": max_loss, "loss": loss_of(settled, losses),
              "ttft_ms": [round(t, 1) for t in ttfts], "ttft_ms_median": round(statistics.median(ttfts), 2),
              "load_avg_1m": round(os.getloadavg()[0], 2)})


def check(rows: list[dict]) -> list[str]:
    """The issue's targets on the rows: a list of misses (empty: met)."""
    misses = []
    cells = collections.defaultdict(list)
    for r in rows:
        if "phase" not in r:
            cells[(r["model"], r["bandwidth_mbit"], r["delay_ms"], r["store"])].append(r)
    for key, rs in cells.items():
        auto = [r for r in rs if r["mode"] == AUTO]
        fixed = [r for r in rs if r["mode"] != AUTO and r["loss"] is not None and r["loss"] <= r["max_loss"] + 1e-9]
        if not auto or not fixed:
            continue
        best = min(fixed, key=lambda r: r["ttft_ms_median"])
        ratio = auto[0]["ttft_ms_median"] / best["ttft_ms_median"]
        if ratio > TTFT_TARGET:
            misses.append(f"{key}: auto {auto[0]['ttft_ms_median']:.0f} ms = {ratio:.2f}x the fastest fixed "
                          f"{best['mode']} {best['options']} ({best['ttft_ms_median']:.0f} ms)")
        if auto[0]["loss"] is not None and auto[0]["loss"] > auto[0]["max_loss"] + 1e-9:
            misses.append(f"{key}: auto picked loss {auto[0]['loss']:.4g} > budget {auto[0]['max_loss']:.4g}")
    for r in rows:
        if "phase" not in r or r["phase"] == 0:
            continue
        if r["requests_to_adapt"] is None or r["requests_to_adapt"] > ADAPT_TARGET:
            misses.append(f"step phase {r['phase']} ({r['bandwidth_mbit']} Mbit): settled after "
                          f"{r['requests_to_adapt']} requests on {r['settled_on']} (picks {r['picks']})")
        slow = settled_too_slow(r, cells.get((r["model"], r["bandwidth_mbit"], 0.0, "warm"), []))
        if slow:
            misses.append(f"step phase {r['phase']} ({r['bandwidth_mbit']} Mbit): {slow}")
    return misses


def settled_vs_fastest(step: dict, grid: list[dict]) -> tuple[float, float, str, float] | None:
    """A step's settled candidate read on the grid's cell at its rate (`grid`: that cell's rows):
    (its median over the fastest fixed candidate's within the budget, its median, the fastest's
    label, the fastest's median); None when the cell has no row of it. Rows are labelled as
    this module labels its picks (bench.serving.ttft.grid.Mode)."""
    fixed = {
        Mode(r["mode"], tuple(sorted(r["options"].items()))).label: r["ttft_ms_median"]
        for r in grid
        if r["mode"] != "auto" and r["loss"] is not None and r["loss"] <= r["max_loss"] + 1e-9
    }
    if step["settled_on"] not in fixed:
        return None
    best = min(fixed, key=fixed.__getitem__)
    return fixed[step["settled_on"]] / fixed[best], fixed[step["settled_on"]], best, fixed[best]


def settled_too_slow(step: dict, grid: list[dict]) -> str:
    """Settling is adapting only when it settles on a candidate as fast as the fastest fixed one
    at that rate: read on the grid's warm, no-delay cell of the same model and rate
    (settled_vs_fastest; '' when within TTFT_TARGET or when the run has no
    such cell to read)."""
    read = settled_vs_fastest(step, grid)
    if read is None or read[0] <= TTFT_TARGET:
        return ""
    ratio, settled_ms, best, best_ms = read
    return (f"settled on {step['settled_on']} ({settled_ms:.0f} ms in the grid cell) = {ratio:.2f}x "
            f"the fastest fixed {best} ({best_ms:.0f} ms)")


# -- links ----------------------------------------------------------------------------------

class LoopbackLink(contextlib.AbstractContextManager):
    """--no-shaping: services and client on loopback; rate and delay are not applied."""
    producer_host = consumer_host = "127.0.0.1"
    producer_prefix: list[str] = []
    consumer_prefix: list[str] = []

    def set_rate(self, rate_mbit: float | None, change: bool = False) -> dict:
        return {"shaping": "none (loopback)", "link_mbit": None}

    def producer_target(self, address: str) -> str:
        return address

    def __exit__(self, *exc) -> None:
        return None


class InsideLink(Shaped, contextlib.AbstractContextManager):
    """This process runs in the consumer's namespace; the outer process built the veth
    (bench.harness.netns.Link). Rates by tc on both egresses (`tc qdisc change` mid-run); a delay by netem
    where the kernel has it, else by a relay (bench.harness.relay) this process starts in its namespace on
    the consumer's path to the producer, only for delay > 0 (bench.serving.ttft.links.Shaped)."""

    def set_rate(self, rate_mbit: float | None, change: bool = False) -> dict:
        from bench.harness.shaping import LinkSpec, label

        spec = LinkSpec(rate_mbit=rate_mbit, delay_ms=self.delay_ms if self.netem else 0.0)
        started = time.monotonic()
        netns.change_qdisc(self.names, spec, self.netem)
        applied = {"shaping": label(LinkSpec(rate_mbit, self.delay_ms), self.netem, self.relay is not None, None),
                   "tc": "change" if change else "set", "applied_s": round(time.monotonic() - started, 3)}
        if not change:  # a measured rate per cell (the step run changes it without pausing)
            applied["link_mbit"] = round(netns.measure_link(self.names, rate_mbit, seconds=1.0), 1)
        return applied

    def __exit__(self, *exc) -> None:
        self.close()
        from bench.harness.shaping import LinkSpec

        netns.change_qdisc(self.names, LinkSpec(), self.netem)


def run_scale(scale: str, args, emit) -> None:
    w = workload_for(scale, args)
    if w is None:
        return
    args.scale_of[w.name] = scale
    common = ["--dtype", w.dtype, "--device", args.device, "--log-level", args.service_log_level, "--max-context-tokens",
              "8192"]
    artifacts = args.artifacts if args.artifacts is not None else ARTIFACTS[scale]
    if artifacts:
        common += ["--artifacts", artifacts]
    for delay in args.delays:
        link = LoopbackLink() if args.no_shaping else InsideLink(args.inside_link == "netem", delay)
        with link, services.running(["--model", w.producer_model, *common],
                                    ["--model", w.consumer_model, *common, *services.NO_PREFIX_CACHE],
                                    log_dir=services.ROOT / "bench/runs/adaptive", producer_host=link.producer_host,
                                    consumer_host=link.consumer_host, producer_prefix=link.producer_prefix,
                                    consumer_prefix=link.consumer_prefix, timeout_s=args.timeout_s,
                                    producer_target=link.producer_target) as (_, consumer):
            asyncio.run(bench_delay(w, consumer.address, link, delay, args, emit))


def run_mixed(args) -> None:
    """bench.serving.mixed's workload on the trained pair, services on loopback with their defaults
    (auto's default budget; prefix cache off: every context is new anyway)."""
    from bench.serving import mixed

    w = workload_for("trained", args)
    if w is None:
        sys.exit(1)
    common = ["--dtype", w.dtype, "--device", args.device, "--log-level", "WARNING", "--max-context-tokens", "8192",
              "--artifacts", args.artifacts or ARTIFACTS["trained"]]
    rows: list[dict] = []

    def emit(r: dict) -> None:
        print(json.dumps(r), flush=True)

    with services.running(["--model", w.producer_model, *common],
                          ["--model", w.consumer_model, *common, *services.NO_PREFIX_CACHE],
                          log_dir=services.ROOT / "bench/runs/adaptive", timeout_s=args.timeout_s) as (_, consumer):
        rows = asyncio.run(mixed.mixed_run(w, consumer.address, args, emit))
    summary = mixed.mixed_summary(rows)
    print(json.dumps(summary), flush=True)
    mixed.write(rows, summary, args.out_dir)


# -- output ---------------------------------------------------------------------------------

def plot(rows: list[dict], png: Path) -> None:
    """TTFT vs bandwidth per (model, store, delay): one line per fixed mode, auto on top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["model"], r["store"], r["delay_ms"]) for r in rows if "phase" not in r}, key=str)
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4), squeeze=False)
    for ax, (model, store, delay) in zip(axes[0], panels):
        cell = [r for r in rows if "phase" not in r and (r["model"], r["store"], r["delay_ms"]) == (model, store, delay)]
        top = max((r["bandwidth_mbit"] or 0) for r in cell) or 100.0
        lines = collections.defaultdict(list)
        for r in cell:
            x = r["bandwidth_mbit"] if r["bandwidth_mbit"] is not None else top * 4  # unshaped: right of the fastest
            label = r["mode"] if not r["options"] or r["mode"] == AUTO else f"{r['mode']} {Mode(r['mode'], tuple(sorted(r['options'].items()))).schedule}"
            lines[label].append((x, r["ttft_ms_median"]))
        for label, pts in sorted(lines.items(), key=lambda kv: kv[0] == AUTO):
            pts.sort()
            style = dict(color="black", linewidth=2.5, marker="o", zorder=5) if label == AUTO else dict(marker=".", alpha=0.8)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label, **style)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"{model}\n{store}, delay {delay:g} ms", fontsize=9)
        ax.set_xlabel("Mbit/s (rightmost: unshaped)")
        ax.set_ylabel("TTFT median, ms")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.serving.adaptive", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scales", nargs="+", choices=["trained", "qwen05b"], default=["trained", "qwen05b"])
    p.add_argument("--bandwidths", nargs="+", type=parse_bandwidth, default=[10.0, 50.0, 100.0, 1000.0, None],
                   help="Mbit/s values or 'unshaped'")
    p.add_argument("--delays", nargs="+", type=float, default=[0.0, 20.0], help="one-way delay, ms")
    p.add_argument("--stores", nargs="+", choices=["cold", "warm"], default=["cold", "warm"])
    p.add_argument("--runs", type=int, default=0, help=f"measured repetitions per cell, every candidate once each (0: {RUNS})")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--gap-ms", type=float, default=100.0, help="pause before each request (the last one's leftover work settles)")
    p.add_argument("--contexts", type=lambda t: dict(kv.split("=") for kv in t.split(",")), default=None,
                   help="context tokens per scale, e.g. trained=256,qwen05b=2048")
    p.add_argument("--max-loss", type=float, help="auto's budget (default: --budget-schedule's loss, else the pair's default)")
    p.add_argument("--budget-schedule", default="R2.R64", help="trained pair: the schedule whose calibrated loss is the budget")
    p.add_argument("--extra-modes", nargs="*", type=parse_mode, default=[parse_mode("raw")],
                   help="fixed modes measured besides the candidates within the budget (default: raw)")
    p.add_argument("--artifacts", help=f"SCD artifacts for both services (default per scale: {ARTIFACTS})")
    p.add_argument("--step-scale", default="qwen05b", help="the scale of the step run ('' : none)")
    p.add_argument("--step-rates", nargs="+", type=parse_bandwidth, default=[100.0, 10.0, 100.0])
    p.add_argument("--step-requests", type=int, default=6)
    p.add_argument("--no-grid", action="store_true", help="only the step run")
    p.add_argument("--device", default="cpu")
    p.add_argument("--service-log-level", default="WARNING", help="the services' --log-level (logs: bench/runs/adaptive)")
    p.add_argument("--dtype", help="override the scale's dtype")
    p.add_argument("--threads", type=int, help=argparse.SUPPRESS)
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--quick", action="store_true", help=f"the QA pair at two rates, a few minutes: {QUICK} (explicit flags win)")
    p.add_argument("--no-shaping", action="store_true", help="loopback, no namespaces (no root)")
    p.add_argument("--out-dir", type=Path, default=None, help="default: bench/results (--mixed: bench/runs/adaptive)")
    p.add_argument("--mixed", action="store_true", help="the mixed workload of bench.serving.mixed instead of the grid (loopback)")
    p.add_argument("--mixed-requests", type=int, default=40, help="steps of the mixed workload (each 1-2 requests)")
    p.add_argument("--mixed-seed", type=int, default=0)
    p.add_argument("--append", action="store_true")
    p.add_argument("--inside-link", choices=["netem", "tbf"], help=argparse.SUPPRESS)
    return p


def resolve(args) -> argparse.Namespace:
    if args.quick:  # the preset fills what the command line left at its default
        defaults = build_parser().parse_args([])
        for key, value in QUICK.items():
            if getattr(args, key) == getattr(defaults, key):
                setattr(args, key, value)
    contexts = dict(CONTEXTS)
    contexts.update({k: int(v) for k, v in (args.contexts or {}).items()})
    args.contexts = contexts
    args.scale_of = {}
    if args.mixed:
        args.no_shaping = True
    if args.out_dir is None:
        args.out_dir = services.ROOT / "bench/runs/adaptive" if args.mixed else RESULTS
    return args


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = resolve(build_parser().parse_args(argv))
    if not args.no_shaping and not args.inside_link:
        try:
            sys.exit(run_inside_link(argv, 0.0, module="bench.serving.adaptive"))  # delays: per pass, inside
        except KeyboardInterrupt:
            sys.exit(130)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.mixed:
        run_mixed(args)
        return
    out = args.out_dir / "adaptive.jsonl"
    rows: list[dict] = []
    with open(out, "a" if args.append else "w") as f:
        def emit(r: dict) -> None:
            rows.append(r)
            line = json.dumps(r)
            print(line, flush=True)
            f.write(line + "\n")
            f.flush()

        for scale in args.scales:
            run_scale(scale, args, emit)
    if rows:
        plot(rows, args.out_dir / "adaptive.png")
    misses = check(rows)
    note(f"{len(rows)} rows -> {out}; targets: " + ("all met" if not misses else f"{len(misses)} missed"))
    for m in misses:
        note(f"  missed: {m}")


if __name__ == "__main__":
    main()
