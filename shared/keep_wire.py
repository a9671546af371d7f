"""The bridge between the wire's KeepSpec (scd.v1) and shared.codecs.kept.KeepRequest: the
producer reads a request's keep selection, the consumer writes it and compares the header's echo.
Knows nothing about transport or models.
"""

from __future__ import annotations

from shared.codecs.base import Codec
from shared.codecs.kept import KeepRequest
from shared.errors import InvalidArgument
from shared.pb import common_pb2, producer_pb2


def to_pb(keep: KeepRequest) -> common_pb2.KeepSpec:
    spec = common_pb2.KeepSpec(policy=keep.policy, sinks=keep.sinks, window=keep.window, heads=keep.heads, weights=keep.weights)
    if keep.budget.count is not None:
        spec.count = keep.budget.count
    else:
        spec.fraction = float(keep.budget.fraction or 0.0)
    return spec


def from_pb(spec: common_pb2.KeepSpec) -> KeepRequest:
    """Checked (InvalidArgument naming the field); absent sinks and window take the defaults."""
    which = spec.WhichOneof("budget")
    fraction = spec.fraction if which == "fraction" else None
    count = spec.count if which == "count" else None
    sinks = spec.sinks if spec.HasField("sinks") else KeepRequest.sinks
    window = spec.window if spec.HasField("window") else KeepRequest.window
    return KeepRequest.checked(spec.policy, fraction, count, sinks, window, spec.heads, spec.weights)


def requested(request: producer_pb2.PrefillRequest, codec: Codec) -> KeepRequest | None:
    """PrefillRequest.keep, checked and resolved for the codec (see the proto); None: unset."""
    if not request.HasField("keep"):
        return None
    if request.first_token:
        raise InvalidArgument("keep: a keep transfer scores and sends the whole context; first_token must be 0")
    return from_pb(request.keep).for_codec(codec)
