"""`make demo`: start producer and consumer on loopback, ask one question per transfer mode the
consumer supports, print each answer and one JSON line per mode, then stop both services.

JSON keys: mode, tokens (generated), ttft_ms, bytes (payload bytes received), raw_kv_bytes
(the producer's full KV in its dtype), match_oracle (same tokens as the consumer's own prefill).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from bench import services
from consumer.client import ConsumerClient, prompt

PAIR = Path(services.ROOT / "checkpoints")
FALLBACK_CONTEXT = ("The producer reads a long context and the consumer writes the answer. "
                    "Most layers are rebuilt from low rank subspaces and a few layers are patched. ") * 8
FALLBACK_QUESTION = " Which layers are patched?"


def default_example() -> tuple[str, str, str, str, str]:
    """(producer model, consumer model, context, question, gold) - the trained pair when shipped."""
    if (PAIR / "qa-base" / "config.json").exists() and (PAIR / "qa-tuned" / "config.json").exists():
        from qa.task import make_example

        ex = make_example(seed=0, split="test", ctx_tokens=512, task="tuned")
        return str(PAIR / "qa-base"), str(PAIR / "qa-tuned"), ex.context, ex.question, ex.answer
    return "tiny-llama", "tiny-llama", FALLBACK_CONTEXT, FALLBACK_QUESTION, ""


async def ask_all(address: str, context: str, question: str, max_new_tokens: int) -> list[dict]:
    rows = []
    async with ConsumerClient(address) as client:
        modes = [c.name for c in (await client.describe()).codecs]
        modes = ["oracle"] + [m for m in modes if m != "oracle"]
        oracle_ids = None
        for mode in modes:
            answer = await client.generate(mode=mode, context=prompt(context), question=prompt(question),
                                           max_new_tokens=max_new_tokens)
            oracle_ids = answer.ids if mode == "oracle" else oracle_ids
            print(f"[{mode:>8}] {answer.text.strip()!r}", file=sys.stderr)
            rows.append({"mode": mode, "tokens": answer.stats.generated_tokens, "ttft_ms": round(answer.stats.ttft_ms, 2),
                         "bytes": answer.stats.bytes_received, "raw_kv_bytes": answer.stats.raw_kv_bytes,
                         "match_oracle": answer.ids == oracle_ids})
    return rows


def main() -> None:
    p_model, c_model, context, question, gold = default_example()
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--producer-model", default=p_model)
    parser.add_argument("--consumer-model", default=c_model)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--consumer", help="use a running consumer at HOST:PORT instead of starting services")
    args = parser.parse_args()
    print(f"# context: {len(context.split())} words; question: {question.strip()!r}; gold: {gold!r}", file=sys.stderr)
    if args.consumer:
        rows = asyncio.run(ask_all(args.consumer, context, question, args.max_new_tokens))
    else:
        common = ["--dtype", args.dtype, "--log-level", "WARNING"]
        with services.running(["--model", args.producer_model, *common], ["--model", args.consumer_model, *common],
                              log_dir=services.ROOT / "bench/runs/demo") as (_, consumer):
            rows = asyncio.run(ask_all(consumer.address, context, question, args.max_new_tokens))
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
