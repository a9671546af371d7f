"""bench.serving.load_test at the shipped limits (its --quick smoke run, gRPC and HTTP streams): what a
user of the defaults gets, with refusals counted by status apart from errors, rows that carry the limits they ran at,
and the head-of-line probe timing cold requests."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from bench.serving import load_test
from shared.config import ConsumerConfig, ProducerConfig


class _Err(grpc.aio.AioRpcError):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def test_refusals_at_a_limit_are_told_apart_from_errors():
    assert load_test.refusal(_Err(grpc.StatusCode.RESOURCE_EXHAUSTED, "more than 16 in flight")) == "RESOURCE_EXHAUSTED"
    assert load_test.refusal(_Err(grpc.StatusCode.UNAVAILABLE, "producer overloaded")) == "UNAVAILABLE (producer overloaded)"
    assert load_test.refusal(_Err(grpc.StatusCode.UNAVAILABLE, "producer unreachable")) is None
    assert load_test.refusal(_Err(grpc.StatusCode.DATA_LOSS, "crc")) is None


def test_cold_probe_contexts_are_all_distinct():
    contexts = {load_test.cold_context(i, which) for i in range(5) for which in ("beside", "alone")}
    assert len(contexts) == 10 and not contexts & set(load_test.CONTEXTS)


@pytest.mark.timeout(600)
async def test_quick_run_at_the_shipped_defaults(tmp_path):
    out = tmp_path / "load.jsonl"
    rows = await asyncio.to_thread(load_test.main, ["--quick", "--limits", "defaults", "--out", str(out)])
    run, hol = rows
    assert (run["producer_max_inflight"], run["consumer_max_inflight"]) == (ProducerConfig.max_inflight,
                                                                            ConsumerConfig.max_inflight)
    assert run["limits"] == hol["limits"] == "defaults" and run["weights"] == "random"
    assert run["unexpected_errors"] == 0 and run["wrong_answers"] == 0 and run["slots_leaked"] == 0
    assert run["http_streams"] == 2 and run["http_unexpected_errors"] == 0  # HTTP (/v1/completions) beside gRPC
    assert run["accounting_balanced"] and run["ok"] + run["cancelled"] + run["refused"] == run["requests"]
    assert run["refused"] == sum(run["refused_by_status"].values())
    assert hol["hol_request"] == "cold" and hol["hol_runs"] == 2 and hol["hol_ttft_alone_ms"] > 0
    assert out.read_text().count("\n") == 2
    # RSS per round of each process; 2 rounds give no verdict on its trend (bench.harness.rss_trend), and nothing fails
    assert [len(v) for v in run["rss_kib_per_round"].values()] == [2, 2] and run["rss_levels_off"] is None
    assert load_test.failures(rows) == []
    bad = {**run, "rss_trend": {"consumer": {"levels_off": False, "peak_rise_pct_per_round": 1.3, "slope_pct_per_round": 1.0}}}
    assert load_test.failures([bad]) == [
        "limits defaults: consumer RSS does not level off: its peak rose 1.3% a round over the second half "
        f"(limit {run['max_rise_pct_per_round']}%; slope 1.0% a round)"
    ]
