"""`make demo`: start producer and consumer on loopback, ask one question with no mode (the
default: what auto chose and why), then once per transfer mode the consumer supports, print each
answer and one JSON line per request, then stop both services.

JSON keys: mode ("default" for the request naming none), served (the mode that answered),
dtype (the consumer's compute dtype: the services run the default `--dtype auto`, bfloat16 where
this machine computes it natively, else float32; why is printed first), tokens (generated),
ttft_ms, bytes (payload bytes received), raw_kv_bytes (the producer's full KV in its dtype),
match_oracle (same tokens as the consumer's own prefill).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from bench.harness import services
from consumer.api.client import ConsumerClient, prompt
from shared.labels import options_label

PAIR = Path(services.ROOT / "checkpoints")
FALLBACK_CONTEXT = ("The producer reads a long context and the consumer writes the answer. "
                    "Most layers are rebuilt from low rank subspaces and a few layers are patched. ") * 8
FALLBACK_QUESTION = " Which layers are patched?"


ARTIFACT = services.ROOT / "artifacts/qa-base-to-tuned.safetensors"
REAL_ARTIFACT = services.ROOT / "artifacts/smollm2-pc.safetensors"  # make real-artifacts (not committed)
DEFAULT = "default"  # the row of the request that names no mode


def modes_asked(codecs: list[str], has_artifact: bool) -> list[str]:
    """The rows the demo prints, in order: the default (no mode named), oracle, then each codec the
    consumer serves (scd only with an artifact). docker/compose_smoke.py checks against this list."""
    return [DEFAULT, "oracle"] + [m for m in codecs if m != "oracle" and (m != "scd" or has_artifact)]


def default_example() -> tuple[str, str, str, str, str, str]:
    """(producer model, consumer model, artifacts, context, question, gold): the trained pair and
    its SCD artifact when shipped, else the tiny random model (no scd)."""
    if (PAIR / "qa-base" / "config.json").exists() and (PAIR / "qa-tuned" / "config.json").exists():
        from qa.task import make_example

        ex = make_example(seed=0, split="test", ctx_tokens=512, task="tuned")
        artifacts = str(ARTIFACT) if ARTIFACT.exists() else ""
        return str(PAIR / "qa-base"), str(PAIR / "qa-tuned"), artifacts, ex.context, ex.question, ex.answer
    return "tiny-llama", "tiny-llama", "", FALLBACK_CONTEXT, FALLBACK_QUESTION, ""


def real_example(context_tokens: int = 1024):
    """The real pair (`--pair real`): P smollm2-135m, C smollm2-135m-tuned, its SCD artifact when
    `make real-artifacts` built it, and a real.tasks test example in C's chat format, as token ids
    (context, question, gold, stop ids)."""
    from transformers import AutoTokenizer

    from real import tasks
    from shared.models import resolve_path

    tok = AutoTokenizer.from_pretrained(resolve_path("smollm2-135m-tuned"))
    ex = tasks.make(tok, "qa", "test", 0, context_tokens)
    artifacts = str(REAL_ARTIFACT) if REAL_ARTIFACT.exists() else ""
    context, question = prompt(ids=ex.context_ids), prompt(ids=ex.question_ids)
    return "smollm2-135m", "smollm2-135m-tuned", artifacts, context, question, ex.answer, [tasks.end_id(tok)], ex


async def ask_all(address: str, context, question, max_new_tokens: int, has_artifact: bool,
                  stop_ids: list[int]) -> list[dict]:
    """`context`, `question`: consumer_pb2.Prompt (text or token ids)."""
    rows = []
    async with ConsumerClient(address) as client:
        described = await client.describe()
        print(f"# consumer computes in {described.model.dtype}: {described.model.dtype_reason}", file=sys.stderr)
        answers = {}
        # the default first, as a caller naming no mode gets it (mode auto: what it chose and why)
        for mode in modes_asked([c.name for c in described.codecs], has_artifact):
            answer = await client.generate(mode=None if mode == DEFAULT else mode, context=context,
                                           question=question, max_new_tokens=max_new_tokens, stop_token_ids=stop_ids)
            answers[mode] = answer
            chosen = dict(answer.stats.transfer.options)
            detail = chosen.get("schedule") or options_label(chosen) or "no options"
            if mode == DEFAULT:
                served = answer.stats.transfer.name
                why = answer.stats.auto.reason if answer.stats.HasField("auto") else described.default_mode_reason
                detail = f"{described.default_mode or 'auto'} chose {served} ({detail}): {why}"
            print(f"[{mode:>9}] {answer.text.strip()!r}  ({detail})", file=sys.stderr)
        oracle_ids = answers["oracle"].ids
        for mode, answer in answers.items():
            rows.append({"mode": mode, "served": answer.stats.transfer.name, "dtype": described.model.dtype,
                         "tokens": answer.stats.generated_tokens, "ttft_ms": round(answer.stats.ttft_ms, 2),
                         "bytes": answer.stats.bytes_received, "raw_kv_bytes": answer.stats.raw_kv_bytes,
                         "match_oracle": answer.ids == oracle_ids})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pair", choices=("default", "real"), default="default",
                        help="default: the trained QA pair (tiny random model without it); real: SmolLM2-135M-Instruct "
                             "-> its fine-tune on a real.tasks example (make real-model; scd with make real-artifacts)")
    parser.add_argument("--producer-model")
    parser.add_argument("--consumer-model")
    parser.add_argument("--artifacts", help="SCD artifact file(s) for both services (default: the pair's)")
    parser.add_argument("--dtype", default="auto", help="both services' --dtype (auto: bfloat16 where native, else float32)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--consumer", help="use a running consumer at HOST:PORT instead of starting services")
    args = parser.parse_args()
    if args.pair == "real":
        p_model, c_model, artifacts, context, question, gold, stop_ids, ex = real_example()
        said = f"{len(ex.context_ids)} tokens of prose ({ex.family}); question: {ex.question.strip()!r}"
    else:
        p_model, c_model, artifacts, context_text, question_text, gold = default_example()
        context, question = prompt(context_text), prompt(question_text)
        said = f"{len(context_text.split())} words; question: {question_text.strip()!r}"
        stop_ids = []
        if gold:  # the QA pair: answers end with its '.' token
            from qa.tokenizer import end_token_id, load_tokenizer

            stop_ids = [end_token_id(load_tokenizer(args.consumer_model or c_model))]
    producer_model, consumer_model = args.producer_model or p_model, args.consumer_model or c_model
    artifacts = artifacts if args.artifacts is None else args.artifacts
    print(f"# context: {said}; gold: {gold!r}", file=sys.stderr)
    if args.consumer:
        rows = asyncio.run(ask_all(args.consumer, context, question, args.max_new_tokens, bool(artifacts), stop_ids))
    else:
        common = ["--dtype", args.dtype, "--log-level", "WARNING", "--artifacts", artifacts]
        with services.running(["--model", producer_model, *common], ["--model", consumer_model, *common],
                              log_dir=services.ROOT / "bench/runs/demo") as (_, consumer):
            rows = asyncio.run(ask_all(consumer.address, context, question, args.max_new_tokens, bool(artifacts), stop_ids))
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
