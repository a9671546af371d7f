"""Chunked prefix reuse on the producer, without gRPC: chunk keys, eviction, and for every codec
the payloads of a continued prefill (stored prefix, new tokens computed) and of a replay equal a
whole-context cold encode in float32, a causal encoder (a learned predictor) included: it
continues from the prefix's stored normalized input."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from calibration.predictor_training import model_config
from consumer.link.producer_client import context_hash
from producer.chunk_store import ChunkEntry, ChunkStore, Index, Slot
from producer.encode import EncodePool
from producer.prefill import EncodedLayer, PrefillDone, PrefillEngine
from producer.reuse import Roots, plan
from shared import chunks
from shared import codecs as codec_lib
from shared.scd import predictor
from shared.scd.artifact import Artifact
from tests.test_prefill_engine import contexts, llama, scd_codecs  # noqa: F401 - fixtures

C = 64  # chunk tokens in these tests (quant's 32-token key groups cut at its multiples)


# -- keys ----------------------------------------------------------------------------------------
def test_chunk_keys_chain_the_prefix_the_model_and_the_codec():
    ids = list(range(3, 300))
    root = chunks.model_root("digest-a", "float32")
    refs = chunks.chain(root, ids, C)
    assert [(r.start, r.end) for r in refs] == [(0, 64), (64, 128), (128, 192), (192, 256), (256, 297)]
    assert all(b.parent == a.key for a, b in zip(refs, refs[1:])) and refs[0].parent == root
    longer = chunks.chain(root, [*ids, 7, 8], C)
    assert [r.key for r in longer[:4]] == [r.key for r in refs[:4]] and longer[4].key != refs[4].key  # shared full chunks
    changed = chunks.chain(root, [ids[0] + 1, *ids[1:]], C)
    assert all(a.key != b.key for a, b in zip(refs, changed))  # a change early changes every later key
    assert chunks.chain(chunks.model_root("digest-b", "float32"), ids, C)[0].key != refs[0].key
    # the dtype the K/V was computed in: other bytes, another chain (a restart in another dtype reuses none)
    assert chunks.model_root("digest-a", "bfloat16") != root
    assert chunks.codec_root("digest-a", "bfloat16", "raw", 1, {}, {}) != chunks.codec_root("digest-a", "float32", "raw", 1, {}, {})
    with pytest.raises(ValueError):
        chunks.model_root("digest-a", "")
    codec = chunks.codec_root("digest-a", "float32", "quant", 1, {"bits": "8", "group_size": "32"}, {})
    assert len({codec, root, chunks.codec_root("digest-a", "float32", "quant", 1, {"bits": "4", "group_size": "32"}, {}),
                chunks.codec_root("digest-a", "float32", "scd", 2, {}, {"artifact": "x"}),
                chunks.codec_root("digest-a", "float32", "scd", 2, {}, {"artifact": "y"}),
                chunks.codec_root("digest-a", "float32", "quant", 2, {"bits": "8", "group_size": "32"}, {})}) == 6
    assert chunks.prefix_key(root, ids, 128, C) == refs[1].key and chunks.prefix_key(root, ids, 0, C) == root
    assert chunks.longest(refs, {refs[0].key, refs[2].key}.__contains__) == 1  # a chunk without its parent is no prefix
    assert chunks.route_key(ids) == chunks.route_key([*ids, 1, 2, 3]) != chunks.route_key([9, *ids])
    # the consumer routes on it: a conversation's next turn goes where its first turn went
    assert context_hash(ids) == context_hash([*ids, 1, 2]) and context_hash([1, 2]) != context_hash([1, 3])


# -- eviction ------------------------------------------------------------------------------------
def _chain_slots(index: Index, name: str, n: int, nbytes: int = 10) -> list[str]:
    keys, parent = [], f"root-{name}"
    for j in range(n):
        key = f"{name}{j}"
        index.add(key, Slot(nbytes, parent, (j + 1) * 64))
        keys.append(key)
        parent = key
    return keys


def test_cost_aware_eviction_takes_leaves_first_and_weighs_hits_and_position():
    index = Index(budget_bytes=1000, policy="cost")
    a = _chain_slots(index, "a", 3)
    for key in a:
        index.touch(key)
    assert index.victim() == "a2"  # the leaf, though the root was used least recently
    b = _chain_slots(index, "b", 2)  # never hit, shorter prefixes: worth less than a's leaf
    assert index.victim() == b[1]
    index.drop(b[1])
    assert index.victim() == b[0]  # now a leaf; still worth less than a2 (end 192, one hit)
    for _ in range(5):
        index.touch(b[0])
    index.touch(b[0])
    assert index.victim() == "a2"  # hits raise a chunk's value: (6+1)*64 > (1+1)*192
    # make_room evicts by that order until the new entry fits, never the new one itself
    index.budget_bytes = 30
    evicted = index.make_room("new", "root-new", 10)
    assert evicted == ["a2", "a1"] and index.nbytes == 20 and index.evictions == 2  # b0 (7 hits) outlasts a1
    assert index.make_room("a2", "a1", 100) is None


def test_lru_eviction_is_plain_least_recent_use():
    index = Index(budget_bytes=1000, policy="lru")
    a = _chain_slots(index, "a", 3)
    for key in a:  # a lookup walks the chain from its root: the root is the least recent
        index.touch(key)
    assert index.victim() == "a0"
    with pytest.raises(ValueError):
        Index(1, policy="fifo")


def test_store_budget_and_tiers():
    store = ChunkStore(budget_bytes=3 * 4 * 64, policy="cost")
    parent = "root"
    for j in range(4):
        entry = ChunkEntry(f"k{j}", parent, (j + 1) * 64, {"0.k": torch.zeros(64, dtype=torch.float32)})
        assert store.put(entry) == (j < 3)  # the fourth would need its own prefix evicted: not kept
        parent = entry.key
    assert sorted(store.entries) == ["k0", "k1", "k2"] and store.evictions == 0 and store.nbytes == 3 * 256
    side = ChunkEntry("s0", "root", 64, {"0.k": torch.zeros(64)})
    assert store.put(side) and sorted(store.entries) == ["k0", "k1", "s0"]  # the chain's leaf made room
    assert store.evictions == 1 and store.get("k0") is not None and store.get("k2") is None
    assert not store.put(ChunkEntry("huge", "root", 64, {"0.k": torch.zeros(1000)}))
    # one request's new chunks never evict each other; RAM stops at the first that does not fit
    batch = [ChunkEntry(f"n{j}", f"n{j - 1}" if j else "root-n", 64 * (j + 1), {"0.k": torch.zeros(64)}) for j in range(4)]
    assert store.put_many(batch) == 3 and sorted(store.entries) == ["n0", "n1", "n2"]
    assert [t.name for t in store.tiers()] == ["ram"]


# -- the engine over every codec -------------------------------------------------------------------
SPECS = [("raw", {}), ("quant", {"bits": "4"}), ("quant", {"bits": "8", "group_size": "64"}), ("recompute", {}),
         ("scd", {"schedule": "R4.P.W.Q8"})]


async def _run(engine, store, ids, encoder, roots, num_layers, send_from=0):
    """(per-layer payloads sent, the plan) for one request through the store."""
    reuse = plan(store, ids, C, roots, encoder, num_layers, send_from)
    if reuse.replay:
        return [reuse.replay_layer(layer) for layer in range(num_layers)], reuse
    items = [x async for x in engine.stream(ids, encoder, lambda layer, p: p, reuse)]
    done = items[-1]
    assert isinstance(done, PrefillDone) and done.reused_tokens == reuse.start
    for entry in done.kept:
        store.put(entry)
    return [x.packed for x in items if isinstance(x, EncodedLayer)], reuse


def _assert_same(got, want, start=0):
    assert len(got) == len(want)
    for layer, (g, w) in enumerate(zip(got, want)):
        assert g.keys() == w.keys(), layer
        for name in w:
            expect = w[name]
            if start:  # the sent part of a whole-context payload: its tokens from `start` on
                axis, group = encoder_layout[layer][name]
                expect = expect.narrow(axis, start // group, expect.shape[axis] - start // group)
            assert g[name].dtype == expect.dtype and g[name].shape == expect.shape, (layer, name)
            assert torch.equal(g[name], expect), (layer, name)


encoder_layout: list = []


def _encoder(codecs, name, options, n):
    codec = codecs[name]
    resolved = codec.resolve(options)
    encoder = codec.encoder(resolved, codec_lib.EncodeRequest(n))
    digest = codec.model.info.weight_digest
    dtype = codec.model.info.dtype
    roots = Roots(chunks.model_root(digest, dtype),
                  chunks.codec_root(digest, dtype, name, codec.format_version, resolved, encoder.metadata()))
    return encoder, roots


@pytest.mark.parametrize(("name", "options"), SPECS, ids=[f"{n}-{'-'.join(o.values())}" for n, o in SPECS])
async def test_continued_and_replayed_streams_equal_a_cold_encode(llama, scd_codecs, name, options):  # noqa: F811
    full = contexts(2 * C + 40, seed=3)[0]  # three chunks, the last a tail
    turn1 = full[: C + 40]  # a full chunk and a 40-token tail: the next turn continues across the boundary
    num_layers = llama.info.num_layers
    with ThreadPoolExecutor(1) as compute:
        engine = PrefillEngine(llama, compute, EncodePool(1))
        encoder, roots = _encoder(scd_codecs, name, options, len(full))
        cold, cold_plan = await _run(engine, ChunkStore(0), full, encoder, roots, num_layers)
        assert cold_plan.start == 0 and not cold_plan.replay
        encoder_layout[:] = [encoder.token_layout(layer) for layer in range(num_layers)]

        store = ChunkStore(1 << 30)
        await _run(engine, store, turn1, *_encoder(scd_codecs, name, options, len(turn1)), num_layers)
        encoder, roots = _encoder(scd_codecs, name, options, len(full))
        continued, reuse = await _run(engine, store, full, encoder, roots, num_layers)
        assert reuse.derived == (name in ("raw", "quant"))  # K/V-only encoders: payloads re-encoded from stored K/V
        # a K/V-only encoder also continues from the stored 40-token tail, cut to a multiple of 16
        # and of its payloads' token groups (quant: 32-token key groups; 64 with group_size 64);
        # the others from the last full chunk. Either way bitwise the cold payloads (below).
        tail = {"raw": 32, "quant": 32 if options.get("group_size") != "64" else 0}.get(name, 0)
        assert not reuse.replay and reuse.start == C + tail and reuse.computed_tokens == len(full) - C - tail
        _assert_same(continued, cold)
        forwards = engine.forwards
        replayed, again = await _run(engine, store, full, encoder, roots, num_layers)
        assert again.replay and again.reused_tokens == len(full) and engine.forwards == forwards
        _assert_same(replayed, cold)
        sent, partial = await _run(engine, store, full, encoder, roots, num_layers, send_from=C)  # caller holds [0, C)
        assert partial.replay
        _assert_same(sent, cold, start=C)
        fresh = ChunkStore(1 << 30)  # K/V of [0, C) only: the new tokens computed, sent from C
        for entry in store.entries.values():
            if entry.key == reuse.kv_refs[0].key:
                fresh.put(entry)
        sent, partial = await _run(engine, fresh, full, encoder, roots, num_layers, send_from=C)
        assert not partial.replay and partial.start == C
        _assert_same(sent, cold, start=C)


@pytest.mark.parametrize(("first", "total"), [(150, 230), (128, 230), (200, 300), (100, 168)])
async def test_a_continued_forward_equals_a_cold_one_within_float_rounding(llama, scd_codecs, first, total):  # noqa: F811
    """At any turn lengths (not only those where the kernels happen to block alike, as in the test
    above) a continued float32 forward's payloads equal a cold encode's within float rounding: a
    forward over fewer tokens may round differently (measured up to ~2e-6), never more."""
    full = contexts(total, seed=7)[0]
    num_layers = llama.info.num_layers
    with ThreadPoolExecutor(1) as compute:
        engine = PrefillEngine(llama, compute, EncodePool(1))
        cold, _ = await _run(engine, ChunkStore(0), full, *_encoder(scd_codecs, "raw", {}, total), num_layers)
        store = ChunkStore(1 << 30)
        await _run(engine, store, full[:first], *_encoder(scd_codecs, "raw", {}, first), num_layers)
        continued, reuse = await _run(engine, store, full, *_encoder(scd_codecs, "raw", {}, total), num_layers)
    assert reuse.start > 0 and not reuse.replay
    for layer, (got, want) in enumerate(zip(continued, cold)):
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5, msg=f"layer {layer} {name}")


async def test_a_group_that_does_not_divide_the_chunk_keeps_the_stream_whole(llama, scd_codecs):  # noqa: F811
    encoder, roots = _encoder(scd_codecs, "quant", {"bits": "8", "group_size": "128"}, 200)
    assert codec_lib.base.chunk_layouts(encoder, llama.info.num_layers, C) is None
    store = ChunkStore(1 << 30)
    ids = contexts(200, seed=4)[0]
    with ThreadPoolExecutor(1) as compute:
        engine = PrefillEngine(llama, compute, EncodePool(1))
        await _run(engine, store, ids, encoder, roots, llama.info.num_layers)
        _, again = await _run(engine, store, ids, encoder, roots, llama.info.num_layers)
    assert again.start == 0 and not again.replay  # K/V kept, but no payload chunks to replay or prepend
    assert all(key in {r.key for r in again.kv_refs} for key in store.entries)


def _with_predictor(art: Artifact, loaded, layer: int) -> Artifact:
    """The artifact with a random (not identity) learned predictor on `layer`: a causal encoder."""
    config = model_config(loaded)
    torch.manual_seed(0)
    model = predictor.build(config)
    with torch.no_grad():
        for block in model.layers:
            block.self_attn.o_proj.weight.normal_(0, 0.05)
            block.mlp.down_proj.weight.normal_(0, 0.05)
    tensors = {**art.tensors, **predictor.to_tensors(layer, model)}
    meta = {**art.meta, "predictor": {"config": config, "layers": {str(layer): {}}}}
    return Artifact(tensors, meta)


async def test_a_causal_predictor_continues_from_the_stored_normalized_input(llama, scd_codecs):  # noqa: F811
    scd = scd_codecs["scd"]
    original = scd.artifacts
    scd.artifacts = [_with_predictor(a, llama, 0) for a in original]
    try:
        full = contexts(2 * C + 40, seed=5)[0]
        num_layers = llama.info.num_layers
        with ThreadPoolExecutor(1) as compute:
            engine = PrefillEngine(llama, compute, EncodePool(1))
            encoder, roots = _encoder(scd_codecs, "scd", {"schedule": "R4.P.W.Q8"}, len(full))
            assert not encoder.per_token and encoder.causal_layers == {0}
            cold, _ = await _run(engine, ChunkStore(0), full, encoder, roots, num_layers)
            encoder_layout[:] = [encoder.token_layout(layer) for layer in range(num_layers)]

            raw, raw_roots = _encoder(scd_codecs, "raw", {}, C + 20)  # K/V chunks kept without the normed input
            store = ChunkStore(1 << 30)
            await _run(engine, store, full[: C + 20], raw, raw_roots, num_layers)
            again, reuse = await _run(engine, store, full, encoder, roots, num_layers)
            assert reuse.start == 0 and not reuse.replay  # they cannot continue the predictor: a cold forward
            _assert_same(again, cold)

            store = ChunkStore(1 << 30)
            head, _ = await _run(engine, store, full[: C + 20], encoder, roots, num_layers)
            _assert_same(_first(head, C), _first(cold, C))  # causal: a prefix's payloads are the longer context's
            continued, reuse = await _run(engine, store, full, encoder, roots, num_layers)
            assert reuse.start == C and not reuse.replay  # the predictor ran over the stored prefix's input
            _assert_same(continued, cold)
            replayed, reuse = await _run(engine, store, full, encoder, roots, num_layers)
            assert reuse.replay
            _assert_same(replayed, cold)
    finally:
        scd.artifacts = original


def _first(layers: list[dict], n: int) -> list[dict]:
    """Each payload's first n tokens (encoder_layout gives the token axis and group)."""
    return [{name: t.narrow(encoder_layout[i][name][0], 0, n // encoder_layout[i][name][1]) for name, t in p.items()}
            for i, p in enumerate(layers)]
