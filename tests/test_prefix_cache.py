"""The consumer's prefix cache: chunks kept in the KV pool with holder counts, leaves evicted
first by value per byte, room made for waiting requests; through the services: a repeated
context answered with no transfer, a context that extends a cached one prefilling only its new
tokens, answers token-identical to a consumer without the cache (float32), KV made one way never
served for another, every block accounted for."""

from __future__ import annotations

import asyncio

import pytest

from consumer.engine.kv_pool import KVPool
from consumer.engine.prefix_cache import PrefixCache
from shared import chunks
from shared.models import load_model
from shared.pb import common_pb2
from tests.conftest import prompt, running_pair

CHUNK = 32


@pytest.fixture(scope="module")
def loaded():
    return load_model("tiny-llama", "float32", "cpu")


def make_pool(loaded, tokens: int = 1024) -> KVPool:
    return KVPool(loaded.info, loaded.device, tokens * loaded.info.kv_bytes(1), 16)


def test_chunks_hold_blocks_and_leaves_go_first_by_value(loaded):
    pool = make_pool(loaded)
    cache = PrefixCache(pool, budget_bytes=10 * 2 * pool.block_bytes, chunk_tokens=CHUNK)  # 10 chunks of 2 blocks
    root = chunks.model_root("w", "float32")
    ctx = list(range(5, 5 + 100))  # 3 full chunks and a 4-token tail
    refs = chunks.chain(root, ctx, CHUNK)
    seq = pool.allocate(len(ctx) + 8)
    assert cache.insert(refs, seq) == 4 and len(cache.entries) == 4
    pool.release(seq)  # the cache still holds the context's blocks
    pool.reclaim()
    assert pool.free_blocks == pool.num_blocks - 7
    hit = cache.lookup(refs)
    assert [c.ref.end for c in hit.shared] == [32, 64, 96] and hit.tail is not None and hit.tokens == 100
    # another context sharing the first chunk: a partial hit
    other = ctx[:CHUNK] + [7] * 40
    hit = cache.lookup(chunks.chain(root, other, CHUNK))
    assert hit.tokens == CHUNK and hit.tail is None and cache.partial_hits == 1
    # under another root nothing is found
    assert cache.lookup(chunks.chain(chunks.model_root("v", "float32"), ctx, CHUNK)).tokens == 0
    # eviction: leaves first (the tail, then its parent, ...), never a chunk whose child is cached
    order = []
    while cache.entries:
        leaves = {k for k, c in cache.entries.items() if c.children == 0}
        before = set(cache.entries)
        assert cache.make_room(pool.free_blocks + pool.reclaimable_blocks + 1) > 0  # one chunk at a time
        gone = before - set(cache.entries)
        assert gone <= leaves
        order += [cache_key_end(refs, k) for k in gone]
    assert order == [100, 96, 64, 32]
    assert pool.free_blocks < pool.num_blocks  # dropped, waiting for the owner's reclaim
    assert pool.reclaim() == 7
    assert pool.free_blocks == pool.num_blocks  # every block back, zeroed
    assert float(pool.k.abs().max()) == 0.0


def cache_key_end(refs, key):
    return next(r.end for r in refs if r.key == key)


def test_value_per_byte_keeps_the_chunks_that_save_most(loaded):
    pool = make_pool(loaded)
    cache = PrefixCache(pool, budget_bytes=1 << 30, chunk_tokens=CHUNK)
    a = chunks.chain(chunks.model_root("w", "float32"), list(range(10, 10 + 64)), CHUNK)  # 2 chunks, end 64
    b = chunks.chain(chunks.model_root("w", "float32"), list(range(200, 200 + 32)), CHUNK)  # 1 chunk, end 32
    for refs, n in ((a, 64), (b, 32)):
        seq = pool.allocate(n)
        cache.insert(refs, seq)
        pool.release(seq)
    pool.reclaim()
    cache.lookup(a)  # a used again
    cache.make_room(pool.free_blocks + 2)  # a waiting request needs 2 blocks more than are free
    assert b[0].key not in cache.entries and a[1].key in cache.entries  # the cheaper, less used chunk went
    cache.clear()
    pool.reclaim()
    assert pool.free_blocks == pool.num_blocks


def ask(context: str, question: str, mode: str = "oracle", options: dict | None = None):
    return dict(context=prompt(context), question=prompt(question), max_new_tokens=6,
                transfer=common_pb2.CodecSpec(name=mode, options=options or {}))


DOC = "The producer reads a long context and the consumer writes the answer quickly. " * 6
TURN = " Then the consumer asks again about the layers that were patched before." * 3


async def test_reuse_through_the_services_is_token_identical_to_no_cache():
    fields = [
        ask(DOC, " Which layers?"),
        ask(DOC, " What is sent?"),  # the same document, another question: the whole context cached
        ask(DOC + TURN, " Which layers?"),  # the next turn: the document's chunks are reused
        ask(DOC, " Which layers?", "raw"),
        ask(DOC, " What is sent?", "raw"),  # the same transfer again: no transfer at all
        ask(DOC, " What is sent?", "quant", {"bits": "8"}),  # another codec: never served raw's KV
    ]
    kw = dict(chunk_tokens=CHUNK, kv_block_tokens=16)
    answers: dict[str, list] = {}
    for name, extra in (("cold", {"prefix_cache_bytes": 0}), ("cached", {})):
        async with running_pair("tiny-llama", consumer_kw={**kw, **extra}) as pair:
            answers[name] = [await pair.generate(**f) for f in fields]
            consumer = pair.consumer.servicer
            prefix = consumer.prefix
            if prefix is not None:
                pool = consumer.batch.pool
                await asyncio.wrap_future(consumer.batch.submit(lambda: None))  # the inserts queued before it ran
                held = {b for c in prefix.entries.values() for b in c.blocks}
                for _ in range(100):  # a request's blocks go back right after its stats message
                    if pool.free_blocks == pool.num_blocks - len(held):
                        break
                    await asyncio.sleep(0.02)
                assert pool.free_blocks == pool.num_blocks - len(held)
                await asyncio.wrap_future(consumer.batch.submit(prefix.clear))  # the engine changes the cache
                for _ in range(100):  # and reclaims what it dropped at its next boundary
                    if pool.free_blocks == pool.num_blocks:
                        break
                    await asyncio.sleep(0.02)
                assert pool.free_blocks == pool.num_blocks
    cold, cached = answers["cold"], answers["cached"]
    assert [ids for ids, _, _ in cached] == [ids for ids, _, _ in cold]  # token-identical (float32)
    reused = [stats.prefix_reused_tokens for _, _, stats in cached]
    T = cached[0][2].context_tokens
    assert reused[0] == 0 and reused[1] == T  # the whole document, tail included
    assert reused[2] == (T // CHUNK) * CHUNK  # the document's full chunks; its tail differs in the longer context
    assert reused[3] == 0 and reused[4] == T and reused[5] == 0
    assert cached[4][2].bytes_received == 0 and cold[4][2].bytes_received > 0  # no transfer at all
    assert all(stats.prefix_reused_tokens == 0 for _, _, stats in cold)


async def test_the_next_turn_asks_the_producer_only_for_the_new_tokens():
    """A codec whose payloads cut along tokens (raw, quant with chunk-aligned groups): the next
    turn of a conversation reuses the cached chunks and asks the producer (PrefillRequest
    first_token + prefix_key) for the rest only; answers equal a consumer and producer without
    any cache, bytes fall with the reused share."""
    turns = [DOC, DOC + TURN, DOC + TURN + TURN]
    specs = [("raw", {}), ("quant", {"bits": "8", "group_size": "32"})]
    fields = [ask(t, " Which layers?", mode, options) for mode, options in specs for t in turns]
    answers = {}
    for name, ckw, pkw in (
        ("cold", {"prefix_cache_bytes": 0}, {"chunk_tokens": 0, "store_bytes": 0}),
        ("cached", {}, {"chunk_tokens": CHUNK}),
    ):
        async with running_pair("tiny-llama", producer_kw=pkw, consumer_kw={"chunk_tokens": CHUNK, **ckw}) as pair:
            answers[name] = [await pair.generate(**f) for f in fields]
    cold, cached = answers["cold"], answers["cached"]
    assert [ids for ids, _, _ in cached] == [ids for ids, _, _ in cold]  # token-identical (float32)
    for k in range(len(specs)):
        first, *later = cached[3 * k : 3 * k + 3]
        assert first[2].prefix_reused_tokens == 0
        for (_, _, stats), (_, _, cold_stats) in zip(later, cold[3 * k + 1 : 3 * k + 3]):
            reused = stats.prefix_reused_tokens
            assert reused > 0 and reused % CHUNK == 0 and reused < stats.context_tokens
            sent = stats.context_tokens - reused
            assert stats.bytes_received < cold_stats.bytes_received
            assert abs(stats.bytes_received / cold_stats.bytes_received - sent / stats.context_tokens) < 0.1
