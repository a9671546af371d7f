"""Who owns the consumer's shared KV state (docs/design.md, "Who owns what"), each test reproducing
a finding of issue #29 that it failed on before the fix:

- a release asked while its task is still in a multi-group step waits for the task to leave the
  batch (before: its blocks were zeroed and freed between two forwards, then written by the next);
- make_room evicts only chunks whose blocks it frees, in value order, and stops when enough are
  free (before: it evicted chunks running requests share, and went on until the cache was empty);
- a cached tail's last block keeps only the tail (before: the inserting request's question and
  answer K/V stayed in it and were copied into the next request);
- the runner's gather scratch stays under its bound and shrinks back;
- the consumer's prefix cache keys a transfer by the producer its stream's header named (before:
  by the link check's digest, so a producer swapped behind one address had its KV served under
  the old producer's key);
- auto treats raw as exact only when the producer's dtype is the consumer's.
"""

from __future__ import annotations

import threading

import pytest

from consumer.engine.batch import BatchEngine, Finished, Task, split_gather
from consumer.engine.decoding import Sampler, Sampling
from consumer.engine.hf_reference import Runner
from consumer.engine.kv_pool import KVPool
from consumer.engine.prefix_cache import PrefixCache
from producer.server import ProducerServer
from shared import chunks
from shared.config import ProducerConfig
from shared.models import load_model
from shared.pb import common_pb2
from tests.conftest import perturbed_model, prompt, running_pair, wait_serving


@pytest.fixture(scope="module")
def loaded():
    return load_model("tiny-llama", "float32", "cpu")


def pool_for(loaded, tokens: int = 1024, block: int = 16) -> KVPool:
    return KVPool(loaded.info, loaded.device, tokens * loaded.info.kv_bytes(1), block)


def others_finish_and_every_block_is_back_zero(engine, pool, seqs, outcomes, which, polls: int) -> None:
    """The tasks `which` finish (up to `polls` waits of 20 ms) and their sequences go back; then every
    block is free and zero: nothing wrote into a block after it was freed."""
    for i in which:
        for _ in range(polls):
            if outcomes[i] and isinstance(outcomes[i][-1], Finished):
                break
            threading.Event().wait(0.02)
        engine.release(seqs[i]).result(10)
    assert pool.free_blocks == pool.num_blocks
    assert float(pool.k.abs().max()) == 0.0 and float(pool.v.abs().max()) == 0.0


def test_a_release_during_a_multi_group_step_waits_for_the_task_to_leave(loaded):
    pool = pool_for(loaded)
    engine = BatchEngine(loaded, pool, max_batch=8, runner=Runner)  # a padding runner: pack() splits prefill rows
    try:
        # pack() puts a 64-token chunk and one 1-token row in the first forward, the other 1-token
        # row in a second forward of the same iteration
        seqs = [pool.allocate(80) for _ in range(3)]
        outcomes: list[list] = [[], [], []]
        tasks = [Task(seq, [5 + i] * n, sink=outcomes[i].append) for i, (seq, n) in enumerate(zip(seqs, (64, 1, 1)))]
        late = tasks[2]
        forward = engine.runner.forward
        calls = []
        released: list = []

        def first_forward_then_the_frontend_leaves(rows):
            logits = forward(rows)
            calls.append(len(rows))
            if len(calls) == 1:  # what a client cancel does while the forward runs (engine.py)
                engine.cancel(late)
                released.append(engine.release(late.seq))
            return logits

        engine.runner.forward = first_forward_then_the_frontend_leaves  # type: ignore[method-assign]
        gate = threading.Event()
        engine.submit(gate.wait, 10)  # hold the engine so that the three join one iteration
        for task in tasks:
            engine.add(task)
        gate.set()
        released_ok = False
        for _ in range(200):
            if released and released[0].done():
                released_ok = True
                break
            threading.Event().wait(0.02)
        assert released_ok
        assert calls[0] == 2  # the 64-token row and one 1-token row shared the first forward
        assert late not in engine.tasks
        others_finish_and_every_block_is_back_zero(engine, pool, seqs, outcomes, (0, 1), polls=200)
    finally:
        engine.shutdown()


def cached(cache: PrefixCache, pool: KVPool, root: str, ctx: list[int]):
    """ctx's chunks inserted from a sequence of its own; the sequence (still held) returned."""
    seq = pool.allocate(len(ctx))
    assert seq is not None
    cache.insert(chunks.chain(root, ctx, cache.chunk_tokens), seq)
    return seq


def test_a_release_during_a_prefill_then_decode_step_waits_for_the_task_to_leave(loaded):
    """The engine's own runner pads nothing, so an iteration has two forwards only when its prefill
    and decode rows together exceed max_batch: a release asked during the first still waits."""
    pool = pool_for(loaded)
    engine = BatchEngine(loaded, pool, max_batch=2)
    try:
        seqs = [pool.allocate(80) for _ in range(3)]
        outcomes: list[list] = [[], [], []]
        sampling = Sampler(Sampling(), loaded.device)
        # two decoding rows (their prompt done) and one 64-token prefill: 3 rows > max_batch 2
        decoding = [Task(seqs[i], [5 + i] * 4, outcomes[i].append, sampling, 40) for i in (0, 1)]
        forward = engine.runner.forward
        calls: list[list[int]] = []
        released: list = []
        late = decoding[1]

        def record(rows):
            logits = forward(rows)
            calls.append([len(r.ids) for r in rows])
            if len(calls) > 1 and len(rows[0].ids) == 64 and not released:  # the prefill forward of a two-forward step
                engine.cancel(late)
                released.append(engine.release(late.seq))
            return logits

        engine.runner.forward = record  # type: ignore[method-assign]
        for task in decoding:
            engine.add(task)
        for _ in range(200):
            if all(t.generated > 0 for t in decoding):
                break
            threading.Event().wait(0.01)
        engine.add(Task(seqs[2], [7] * 64, outcomes[2].append))
        for _ in range(300):
            if released and released[0].done():
                break
            threading.Event().wait(0.02)
        assert released and released[0].done()
        assert [64] in calls  # the prefill alone, the decode rows in the forward after it
        assert late not in engine.tasks
        others_finish_and_every_block_is_back_zero(engine, pool, seqs, outcomes, (0, 2), polls=300)
    finally:
        engine.shutdown()


def test_make_room_evicts_only_what_frees_blocks_least_value_first(loaded):
    pool = pool_for(loaded, tokens=512)  # 32 blocks
    cache = PrefixCache(pool, budget_bytes=1 << 30, chunk_tokens=32)  # 2 blocks a chunk
    root = chunks.model_root("w", "float32")
    running = cached(cache, pool, root, list(range(100, 164)))  # 2 chunks a running request still holds
    cheap = cached(cache, pool, root, list(range(300, 332)))  # 1 chunk, end 32: least value
    dear = cached(cache, pool, root, list(range(500, 564)))  # 2 chunks, end 64
    pool.release_many([cheap, dear])  # only the cache holds these now
    pool.reclaim()
    assert pool.free_blocks == 32 - 10
    # a request waits for 2 more blocks than are free: the cheapest chunk the cache alone holds goes
    assert cache.make_room(pool.free_blocks + 2) == 2
    assert len(cache.entries) == 4 and cache.evictions == 1
    assert chunks.chain(root, list(range(300, 332)), 32)[0].key not in cache.entries
    # asking for everything frees what the cache alone holds, never the running request's chunks
    freed = cache.make_room(pool.num_blocks)
    assert freed == 4 and cache.kept_shared >= 1
    assert {c.ref.start for c in cache.entries.values()} == {0, 32} and len(cache.entries) == 2
    assert all(pool.holders(b) == 2 for c in cache.entries.values() for b in c.blocks)
    pool.reclaim()
    assert pool.free_blocks == 32 - 4
    pool.release(running)
    cache.clear()
    pool.reclaim()
    assert pool.free_blocks == pool.num_blocks


def test_make_room_on_a_large_cache_pops_from_its_index(loaded):
    """Many chunks: eviction order is by value per byte (hits), and the heap keeps stale items bounded."""
    pool = pool_for(loaded, tokens=16 * 2048)
    cache = PrefixCache(pool, budget_bytes=1 << 40, chunk_tokens=16)
    root = chunks.model_root("w", "float32")
    seqs = [cached(cache, pool, root, [7, i, i + 1]) for i in range(0, 1500)]  # 1500 one-block tails
    pool.release_many(seqs)
    pool.reclaim()
    for i in range(0, 1500, 2):  # even ones used again: they are worth more
        cache.lookup(chunks.chain(root, [7, i, i + 1], 16))
    assert len(cache._heap) <= 64 + 4 * len(cache.entries)
    cache.make_room(pool.free_blocks + 750)
    left = {c.ref.key for c in cache.entries.values()}
    assert left == {chunks.chain(root, [7, i, i + 1], 16)[0].key for i in range(0, 1500, 2)}


def test_a_cached_tail_keeps_only_its_own_tokens(loaded):
    pool = pool_for(loaded)
    cache = PrefixCache(pool, budget_bytes=1 << 30, chunk_tokens=32)
    ctx = list(range(40))  # a full chunk and an 8-token tail: the tail's block holds positions 32..47
    seq = pool.allocate(48)
    pool.k[:, seq.blocks] = 1.0  # the request's context, question and answer K/V
    pool.v[:, seq.blocks] = 1.0
    cache.insert(chunks.chain(chunks.model_root("w", "float32"), ctx, 32), seq)
    last = seq.blocks[2]
    assert float(pool.k[:, last, :8].min()) == 1.0  # the tail's 8 tokens kept
    assert float(pool.k[:, last, 8:].abs().max()) == 0.0 and float(pool.v[:, last, 8:].abs().max()) == 0.0
    assert float(pool.k[:, seq.blocks[1]].min()) == 1.0  # a full chunk's blocks untouched


def test_the_gather_scratch_stays_under_its_bound_and_shrinks(loaded):
    pool = pool_for(loaded, tokens=256)  # 16 blocks
    runner = Runner(loaded, pool)
    assert runner.scratch_limit_blocks == 32
    runner.scratch(30)
    assert runner._scratch[0].shape[0] == 30
    with pytest.raises(ValueError, match="scratch limit"):
        runner.scratch(33)
    for _ in range(2 * Runner.SHRINK_EVERY):  # a window that still saw the 30, then one that did not
        runner.scratch(2)
    assert runner._scratch[0].shape[0] == 4  # twice the recent peak
    assert runner.scratch_bytes == 4 * pool.block_bytes // loaded.info.num_layers <= runner.scratch_limit_bytes()

    class Seq:
        def __init__(self, length):
            self.length = length

    class T:
        def __init__(self, length):
            self.seq = Seq(length)

    rows = [(T(160), 1)] + [(T(10), 1) for _ in range(7)]  # one long row beside seven short ones
    groups = split_gather(rows, 16, 32)  # type: ignore[arg-type]
    assert sorted(len(g) for g in groups) == [1, 7]
    for g in groups:
        assert len(g) * max(-(-(t.seq.length + n) // 16) for t, n in g) <= 32 or len(g) == 1


def ask(context: str, mode: str = "raw"):
    return dict(
        context=prompt(context), question=prompt(" Which layers?"), max_new_tokens=4, transfer=common_pb2.CodecSpec(name=mode)
    )


async def test_a_producer_swapped_behind_one_address_is_keyed_by_its_own_header(tmp_path):
    """The link check saw producer A; the stream came from producer B (other weights, same port):
    B's KV is cached under B's key, never served as A's."""
    perturbed_model("tiny-llama", 11, 0.05, save_to=tmp_path)
    kw = {"producer_check_interval_s": 3600.0}  # the link keeps what it saw first
    async with running_pair("tiny-llama", consumer_kw=kw) as pair:
        consumer = pair.consumer.servicer
        await pair.generate(**ask("A document the first producer reads. " * 4))
        seen = consumer._producer_digest()
        port = int(pair.producer.address.rsplit(":", 1)[1])
        await pair.producer.stop()
        swapped = ProducerServer(ProducerConfig(port=port, model=str(tmp_path), dtype="float32", device="cpu", drain_grace_s=0.5))
        await swapped.start()
        await swapped.load()
        try:
            await wait_serving(swapped.address)
            assert swapped.servicer.loaded.info.weight_digest != seen
            assert consumer._producer_digest() == seen  # not checked again
            doc = "Another document, read by whoever listens on that port now. " * 4
            _, _, stats = await pair.generate(**ask(doc))
            assert stats.transfer.name == "raw" and stats.prefix_reused_tokens == 0
            codec = consumer.codecs["raw"]
            options = codec.resolve({})
            context_ids = await consumer._tokenize(doc, True)
            # under the producer the link believes in, nothing: B's KV is not A's
            assert consumer.pipeline.cached_tokens(codec, options, context_ids) == 0
            again_raw = await pair.generate(**ask(doc))
            assert again_raw[2].prefix_reused_tokens == 0  # transferred again, not served from B's KV
        finally:
            await swapped.stop()


def test_auto_counts_raw_exact_only_in_the_consumers_dtype(loaded):
    from consumer.auto.chooser import Chooser
    from consumer.auto.planner import TransferPlanner
    from consumer.auto.producer_memory import ProducerMemory
    from shared import codecs as codec_lib

    codecs = codec_lib.create_codecs(loaded, artifacts=[])
    digest = loaded.info.weight_digest
    for dtype, exact in (("float32", True), ("bfloat16", False)):
        chooser = Chooser(
            loaded,
            codecs,
            TransferPlanner(),
            ProducerMemory(),
            lambda c, ids, tenant="": 0,
            lambda: digest,
            lambda: True,
            lambda dtype=dtype: dtype,
            lambda: loaded.info.identity,
        )
        modes = {c.mode for c in chooser.candidates() if c.loss == 0.0}
        assert ("raw" in modes) is exact, (dtype, modes)


def test_every_root_names_the_dtype():
    assert chunks.model_root("w", "float32") != chunks.model_root("w", "bfloat16")
    assert chunks.codec_root("w", "float32", "raw", 1, {}, {}) != chunks.codec_root("w", "bfloat16", "raw", 1, {}, {})
    with pytest.raises(ValueError, match="dtype"):
        chunks.model_root("w", "")
