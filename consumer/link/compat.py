"""The consumer's compatibility rule for its producers, read from the producer's `Describe`:
another API version, or a codec both sides have whose payload format versions differ. The
producer link (consumer.link.readiness) asks and applies it at start and on every re-check; an
incompatible producer keeps readiness NOT_SERVING with the reason logged.
"""

from __future__ import annotations

from collections.abc import Mapping

from shared import API_VERSION
from shared.pb import producer_pb2


def mismatch(reply: producer_pb2.ProducerServiceDescribeResponse, codecs: Mapping, api_version: str = API_VERSION) -> str:
    """Why a producer that answered `reply` is incompatible with these codecs ("" when it is not)."""
    if reply.api_version != api_version:
        return f"producer api_version {reply.api_version!r} != consumer {api_version!r}"
    for info in reply.codecs:
        local = codecs.get(info.name)
        if local is not None and info.format_version and info.format_version != local.format_version:
            return f"codec {info.name!r}: producer format_version {info.format_version} != consumer {local.format_version}"
    return ""
