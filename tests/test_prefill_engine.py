"""The producer's prefill engine without gRPC: batched forwards whose per-row captures and
encoded payloads equal batch-1 ones (float32), encoding off the forward, and a cancel or an
encode error inside a batch touching only its own request."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from calibration.distill import distill
from producer.encode import EncodePool
from producer.prefill import EncodedLayer, PrefillDone, PrefillEngine
from shared import codecs as codec_lib
from shared import kv
from shared.models import load_model
from shared.scd.artifact import discover
from tests.test_scd import heldout, random_corpus

ALL = kv.Capture.KV | kv.Capture.NORMED | kv.Capture.HIDDEN


def contexts(*lengths: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 380, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def llama():
    return load_model("tiny-llama", "float32", "cpu")


@torch.inference_mode()
def hf_states(loaded, ids: list[int]) -> dict[int, kv.LayerState]:
    """Every layer's states from Hugging Face's own forward (hooks on its modules): the reference."""
    states: dict[int, kv.LayerState] = {}
    cache = kv.empty_cache(loaded)
    with kv.layer_capture(loaded, cache, ALL, lambda s: states.__setitem__(s.index, s)):
        kv.prefill_context(loaded, torch.tensor([ids]), cache)
    return states


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_batched_capture_equals_batch_one_per_row(name):
    loaded = load_model(name, "float32", "cpu")
    rows = contexts(37, 5, 120, 64)
    needs = [ALL, kv.Capture.KV, kv.Capture.NORMED | kv.Capture.HIDDEN, ALL]
    batched: dict[tuple[int, int], kv.LayerState] = {}
    kv.batch_capture(loaded, rows, needs, lambda row, s: batched.__setitem__((row, s.index), s))
    for row, ids in enumerate(rows):
        reference = hf_states(loaded, ids)  # Hugging Face's modules, hooks
        alone: dict[int, kv.LayerState] = {}
        kv.batch_capture(loaded, [ids], [ALL], lambda _, s, alone=alone: alone.__setitem__(s.index, s))
        states, _ = kv.capture_states(loaded, ids, ALL)
        for index, ref in reference.items():
            got = batched[(row, index)]
            for f, flag in (("keys", kv.Capture.KV), ("values", kv.Capture.KV), ("normed", kv.Capture.NORMED),
                            ("hidden", kv.Capture.HIDDEN)):
                assert torch.equal(getattr(alone[index], f), getattr(ref, f))  # batch 1: bit for bit
                assert torch.equal(getattr(states[index], f), getattr(ref, f))
                if flag in needs[row]:
                    assert getattr(got, f).shape == getattr(ref, f).shape
                    torch.testing.assert_close(getattr(got, f), getattr(ref, f), atol=1e-5, rtol=0)
                else:
                    assert getattr(got, f) is None


def test_inactive_rows_leave_the_batch_and_the_rest_is_unchanged(llama):
    rows = contexts(90, 20, 40)
    full: dict[tuple[int, int], kv.LayerState] = {}
    kv.batch_capture(llama, rows, [ALL] * 3, lambda row, s: full.__setitem__((row, s.index), s))
    seen: dict[tuple[int, int], kv.LayerState] = {}
    kv.batch_capture(llama, rows, [ALL] * 3, lambda row, s: seen.__setitem__((row, s.index), s),
                     active=lambda row: row != 0 or len([k for k in seen if k[0] == 0]) < 2)
    assert sorted(i for r, i in seen if r == 0) == [0, 1]  # the longest row left after layer 1
    for (row, index), state in seen.items():
        torch.testing.assert_close(state.keys, full[(row, index)].keys, atol=1e-5, rtol=0)
        torch.testing.assert_close(state.hidden, full[(row, index)].hidden, atol=1e-5, rtol=0)


def keep_payloads(layer: int, payloads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return payloads


async def collect(stream) -> tuple[list[EncodedLayer], PrefillDone]:
    layers = []
    async with contextlib.aclosing(stream) as items:
        async for item in items:
            if isinstance(item, PrefillDone):
                return layers, item
            layers.append(item)
    raise AssertionError("no PrefillDone")


@contextlib.contextmanager
def held(executor: ThreadPoolExecutor):
    """The compute thread busy until the block ends: prefills queue up meanwhile."""
    release = threading.Event()
    executor.submit(release.wait)
    try:
        yield
    finally:
        release.set()


@pytest.fixture(scope="module")
def scd_codecs(llama, tmp_path_factory):
    art = distill(llama, llama, random_corpus(12, 96, 0), heldout(3, 1), corpus_name="random", generations=2,
                  log=lambda m: None)
    path = tmp_path_factory.mktemp("artifacts")
    art.save(path / "tiny-llama-homogeneous.safetensors")
    return codec_lib.create_codecs(llama, artifacts=discover([str(path)]))


def encoders(codecs, n_tokens: int):
    request = codec_lib.EncodeRequest(n_tokens)
    specs = [("raw", {}), ("quant", {"bits": "4"}), ("recompute", {}), ("scd", {"schedule": "R4.P.W.Q8"})]
    made = []
    for name, options in specs:
        codec = codecs[name]
        made.append(codec.encoder(codec.resolve(options), request))
    assert kv.Capture.NORMED in made[3].captures and kv.Capture.HIDDEN in made[2].captures
    return made


async def test_batched_prefills_encode_what_solo_prefills_encode(llama, scd_codecs):
    # whole quantization groups (32 tokens): a group of one token has a near-zero scale, and there
    # a 1e-7 difference in K moves its code anywhere
    rows = contexts(64, 32, 96, 64, seed=1)
    with ThreadPoolExecutor(1) as compute:
        engine = PrefillEngine(llama, compute, EncodePool(1), max_batch=8, max_batch_tokens=8192)
        solo = []
        for ids, encoder in zip(rows, encoders(scd_codecs, 0)):
            solo.append(await collect(engine.stream(ids, encoder, keep_payloads)))
        assert engine.forwards == 4
        with held(compute):
            tasks = [asyncio.ensure_future(collect(engine.stream(ids, encoder, keep_payloads)))
                     for ids, encoder in zip(rows, encoders(scd_codecs, 0))]
            await asyncio.sleep(0.05)
        batched = await asyncio.gather(*tasks)
        assert engine.forwards == 5 and engine.forward_rows == 8  # the four waiting prefills ran as one forward
    for (solo_layers, solo_done), (layers, done) in zip(solo, batched):
        assert done.batch_size == 4 and solo_done.batch_size == 1
        assert [x.layer for x in layers] == list(range(llama.info.num_layers))
        for a, b in zip(solo_layers, layers):
            assert a.packed.keys() == b.packed.keys() and a.payload_bytes == b.payload_bytes
            for name in a.packed:
                x, y = a.packed[name], b.packed[name]
                assert x.dtype == y.dtype and x.shape == y.shape
                if x.is_floating_point():
                    torch.testing.assert_close(x.float(), y.float(), atol=1e-5, rtol=0)
                else:  # quantized codes: identical
                    assert torch.equal(x, y), name


async def test_the_token_budget_and_max_batch_split_batches(llama):
    rows = contexts(100, 100, 100, 10, 10, seed=2)
    with ThreadPoolExecutor(1) as compute:
        engine = PrefillEngine(llama, compute, EncodePool(1), max_batch=2, max_batch_tokens=250)
        raw = codec_lib.create_codecs(llama, ["raw"])["raw"]
        with held(compute):
            tasks = [asyncio.ensure_future(collect(engine.stream(ids, raw.encoder({}, codec_lib.EncodeRequest(0)), keep_payloads)))
                     for ids in rows]
            await asyncio.sleep(0.05)
        done = [d for _, d in await asyncio.gather(*tasks)]
    # 2 x 100 fits 250, a third 100 would not; then 100 + 10 (2 x 100 padded), then the last 10 alone
    assert [d.batch_size for d in done] == [2, 2, 2, 2, 1] and engine.forwards == 3


class SlowEncoder(codec_lib.LayerEncoder):
    """Raw K/V after a pause per layer; fails at `fail_at` when set."""

    captures = kv.Capture.KV

    def __init__(self, pause_s: float = 0.0, fail_at: int = -1):
        self.pause_s, self.fail_at = pause_s, fail_at
        self.finished_at: list[float] = []

    def encode(self, state):
        time.sleep(self.pause_s)
        if state.index == self.fail_at:
            raise ValueError(f"encoder broke at layer {state.index}")
        keys, values = state.kv()
        self.finished_at.append(time.perf_counter())
        return {"k": keys, "v": values}


async def test_the_forward_never_waits_for_the_encoder(llama):
    with ThreadPoolExecutor(1) as compute:
        engine = PrefillEngine(llama, compute, EncodePool(1))
        slow = SlowEncoder(pause_s=0.15)
        started = time.perf_counter()
        layers, done = await collect(engine.stream(contexts(64)[0], slow, keep_payloads))
        forward_end = started + done.prefill_ms / 1e3
    n = llama.info.num_layers
    assert len(layers) == n and done.encode_ms >= n * 150
    assert done.prefill_ms < 150  # the forward finished before the first layer's encode did
    assert all(t > forward_end for t in slow.finished_at)


async def test_a_cancel_or_an_encode_error_in_a_batch_touches_only_its_request(llama):
    rows = contexts(70, 40, 55, seed=3)
    raw = codec_lib.create_codecs(llama, ["raw"])["raw"]
    with ThreadPoolExecutor(1) as compute:
        engine = PrefillEngine(llama, compute, EncodePool(1))
        solo = [await collect(engine.stream(ids, raw.encoder({}, codec_lib.EncodeRequest(0)), keep_payloads)) for ids in rows]

        async def cancelled_after_one_layer(ids):
            async with contextlib.aclosing(engine.stream(ids, SlowEncoder(), keep_payloads)) as items:
                async for item in items:
                    return item.layer  # leaves after its first layer: the stream closes

        with held(compute):
            tasks = [
                asyncio.ensure_future(cancelled_after_one_layer(rows[0])),
                asyncio.ensure_future(collect(engine.stream(rows[1], raw.encoder({}, codec_lib.EncodeRequest(0)), keep_payloads))),
                asyncio.ensure_future(collect(engine.stream(rows[2], SlowEncoder(fail_at=2), keep_payloads))),
            ]
            await asyncio.sleep(0.05)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert engine.forwards == 4  # the three ran as one batch
    assert results[0] == 0
    assert isinstance(results[2], ValueError) and "layer 2" in str(results[2])
    layers, done = results[1]
    assert done.batch_size == 3 and len(layers) == llama.info.num_layers
    for a, b in zip(solo[1][0], layers):
        for name in a.packed:
            torch.testing.assert_close(a.packed[name], b.packed[name], atol=1e-5, rtol=0)


def test_lanes_keep_their_order_and_interleave_on_the_pool():
    pool = EncodePool(3)
    lanes = [pool.lane() for _ in range(4)]
    seen: list[tuple[int, int]] = []
    running = [0] * len(lanes)
    overlap = []
    finished = threading.Event()

    def task(lane: int, i: int):
        def run():
            running[lane] += 1
            overlap.append(running[lane] > 1)
            time.sleep(0.001 * (i % 3))
            seen.append((lane, i))
            running[lane] -= 1
            if len(seen) == 4 * 30:
                finished.set()
        return run

    for i in range(30):
        for n, lane in enumerate(lanes):
            lane.put(task(n, i))
    assert finished.wait(10)
    pool.shutdown()
    assert not any(overlap)  # one task of a lane at a time
    for n in range(len(lanes)):
        assert [i for lane, i in seen if lane == n] == list(range(30))  # in put order
    assert {lane for lane, _ in seen[:8]} == set(range(4))  # every lane got going early
