"""Bytes on the wire of keep transfers through the real services: one producer and one consumer
in-process (loopback, port 0), one context, each codec whole and at each keep selection; per row
the bytes the consumer received, their share of the whole transfer's, the kept share of the
context, and whether the greedy answer is the whole transfer's. Prints JSON lines.

    python -m bench.keep.wire_bytes --model tiny-llama --tokens 512
    python -m bench.keep.wire_bytes --model smollm2-135m --artifacts artifacts/smollm2-135m-homogeneous.safetensors \\
        --codecs raw,quant,scd --tokens 2048
"""

from __future__ import annotations

import argparse
import asyncio
import json

import torch

from consumer.api.client import ConsumerClient
from consumer.server import ConsumerServer
from producer.server import ProducerServer
from shared.config import ConsumerConfig, ProducerConfig
from shared.pb import common_pb2, consumer_pb2

KEEPS = ("snapkv:0.1", "snapkv:0.25", "h2o:0.5", "streaming:0.25")


def _prompt(ids: list[int]) -> consumer_pb2.Prompt:
    return consumer_pb2.Prompt(token_ids=consumer_pb2.TokenIds(ids=ids))


async def measure(args) -> list[dict]:
    common = dict(port=0, model=args.model, device="cpu", artifacts=args.artifacts, drain_grace_s=0.5)
    producer = ProducerServer(ProducerConfig(**common, store_bytes=0))
    await producer.start()
    await producer.load()
    consumer = ConsumerServer(ConsumerConfig(**common, producer=producer.address, prefix_cache_bytes=0))
    await consumer.start()
    await consumer.load()
    vocab = consumer.servicer.loaded.info.vocab_size
    ids = torch.randint(3, min(vocab, 30000), (args.tokens,), generator=torch.Generator().manual_seed(args.seed)).tolist()
    client = ConsumerClient(consumer.address)
    rows = []
    try:
        for codec in args.codecs.split(","):
            whole = None
            for keep in ("", *args.keeps.split(",")):
                options = {"keep": keep} if keep else {}
                answer = await client.generate(
                    timeout=600,
                    context=_prompt(ids),
                    question=_prompt(ids[-8:]),
                    max_new_tokens=args.new_tokens,
                    transfer=common_pb2.CodecSpec(name=codec, options=options),
                )
                whole = whole or answer
                row = {
                    "model": args.model,
                    "codec": codec,
                    "keep": answer.stats.transfer.options.get("keep", ""),
                    "context_tokens": answer.stats.context_tokens,
                    "bytes": answer.stats.bytes_received,
                    "share_of_whole": round(answer.stats.bytes_received / whole.stats.bytes_received, 4),
                    "same_answer_as_whole": answer.ids == whole.ids,
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        await client.channel.close()
        await consumer.stop(0)
        await producer.stop(0)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--artifacts", default="", help="SCD artifacts (needed for codec scd)")
    p.add_argument("--codecs", default="raw,quant")
    p.add_argument("--keeps", default=",".join(KEEPS))
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    return asyncio.run(measure(p.parse_args(argv)))


if __name__ == "__main__":
    main()
