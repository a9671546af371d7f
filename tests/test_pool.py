"""The producer pool on gRPC's own load balancing (bench.serving.pool_test, small): ring_hash on the
context hash keeps a context on one producer (repeats are store hits), round_robin does not,
and stopping a producer mid-run fails no request when LOCAL_PREFILL is allowed."""

from __future__ import annotations

import json

from bench.serving import pool_test
from consumer.link.producer_client import HASH_HEADER, channel_options, context_hash, service_config


async def test_pool_affinity_and_failover():
    # run in a worker thread: pool_test drives its own event loop
    import asyncio

    result = await asyncio.to_thread(pool_test.main, ["--contexts", "6", "--repeats", "3", "--words", "24"])
    assert result["producers"] == 3 and result["requests"] == 18
    assert result["affinity_hit_rate"] >= 0.9
    assert result["round_robin_hit_rate"] < result["affinity_hit_rate"]
    assert result["failover_errors"] == 0 and result["failover_requests"] == 18
    assert result["ring_hash_errors"] == result["round_robin_errors"] == 0
    assert result["weights"] == "random"  # tiny-llama: what the row ran on


def test_service_config_selects_the_policy():
    ring = service_config("ring_hash")
    assert ring["loadBalancingConfig"] == [{"ring_hash_experimental": {"requestHashHeader": HASH_HEADER}}]
    assert ring["methodConfig"][0]["retryPolicy"]["retryableStatusCodes"][0] == "UNAVAILABLE"
    assert service_config("round_robin")["loadBalancingConfig"] == [{"round_robin": {}}]
    options = dict(channel_options("ring_hash"))  # what the producer client's channel is built with
    assert json.loads(options["grpc.service_config"]) == ring
    assert json.loads(dict(channel_options("round_robin"))["grpc.service_config"]) == service_config("round_robin")
    assert context_hash([1, 2, 3]) == context_hash([1, 2, 3]) != context_hash([1, 2, 4])
