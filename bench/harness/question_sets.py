"""The questions a serving benchmark asks a pair through the services, and how their answers
score: the trained QA pairs over qa.shifted's sets (text prompts, 8-token answers up to the task's
END, qa.metrics F1), and the real pair over real.tasks examples (token-id prompts in the
consumer's chat format, greedy up to `<|im_end|>` or real.quality's 48 new tokens, real.score
F1). Each names what a row ran on (weights, model, dtype, artifact, split). Knows nothing about
policies or the rows' figures.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.harness import pairs, provenance, services
from bench.harness.pairs import PAIRS
from consumer.api.client import Answer, ConsumerClient, prompt

ROOT = services.ROOT


@dataclass(frozen=True)
class Asked:
    """One example as the services are asked it: its prompts, its gold answer and the fields a
    per-example row names it by."""

    set: str
    index: int
    context: Any  # consumer_pb2.Prompt
    question: Any  # consumer_pb2.Prompt
    gold: str | None
    labels: dict = field(default_factory=dict)
    example: Any = None  # what `f1` scores against (a real.tasks.Example)


class _PairSets:
    """The services' side of a pair: the checkpoints or short names each runs and the artifact."""

    pair: Any

    @property
    def producer(self) -> str:
        return self.pair.producer

    @property
    def consumer(self) -> str:
        return self.pair.consumer

    @property
    def artifact(self) -> str:
        return self.pair.artifact


@dataclass
class QaSets(_PairSets):
    """A trained QA pair of bench.harness.pairs over qa.shifted's sets."""

    name: str
    max_new_tokens: int = 8

    def __post_init__(self) -> None:
        from transformers import AutoTokenizer

        from qa.tokenizer import end_token_id

        self.pair = PAIRS[self.name]
        self.end_id = end_token_id(AutoTokenizer.from_pretrained(ROOT / self.pair.consumer))

    def schedule(self) -> dict:
        return {"schedule": self.pair.headline} if self.pair.headline else {}

    def base(self) -> dict:
        return {
            "pair": self.name,
            "weights": "trained",
            "model": f"{Path(self.producer).name}->{Path(self.consumer).name}",
            "dtype": "float32",
            "link": "loopback",
        }

    def set_fields(self, name: str) -> dict:
        return {"set": name}

    def warm(self) -> Asked:
        return next(self.asked("in_distribution", 1, start=10_000))

    def asked(self, set_name: str, n: int, start: int = 0) -> Iterator[Asked]:
        from qa.shifted import examples

        for index, ex in enumerate(examples(set_name, n, start=start)):
            yield Asked(set_name, index, ex.context, ex.question, ex.answer)

    async def ask(self, client: ConsumerClient, q: Asked, mode: str, options: dict, **fields) -> Answer:
        return await pairs.ask(client, q.context, q.question, self.end_id, mode, options, **fields)

    def f1(self, text: str, q: Asked) -> float | None:
        from qa.metrics import f1_score
        from qa.task import END

        return None if q.gold is None else f1_score(text.removesuffix(END).strip(), q.gold)


@dataclass(frozen=True)
class RealPair:
    label: str  # real.quality's pair label: "P->C" | "P->P"
    producer: str  # shared.pretrained short names
    consumer: str
    artifact: str
    headline: str  # the schedule chosen on validation (bench.figures.real_pair.choose)


REAL_PAIRS = {
    "smollm2-pc": RealPair("P->C", "smollm2-135m", "smollm2-135m-tuned", "artifacts/smollm2-pc.safetensors", "s11"),
    "smollm2-pp": RealPair("P->P", "smollm2-135m", "smollm2-135m", "artifacts/smollm2-pp.safetensors", "s5"),
}


@dataclass
class RealSets(_PairSets):
    """A real pair of REAL_PAIRS over real.tasks examples: one set per split, the families in
    turn, `context_tokens` of chat prefix, asked as token ids (the context's ids apart from the
    question's, as real.tasks splits them)."""

    name: str
    context_tokens: int = 1024
    schedule_name: str = ""  # "" = the pair's headline
    max_new_tokens: int = 48  # real.quality's default
    dtype: str = "float32"
    models: dict = field(default_factory=dict)  # producer_model / consumer_model rows, from Describe

    def __post_init__(self) -> None:
        from transformers import AutoTokenizer

        from real import tasks
        from shared import pretrained

        self.pair = REAL_PAIRS[self.name]
        self.schedule_name = self.schedule_name or self.pair.headline
        self.tokenizer = AutoTokenizer.from_pretrained(pretrained.ensure(self.pair.consumer))
        self.end_id = tasks.end_id(self.tokenizer)

    def schedule(self) -> dict:
        return {"schedule": self.schedule_name}

    def base(self) -> dict:
        from shared.scd.artifact import Artifact

        return {
            "pair": self.pair.label,
            "weights": provenance.weights_of(self.consumer),
            "model": f"{self.producer}->{self.consumer}",
            "dtype": self.dtype,
            **self.models,
            "artifact": Artifact.load(ROOT / self.artifact).artifact_id,
            "artifact_file": self.artifact,
            "schedule": self.schedule_name,
            "context_tokens_asked": self.context_tokens,
            "max_new_tokens": self.max_new_tokens,
            "link": "loopback",
        }

    async def describe(self, consumer: str, producer: str) -> None:
        """Fill `models` from both services' Describe (digest, dtype, origin: what ran)."""
        import grpc

        from shared.pb import producer_pb2, producer_pb2_grpc

        def row(info) -> dict:
            return {"model": info.model_id, "weight_digest": info.weight_digest, "dtype": info.dtype, "origin": info.origin}

        async with ConsumerClient(consumer) as client:
            self.models["consumer_model"] = row((await client.describe()).model)
        async with grpc.aio.insecure_channel(producer) as channel:
            reply = await producer_pb2_grpc.ProducerServiceStub(channel).Describe(
                producer_pb2.ProducerServiceDescribeRequest(), timeout=10
            )
        self.models["producer_model"] = row(reply.model)

    def set_fields(self, name: str) -> dict:
        return {"set": name, "split": name}  # a set is a split of real.tasks

    def warm(self) -> Asked:
        return next(self.asked("train", 1))

    def asked(self, set_name: str, n: int, start: int = 0) -> Iterator[Asked]:
        """Examples start.. of split `set_name` (made one at a time: a stopped run made no more
        than it asked)."""
        from real import tasks

        families = tasks.FAMILIES
        for index in range(start, start + n):
            ex = tasks.make(self.tokenizer, families[index % len(families)], set_name, index, self.context_tokens)
            labels = {"split": set_name, "family": ex.family, "seed": ex.seed, "context_tokens": len(ex.context_ids)}
            yield Asked(set_name, index, prompt(ids=ex.context_ids), prompt(ids=ex.question_ids), ex.answer, labels, ex)

    async def ask(self, client: ConsumerClient, q: Asked, mode: str, options: dict, **fields) -> Answer:
        answer = await client.generate(
            mode=mode,
            options=options,
            context=q.context,
            question=q.question,
            max_new_tokens=self.max_new_tokens,
            stop_token_ids=[self.end_id],
            **fields,
        )
        answer.text = answer.text.strip()  # the services' text skips special tokens (the stop token)
        return answer

    def f1(self, text: str, q: Asked) -> float | None:
        from real import score

        return score.score(text, q.example)["f1"]
