"""The trained QA pairs the quality and audit benchmarks run through the services: name ->
producer checkpoint, consumer checkpoint, SCD artifact, and the context lengths each is run at
(the 2-layer models are trained on ~600-token contexts, the 6-layer ones on ~1000)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Pair:
    producer: str
    consumer: str
    artifact: str
    ctxs: tuple[int, ...]
    headline: str = ""  # the schedule bench.audit checks by default ("" = the artifact's default)


PAIRS = {
    "heterogeneous": Pair(
        "checkpoints/qa-base", "checkpoints/qa-tuned", "artifacts/qa-base-to-tuned.safetensors", (512,), "R2.R64"
    ),
    "homogeneous": Pair("checkpoints/qa-tuned", "checkpoints/qa-tuned", "artifacts/qa-tuned-to-tuned.safetensors", (512,)),
    "deep-full": Pair(
        "checkpoints/deep/qa-deep-base",
        "checkpoints/deep/qa-deep-tuned",
        "artifacts/qa-deep-base-to-tuned.safetensors",
        (512, 1024),
    ),
    "deep-lora": Pair(
        "checkpoints/deep/qa-deep-base",
        "checkpoints/deep/qa-deep-lora",
        "artifacts/qa-deep-base-to-lora.safetensors",
        (512, 1024),
    ),
}
