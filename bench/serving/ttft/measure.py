"""The TTFT measurement loop: start each scale's services behind a link and time requests.

Per (bandwidth, context, store) the modes are measured interleaved: `--warmup` unmeasured
repetitions, then `--runs` measured ones, each repetition running every mode once in the order
of `grid.rotation` (shifted by one per repetition), so drift of the machine hits every mode
alike. The oracle needs no link: it is measured once per context, interleaved with the cold
modes of the first bandwidth, and its requests also give the cached-consumer reference row.
After every measured request the 1-minute load average is sampled. Owns the gRPC calls to the
consumer; turning samples into rows is bench.serving.ttft.report's job.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time

import grpc

from bench.harness import cpu_stages, provenance, services
from bench.harness.workloads import Workload, note, workload_for
from bench.serving.ttft import report
from bench.serving.ttft.grid import ORACLE, Mode, grid_for, rotation
from consumer.api.client import ConsumerClient, prompt


class ModeRefused(Exception):
    """The consumer or producer cannot serve this mode here (unknown codec, no artifact, no store)."""


async def ask(client: ConsumerClient, w: Workload, mode: Mode, ctx: int, warm: bool, timeout_s: float):
    """One Generate call; returns (answer, gold)."""
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


async def measure_interleaved(client, w: Workload, modes: list[Mode], ctx: int, store: str, args,
                              refused: set[Mode]) -> dict[Mode, list[report.Sample]]:
    """Warm-up then measured repetitions, every mode once per repetition in rotating order.
    Returns the samples of the modes that completed every repetition; a refused mode is added to
    `refused` (skipped from here on), a failed call skips that mode for this cell only."""
    warm = store == "warm"
    active = list(modes)
    samples: dict[Mode, list[report.Sample]] = {m: [] for m in modes}
    for rep in range(-args.warmup, args.runs):
        for mode in rotation(list(active), rep):
            try:
                answer, gold = await ask(client, w, mode, ctx, warm, args.timeout_s)
                if rep >= 0 and warm and not answer.stats.producer_store_hit:
                    raise ModeRefused("warm store requested but the producer reported no store hit")
            except ModeRefused as err:
                note(f"skip mode {mode.label} from here on: {err}")
                refused.add(mode)
                active.remove(mode)
                continue
            except grpc.aio.AioRpcError as err:
                note(f"skip cell {mode.label} ctx {ctx} {store}: {err.code().name}: {err.details()}")
                active.remove(mode)
                continue
            if rep < 0:
                continue
            load = os.getloadavg()[0]
            samples[mode].append(report.Sample(answer, gold, load))
            s = answer.stats
            note(f"  {mode.label} ctx {ctx} {store} run {rep + 1}/{args.runs}: ttft {s.ttft_ms:.1f} ms, "
                 f"{s.bytes_received} B, producer prefill {s.producer_prefill_ms:.1f} ms, load {load:.2f}")
    return {m: samples[m] for m in modes if m in active}


async def _advertised_modes(client: ConsumerClient, modes: list[Mode]) -> list[Mode]:
    advertised = {c.name for c in (await client.describe()).codecs}
    kept = [m for m in modes if m.name in advertised]
    for m in modes:
        if m not in kept:
            note(f"skip mode {m.label}: the consumer does not advertise codec {m.name!r} "
                 f"(advertised: {', '.join(sorted(advertised))})")
    return kept


async def _stores(client: ConsumerClient, w: Workload, stores: list[str], timeout_s: float) -> list[str]:
    """The requested store states this producer can serve (warm needs a context store)."""
    stores = list(stores)
    if "warm" in stores:
        await ask(client, w, Mode("raw"), 64, True, timeout_s)
        again, _ = await ask(client, w, Mode("raw"), 64, True, timeout_s)
        if not again.stats.producer_store_hit:
            note("skip store=warm: the producer reported no store hit for a repeated context (no context store)")
            stores.remove("warm")
    return stores


def _profiled(args, w: Workload, ctx: int, store: str, pids: dict[str, int]) -> contextlib.ExitStack:
    """py-spy on each service while a cell runs, when --profile-dir asks (bench.harness.cpu_stages)."""
    stack = contextlib.ExitStack()
    if args.profile_dir is not None:
        for name, pid in pids.items():
            stack.enter_context(cpu_stages.Sampler(pid, args.profile_dir / f"{w.name}-{ctx}-{store}-{name}.txt"))
    return stack


async def bench_scale(w: Workload, consumer_address: str, link, args, grid, emit, pids: dict[str, int]) -> None:
    """Every cell of one scale's grid, rows handed to `emit` as each cell completes (`pids`: the
    services' processes, for --profile-dir)."""
    bandwidths, contexts = grid
    artifacts = provenance.artifacts_by_id(args.artifacts)
    async with ConsumerClient(consumer_address) as client:
        modes = await _advertised_modes(client, args.modes)
        stores = await _stores(client, w, args.stores, args.timeout_s)
        refused: set[Mode] = set()
        oracle_done: set[int] = set()
        for bw in bandwidths:
            qdisc = link.shape(bw)
            link_mbit = link.measure(bw)
            burst = link.burst_bytes(bw)
            shaping = qdisc["kind"] if bw is not None or link.kind == "loopback" else "none"
            if link.relay is not None:  # the delay on a kernel without netem
                shaping = f"{shaping} + userspace relay delay {link.delay_ms:g} ms (no netem)"
            note(f"[{w.name}] link {bw or 'unshaped'} Mbit: qdisc {qdisc}, sustained {link_mbit:.1f} Mbit/s, "
                 f"burst {burst} B")
            for ctx in contexts:
                if w.max_ctx and ctx > w.max_ctx:
                    note(f"skip ctx {ctx} for {w.name}: its QA generator makes at most {w.max_ctx}-token contexts")
                    continue
                for store in stores:
                    cell = [m for m in modes if m.name != ORACLE and m not in refused]
                    if store == "cold" and ctx not in oracle_done:
                        cell = [m for m in modes if m.name == ORACLE and m not in refused] + cell
                    with _profiled(args, w, ctx, store, pids):
                        results = await measure_interleaved(client, w, cell, ctx, store, args, refused)
                    for mode, samples in results.items():
                        ran_on = provenance_of(w, mode, samples, artifacts)
                        if mode.name == ORACLE:
                            oracle_done.add(ctx)
                            oracle = report.row(w.name, w.dtype, "n/a", None, None, 0, ctx, mode, "cold", samples)
                            emit({**oracle, **ran_on})
                            emit({**report.cached_reference(oracle, samples), **ran_on})
                        else:
                            row = report.row(w.name, w.dtype, shaping, bw, link_mbit, burst, ctx, mode, store, samples)
                            emit({**row, **ran_on})


def provenance_of(w: Workload, mode: Mode, samples: list[report.Sample], artifacts: dict[str, dict]) -> dict:
    """What a row ran on: the weights, and for scd the artifact the stream used and its corpus."""
    out: dict = {"weights": w.weights}
    if mode.name == "scd":
        used = dict(samples[0].answer.stats.transfer.options).get("artifact", "")
        out.update(artifacts.get(used, {"artifact": used or None, "calibration_corpus": None}))
    return out


def run_grid(args, link, emit) -> None:
    """Every scale in turn: start its services behind `link`, measure, stop them."""
    for scale in args.model_scale:
        w = workload_for(scale, args)
        if w is None:
            continue
        grid = grid_for(scale, args)
        note(f"[{w.name}] bandwidths {grid[0]}, contexts {grid[1]}")
        common = ["--dtype", w.dtype, "--device", args.device, "--log-level", "WARNING",
                  "--max-context-tokens", str(max(8192, max(grid[1]))), "--artifacts", args.artifacts]
        started = time.monotonic()
        with services.running(["--model", w.producer_model, *common], ["--model", w.consumer_model, *common, *services.NO_PREFIX_CACHE],
                              log_dir=services.ROOT / "bench/runs/ttft", producer_host=link.producer_host,
                              consumer_host=link.consumer_host, producer_prefix=link.producer_prefix,
                              consumer_prefix=link.consumer_prefix, timeout_s=args.timeout_s,
                              producer_target=link.producer_target) as (producer, consumer):
            note(f"[{w.name}] services up in {time.monotonic() - started:.1f}s ({w.dtype}, {args.device})")
            try:
                pids = {"producer": producer.process.pid, "consumer": consumer.process.pid}
                asyncio.run(bench_scale(w, consumer.address, link, args, grid, emit, pids))
            finally:
                link.close()
