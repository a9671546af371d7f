"""The consumer's transfer-or-prefill planner: its estimates and decisions, and the real services
honouring GenerateRequest.fallback_to_oracle."""

from __future__ import annotations

import pytest

from consumer.planner import Decision, Observation, TransferPlanner
from shared.pb import common_pb2
from tests.conftest import prompt, running_pair
from tests.test_end_to_end import CONTEXT, QUESTION


def remote(bytes_received: int, transfer_ms: float, prefill_ms: float, hit: bool = False, tokens: int = 100) -> Observation:
    return Observation("raw", {}, tokens, bytes_received, transfer_ms, 1.0, 0.0 if hit else prefill_ms, 0.0, hit)


def test_estimates_and_decisions():
    planner = TransferPlanner()
    first = planner.decide("raw", {}, 100)
    assert not first.local and "no estimate yet" in first.reason and "oracle request" in first.reason
    planner.observe(Observation("oracle", {}, 100, 0, 0.0, 50.0, 0.0, 0.0, False))  # 0.5 ms/token locally
    planner.observe(remote(100_000, 30.0, 10.0))  # 1000 B/token, 20 ms on the wire -> 5000 B/ms
    assert planner.local_ms_per_token.value == 0.5
    assert planner.producer_ms_per_token.value == pytest.approx(0.1)
    assert planner.link_bytes_per_ms.value == pytest.approx(5000.0)
    # remote: 1000 * (0.1 + 1000 / 5000) = 300 ms vs local 500 ms
    d = planner.decide("raw", {}, 1000)
    assert d == Decision(False, "remote: estimated local 500.0 ms vs remote 300.0 ms")
    for _ in range(20):  # the link slows to 100 B/ms (store hits: the whole transfer is wire time)
        planner.observe(remote(100_000, 1000.0, 0.0, hit=True))
    assert planner.link_bytes_per_ms.value == pytest.approx(100.0, rel=0.05)  # EWMA: the old rate has faded
    assert planner.producer_ms_per_token.value == pytest.approx(0.1)  # hits do not count as prefill
    assert planner.decide("raw", {}, 1000).local
    # a mode never seen has no bytes/token estimate: keep it remote and say so
    other = planner.decide("quant", {"bits": "4"}, 1000)
    assert not other.local and "bytes/token of quant(bits=4)" in other.reason


async def test_services_fall_back_to_the_oracle_when_the_estimates_say_so():
    fields = dict(context=prompt(CONTEXT), question=prompt(QUESTION), max_new_tokens=8)
    async with running_pair("tiny-llama") as pair:
        oracle, _, _ = await pair.generate(transfer=common_pb2.CodecSpec(name="oracle"), **fields)
        raw, _, stats = await pair.generate(transfer=common_pb2.CodecSpec(name="raw"), fallback_to_oracle=True, **fields)
        assert stats.transfer.name == "raw" and stats.bytes_received > 0  # first raw request: no link estimate yet
        assert stats.transfer.options["fallback"].startswith("remote: no estimate yet")
        planner = pair.consumer.servicer.planner
        assert planner.local_ms_per_token.value > 0 and planner.link_bytes_per_ms.value > 0
        planner.link_bytes_per_ms.value = 1e-3  # as if the link had crawled on the last transfers
        ids, _, stats = await pair.generate(transfer=common_pb2.CodecSpec(name="raw"), fallback_to_oracle=True, **fields)
        assert stats.transfer.name == "oracle" and stats.bytes_received == 0 and ids == oracle
        assert stats.transfer.options["fallback"].startswith("local: estimated local")
        planner.link_bytes_per_ms.value = 1e12
        planner.local_ms_per_token.value = 1e6  # as if the consumer's own prefill were very slow
        ids, _, stats = await pair.generate(transfer=common_pb2.CodecSpec(name="raw"), fallback_to_oracle=True, **fields)
        assert stats.transfer.name == "raw" and ids == raw
        assert stats.transfer.options["fallback"].startswith("remote: estimated local")
        _, _, stats = await pair.generate(transfer=common_pb2.CodecSpec(name="raw"), **fields)
        assert "fallback" not in stats.transfer.options  # not asked: no planning
