"""Chunked prefix reuse through the real services (float32): a conversation's next turn
continues the producer's stored prefix across a chunk boundary and answers exactly what a cold
run answers; PrefillRequest.first_token and prefix_key; the disk tier survives a restart and
never serves flipped or truncated bytes; a prefix of another model is never served."""

from __future__ import annotations

import asyncio
from contextlib import AbstractAsyncContextManager

import grpc
import pytest
import torch
from safetensors import safe_open

from producer.server import ProducerServer
from shared import chunks, wire
from shared.pb import common_pb2, producer_pb2, producer_pb2_grpc
from tests.conftest import perturbed_model, prompt, running_pair
from tests import test_single_flight as single_flight
from tests.test_metrics import scrape, value
from tests.test_prefill_engine import contexts, held

C = 64
QUANT = common_pb2.CodecSpec(name="quant", options={"bits": "8"})


def producer(model: str = "tiny-llama", **kw) -> AbstractAsyncContextManager[tuple[ProducerServer, producer_pb2_grpc.ProducerServiceStub]]:
    return single_flight.producer(**{"model": model, "chunk_tokens": C, **kw})


async def prefill(stub, ids, spec=QUANT, **fields) -> tuple[producer_pb2.PrefillHeader, dict, producer_pb2.PrefillTrailer]:
    """(header, {(layer, kind): tensor}, trailer) of one Prefill stream."""
    header, parts, trailer = None, {}, None
    async for m in stub.Prefill(producer_pb2.PrefillRequest(token_ids=ids, codec=spec, **fields), timeout=60):
        kind = m.WhichOneof("kind")
        if kind == "header":
            header = m.header
        elif kind == "chunk":
            parts.setdefault((m.chunk.layer, m.chunk.kind), []).append(m.chunk)
        else:
            trailer = m.trailer
    return header, {k: wire.payload_from_pb(v) for k, v in parts.items()}, trailer


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and (a[k] == b[k]).all() for k in a)


def key_for(header: producer_pb2.PrefillHeader, ids: list[int], first: int, tenant: str = "") -> str:
    """What a consumer computes from an earlier stream's header (see PrefillRequest.prefix_key)."""
    root = chunks.codec_root(header.producer.identity, header.kv_dtype, header.codec.name, header.codec_format_version,
                             dict(header.codec.options), dict(header.codec_metadata), tenant)
    return chunks.prefix_key(root, ids, first, header.chunk_tokens)


@pytest.mark.parametrize("spec", [common_pb2.CodecSpec(name="raw"), QUANT, common_pb2.CodecSpec(name="recompute")],
                         ids=["raw", "quant", "recompute"])
async def test_the_next_turn_continues_the_stored_prefix_and_answers_as_cold(spec):
    turns = [contexts(C + 30, seed=11)[0]]
    for extra in (50, 70):  # each turn crosses a chunk boundary
        turns.append(turns[-1] + contexts(extra, seed=len(turns))[0])
    question = prompt(ids=[17, 42, 99])
    answers = {}
    # turn 2 reuses chunk 0 (64 of 144 tokens), turn 3 chunks 0-1 (128 of 214); raw also continues
    # from the stored tail, cut to a multiple of 16: 64 + 16 of turn 1's 30, and 128 + 16 (quant's
    # 32-token key groups take none of a 30- or 16-token tail; recompute keeps no K/V tails)
    reused = 80 + 144 if spec.name == "raw" else 64 + 128
    for kw in ({"chunk_tokens": 0, "store_bytes": 0}, {"chunk_tokens": C, "metrics_port": 0}):
        async with running_pair("tiny-llama", producer_kw=kw, consumer_kw={"prefix_cache_bytes": 0}) as pair:
            answers[kw["chunk_tokens"]] = [
                (await pair.generate(context=prompt(ids=ids), question=question, max_new_tokens=6, transfer=spec))[0]
                for ids in turns
            ]
            stats = (await pair.producer_stub.Describe(producer_pb2.ProducerServiceDescribeRequest(), timeout=5)).stats
            if kw["chunk_tokens"]:
                samples = await asyncio.to_thread(scrape, pair.producer.server.metrics_port)
                assert value(samples, "scd_prefill_tokens_reused_total") == reused
                assert value(samples, "scd_prefill_partial_hits_total") == 2
                assert value(samples, "scd_store_tier_entries", tier="ram") == stats.store_tiers[0].entries
    assert answers[C] == answers[0]  # token-identical to a cold run
    assert stats.store_partial_hits == 2 and stats.prefill_tokens_reused == reused
    assert stats.prefill_tokens_computed == (C + 30) + 144 + 214 - reused
    assert [t.name for t in stats.store_tiers] == ["ram"] and stats.store_tiers[0].entries > 0


async def test_first_token_sends_only_the_rest_after_checking_the_prefix_key():
    ids = contexts(2 * C + 40, seed=21)[0]
    async with producer() as (_, stub):
        header, full, trailer = await prefill(stub, ids)
        assert header.chunk_tokens == C and header.first_token == 0 and trailer.computed_tokens == len(ids)
        key = key_for(header, ids, C)
        header2, rest, trailer2 = await prefill(stub, ids, first_token=C, prefix_key=key)
        assert header2.first_token == C and header2.prefix_key == key and header2.num_tokens == len(ids)
        assert trailer2.store_hit and trailer2.reused_tokens == len(ids)  # all of it stored: replayed
        group = int(header.codec.options["group_size"])
        for (layer, kind), t in full.items():
            cut = C // group if kind in ("k_scale", "k_min") else C  # key scales: one per group of tokens
            assert (rest[(layer, kind)] == t[:, cut:]).all(), (layer, kind)
        assert trailer2.payload_bytes < trailer.payload_bytes

        for bad, code in (
            ({"first_token": 30, "prefix_key": key}, grpc.StatusCode.INVALID_ARGUMENT),  # not a chunk boundary
            ({"first_token": 3 * C, "prefix_key": key}, grpc.StatusCode.INVALID_ARGUMENT),  # past the context
            ({"prefix_key": key}, grpc.StatusCode.INVALID_ARGUMENT),  # a key without a first token
            ({"first_token": C}, grpc.StatusCode.INVALID_ARGUMENT),  # a first token without a key
            ({"first_token": C, "prefix_key": key_for(header, [1, *ids[1:]], C)}, grpc.StatusCode.FAILED_PRECONDITION),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await prefill(stub, ids, **bad)
            assert err.value.code() == code, bad
        # another codec's options: its prefix was built from another stream
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await prefill(stub, ids, spec=common_pb2.CodecSpec(name="quant", options={"bits": "4"}), first_token=C, prefix_key=key)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "prefix_key" in err.value.details()
        # a codec whose payloads do not cut at chunk boundaries refuses a first token
        wide = common_pb2.CodecSpec(name="quant", options={"bits": "8", "group_size": "128"})
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await prefill(stub, ids, spec=wide, first_token=C, prefix_key=key)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    async with producer(store_bytes=0) as (_, stub):  # holding nothing: computes all, sends the rest
        _, rest_cold, trailer = await prefill(stub, ids, first_token=C, prefix_key=key)
        assert same(rest_cold, rest) and trailer.computed_tokens == len(ids) and not trailer.store_hit
    async with producer(chunk_tokens=0) as (_, stub):  # chunked reuse off
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await prefill(stub, ids, first_token=C, prefix_key=key)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "chunk_tokens=0" in err.value.details()


async def test_the_disk_tier_survives_a_restart_and_never_serves_bad_bytes(tmp_path):
    ids = contexts(2 * C + 40, seed=31)[0]
    disk = {"store_disk_dir": str(tmp_path / "chunks")}
    async with producer(**disk) as (server, stub):
        _, cold, _ = await prefill(stub, ids)
        server.servicer.chunks.disk.flush()
    files = sorted((tmp_path / "chunks").glob("*.safetensors"))
    assert len(files) == 3  # quant reads only K/V: its payloads are encoded from the 3 chunks' stored K/V

    async with producer(**disk) as (server, stub):  # restarted: RAM empty, the disk tier serves
        _, warm, trailer = await prefill(stub, ids)
        assert trailer.store_hit and trailer.computed_tokens == 0 and same(warm, cold)
        tiers = {t.name: t for t in (await stub.Describe(producer_pb2.ProducerServiceDescribeRequest(), timeout=5)).stats.store_tiers}
        assert tiers["disk"].entries == 3 and tiers["disk"].hits == 3 and tiers["ram"].entries == 3

    for path in files:  # flip bytes at the end of every file (tensor data), truncate the tail's
        data = bytearray(path.read_bytes())
        data[-8:] = bytes(b ^ 0xFF for b in data[-8:])
        path.write_bytes(data)
    tail = max(files, key=lambda p: int(safe_open(str(p), framework="pt").metadata()["end"]))
    tail.write_bytes(tail.read_bytes()[:-100])
    async with producer(**disk) as (server, stub):
        _, again, trailer = await prefill(stub, ids)
        assert not trailer.store_hit and trailer.reused_tokens == 0 and same(again, cold)  # prefilled, never bad bytes
        disk_tier = server.servicer.chunks.disk
        assert disk_tier.corrupt == 2  # the truncated file at the scan, the flipped first chunk the plan read
        server.servicer.chunks.disk.flush()
        _, fixed, trailer = await prefill(stub, ids)  # rewritten by the prefill: served again
        assert trailer.store_hit and same(fixed, cold)


async def test_a_prefix_of_another_model_is_never_served(tmp_path):
    ids = contexts(2 * C + 40, seed=41)[0]
    other = tmp_path / "other-llama"
    perturbed_model("tiny-llama", seed=1, scale=0.02, save_to=other)
    disk = {"store_disk_dir": str(tmp_path / "chunks")}
    async with producer(**disk) as (server, stub):
        await prefill(stub, ids)
        server.servicer.chunks.disk.flush()
    async with producer(str(other), store_bytes=0) as (_, stub):
        _, cold_other, _ = await prefill(stub, ids)
    async with producer(str(other), **disk) as (_, stub):  # same disk, same tokens, another model
        _, got, trailer = await prefill(stub, ids)
        assert not trailer.store_hit and trailer.reused_tokens == 0 and same(got, cold_other)
        _, got, trailer = await prefill(stub, ids + [5] * 10)  # a longer context: no prefix of the first model either
        assert trailer.reused_tokens == 2 * C + 32  # only its own chunks and tail (cut to 32), stored by the call above


async def test_a_restart_in_another_dtype_reuses_nothing_computed_in_the_first(tmp_path):
    """Chunk keys carry the dtype the K/V was computed in: a bfloat16 producer restarted on a
    float32 producer's disk tier neither replays its float32 chunks (raw payloads of another dtype
    than the header's kv_dtype) nor continues a prefill from them (stored K/V cast); it sends what a
    bfloat16 producer on an empty disk tier sends, request after request."""
    ids = contexts(2 * C + 40, seed=61)[0]
    longer = ids + contexts(50, seed=62)[0]  # the next turn: continues a stored prefix
    raw = common_pb2.CodecSpec(name="raw")
    disk = {"store_disk_dir": str(tmp_path / "chunks")}
    async with producer(dtype="float32", **disk) as (server, stub):
        for context in (ids, longer):
            await prefill(stub, context, spec=raw)
        server.servicer.chunks.disk.flush()
    assert len(list((tmp_path / "chunks").glob("*.safetensors"))) >= 3
    streams = {}
    for name, where in (("fresh", tmp_path / "empty"), ("restarted", tmp_path / "chunks")):
        async with producer(dtype="bfloat16", store_disk_dir=str(where)) as (_, stub):
            streams[name] = [await prefill(stub, context, spec=raw) for context in (ids, longer)]
    for (fresh_header, fresh, fresh_trailer), (header, got, trailer) in zip(streams["fresh"], streams["restarted"]):
        assert header.kv_dtype == "bfloat16" and {t.dtype for t in got.values()} == {torch.bfloat16}
        assert same(got, fresh)
        assert (trailer.store_hit, trailer.reused_tokens) == (fresh_trailer.store_hit, fresh_trailer.reused_tokens)
    assert streams["restarted"][0][2].reused_tokens == 0 and streams["restarted"][1][2].reused_tokens > 0  # its own chunks only


async def test_a_turn_arriving_while_its_prefix_prefills_waits_and_continues_it():
    first = contexts(2 * C + 10, seed=51)[0]
    second = first + contexts(40, seed=52)[0]
    async with producer() as (server, stub):
        with held(server.executor):  # the first turn's prefill waits for the compute thread
            a = asyncio.ensure_future(prefill(stub, first))
            await single_flight.until(lambda: len(server.servicer.flights.running) == 1)
            b = asyncio.ensure_future(prefill(stub, second))
            await single_flight.until(lambda: server.servicer.prefix_waits == 1)
        (_, _, ta), (_, waited, tb) = await asyncio.gather(a, b)
        assert ta.computed_tokens == len(first) and tb.reused_tokens == 2 * C and tb.computed_tokens == len(second) - 2 * C
        assert not server.servicer.prefix_flights  # forgotten once the flights ended
    async with producer(store_bytes=0) as (_, stub):
        _, cold, _ = await prefill(stub, second)
    assert same(waited, cold)
