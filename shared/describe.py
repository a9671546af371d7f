"""Describe-message builders common to both services (ModelInfo, CodecInfo, Limits to proto)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping

from shared.codecs import Codec
from shared.codecs.scd import ScdCodec
from shared.models import ModelInfo
from shared.pb import common_pb2


def public_model_id(model_id: str) -> str:
    """A hub id or builtin name as it is; a local path as its last component (callers never
    see the server's filesystem)."""
    path = model_id.rstrip("/")
    if os.path.isabs(path) or path.startswith((".", "~")) or os.path.exists(path):
        return os.path.basename(path) or model_id
    return model_id


def model_to_pb(info: ModelInfo, name: str = "") -> common_pb2.ModelInfo:
    """`name`: the served model name (the consumer's --served-model-name); "": public_model_id."""
    fields = dataclasses.asdict(info)
    fields["model_id"] = name or public_model_id(info.model_id)
    return common_pb2.ModelInfo(**fields)


def codecs_to_pb(codecs: Mapping[str, Codec]) -> list[common_pb2.CodecInfo]:
    return [
        common_pb2.CodecInfo(
            name=name, description=c.description, uses_producer=True, format_version=c.format_version, keep_heads=c.keep_heads
        )
        for name, c in sorted(codecs.items())
    ]


def local_mode_pb(name: str) -> common_pb2.CodecInfo:
    """The consumer's own-prefill mode, listed beside the codecs (tokens only cross)."""
    return common_pb2.CodecInfo(
        name=name, description="tokens only: the consumer prefills the context itself (reference quality)", uses_producer=False
    )


def artifacts_to_pb(
    codecs: Mapping[str, Codec], keep_weights: Callable[[str], str] = lambda _: ""
) -> list[common_pb2.ArtifactInfo]:
    """The SCD artifacts the service loaded, with their schedules and every transfer mode's point on
    their loss scale; `keep_weights`: an artifact id's learned keep weights digest ("" none: a
    producer's, producer.keep_weights)."""
    codec = codecs.get("scd")
    out = []
    for art in codec.artifacts if isinstance(codec, ScdCodec) else []:
        out.append(
            common_pb2.ArtifactInfo(
                artifact_id=art.artifact_id,
                format_version=art.meta["format_version"],
                producer_model_id=public_model_id(art.meta["producer"]["model_id"]),
                producer_weight_digest=art.meta["producer"]["weight_digest"],
                consumer_model_id=public_model_id(art.meta["consumer"]["model_id"]),
                consumer_weight_digest=art.meta["consumer"]["weight_digest"],
                schedules=[
                    common_pb2.ScheduleInfo(
                        name=e.name, schedule=e.schedule, calibrated_loss=e.loss, bytes_per_token=e.bytes_per_token
                    )
                    for e in art.schedules
                ],
                predictor_layers=art.predictor_layers,
                file_name=art.path.name if art.path is not None else "",
                keep_weights_digest=keep_weights(art.artifact_id),
                transfer_points=[
                    common_pb2.TransferPoint(
                        mode=t.mode, options=dict(t.options), calibrated_loss=t.loss, bytes_per_token=t.bytes_per_token, how=t.how
                    )
                    for t in art.transfer_points()
                ],
                default_schedule=art.default_entry().name if art.schedules else "",
                default_schedule_chosen_on=art.default_chosen_on() if art.schedules else "",
            )
        )
    return out
