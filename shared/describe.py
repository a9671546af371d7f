"""Describe-message builders common to both services (ModelInfo, CodecInfo, Limits to proto)."""

from __future__ import annotations

import dataclasses
from typing import Mapping

from shared.codecs import Codec
from shared.models import ModelInfo
from shared.pb import common_pb2


def model_to_pb(info: ModelInfo) -> common_pb2.ModelInfo:
    return common_pb2.ModelInfo(**dataclasses.asdict(info))


def codecs_to_pb(codecs: Mapping[str, Codec]) -> list[common_pb2.CodecInfo]:
    return [
        common_pb2.CodecInfo(name=name, description=c.description, uses_producer=c.uses_producer)
        for name, c in sorted(codecs.items())
    ]
