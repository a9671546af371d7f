"""Prometheus endpoints of a real pair: scraped after real requests, the counts moved (RPCs by
method and status, latency, per-mode stage histograms and bytes, store hits/misses, in-flight,
admission, fallbacks, stream-contract statuses). Two servers in one process do not collide."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import urllib.request

import grpc
import pytest
import structlog
from prometheus_client.parser import text_string_to_metric_families

from shared import logs, metrics_http
from shared.metrics import Metrics
from shared.pb import common_pb2, consumer_pb2, producer_pb2
from tests.conftest import prompt, running_pair

CONTEXT = dict(context=prompt("the quick brown fox jumps over the lazy dog"), question=prompt("fox ?"), max_new_tokens=2)


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture(scope="module")
async def pair():
    async with running_pair(
        "tiny-llama", producer_kw=dict(metrics_port=0), consumer_kw=dict(metrics_port=0, prefix_cache_bytes=0)
    ) as pair:
        yield pair


async def test_counts_move_after_real_requests(pair):
    producer_port, consumer_port = pair.producer.server.metrics_port, pair.consumer.server.metrics_port
    assert producer_port > 0 and consumer_port > 0 and producer_port != consumer_port
    for mode in ("oracle", "raw", "raw"):  # the second raw is a producer store hit
        await pair.generate(transfer=common_pb2.CodecSpec(name=mode), **CONTEXT)
    with pytest.raises(grpc.aio.AioRpcError):
        await pair.generate(max_new_tokens=100000, context=prompt("a"), question=prompt("b"))

    c = scrape(consumer_port)
    generate = "Generate"
    assert value(c, "scd_rpc_total", method=generate, code="OK") == 3
    assert value(c, "scd_rpc_total", method=generate, code="INVALID_ARGUMENT") == 1
    assert value(c, "scd_rpc_duration_seconds_count", method=generate) == 4
    assert value(c, "scd_generate_total", mode="raw") == 2 and value(c, "scd_generate_total", mode="oracle") == 1
    for stage in ("ttft", "transfer", "rebuild", "question_prefill", "decode"):
        assert value(c, "scd_generate_stage_seconds_count", stage=stage, mode="raw") == 2
    assert value(c, "scd_transfer_bytes_total", mode="raw") > 0
    assert value(c, "scd_transfer_bytes_total", mode="oracle") == 0
    assert value(c, "scd_inflight") == 0 and value(c, "scd_inflight_limit") == pair.consumer.config.max_inflight
    assert (("scd_admission_rejected_total", (("reason", "limit"),))) in c

    p = scrape(producer_port)
    assert value(p, "scd_rpc_total", method="Prefill", code="OK") == 2
    assert value(p, "scd_store_hits_total") == 1 and value(p, "scd_store_misses_total") == 1
    assert value(p, "scd_store_bytes") > 0 and value(p, "scd_store_entries") == 1
    assert ("scd_rpc_total", (("code", "OK"), ("method", generate))) not in p  # registries are per server


async def test_producer_log_lines_carry_the_request_id(pair):
    """Every producer log line of a request carries the consumer's request id (x-request-id)."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    try:
        with structlog.testing.capture_logs(processors=[structlog.contextvars.merge_contextvars]) as lines:
            spec = common_pb2.CodecSpec(name="raw")
            await pair.generate(
                transfer=spec,
                request_id="rid-metrics-1",
                context=prompt("one two three four five"),
                question=prompt("six"),
                max_new_tokens=1,
            )
    finally:
        logs.configure("tests", os.environ.get("SCD_TEST_LOG_LEVEL", "WARNING"))
    producer_lines = [x for x in lines if str(x.get("event", "")).startswith("prefill.")]
    assert {x["event"] for x in producer_lines} >= {"prefill.start", "prefill.done"}
    assert all(x.get("request_id") == "rid-metrics-1" for x in producer_lines), producer_lines


async def test_stream_contract_statuses_and_fallbacks_are_counted(pair):
    """A Prefill the producer refuses as a precondition is counted as a contract status; a
    producer that went away under LOCAL_PREFILL is a fallback, not an error."""
    with pytest.raises(grpc.aio.AioRpcError) as err:
        request = producer_pb2.PrefillRequest(token_ids=[5, 6, 7], consumer_weight_digest="0" * 64)
        request.codec.name = "scd"
        async for _ in pair.producer_stub.Prefill(request, timeout=10):
            pass
    code = err.value.code().name
    p = scrape(pair.producer.server.metrics_port)
    assert value(p, "scd_rpc_total", method="Prefill", code=code) == 1
    if code in ("DATA_LOSS", "FAILED_PRECONDITION"):
        assert value(p, "scd_stream_contract_violations_total", method="Prefill", code=code) == 1

    await pair.producer.stop(0)
    spec = common_pb2.CodecSpec(name="raw")
    _, _, stats = await pair.generate(
        transfer=spec, on_transfer_failure=consumer_pb2.TRANSFER_FAILURE_POLICY_LOCAL_PREFILL, **CONTEXT
    )
    assert stats.transfer_failure.startswith("UNAVAILABLE")
    c = scrape(pair.consumer.server.metrics_port)
    assert value(c, "scd_transfer_fallbacks_total", reason="UNAVAILABLE") == 1


def test_contract_codes_from_the_interceptor_record():
    metrics = Metrics("test")
    metrics.record("Generate", "DATA_LOSS", 0.01)
    metrics.record("Generate", "OK", 0.01)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in metrics.registry.collect() for s in f.samples}
    assert value(samples, "scd_stream_contract_violations_total", method="Generate", code="DATA_LOSS") == 1


async def test_each_service_exports_its_own_families_without_created_series_or_health():
    """Issue 19, finding 7: short method names, no health probes in the request metrics, no
    `_created` series, the consumer's and the producer's own families only, and the figures an
    operator looks for (raw-KV bytes, compression ratio, producer bytes sent, prefill/encode
    times, the producer link)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with running_pair("tiny-llama", producer_kw=dict(metrics_port=0), consumer_kw=dict(metrics_port=0)) as pair:
        async with grpc.aio.insecure_channel(pair.consumer.address) as channel:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        await pair.generate(transfer=common_pb2.CodecSpec(name="raw"), **CONTEXT)
        c, p = scrape(pair.consumer.server.metrics_port), scrape(pair.producer.server.metrics_port)
    for samples in (c, p):
        assert not [name for name, _ in samples if name.endswith("_created")]
        assert not [labels for name, labels in samples if name == "scd_rpc_total" and "/" in dict(labels)["method"]]
        assert not [labels for name, labels in samples if name == "scd_rpc_total" and dict(labels)["method"] == "Check"]
    assert value(c, "scd_raw_kv_bytes_total", mode="raw") > 0 and value(c, "scd_compression_ratio_count", mode="raw") >= 1
    assert value(c, "scd_producer_link", state="ok") == 1
    assert value(p, "scd_prefill_sent_bytes_total", codec="raw") > 0
    assert value(p, "scd_prefill_seconds_count", codec="raw") + value(p, "scd_store_hits_total") >= 1
    assert not [name for name, _ in p if name.startswith(("scd_generate", "scd_transfer", "scd_audit", "scd_producer_link"))]
    assert not [name for name, _ in c if name.startswith(("scd_store", "scd_prefill"))]


def test_audit_decisions_and_divergences_are_counted():
    from types import SimpleNamespace

    metrics = Metrics("scd.v1.ConsumerService")
    from shared.metrics import GENERATE_STAGES

    base = dict(
        codec="scd", bytes_received=100, raw_kv_bytes=1000, transfer_failure="", **{f"{s}_ms": 1.0 for s in GENERATE_STAGES}
    )
    for decision in ("ok", "diverged", "diverged: prefilled locally"):
        metrics.observe_generate(SimpleNamespace(audit_decision=decision, **base))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in metrics.registry.collect() for s in f.samples}
    assert value(samples, "scd_audit_decisions_total", decision="diverged_prefilled") == 1
    assert value(samples, "scd_audit_divergences_total", mode="scd") == 2
    assert value(samples, "scd_compression_ratio_sum", mode="scd") == 30.0


def test_the_metrics_port_bounds_what_idle_peers_hold(monkeypatch):
    """40 connections from one peer that never finish a request hold at most MAX_PER_PEER threads
    (the rest are closed unread), each only until its time is up; a scrape from another address
    succeeds meanwhile, and from the same one after. Before (prometheus_client's server: a thread
    per connection, no timeout): 5000 such peers held 1359 threads, 946 still there after they
    left (the script in shared/metrics_http.py's commit)."""
    monkeypatch.setattr(metrics_http._Handler, "timeout", 5.0)
    metrics = Metrics("test")
    port = metrics.serve(0, "127.0.0.1")
    before = threading.active_count()
    peers = [socket.create_connection(("127.0.0.1", port)) for _ in range(40)]
    try:
        for peer in peers:
            peer.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # the headers never end
        deadline = time.monotonic() + 4
        while metrics.http.refused < 40 - metrics_http.MAX_PER_PEER and time.monotonic() < deadline:
            time.sleep(0.01)
        assert metrics.http.refused == 40 - metrics_http.MAX_PER_PEER
        assert threading.active_count() - before <= 2 * metrics_http.MAX_PER_PEER  # a handler and its timer each
        assert b"scd_" in scrape_bytes(port, source="127.0.0.2")  # another address is served meanwhile
        time.sleep(6.0)  # the held ones are cut (no peer has to leave first)
        assert threading.active_count() <= before
        assert b"scd_" in scrape_bytes(port)
    finally:
        for peer in peers:
            peer.close()
        metrics.stop()


def scrape_bytes(port: int, source: str = "127.0.0.1") -> bytes:
    """GET /metrics from a chosen loopback source address (Linux routes all of 127/8 locally)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0)) as sock:
        sock.sendall(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.0 200"), reply[:200]
    return reply


def test_a_peer_trickling_its_request_is_cut_at_the_connections_time(monkeypatch):
    """A socket timeout restarts at every byte: MAX_CONNECTIONS peers from different addresses
    sending one header byte a second held every slot for as long as they went on (every scrape
    failed). A connection now lives at most TIMEOUT_S from its accept, whatever it sends."""
    monkeypatch.setattr(metrics_http._Handler, "timeout", 2.0)
    metrics = Metrics("test")
    port = metrics.serve(0, "127.0.0.1")
    peers = [
        socket.create_connection(("127.0.0.1", port), source_address=(f"127.0.1.{i}", 0))
        for i in range(1, metrics_http.MAX_CONNECTIONS + 1)
    ]
    try:
        for peer in peers:
            peer.sendall(b"GET /metrics HTTP/1.1\r\n")
        cut = set()
        start = time.monotonic()
        while len(cut) < len(peers) and time.monotonic() - start < 6:
            for i, peer in enumerate(peers):
                if i in cut:
                    continue
                try:
                    peer.sendall(b"X")  # one byte a tick: a socket timeout would never fire
                except OSError:
                    cut.add(i)
            time.sleep(0.5)
        assert len(cut) == len(peers), f"{len(peers) - len(cut)} trickling peers still held after {time.monotonic() - start:.1f} s"
        assert time.monotonic() - start < 2.0 + 2.5
        assert b"scd_" in scrape_bytes(port)
    finally:
        for peer in peers:
            peer.close()
        metrics.stop()


def test_a_connection_whose_timer_cannot_start_still_gives_its_slot_back(monkeypatch):
    """Out of threads, the cut's timer fails to start: the connection is served with its per-read
    timeout only and its peer and global slots come back (they leaked: every later scrape from
    that address was refused)."""
    metrics = Metrics("test")
    port = metrics.serve(0, "127.0.0.1")
    start = threading.Timer.start

    def refuse(self):
        if self.function is metrics_http._cut:
            raise RuntimeError("can't start new thread")
        return start(self)

    monkeypatch.setattr(threading.Timer, "start", refuse)
    try:
        for _ in range(metrics_http.MAX_PER_PEER + 2):
            assert b"scd_" in scrape_bytes(port)
        monkeypatch.setattr(threading.Timer, "start", start)
        deadline = time.monotonic() + 5
        while metrics.http.peers and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not metrics.http.peers and metrics.http.refused == 0
    finally:
        metrics.stop()
