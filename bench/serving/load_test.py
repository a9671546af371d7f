"""`python -m bench.serving.load_test` (`make load-test`): the pair as real processes under abuse, first at
the services' shipped limits, then (labelled) with the limits raised.

1. Reference answers: every (mode, context) request run alone, greedy.
2. Rounds of concurrent Generate streams over every transfer mode (oracle, raw, quant int8/int4,
   recompute, scd with a homogeneous artifact calibrated here), about a third cancelled by the
   client at a random moment, some with tiny deadlines. A wrong answer is an OK status whose
   tokens differ from the same request run alone. A refused call is one turned away at a limit:
   RESOURCE_EXHAUSTED (the consumer's --max-inflight) or UNAVAILABLE "producer overloaded" (the
   producer's, passed on by the consumer after gRPC's retries); they are counted by status. An
   unexpected error is any other status than those and the client's own cancel or tiny deadline.
   Beside them, HTTP streams (`--http-streams`, default a quarter of --streams) through the
   consumer's OpenAI-compatible port (--http-port): /v1/completions, streamed (SSE), the same modes
   and contexts as one prompt, about a third closed by the client mid-stream. A wrong answer is a
   finished stream whose token ids (return_token_ids) differ from the same request run alone over
   HTTP; 429 (max_inflight) and 503 "overloaded" are refusals; any other status, or an error
   event in the stream, is an unexpected error (counted with the gRPC ones, and apart:
   http_unexpected_errors).
3. After each round, settle and read both processes' RSS from /proc (`rss_kib_per_round`); over
   the second half of the rounds, its slope and the rise of its peak per round (bench.harness.rss_trend:
   the verdict `rss_levels_off`). At the end, both services' Describe counters: slots in flight
   must be 0 and started == completed + cancelled + failed on both. `--heap-trace DIR` also
   asks the consumer (SCD_HEAP_TRACE, shared.heap_trace) for a heap dump after each round and
   adds what grew from round 2 to the last (`heap_growth_round2_to_last`).
4. Head-of-line check (at the shipped limits): the TTFT of a request that needs the producer's
   compute thread (raw, a context the producer has never seen) while another caller reads its own
   large Prefill stream at ~1 KB/s, interleaved with the same kind of cold request alone; prints
   the ratio (target < 1.2).

`--limits defaults` runs the services with no --max-inflight flag (shared/config.py: producer 32,
consumer 64), `raised` with --max-inflight RAISED on both; `both` (the default) runs the two in
turn. One JSON line per run and one for the head-of-line check, each with `limits`,
`producer_max_inflight`, `consumer_max_inflight` and `weights`; the run lines are
{"streams", "http_streams", "rounds", "requests", "ok", "cancelled", "refused", "refused_by_status",
 "unexpected_errors", "wrong_answers", "rss_growth_pct" (both processes, round 2 to the last),
 "rss_kib_per_round", "rss_trend", "rss_levels_off", "slots_leaked", "accounting_balanced",
 "admitted_p50_ms", "admitted_p95_ms" (end-to-end latency of the calls answered OK),
 "consumer_cpu_ms_per_request", ...}. The process exits 1 on a wrong answer, an unexpected error,
a slot in flight or unbalanced counters after settling, or an RSS that does not level off.
`--quick` is a smoke run (8 streams and 2 HTTP streams, 2 rounds: no RSS verdict, 2 head-of-line
repetitions).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import grpc

from bench.harness import provenance, rss_trend, services
from bench.micro.transport import process_cpu_s
from shared import heap_trace
from shared.config import ConsumerConfig, ProducerConfig
from shared.pb import common_pb2, consumer_pb2, consumer_pb2_grpc, producer_pb2, producer_pb2_grpc

MODES = [("oracle", {}), ("raw", {}), ("quant", {"bits": "8"}), ("quant", {"bits": "4"}), ("recompute", {}), ("scd", {}),
         ("scd+verify", {}), ("quant+verify", {"bits": "4"})]  # "+verify": verified decoding (its answer is the oracle's)
VERIFIED = "+verify"


def codec_of(mode: str) -> tuple[str, bool]:
    """('scd', True) for 'scd+verify': the codec asked and whether the answer is verified."""
    return mode.removesuffix(VERIFIED), mode.endswith(VERIFIED)
CONTEXTS = [
    "The producer reads a long context and the consumer writes the answer. " * 6,
    "Semantic cache distillation sends compact codes instead of the raw key value cache. " * 9,
    "Most layers are rebuilt from low rank subspaces and a few layers are patched. " * 12,
]
QUESTION = " Which layers are patched?"
EXPECTED_WHEN_CANCELLED = {grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED}
DEFAULT_LIMITS = {"producer": ProducerConfig.max_inflight, "consumer": ConsumerConfig.max_inflight}


def refusal(err: grpc.aio.AioRpcError) -> str | None:
    """The status under which a call was turned away at a limit, or None for any other error."""
    if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return "RESOURCE_EXHAUSTED"
    if err.code() == grpc.StatusCode.UNAVAILABLE and "overloaded" in (err.details() or ""):
        return "UNAVAILABLE (producer overloaded)"
    return None


def build_artifact(directory: Path) -> None:
    """A homogeneous SCD artifact for tiny-llama (a few seconds)."""
    from calibration.distill import distill
    from shared.models import load_model

    model = load_model("tiny-llama", "float32", "cpu")
    corpus = [[(7 * i + 13 * j) % 370 + 5 for j in range(96)] for i in range(12)]
    from calibration.search import HeldOut

    held = [HeldOut(s[:80], s[80:92], 6) for s in corpus[:3]]
    distill(model, model, corpus, held, corpus_name="load-test", generations=1, log=lambda m: None).save(directory / "tiny.safetensors")


def request(mode: str, options: dict, context: str, max_new: int) -> consumer_pb2.GenerateRequest:
    codec, verified = codec_of(mode)
    verify = consumer_pb2.VERIFY_POLICY_VERIFIED if verified else consumer_pb2.VERIFY_POLICY_UNSPECIFIED
    return consumer_pb2.GenerateRequest(context=consumer_pb2.Prompt(text=context), question=consumer_pb2.Prompt(text=QUESTION),
                                        max_new_tokens=max_new, transfer=common_pb2.CodecSpec(name=codec, options=options),
                                        verify=verify)


async def answer(stub, req, timeout: float) -> tuple[list[int], float]:
    ids, first = [], None
    started = time.perf_counter()
    async for msg in stub.Generate(req, timeout=timeout):
        if msg.WhichOneof("kind") == "token":
            first = first or time.perf_counter()
            ids += msg.token.ids
    return ids, ((first or time.perf_counter()) - started) * 1e3


async def one(stub, rng: random.Random, refs: dict, args, tally: dict) -> None:
    key = rng.randrange(len(MODES)), rng.randrange(len(CONTEXTS))
    mode, options = MODES[key[0]]
    req = request(mode, options, CONTEXTS[key[1]], args.max_new_tokens)
    roll = rng.random()
    cancel_at = rng.uniform(0.0, 1.5) if roll < 1 / 3 else None
    timeout = rng.uniform(0.01, 0.2) if 1 / 3 <= roll < 0.45 else 60.0
    started = time.perf_counter()
    call = stub.Generate(req, timeout=timeout)
    ids = []
    try:
        async with asyncio.timeout(cancel_at):
            async for msg in call:
                if msg.WhichOneof("kind") == "token":
                    ids += msg.token.ids
        tally["ok"] += 1
        tally["latency_ms"].append((time.perf_counter() - started) * 1e3)
        if ids != refs[key]:
            tally["wrong_answers"] += 1
            print(f"# WRONG ANSWER {mode} {options} ctx {key[1]}: {ids} != {refs[key]}", file=sys.stderr)
    except TimeoutError:
        call.cancel()
        tally["cancelled"] += 1
    except grpc.aio.AioRpcError as err:
        if err.code() in EXPECTED_WHEN_CANCELLED and (cancel_at is not None or timeout < 1):
            tally["cancelled"] += 1
        elif refused := refusal(err):
            tally["refused"][refused] = tally["refused"].get(refused, 0) + 1
        else:
            tally["unexpected_errors"] += 1
            print(f"# unexpected {err.code().name}: {err.details()[:200]}", file=sys.stderr)


def http_body(mode: str, options: dict, context: str, max_new: int) -> dict:
    """The OpenAI-compatible request for (mode, context): the context and question as one prompt."""
    codec, verified = codec_of(mode)
    scd = {"mode": codec, "options": options, **({"verify": "verified"} if verified else {})}
    return {"prompt": context + QUESTION, "max_tokens": max_new, "temperature": 0, "scd": scd,
            "return_token_ids": True, "stream": True}


async def http_answer(session: aiohttp.ClientSession, url: str, body: dict, cancel_at: float | None = None) -> tuple[int, list[int], str]:
    """(HTTP status, token ids, error) of one streamed /v1/completions; raises TimeoutError at cancel_at
    (the client closes the connection mid-stream)."""
    ids: list[int] = []
    async with asyncio.timeout(cancel_at):
        async with session.post(url, json=body) as r:
            if r.status != 200:
                return r.status, ids, (await r.text())[:200]
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    return 500, ids, json.dumps(event["error"])[:200]
                for choice in event.get("choices", []):
                    ids += choice.get("token_ids") or []
    return 200, ids, ""


async def one_http(session, url: str, rng: random.Random, refs: dict, args, tally: dict) -> None:
    key = rng.randrange(len(MODES)), rng.randrange(len(CONTEXTS))
    mode, options = MODES[key[0]]
    cancel_at = rng.uniform(0.0, 1.5) if rng.random() < 1 / 3 else None
    started = time.perf_counter()
    try:
        status, ids, error = await http_answer(session, url, http_body(mode, options, CONTEXTS[key[1]], args.max_new_tokens), cancel_at)
    except TimeoutError:
        tally["cancelled"] += 1
        return
    except aiohttp.ClientError as err:
        tally["unexpected_errors"] += 1
        tally["http_unexpected_errors"] += 1
        print(f"# unexpected HTTP client error: {err!r:.200}", file=sys.stderr)
        return
    if status == 200:
        tally["ok"] += 1
        tally["latency_ms"].append((time.perf_counter() - started) * 1e3)
        if ids != refs[key]:
            tally["wrong_answers"] += 1
            print(f"# WRONG HTTP ANSWER {mode} {options} ctx {key[1]}: {ids} != {refs[key]}", file=sys.stderr)
    elif status == 429 or (status == 503 and "overloaded" in error):
        name = f"HTTP {status}"
        tally["refused"][name] = tally["refused"].get(name, 0) + 1
    else:
        tally["unexpected_errors"] += 1
        tally["http_unexpected_errors"] += 1
        print(f"# unexpected HTTP {status}: {error}", file=sys.stderr)


async def settle(consumer_stub, producer_stub, timeout_s: float = 30.0):
    until = time.monotonic() + timeout_s
    while True:
        c = (await consumer_stub.Describe(consumer_pb2.ConsumerServiceDescribeRequest(), timeout=10)).stats
        p = (await producer_stub.Describe(producer_pb2.ProducerServiceDescribeRequest(), timeout=10)).stats
        balanced = (c.generates_started == c.generates_completed + c.generates_cancelled + c.generates_failed
                    and p.prefills_started == p.prefills_completed + p.prefills_cancelled + p.prefills_failed)
        if (balanced and c.inflight == 0 and p.inflight == 0) or time.monotonic() > until:
            return c, p, balanced


async def slow_reader(address: str, ids: list[int], stop: asyncio.Event) -> None:
    """Reads a large raw Prefill stream at ~1 KB/s (1 KiB chunks, one per second)."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = producer_pb2_grpc.ProducerServiceStub(channel).Prefill(
            producer_pb2.PrefillRequest(token_ids=ids, codec=common_pb2.CodecSpec(name="raw")), timeout=600)
        while not stop.is_set() and await call.read() != grpc.aio.EOF:
            await asyncio.sleep(1.0)
        call.cancel()


def percentile(values: list[float], q: float) -> float | None:
    ordered = sorted(values)
    return round(ordered[int(q * (len(ordered) - 1))], 1) if ordered else None


async def storm(stub, pstub, producer, consumer, args, refs: dict, http_url: str = "", http_refs: dict | None = None) -> dict:
    """The rounds of concurrent streams (gRPC, and HTTP beside them), then the counters and RSS: one run's row."""
    rng = random.Random(args.seed)
    tally: dict = {"ok": 0, "cancelled": 0, "refused": {}, "unexpected_errors": 0, "wrong_answers": 0, "latency_ms": [],
                   "http_unexpected_errors": 0}
    procs = {"consumer": consumer.process.pid, "producer": producer.process.pid}
    rss: dict[str, list[int]] = {name: [] for name in procs}
    http_streams = args.http_streams if http_url else 0
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) if http_streams else None
    cpu_start = process_cpu_s(consumer.process.pid)
    for r in range(args.rounds):
        calls = [one(stub, rng, refs, args, tally) for _ in range(args.streams)]
        calls += [one_http(session, http_url, rng, http_refs or {}, args, tally) for _ in range(http_streams)]
        rng.shuffle(calls)
        await asyncio.gather(*calls)
        await settle(stub, pstub)
        for name, pid in procs.items():
            rss[name].append(rss_trend.rss_kib(pid))
        if args.heap_trace:  # after the RSS reading: the dump itself allocates
            await rss_trend.heap_dump(args.heap_trace, consumer.process.pid, r)
        print(f"# round {r + 1}/{args.rounds}: {tally['ok']} ok, {tally['cancelled']} cancelled, "
              f"{sum(tally['refused'].values())} refused, {tally['unexpected_errors']} unexpected; RSS MiB "
              + ", ".join(f"{n} {v[-1] / 1024:.1f}" for n, v in rss.items()), file=sys.stderr)
    if session is not None:
        await session.close()
    c, p, balanced = await settle(stub, pstub)
    cpu_ms = 1e3 * (process_cpu_s(consumer.process.pid) - cpu_start) / max(1, tally["ok"] + tally["cancelled"])
    heap = {}
    if args.heap_trace and args.rounds > 2:  # what grew from round 2 to the last
        pid = consumer.process.pid
        heap = {"heap_growth_round2_to_last": rss_trend.diff_dumps(args.heap_trace / f"consumer-{pid}-001.json",
                                                                   args.heap_trace / f"consumer-{pid}-{args.rounds - 1:03d}.json")}
    total = [sum(v) for v in zip(*rss.values(), strict=True)]
    trends = {name: rss_trend.trend(series) for name, series in rss.items()}
    lat = tally["latency_ms"]
    return {
        "streams": args.streams, "http_streams": http_streams, "rounds": args.rounds,
        "requests": (args.streams + http_streams) * args.rounds, "http_unexpected_errors": tally["http_unexpected_errors"],
        "ok": tally["ok"], "cancelled": tally["cancelled"], "refused": sum(tally["refused"].values()),
        "refused_by_status": dict(sorted(tally["refused"].items())),
        "unexpected_errors": tally["unexpected_errors"], "wrong_answers": tally["wrong_answers"],
        "rss_growth_pct": round(100 * (total[-1] - total[1]) / total[1], 2) if len(total) > 1 else None,
        "rss_kib_per_round": rss, "rss_trend": trends,
        "rss_levels_off": None if None in (t["levels_off"] for t in trends.values()) else all(t["levels_off"] for t in trends.values()),
        "max_rise_pct_per_round": rss_trend.MAX_RISE_PCT_PER_ROUND,
        "slots_leaked": c.inflight + p.inflight, "accounting_balanced": balanced,
        "admitted_p50_ms": percentile(lat, 0.5), "admitted_p95_ms": percentile(lat, 0.95),
        "consumer_cpu_ms_per_request": round(cpu_ms, 1),
        "consumer": {"started": c.generates_started, "completed": c.generates_completed,
                     "cancelled": c.generates_cancelled, "failed": c.generates_failed},
        "producer": {"started": p.prefills_started, "completed": p.prefills_completed,
                     "cancelled": p.prefills_cancelled, "failed": p.prefills_failed},
        "load_avg_1m": round(os.getloadavg()[0], 2), "cores": os.cpu_count(), **heap,
    }


def cold_context(i: int, which: str) -> str:
    """A context of CONTEXTS[2]'s length that no earlier request used: a producer store miss."""
    return f"{CONTEXTS[2]} Probe {which} {i}."


async def head_of_line(stub, pstub, producer_address: str, args) -> dict:
    """A cold raw request beside a ~1 KB/s reader of a large stream, then a cold request alone,
    interleaved so drift hits both; each repetition opens a new slow stream of a new context
    (its forward runs while the reader stalls) and asks for new contexts."""
    await answer(stub, request("raw", {}, cold_context(-1, "warm-up"), 2), 60)
    alone, beside = [], []
    for i in range(args.hol_runs):
        stop = asyncio.Event()
        ids = [5 + (j * (i + 3)) % 370 for j in range(6000)]
        reader = asyncio.ensure_future(slow_reader(producer_address, ids, stop))
        await asyncio.sleep(1.5)  # its forward is done, its stream stalled on the reader
        beside.append((await answer(stub, request("raw", {}, cold_context(i, "beside"), 2), 60))[1])
        stop.set()
        await reader
        await settle(stub, pstub)  # the slow stream's cancel has reached both services: nothing in flight
        alone.append((await answer(stub, request("raw", {}, cold_context(i, "alone"), 2), 60))[1])
    return {"hol_ttft_alone_ms": round(statistics.median(alone), 1),
            "hol_ttft_beside_slow_reader_ms": round(statistics.median(beside), 1),
            "hol_ttft_ratio": round(statistics.median(beside) / statistics.median(alone), 3), "hol_runs": args.hol_runs,
            "hol_request": "cold", "load_avg_1m": round(os.getloadavg()[0], 2), "cores": os.cpu_count()}


async def run_at(limits: str, args, artifacts: str, log_dir: Path) -> list[dict]:
    """One run of the storm (and, at the shipped defaults, the head-of-line check) at `limits`."""
    inflight = DEFAULT_LIMITS if limits == "defaults" else {"producer": args.raised, "consumer": args.raised}
    flags = [] if limits == "defaults" else ["--max-inflight", str(args.raised)]
    common = ["--model", "tiny-llama", "--device", "cpu", "--artifacts", artifacts]
    split = ["--engine-process"] if args.engine_process else []
    http_port = services.free_port() if args.http_streams else -1
    split += ["--http-port", str(http_port)] if http_port > 0 else []
    trace = ["env", f"{heap_trace.ENV}={args.heap_trace}"] if args.heap_trace else []
    labels = {"limits": limits, "producer_max_inflight": inflight["producer"], "consumer_max_inflight": inflight["consumer"],
              "engine_process": args.engine_process, "weights": provenance.weights_of("tiny-llama"),
              "code": services.code_version()}
    lines = []
    with services.running([*common, *flags, "--max-chunk-bytes", "1024"], [*common, *flags, *split], log_dir / limits,
                          consumer_prefix=trace) as (producer, consumer):
        async with grpc.aio.insecure_channel(consumer.address) as cch, grpc.aio.insecure_channel(producer.address) as pch:
            stub = consumer_pb2_grpc.ConsumerServiceStub(cch)
            pstub = producer_pb2_grpc.ProducerServiceStub(pch)
            refs = {}
            for m, (mode, options) in enumerate(MODES):
                for c, context in enumerate(CONTEXTS):
                    refs[(m, c)], _ = await answer(stub, request(mode, options, context, args.max_new_tokens), 120)
            oracle = next(m for m, (mode, _) in enumerate(MODES) if mode == "oracle")
            for m, (mode, _) in enumerate(MODES):  # verified answers are the oracle's (greedy), alone
                for c in range(len(CONTEXTS)):
                    if codec_of(mode)[1] and refs[(m, c)] != refs[(oracle, c)]:
                        raise RuntimeError(f"verified {mode} answers {refs[(m, c)]} where the oracle answers {refs[(oracle, c)]}")
            http_url, http_refs = "", {}
            if http_port > 0:  # the HTTP references: each request alone, over HTTP (its own prompt split)
                host = consumer.address.rsplit(":", 1)[0]
                http_url = f"http://{host}:{http_port}/v1/completions"
                async with aiohttp.ClientSession() as session:
                    for m, (mode, options) in enumerate(MODES):
                        for c, context in enumerate(CONTEXTS):
                            status, ids, error = await http_answer(session, http_url, http_body(mode, options, context, args.max_new_tokens))
                            if status != 200:
                                raise RuntimeError(f"HTTP reference {mode} {options}: {status} {error}")
                            http_refs[(m, c)] = ids
            lines.append({**await storm(stub, pstub, producer, consumer, args, refs, http_url, http_refs), **labels})
            print(json.dumps(lines[-1]), flush=True)
            if limits == "defaults" and args.hol_runs:
                lines.append({**await head_of_line(stub, pstub, producer.address, args), **labels})
                print(json.dumps(lines[-1]), flush=True)
    return lines


async def main_async(args) -> list[dict]:
    lines = []
    run = ("defaults", "raised") if args.limits == "both" else (args.limits,)
    with tempfile.TemporaryDirectory() as tmp:
        build_artifact(Path(tmp))
        for limits in run:
            lines += await run_at(limits, args, tmp, Path(tmp) / "logs")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # this run's rows replace those of the settings it ran (limits, engine process); the others' are kept
    kept = [json.loads(x) for x in args.out.read_text().splitlines() if x.strip()] if args.out.exists() else []
    rows = [r for r in kept if r.get("limits") not in run or r.get("engine_process", False) != args.engine_process] + lines
    args.out.write_text("".join(json.dumps(line) + "\n" for line in rows))
    return lines


def failures(rows: list[dict]) -> list[str]:
    """What makes `make load-test` fail, one line each: a wrong answer, an unexpected error, a slot
    in flight or counters out of balance after settling, or a process whose RSS does not level off
    (bench.harness.rss_trend)."""
    out = []
    for r in (r for r in rows if "rounds" in r):
        at = f"limits {r['limits']}"
        if r["wrong_answers"] or r["unexpected_errors"]:
            out.append(f"{at}: {r['wrong_answers']} wrong answers, {r['unexpected_errors']} unexpected errors")
        if r["slots_leaked"] or not r["accounting_balanced"]:
            out.append(f"{at}: {r['slots_leaked']} slots in flight after settling, counters balanced {r['accounting_balanced']}")
        for name, t in r["rss_trend"].items():
            if t["levels_off"] is False:
                out.append(f"{at}: {name} RSS does not level off: its peak rose {t['peak_rise_pct_per_round']}% a round over "
                           f"the second half (limit {r['max_rise_pct_per_round']}%; slope {t['slope_pct_per_round']}% a round)")
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m bench.serving.load_test", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--rounds", type=int, default=20,
                   help="rounds per run; the RSS verdict needs >= 10 (bench.harness.rss_trend: the second half's peaks)")
    p.add_argument("--http-streams", type=int, default=-1,
                   help="concurrent HTTP streams (/v1/completions) per round beside the gRPC ones; -1: a quarter of --streams, 0: none")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--hol-runs", type=int, default=7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limits", choices=["defaults", "raised", "both"], default="both",
                   help=f"defaults: the shipped --max-inflight ({DEFAULT_LIMITS}); raised: --raised on both")
    p.add_argument("--raised", type=int, default=128, help="--max-inflight of both services in the raised run")
    p.add_argument("--engine-process", action="store_true",
                   help="the consumer with --engine-process (its engine in a child process); rows say engine_process")
    p.add_argument("--quick", action="store_true", help="smoke run: 8 streams, 2 rounds, 2 head-of-line repetitions")
    p.add_argument("--heap-trace", type=Path, default=None, metavar="DIR",
                   help="run the consumer with tracemalloc (shared.heap_trace, slow) and write a heap dump into DIR after "
                        "every round; the row gets heap_growth_round2_to_last (RSS readings include tracemalloc's own memory; "
                        "SCD_HEAP_TRACE_FRAMES=0 in the environment: no tracemalloc, the rest of each dump kept)")
    p.add_argument("--out", type=Path, default=services.ROOT / "bench/results/load.jsonl")
    args = p.parse_args(argv)
    if args.quick:
        args.streams, args.rounds, args.hol_runs, args.max_new_tokens = 8, 2, 2, 4
    if args.heap_trace:
        args.heap_trace = args.heap_trace.resolve()
        args.heap_trace.mkdir(parents=True, exist_ok=True)
    if args.http_streams < 0:
        args.http_streams = max(1, args.streams // 4)
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    bad = failures(main())
    for line in bad:
        print(f"# FAIL {line}", file=sys.stderr)
    sys.exit(1 if bad else 0)
