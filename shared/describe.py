"""Describe-message builders common to both services (ModelInfo, CodecInfo, Limits to proto)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from shared.codecs import Codec
from shared.models import ModelInfo
from shared.pb import common_pb2


def model_to_pb(info: ModelInfo) -> common_pb2.ModelInfo:
    return common_pb2.ModelInfo(**dataclasses.asdict(info))


def codecs_to_pb(codecs: Mapping[str, Codec]) -> list[common_pb2.CodecInfo]:
    return [common_pb2.CodecInfo(name=name, description=c.description, uses_producer=True) for name, c in sorted(codecs.items())]


def local_mode_pb(name: str) -> common_pb2.CodecInfo:
    """The consumer's own-prefill mode, listed beside the codecs (tokens only cross)."""
    return common_pb2.CodecInfo(
        name=name, description="tokens only: the consumer prefills the context itself (reference quality)", uses_producer=False
    )


def artifacts_to_pb(codecs: Mapping[str, Codec]) -> list[common_pb2.ArtifactInfo]:
    """The SCD artifacts the service loaded, with their schedules."""
    codec = codecs.get("scd")
    out = []
    for art in codec.artifacts if codec is not None else []:
        out.append(
            common_pb2.ArtifactInfo(
                artifact_id=art.artifact_id,
                format_version=art.meta["format_version"],
                producer_model_id=art.meta["producer"]["model_id"],
                producer_weight_digest=art.meta["producer"]["weight_digest"],
                consumer_model_id=art.meta["consumer"]["model_id"],
                consumer_weight_digest=art.meta["consumer"]["weight_digest"],
                schedules=[
                    common_pb2.ScheduleInfo(
                        name=e.name, schedule=e.schedule, calibrated_loss=e.loss, bytes_per_token=e.bytes_per_token
                    )
                    for e in art.schedules
                ],
                predictor_layers=art.predictor_layers,
            )
        )
    return out
