"""The (producer, consumer) pair an artifact names, loaded and checked against its weight digests."""

from __future__ import annotations

from shared.models import LoadedModel, load_model
from shared.scd.artifact import Artifact


def load_pair(art: Artifact, dtype: str = "float32") -> tuple[LoadedModel, LoadedModel]:
    producer = load_model(art.meta["producer"]["model_id"], dtype, "auto")
    consumer = load_model(art.meta["consumer"]["model_id"], dtype, "auto")
    art.check_model("producer", producer.info)
    art.check_model("consumer", consumer.info)
    return producer, consumer
