"""The consumer's compatibility check of its producers, once at start (before readiness).

Asks the producer's `Describe` (through the consumer's own producer channel: its balancing, TLS
and token) for `api_version` and each codec's payload `format_version`, and returns why this
consumer cannot work with it: another API version, or a codec both sides have whose format
versions differ. The server then keeps readiness NOT_SERVING with that reason logged. A
producer that does not answer is not a mismatch: it may start later, and the call path reports
it per request (UNAVAILABLE, or the consumer's own prefill under LOCAL_PREFILL).
"""

from __future__ import annotations

from collections.abc import Mapping

import grpc

from shared import API_VERSION, logs
from shared.pb import producer_pb2

log = logs.get("consumer.compat")


def mismatch(reply: producer_pb2.ProducerServiceDescribeResponse, codecs: Mapping, api_version: str = API_VERSION) -> str:
    """Why a producer that answered `reply` is incompatible with these codecs ("" when it is not)."""
    if reply.api_version != api_version:
        return f"producer api_version {reply.api_version!r} != consumer {api_version!r}"
    for info in reply.codecs:
        local = codecs.get(info.name)
        if local is not None and info.format_version and info.format_version != local.format_version:
            return f"codec {info.name!r}: producer format_version {info.format_version} != consumer {local.format_version}"
    return ""


async def check_producer(stub, codecs: Mapping, timeout_s: float = 5.0) -> str:
    """The mismatch reason of the producer `stub` reaches ("" when compatible or unreachable)."""
    try:
        reply = await stub.Describe(producer_pb2.ProducerServiceDescribeRequest(), timeout=timeout_s)
    except grpc.aio.AioRpcError as exc:
        log.warning("producer.describe_failed", code=exc.code().name, details=(exc.details() or "")[:200])
        return ""
    reason = mismatch(reply, codecs)
    log.info(
        "producer.compatible" if not reason else "producer.incompatible", api_version=reply.api_version, reason=reason or None
    )
    return reason
