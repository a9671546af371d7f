"""The (producer, consumer) pair an artifact names, loaded and checked against its weight digests."""

from __future__ import annotations

from shared.models import LoadedModel, load_model
from shared.scd.artifact import Artifact


def load_pair(art: Artifact, dtype: str = "float32") -> tuple[LoadedModel, LoadedModel]:
    """Both models in dtype, checked against the artifact's digests (FailedPrecondition naming the
    side that does not match); one model serves both sides when the artifact names it twice."""
    producer = load_model(art.meta["producer"]["model_id"], dtype, "auto")
    same = art.meta["consumer"]["model_id"] == art.meta["producer"]["model_id"]
    consumer = producer if same else load_model(art.meta["consumer"]["model_id"], dtype, "auto")
    art.check_model("producer", producer.info)
    art.check_model("consumer", consumer.info)
    return producer, consumer
