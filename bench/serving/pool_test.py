"""`make pool-test`: a producer pool behind gRPC's own load balancing, on loopback.

Three producers (in-process servers on free ports) and one consumer whose `--producer` is the
target `ipv4:127.0.0.1:a,127.0.0.1:b,127.0.0.1:c`. A workload of repeated contexts runs twice:
with `ring_hash` keyed by the context hash (each context lands on one producer, so repeats are
that producer's store hits) and with `round_robin` (stores cleared first). Then a failover run:
requests keep coming with on_transfer_failure=LOCAL_PREFILL while one producer is stopped
mid-run; ring_hash moves its contexts to the next producer and calls that were in flight on it
become the consumer's own prefill. Prints one JSON line (and writes it with --out):
{"producers", "requests", "affinity_hit_rate", "round_robin_hit_rate", "failover_errors",
"failover_requests", ...}; affinity_hit_rate = store hits / requests whose context an earlier pass sent.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

import grpc

from bench.harness.provenance import weights_of
from consumer.api.client import ConsumerClient, prompt
from consumer.server import ConsumerServer
from producer.server import ProducerServer
from shared import logs
from shared.config import ConsumerConfig, ProducerConfig
from shared.pb import common_pb2, consumer_pb2

LOCAL_PREFILL = consumer_pb2.TRANSFER_FAILURE_POLICY_LOCAL_PREFILL


def workload(contexts: int, repeats: int, words: int, seed: int) -> list[list[str]]:
    """`repeats` passes over `contexts` distinct texts, each pass shuffled."""
    rng = random.Random(seed)
    texts = [" ".join(f"w{rng.randrange(10_000)}" for _ in range(words)) for _ in range(contexts)]
    return [rng.sample(texts, len(texts)) for _ in range(repeats)]


async def run_phase(client: ConsumerClient, passes: list[list[str]], concurrency: int, policy: int = 0) -> dict:
    """Send the passes one after another (within a pass at most `concurrency` calls at once);
    a repeated request is one whose context an earlier pass sent, so its store entry exists."""
    seen: set[str] = set()
    repeated = hits = errors = fallbacks = 0
    gate = asyncio.Semaphore(concurrency)

    async def one(text: str, repeat: bool) -> None:
        nonlocal repeated, hits, errors, fallbacks
        async with gate:
            try:
                answer = await client.generate(
                    timeout=60,
                    transfer=common_pb2.CodecSpec(name="raw"),
                    context=prompt(text),
                    question=prompt("w1 ?"),
                    max_new_tokens=1,
                    on_transfer_failure=policy,
                )
            except grpc.aio.AioRpcError:
                errors += 1
                return
        fallbacks += bool(answer.stats.transfer_failure)
        if repeat:
            repeated += 1
            hits += answer.stats.producer_store_hit

    for items in passes:
        await asyncio.gather(*(one(text, text in seen) for text in items))
        seen.update(items)
    requests = sum(map(len, passes))
    return {"requests": requests, "repeated": repeated, "hits": hits, "errors": errors, "fallbacks": fallbacks}


def clear_stores(producers: list[ProducerServer]) -> None:
    for p in producers:
        p.servicer.store.clear()


async def pool_test(args) -> dict:
    producers = []
    for _ in range(args.producers):
        p = ProducerServer(ProducerConfig(port=0, model=args.model, device="cpu", drain_grace_s=0.5))
        await p.start()
        await p.load()
        producers.append(p)
    target = "ipv4:" + ",".join(f"127.0.0.1:{p.server.port}" for p in producers)
    consumers = {}
    for lb in ("ring_hash", "round_robin"):
        c = ConsumerServer(
            # prefix cache off: a repeated context must reach a producer (affinity is what this measures)
            ConsumerConfig(
                port=0, model=args.model, device="cpu", producer=target, producer_lb=lb, drain_grace_s=0.5, prefix_cache_bytes=0
            )
        )
        await c.start()
        await c.load()
        consumers[lb] = c
    items = workload(args.contexts, args.repeats, args.words, args.seed)
    started = time.perf_counter()
    try:
        async with ConsumerClient(consumers["ring_hash"].address) as client:
            ring = await run_phase(client, items, args.concurrency)
        per_producer = [p.servicer.store.hits + p.servicer.store.misses for p in producers]
        clear_stores(producers)
        async with ConsumerClient(consumers["round_robin"].address) as client:
            rr = await run_phase(client, items, args.concurrency)
        clear_stores(producers)
        # failover: ring_hash, LOCAL_PREFILL allowed, producer 0 stopped after a third of the calls
        fail_items = workload(args.contexts, args.repeats, args.words, args.seed + 1)
        async with ConsumerClient(consumers["ring_hash"].address) as client:
            phase = asyncio.create_task(run_phase(client, fail_items, args.concurrency, LOCAL_PREFILL))
            while sum(p.servicer.store.hits + p.servicer.store.misses for p in producers) < args.contexts * args.repeats // 3:
                await asyncio.sleep(0.01)
            await producers[0].stop(0)
            failover = await phase
    finally:
        for c in consumers.values():
            await c.stop(0)
        for p in producers[1:]:
            await p.stop(0)
    return {
        "producers": args.producers,
        "requests": ring["requests"],
        "affinity_hit_rate": round(ring["hits"] / max(1, ring["repeated"]), 4),
        "round_robin_hit_rate": round(rr["hits"] / max(1, rr["repeated"]), 4),
        "failover_errors": failover["errors"],
        "failover_requests": failover["requests"],
        "failover_fallbacks": failover["fallbacks"],
        "ring_hash_errors": ring["errors"],
        "round_robin_errors": rr["errors"],
        "ring_hash_calls_per_producer": per_producer,
        "contexts": args.contexts,
        "repeats": args.repeats,
        "model": args.model,
        "seconds": round(time.perf_counter() - started, 1),
        "weights": weights_of(args.model),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.serving.pool_test", description=__doc__.split("\n\n")[0])
    parser.add_argument("--producers", type=int, default=3)
    parser.add_argument("--contexts", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--words", type=int, default=48, help="words per context")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="", help="also write the JSON here")
    args = parser.parse_args(argv)
    logs.configure("pool-test", "WARNING")
    result = asyncio.run(pool_test(args))
    line = json.dumps(result)
    print(line)
    if args.out:
        Path(args.out).write_text(line + "\n")
    return result


if __name__ == "__main__":
    main()
