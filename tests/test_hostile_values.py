"""Finite but absurd K/V from a hostile producer, against a real consumer: keys or values of 3e38,
1e30 or just past the limit of the consumer's layer (shared.kv_bound), in float32 and bfloat16
streams, to a float32 and a bfloat16 consumer, alone and among good requests decoded in the same
batches, and through every codec that carries values (raw, quant, scd, recompute): each fails
DATA_LOSS naming the layer, the tensor and the limit, never an answer with status OK; the good
requests get exactly their own tokens; every slot and block comes back.

Streams are the real producers' recordings (tests/test_hostile_producer.py's `world`, plus a
bfloat16 producer's raw stream and a recompute stream) with one layer rewritten, CRCs fixed.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from consumer.api.client import ConsumerClient
from producer.server import ProducerServer
from shared.config import ProducerConfig
from tests import test_hostile_producer
from tests.hostile import all_back, chunks, consumer_of, copy, poke, record, set_data
from tests.test_hostile_producer import DL, P8, ask, generate_fields, tokens

world = test_hostile_producer.world  # the real producer, its artifact and recordings (a module fixture: built again here)

LAYER = 1
PAST = 1.02  # "just past": 2% over the limit, after rounding to bfloat16 (2^-8) still past it
ELEMENT = {torch.float32: 4, torch.bfloat16: 2}


@pytest.fixture(scope="module")
async def streams(world):
    """Recordings by stream dtype: the world's float32 raw, quant, scd and recompute streams, and a
    bfloat16 producer's raw stream, of the same context."""
    producer = ProducerServer(
        ProducerConfig(port=0, model="tiny-llama", dtype="bfloat16", device="cpu", max_chunk_bytes=1024, drain_grace_s=0)
    )
    await producer.start()
    await producer.load()
    try:
        bf16_raw = await record(producer.address, world["ids"], "raw")
    finally:
        await producer.stop(0)
    rec = world["rec"]
    recompute = await record(world["producer"].address, world["ids"], "recompute", {"start": "1", "end": "2"})
    return {"float32": rec["raw"], "bfloat16": bf16_raw, "quant": rec["quant"], "scd": rec["scd"], "recompute": recompute}


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
async def consumer(request, world):
    """A real consumer of the consumer dtype `param` behind a hostile producer whose script each test sets."""
    holder: dict = {}
    async with consumer_of(lambda r: holder["script"](r), artifacts=str(world["path"]), dtype=request.param) as (server, _):
        client = ConsumerClient(server.address)
        yield holder, client, server
        await client.channel.close()


def absurd(messages, kind: str, value, limit: float, layer: int = LAYER) -> list:
    """`messages` with payload `kind` of `layer` rewritten: every element `value`, or for "past"
    one element of -limit * PAST (a single element: the check reads every one). The chunks'
    element type is the stream's (header.kv_dtype)."""
    dtype = getattr(torch, messages[0].header.kv_dtype)
    out = [copy(m) for m in messages]
    targets = chunks(out, kind, layer=layer)
    assert targets, (kind, layer)  # a mutation that finds nothing to mutate tests nothing
    if value == "past":
        poke(out[targets[-1]], dtype, 1, -limit * PAST)
        return out
    for i in targets:
        n = len(out[i].chunk.data) // ELEMENT[dtype]
        set_data(out[i], torch.full((n,), value, dtype=dtype).view(torch.uint8).numpy().tobytes())
    return out


def limit_of(server, kind: str, layer: int = LAYER) -> float:
    bound = server.servicer.loaded.kv_bounds[layer]
    return bound.keys if kind == "k" else bound.values


def assert_refused(err, received, kind: str, limit: float, layer: int = LAYER) -> None:
    name = "keys" if kind == "k" else "values"
    assert err is not None, f"status OK with {len(received)} messages: absurd {name} were answered"
    assert err.code() == DL and f"layer {layer}: rebuilt {name} reach |" in err.details(), err.details()
    assert f"past {limit:.4g}" in err.details(), err.details()
    assert received == []


@pytest.mark.parametrize("stream_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["k", "v"])
@pytest.mark.parametrize("value", [3e38, 1e30, "past"], ids=["3e38", "1e30", "just_past"])
async def test_absurd_raw_kv_fail_with_data_loss_naming_the_layer(streams, consumer, stream_dtype, kind, value):
    holder, client, server = consumer
    limit = limit_of(server, kind)
    holder["script"] = lambda request: absurd(streams[stream_dtype], kind, value, limit)
    received, err = await ask(client, **generate_fields("raw", {}))
    assert_refused(err, received, kind, limit)
    await all_back(server)


@pytest.mark.parametrize("stream_dtype", ["float32", "bfloat16"])
async def test_absurd_kv_inside_a_batch_fail_alone(streams, consumer, stream_dtype):
    """Nine requests at once, every other one hostile (keys or values of 3e38, 1e30, just past):
    each hostile one fails DATA_LOSS naming its layer and limit, each good one gets exactly the
    tokens it gets alone."""
    holder, client, server = consumer
    good = streams[stream_dtype]
    variants = [("k", 3e38), ("v", 1e30), ("k", "past"), ("v", "past")]
    holder["script"] = lambda request: good
    fields = {**generate_fields("raw", {}), "max_new_tokens": 8}
    alone, err = await ask(client, **fields)
    assert err is None
    by_id = {f"hostile-{n}": absurd(good, kind, value, limit_of(server, kind)) for n, (kind, value) in enumerate(variants)}
    holder["script"] = lambda request: by_id.get(request.request_id, good)
    names = [f"hostile-{i // 2}" if i % 2 else f"good-{i}" for i in range(2 * len(variants) + 1)]
    results = await asyncio.gather(*(ask(client, request_id=name, **fields) for name in names))
    for name, (received, err) in zip(names, results):
        if name.startswith("hostile"):
            kind = variants[int(name.split("-")[1])][0]
            assert_refused(err, received, kind, limit_of(server, kind))
        else:
            assert err is None, (name, err)
            assert tokens(received) == tokens(alone), name
    await all_back(server)


def fp16_max(messages, names: tuple[str, ...], layer: int = LAYER) -> list:
    """Payloads `names` of `layer` at fp16's largest (65504): quant's key scales and minimums
    (dequantized keys reach ~1.7e7), a Reuse layer's code scales, a Patch's normalized input.
    Finite in every dtype, far past any limit of the tiny model."""
    out = [copy(m) for m in messages]
    for name in names:
        targets = chunks(out, name, layer=layer)
        assert targets, (name, layer)
        for i in targets:
            n = len(out[i].chunk.data) // 2
            set_data(out[i], torch.full((n,), 65504.0, dtype=torch.float16).view(torch.uint8).numpy().tobytes())
    return out


async def test_every_codec_refuses_kv_past_the_limit(world, streams, consumer):
    """quant (scales), scd (its raw action at 3e38, a Reuse layer's codes checked against the
    Reuse limit, a Patch's normalized input) and recompute (a raw layer outside its span, layer
    2) refuse absurd rebuilt K/V; the unmutated streams of each answer."""
    holder, client, server = consumer
    rec = world["rec"]
    cheap = {"schedule": world["art"].schedules[0].name}  # Reuse (R2) on every layer
    # the layers the default schedule sends raw (W) and as a Patch (P): calibration picks that schedule
    # by measured loss, so it differs between CPUs (W.P.W.P on an AVX2 host)
    schedule = str(world["art"].default_entry().schedule).split(".")
    raw_layer, patch_layer = schedule.index("W"), schedule.index("P")
    span = {"start": "1", "end": "2"}
    cases = [
        ("quant", {"bits": "8"}, "quant", lambda m: fp16_max(m, ("k_scale", "k_min")), LAYER),
        ("scd", {}, "scd", lambda m: absurd(m, "k", 3e38, 0, layer=raw_layer), raw_layer),
        ("scd", {}, "scd", lambda m: fp16_max(m, ("x",), patch_layer), patch_layer),
        ("scd", cheap, "cheap_scd", lambda m: fp16_max(m, ("z_scale",)), LAYER),
        ("scd", {"schedule": P8}, "p8_scd", lambda m: fp16_max(m, ("x_scale",)), LAYER),  # an int8 Patch's scales
        ("recompute", span, "recompute", lambda m: absurd(m, "k", 1e30, 0, layer=2), 2),
    ]
    for codec, options, key, mutate, layer in cases:
        recording = streams.get(key) or rec[key]
        mutated = mutate(recording)
        holder["script"] = lambda request, m=mutated: m
        received, err = await ask(client, **generate_fields(codec, options))
        assert err is not None and err.code() == DL, (codec, key, err)
        assert f"layer {layer}: rebuilt keys reach |" in err.details() and received == [], (codec, key, err.details())
        await all_back(server)
        holder["script"] = lambda request, m=recording: m  # the control: the unmutated stream answers
        received, err = await ask(client, **generate_fields(codec, options))
        assert err is None and received[-1].stats.transfer.name == codec, (codec, key, err)
