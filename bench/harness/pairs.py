"""The trained QA pairs the quality and audit benchmarks run through the services: name ->
producer checkpoint, consumer checkpoint, SCD artifact, and the context lengths each is run at
(the 2-layer models are trained on ~600-token contexts, the 6-layer ones on ~1000)."""

from __future__ import annotations

from dataclasses import dataclass

from qa.evaluate import PAIRS as QA_PAIRS


@dataclass(frozen=True)
class Pair:
    producer: str
    consumer: str
    artifact: str
    ctxs: tuple[int, ...]
    headline: str = ""  # the schedule bench.serving.audit checks by default ("" = the artifact's default)
    max_gap: float = 2.0  # F1 points: the quality target (heterogeneous 2, homogeneous 1) a headline schedule meets


def _checkpoints(name: str) -> tuple[str, str]:
    """(producer, consumer) checkpoint folders of a qa.evaluate pair, relative to the repo root."""
    producer, consumer = QA_PAIRS[name]
    return f"checkpoints/{producer}", f"checkpoints/{consumer}"


PAIRS = {
    "heterogeneous": Pair(*_checkpoints("2-layer"), "artifacts/qa-base-to-tuned.safetensors", (512,), "R2.R64"),
    "homogeneous": Pair(
        "checkpoints/qa-tuned", "checkpoints/qa-tuned", "artifacts/qa-tuned-to-tuned.safetensors", (512,), max_gap=1.0
    ),
    "deep-full": Pair(*_checkpoints("deep-full"), "artifacts/qa-deep-base-to-tuned.safetensors", (512, 1024)),
    "deep-lora": Pair(*_checkpoints("deep-lora"), "artifacts/qa-deep-base-to-lora.safetensors", (512, 1024)),
}


def pick_headline(rows: list[dict], max_gap: float) -> str | None:
    """The schedule of the cheapest SCD row (bytes/token) whose F1 gap to the oracle is at most
    `max_gap` points; None when none is. Rows of one pair at one context length."""
    fit = [r for r in rows if r["mode"] == "scd" and r["f1_gap_vs_oracle"] <= max_gap]
    return min(fit, key=lambda r: r["bytes_per_token"])["schedule"] if fit else None


async def ask(client, context: str, question: str, end_id: int, mode: str, options: dict, **fields):
    """One QA question through the consumer (greedy, stops at the task's END token): the
    consumer.api.client Answer, with `text` cut to the answer words."""
    from consumer.api.client import prompt
    from qa.task import END

    answer = await client.generate(
        mode=mode,
        options=options,
        context=prompt(context),
        question=prompt(question),
        max_new_tokens=8,
        stop_token_ids=[end_id],
        **fields,
    )
    answer.text = answer.text.strip().removesuffix(END).strip()
    return answer
