"""The consumer's running estimates (consumer.auto.planner): what each measurement teaches, the link
measured from the stream's own span (a compute-paced span only a lower bound), the round trip,
and the pipelined time of a candidate; and the real services honouring fallback_to_oracle."""

from __future__ import annotations

import pytest

from consumer.auto.planner import Fit, Observation, TransferPlanner, arrived_then_computed, pipelined
from shared.pb import common_pb2
from tests.conftest import prompt, running_pair
from tests.test_end_to_end import CONTEXT, QUESTION


def stream(
    span_bytes: int, span_ms: float, prefill_ms: float = 0.0, hit: bool = False, tokens: int = 100, header_ms: float = 5.0
) -> Observation:
    return Observation(
        "raw",
        {},
        tokens,
        bytes_received=span_bytes + 1000,
        rebuild_ms=10.0,
        sent_tokens=tokens,
        producer_prefill_ms=0.0 if hit else prefill_ms,
        producer_store_hit=hit,
        computed_tokens=0 if hit else tokens,
        header_ms=header_ms,
        span_ms=span_ms,
        span_bytes=span_bytes,
    )


def test_what_each_measurement_teaches():
    p = TransferPlanner()
    assert p.estimate_local(100).ms is None and p.estimate_remote("raw", 2, 100, 100, 100).ms is None
    p.observe(Observation("oracle", {}, 100, 0, 50.0, local_tokens=100, question_tokens=10, question_prefill_ms=2.0))
    assert p.estimate_local(100).ms == pytest.approx(50.0) and p.question.predict(10).ms == pytest.approx(2.0)
    p.observe(stream(100_000, 20.0, hit=True))  # a replay: the span is the link's -> 5000 B/ms
    assert p.link_bytes_per_ms.value == pytest.approx(5000.0) and not p.link_lower_bound
    assert p.producer_prefill.count == 0  # a hit computed nothing
    assert p.bytes_per_token["raw"].value == pytest.approx(1010.0) and p.rtt_ms == 5.0


def test_a_compute_paced_span_only_raises_the_link_estimate():
    p = TransferPlanner()
    p.observe(stream(100_000, 20.0, hit=True))  # 5000 B/ms
    p.observe(stream(100_000, 100.0, prefill_ms=90.0))  # paced by the forward: 1000 B/ms, a lower bound only
    assert p.link_bytes_per_ms.value == pytest.approx(5000.0) and not p.link_lower_bound
    assert p.producer_prefill.predict(100).ms == pytest.approx(90.0)
    p.observe(stream(1_000_000, 100.0, prefill_ms=90.0))  # 10000 B/ms even while computing: the link is faster
    assert p.link_bytes_per_ms.value == pytest.approx(10000.0) and p.link_lower_bound  # marked a lower bound
    assert p.snapshot()["link_lower_bound"] == 1.0
    p.observe(stream(100_000, 100.0, prefill_ms=10.0))  # the forward took a tenth of the span: a real sample
    assert p.link_bytes_per_ms.value == pytest.approx(1000.0) and not p.link_lower_bound  # 10x below: a step change
    p.observe(stream(100_000, 80.0, prefill_ms=10.0))  # within 2x: averaged
    assert p.link_bytes_per_ms.value == pytest.approx(0.5 * 1000 + 0.5 * 1250)
    p.observe(stream(1000, 100.0, hit=True))  # under MIN_WIRE_BYTES: says nothing about bandwidth
    assert p.link_bytes_per_ms.value == pytest.approx(1125.0)


def test_the_link_estimate_follows_a_rate_change_within_three_transfers():
    p = TransferPlanner()
    for _ in range(5):
        p.observe(stream(1_000_000, 80.0, hit=True))  # 12500 B/ms = 100 Mbit/s
    p.observe(stream(1_000_000, 800.0, hit=True))  # 10 Mbit/s: a step, not noise
    assert p.link_bytes_per_ms.value == pytest.approx(1250.0)
    p.observe(stream(1_000_000, 700.0, hit=True))  # within RATE_JUMP: averaged
    assert 1250.0 < p.link_bytes_per_ms.value < 1_000_000 / 700.0
    assert min(p.header_ms) == 5.0


def test_remote_estimate_is_pipelined_and_borrows_for_unseen_modes():
    p = TransferPlanner()
    p.observe(Observation("oracle", {}, 100, 0, 100.0, local_tokens=100))  # 1 ms/token locally
    p.observe(stream(100_000, 20.0, prefill_ms=0.0, hit=True, header_ms=4.0))
    p.producer_prefill.add(100, 50.0)
    e = p.estimate_remote("raw", 4, compute=100, encode=100, send=100)
    wire = 1010.0 * 100 / 5000.0
    assert e.ms == pytest.approx(4.0 + pipelined([50.0, wire, 10.0], 4))
    assert not e.confident and "encode not measured" in e.why  # no encode measured for raw yet: borrowed (none)
    unseen = p.estimate_remote("quant(bits=8,group_size=32)", 4, 0, 0, 100, prior_bytes_per_token=300.0)
    assert unseen.ms == pytest.approx(4.0 + pipelined([0.0, 300.0 * 100 / 5000.0, 10.0], 4))  # raw's rebuild rate borrowed
    assert "wire" in unseen.detail and not unseen.confident and "borrowed" in unseen.why
    assert pipelined([10.0, 2.0, 4.0], 2) == 13.0
    # what the link is worth: the same estimate with the wire free; a store replay is paced by the link
    assert e.free_link_ms == pytest.approx(4.0 + pipelined([50.0, 10.0], 4)) and not e.link_paced
    replay = p.estimate_remote("raw", 4, compute=0, encode=0, send=100)
    assert replay.link_paced and replay.free_link_ms == pytest.approx(4.0 + pipelined([0.0, 10.0], 4))
    assert replay.ms is not None and replay.free_link_ms < replay.ms


def test_a_rebuild_that_computes_after_part_of_the_stream_is_not_spread_over_the_layers():
    """recompute runs its span once the hidden state at `start` arrived: on the 0.5B shape (24
    layers, span [9, 15)) after 58% of the bytes, then ~2 s of the consumer's layers; spread
    evenly over the layers (pipelined) it read ~1 s less than it took through the services."""
    from types import SimpleNamespace

    from shared.codecs.recompute import RecomputeCodec

    info = SimpleNamespace(num_layers=24, num_kv_heads=2, head_dim=64, hidden_size=896, model_id="qwen05b-shaped")
    codec = RecomputeCodec.__new__(RecomputeCodec)
    codec.model = SimpleNamespace(info=info)
    start = codec.compute_start({"start": "9", "end": "15"})
    assert start == pytest.approx(((9 * 256 + 896) / (18 * 256 + 896), 10 / 24))
    # wire-bound (a store replay at 100 Mbit/s): the span starts at 58% of the wire, then computes
    assert arrived_then_computed(5.0, 1877.0, 2000.0, 24, start) == pytest.approx(1877.0 * start[0] + 2000.0)
    assert arrived_then_computed(5.0, 1877.0, 2000.0, 24, start) > pipelined([5.0, 1877.0, 2000.0], 24) + 900
    # producer-bound (a cold 2048-token prefill): the last layer's arrival decides
    assert arrived_then_computed(6500.0, 1877.0, 2000.0, 24, start) == pytest.approx(pipelined([6500.0, 1877.0], 24) + 2000 / 24)
    p = TransferPlanner()
    p.observe(stream(100_000, 20.0, prefill_ms=0.0, hit=True, header_ms=4.0))
    spread = p.estimate_remote("recompute(end=15,start=9)", 24, 0, 0, 100, prior_bytes_per_token=1010.0)
    computed = p.estimate_remote("recompute(end=15,start=9)", 24, 0, 0, 100, 1010.0, compute_start=start)
    wire = 1010.0 * 100 / 5000.0
    assert computed.ms == pytest.approx(4.0 + max(pipelined([0.0, wire], 24) + 10.0 / 24, wire * start[0] + 10.0))
    assert computed.ms > spread.ms and "computed after 58% of the bytes" in computed.detail


async def test_services_fall_back_to_the_oracle_when_the_estimates_say_so():
    fields = dict(context=prompt(CONTEXT), question=prompt(QUESTION), max_new_tokens=8)
    async with running_pair("tiny-llama", consumer_kw={"prefix_cache_bytes": 0}) as pair:  # every request rebuilds
        oracle, _, _ = await pair.generate(transfer=common_pb2.CodecSpec(name="oracle"), **fields)
        raw, _, stats = await pair.generate(transfer=common_pb2.CodecSpec(name="raw"), fallback_to_oracle=True, **fields)
        assert stats.transfer.name == "raw" and stats.bytes_received > 0  # first raw request: no link estimate yet
        assert stats.transfer.options["fallback"].startswith("remote: cold start")
        assert [c.mode for c in stats.auto.candidates if c.chosen] == ["raw"]
        planner = pair.consumer.servicer.planner
        assert planner.estimate_local(100).ms > 0 and planner.link_bytes_per_ms.value > 0
        planner.link_bytes_per_ms.value = 1e-3  # as if the link had crawled on the last transfers
        ids, _, stats = await pair.generate(transfer=common_pb2.CodecSpec(name="raw"), fallback_to_oracle=True, **fields)
        assert stats.transfer.name == "oracle" and stats.bytes_received == 0 and ids == oracle
        assert stats.transfer.options["fallback"].startswith("local: fastest")
        planner.link_bytes_per_ms.value = 1e12
        slow_own_prefill(planner)  # as if the consumer's own prefill were very slow
        ids, _, stats = await pair.generate(transfer=common_pb2.CodecSpec(name="raw"), fallback_to_oracle=True, **fields)
        assert stats.transfer.name == "raw" and ids == raw
        assert stats.transfer.options["fallback"].startswith("remote: fastest")
        _, _, stats = await pair.generate(transfer=common_pb2.CodecSpec(name="raw"), **fields)
        assert "fallback" not in stats.transfer.options and not stats.HasField("auto")  # not asked: no planning


def slow_own_prefill(planner: TransferPlanner, ms_per_token: float = 1e6) -> None:
    planner.local = Fit()
    for tokens in (8, 4096):
        planner.local.add(tokens, tokens * ms_per_token)


def test_producer_memory_remembers_prefixes_per_mode_and_stays_bounded():
    from consumer.auto.producer_memory import PENDING, ProducerMemory

    m = ProducerMemory(capacity=16)
    ids = list(range(1000))
    assert m.held("p" * 64, "float32", "raw", ids) == (0, 0)
    m.remember("p" * 64, "float32", "raw", ids[:600], chunk_tokens=256)
    assert m.held("p" * 64, "float32", "raw", ids) == (512, 512)  # the two full chunks the longer context shares
    assert m.held("p" * 64, "float32", "quant(bits=8)", ids) == (512, 0)  # the KV is there, not quant's payloads
    assert m.held("q" * 64, "float32", "raw", ids) == (0, 0)  # another producer
    assert m.held("p" * 64, "bfloat16", "raw", ids) == (0, 0)  # the same weights restarted in another dtype
    assert m.held("p" * 64, "float32", "raw", ids[:600]) == (600, 600)  # the whole context, its tail included
    m.remember("", "float32", "raw", ids, chunk_tokens=256)  # producer not known: nothing to remember
    for n in range(20):
        m.remember("p" * 64, "float32", "raw", [n] * 300, chunk_tokens=256)
    assert len(m.pending) == 20  # hashed only once auto asks: no work for requests that never use auto
    m.held("p" * 64, "float32", "raw", ids)
    assert len(m.keys) == 16 and not m.pending
    for n in range(100):
        m.remember("p" * 64, "float32", "raw", [n] * 300, chunk_tokens=256)
    assert len(m.pending) == PENDING  # bounded while auto never asks


def test_overhead_is_learned_only_from_roughly_right_estimates():
    p = TransferPlanner()
    p.observe_overhead(True, 12.0, 8.0)  # 4 ms the model leaves out
    assert p.overhead_ms["remote"].value == 4.0
    p.observe_overhead(True, 21000.0, 5000.0)  # a stale link, not an overhead: ignored
    p.observe_overhead(False, 1.0, 5000.0)
    assert p.overhead_ms["remote"].value == 4.0 and p.overhead_ms["local"].value is None
