"""Mode auto as an operator meets it (issue 31): one readiness rule (ready = the default mode can be
served now; the producer link reported apart, with its own health service), a healthcheck that
says why, naive reuse refused as a default, the default schedule and budget in Describe, the
trail in the stats and the log, and a background probe that measures while nobody waits."""

from __future__ import annotations

import asyncio
import logging
import math
import os
from pathlib import Path

import pytest
import structlog
from grpc_health.v1 import health_pb2

from bench.harness.services import free_port
from consumer.link.readiness import HEALTH_SERVICE
from consumer.server import ConsumerServer
from producer.server import ProducerServer
from qa.task import make_example
from shared import healthcheck, logs
from shared.config import ConsumerConfig, ProducerConfig
from shared.startup import StartupError
from tests.conftest import ConsumerClient, perturbed_model, prompt, running_pair
from tests.test_metrics import scrape, value
from tests.test_planner import slow_own_prefill
from tests.test_readiness import health, servers

ROOT = Path(__file__).resolve().parents[1]
ARTIFACT = str(ROOT / "artifacts" / "qa-base-to-tuned.safetensors")
FIELDS = dict(context=prompt("a b c d e f g h"), question=prompt(" i j"), max_new_tokens=2)
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


async def status(address: str, service: str = "") -> tuple[bool, str]:
    return await asyncio.to_thread(healthcheck.status, address, 5.0, service)


async def test_auto_is_ready_without_a_producer_and_the_link_is_reported_apart():
    async with servers(None, {}) as (_, consumer):  # no producer at all; default auto
        assert await health(consumer.address) == SERVING
        assert await status(consumer.address) == (True, "SERVING")
        ok, line = await status(consumer.address, HEALTH_SERVICE)
        assert not ok and line.startswith("NOT_SERVING: producer link unreachable")
        async with ConsumerClient(consumer.address) as client:
            answer = await client.generate(timeout=30, **FIELDS)  # served by the consumer's own prefill
            described = await client.describe()
        assert answer.stats.transfer.name == "oracle" and answer.stats.auto.candidates
        assert described.producer_link.state == "unreachable" and not described.producer_link.usable
    async with servers(None, {"default_mode": "raw"}) as (_, consumer):  # a fixed transfer default needs it
        ok, line = await status(consumer.address)
        assert not ok and line.startswith("NOT_SERVING: default mode raw needs the producer: producer unreachable")
    missing = await status("127.0.0.1:1")
    assert missing[0] is False and missing[1].startswith("UNREACHABLE: 127.0.0.1:1: UNAVAILABLE")


async def test_a_naive_reuse_default_is_a_startup_error_unless_allowed(tmp_path):
    perturbed_model("tiny-llama", seed=3, scale=0.02, save_to=tmp_path)
    producer = ProducerServer(ProducerConfig(port=0, model="tiny-llama", device="cpu", drain_grace_s=0))
    await producer.start()
    await producer.load()
    try:
        for kw, refused in (({"default_mode": "raw"}, True), ({"default_mode": "quant", "allow_naive_reuse_default": True}, False)):
            consumer = ConsumerServer(ConsumerConfig(port=0, model=str(tmp_path), device="cpu", producer=producer.address,
                                                     drain_grace_s=0, **kw))
            await consumer.start()
            try:
                if refused:
                    with pytest.raises(StartupError) as err:
                        await consumer.load()
                    assert "--default-mode raw: naive reuse" in str(err.value)
                    assert "--allow-naive-reuse-default" in str(err.value)
                else:
                    await consumer.load()
                    async with ConsumerClient(consumer.address) as client:
                        answer = await client.generate(timeout=30, **FIELDS)
                    assert answer.stats.transfer.name == "quant" and answer.stats.bytes_received > 0
            finally:
                await consumer.stop(0)
    finally:
        await producer.stop(0)


async def test_describe_shows_the_default_schedule_and_budget_and_the_stats_the_trail():
    """The shipped pair without its producer: the artifact's default is the schedule chosen on
    validation (s5, R2.R64), auto's default budget is its loss and admits it; a no-mode request's
    stats list only the candidates within reach, count the rest by why, and the log line says
    what auto chose, why, its estimate and the measured TTFT."""
    tuned = str(ROOT / "checkpoints" / "qa-tuned")
    consumer = ConsumerServer(ConsumerConfig(port=0, model=tuned, device="cpu", producer=f"127.0.0.1:{free_port()}",
                                             artifacts=ARTIFACT, drain_grace_s=0))
    await consumer.start()
    await consumer.load()
    try:
        async with ConsumerClient(consumer.address) as client:
            described = await client.describe()
            (art,) = described.artifacts
            assert art.default_schedule == "s5" and "validation" in art.default_schedule_chosen_on
            s5 = next(s for s in art.schedules if s.name == "s5")
            budget = described.auto_default_budget
            assert s5.schedule == "R2.R64" and budget.max_loss == pytest.approx(s5.calibrated_loss) and "s5" in budget.source
            ex = make_example(seed=5, split="test", ctx_tokens=256, task="tuned")
            structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))  # tests log WARNING
            with structlog.testing.capture_logs() as lines:
                answer = await client.generate(timeout=60, context=prompt(ex.context), question=prompt(ex.question),
                                               max_new_tokens=2)
    finally:
        logs.configure("tests", os.environ.get("SCD_TEST_LOG_LEVEL", "WARNING"))
        await consumer.stop(0)
    auto = answer.stats.auto
    assert answer.stats.transfer.name == "oracle" and [c.mode for c in auto.candidates] == ["oracle"]
    assert all(c.within_budget and c.key for c in auto.candidates)
    why = {e.reason: e for e in auto.excluded}
    assert why["the producer link is unusable"].count == 2  # s5 and s6 are within the loss budget
    over = next(e for r, e in why.items() if r.startswith("over the loss budget"))
    assert over.count == 5 and all("schedule=s" in k for k in over.candidates)
    for c in auto.candidates:
        assert all(v != "" for v in c.options.values())
    (done,) = [line for line in lines if line["event"] == "generate.done"]
    assert done["auto_choice"] == "oracle" and auto.reason.startswith(done["auto_reason"]) and done["ttft_ms"] > 0
    assert done["auto_estimate_ms"] is None or not math.isnan(done["auto_estimate_ms"])


async def test_an_idle_consumer_probes_in_the_background():
    async with running_pair("tiny-llama", consumer_kw={"probe_idle_s": 0.3, "prefix_cache_bytes": 0}) as pair:
        planner = pair.consumer.servicer.planner
        for _ in range(200):  # no request at all: the probes alone measure the producer and the link
            if planner.producer_prefill.count >= 2:
                break
            await asyncio.sleep(0.1)
        snapshot = planner.snapshot()
        assert snapshot["producer_prefill.samples"] >= 2 and snapshot["producer_prefill.ms_per_token"] >= 0
        assert pair.consumer.probe is not None and pair.consumer.probe.runs >= 2 and planner.header_ms
        described = await pair.client.describe()
        assert described.estimates["producer_prefill.samples"] >= 2 and "producer_queue.age_s" in described.estimates


async def test_a_consumer_serving_locally_probes_the_idle_link():
    """Auto keeps choosing its own prefill because the link looked slow: no request measures the
    link, so a rate step up would never be seen. A small probe does, while the link is idle
    (issue 31: adaptation after a rate step); the idle probe (probe_idle_s) never fires here."""
    consumer_kw = {"probe_idle_s": 60.0, "prefix_cache_bytes": 0, "metrics_port": 0}
    async with running_pair("tiny-llama", consumer_kw=consumer_kw) as pair:
        planner, chooser, probe = pair.consumer.servicer.planner, pair.consumer.servicer.chooser, pair.consumer.probe
        assert probe is not None
        for mode in ("raw", "oracle", "raw", "oracle"):  # every estimate measured
            await pair.client.generate(timeout=30, mode=mode, **FIELDS)
        assert probe.link_runs == 0
        slow_own_prefill(planner, ms_per_token=50.0)  # the own prefill: 400 ms here, so a fast link would win ...
        planner.observe_abandoned(1 << 20, 1e6)  # ... but the link read ~1 byte/ms: remote transfers look hopeless
        answer = await pair.client.generate(timeout=30, **FIELDS)
        assert answer.stats.transfer.name == "oracle" and chooser.local_choice_at > 0
        for _ in range(100):
            if probe.link_runs:
                break
            await asyncio.sleep(0.1)
        assert probe.link_runs >= 1 and probe.failures == 0
        assert planner.link_bytes_per_ms.value is not None and planner.link_bytes_per_ms.value > 100  # measured again
        assert probe.link_every_s >= 2.0  # spaced: at most one in LINK_PROBE_MIN_S
        slow_own_prefill(planner, ms_per_token=50.0)
        planner.observe_abandoned(1 << 20, 1e6)  # slow again: served locally again, so the probes go on
        answer = await pair.client.generate(timeout=30, **FIELDS)
        assert answer.stats.transfer.name == "oracle"
        for _ in range(100):
            if probe.link_runs >= 2:
                break
            await asyncio.sleep(0.1)
        # the same context again: replayed from the producer's store, paced by the link, not a forward
        assert probe.link_runs >= 2 and probe.last_link is not None and probe.last_link.producer_store_hit
        samples = scrape(pair.consumer.server.metrics_port)
        assert value(samples, "scd_background_probes_total", why="link") == probe.link_runs
        assert value(samples, "scd_background_probes_total", why="idle") == 0  # never idle for 60 s here


async def test_messages_name_what_to_fix():
    """Issue 31, item 9: env values and flags named without Python's words, the token hint naming
    both flags, a plaintext channel to a TLS producer read as a TLS failure, a refused token
    logged by the producer."""
    import grpc

    from consumer.link import readiness
    from shared import config as config_lib
    from shared.pb import producer_pb2, producer_pb2_grpc

    with pytest.raises(config_lib.FlagError) as err:
        config_lib.load(ConsumerConfig, "consumer", [], env={"SCD_CONSUMER_MAX_TEXT_BYTES": "abc"})
    assert str(err.value) == "SCD_CONSUMER_MAX_TEXT_BYTES='abc': not an integer"
    with pytest.raises(config_lib.FlagError) as err:
        config_lib.load(ConsumerConfig, "consumer", ["--reflection", "maybe"], env={})
    assert "invalid boolean" in str(err.value) and "parse_bool" not in str(err.value)
    refused = readiness.failure(grpc.StatusCode.UNAUTHENTICATED, "")
    assert refused is not None and "--producer-token or --producer-token-file" in str(refused)

    class Closed(grpc.aio.AioRpcError):
        def __init__(self):
            super().__init__(grpc.StatusCode.UNAVAILABLE, None, None, details="Socket closed")

    assert readiness.classify(Closed(), "plaintext").state == "tls_failed"
    producer = ProducerServer(ProducerConfig(port=0, model="tiny-llama", device="cpu", drain_grace_s=0, token="secret"))
    await producer.start()
    try:
        with structlog.testing.capture_logs() as lines:
            async with grpc.aio.insecure_channel(producer.address) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as rpc:
                    await producer_pb2_grpc.ProducerServiceStub(channel).Describe(
                        producer_pb2.ProducerServiceDescribeRequest(), timeout=10)
        assert rpc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        (line,) = [x for x in lines if x["event"] == "auth.rejected"]
        assert line["why"] == "no bearer token" and "Describe" in line["method"] and "secret" not in str(line)
    finally:
        await producer.stop(0)
