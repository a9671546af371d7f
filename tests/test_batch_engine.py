"""The consumer's batch engine without gRPC: the runner against the model's own forward, the KV
pool written in place, batched answers equal to one-row-per-forward answers, a hostile row that
fails alone, cancel and release returning every block, KV admission's limits."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from consumer.engine.batch import BatchEngine, Finished, Task
from consumer.engine.decoding import Sampler, Sampling
from consumer.engine.hf_reference import Runner
from consumer.engine.kv_admission import KVAdmission
from consumer.engine.kv_pool import KVPool
from consumer.engine.pool_forward import PoolRunner
from consumer.engine.rows import Row
from shared.errors import DataLoss, DeadlineExceeded, ResourceExhausted
from shared.models import load_model


@pytest.fixture(scope="module")
def loaded():
    return load_model("tiny-llama", "float32", "cpu")  # GQA: 4 heads over 2 KV heads


def pool_for(loaded, tokens: int = 4096, block: int = 16) -> KVPool:
    return KVPool(loaded.info, loaded.device, tokens * loaded.info.kv_bytes(1), block)


def ids(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (n,), generator=g).tolist()


@pytest.mark.parametrize("runner_type", [Runner, PoolRunner])
@torch.inference_mode()
def test_runner_matches_the_models_forward_on_ragged_chunked_rows(loaded, runner_type):
    pool = pool_for(loaded)
    runner = runner_type(loaded, pool)
    vocab = loaded.info.vocab_size
    seqs = [ids(n, seed, vocab) for seed, n in enumerate((37, 5, 90))]
    kvs = [pool.allocate(128) for _ in seqs]
    runner.forward([Row(kv, s[:20], 0) for kv, s in zip(kvs, seqs)])  # first chunk, ragged (5 < 20)
    longer = [(kv, s) for kv, s in zip(kvs, seqs) if len(s) > 20]
    logits = runner.forward([Row(kv, s[20:], kv.length) for kv, s in longer])
    for row, (_, s) in enumerate(longer):
        ref = loaded.model(torch.tensor([s])).logits[0, -1]
        torch.testing.assert_close(logits[row], ref, atol=1e-4, rtol=1e-4)
    logits = runner.forward([Row(kv, [7], kv.length) for kv in kvs])  # one decode step, all rows
    for row, s in enumerate(seqs):
        ref = loaded.model(torch.tensor([s + [7]])).logits[0, -1]
        torch.testing.assert_close(logits[row], ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
@torch.inference_mode()
def test_the_pool_forward_equals_the_hf_runner_with_prefill_and_decode_rows_together(name, dtype):
    """Our forward over the pool in place against the Hugging Face runner over gathered blocks:
    the same rows (a chunk after a prefix, a first chunk, decode rows) in one forward each, on two
    pools with the same tables, one of them scattered (not one run: read through the gather).
    float32: logits within 1e-4; bfloat16: within 2**-5 of the largest |logit| (decode rows go
    through the paged kernel, which keeps scores, softmax and sums in float32 and rounds once,
    where bf16 SDPA rounds its own way: a few bf16 steps apart after the layers; the kernel itself
    is held to float32 SDPA in tests/test_paged_attention.py), argmax equal wherever the
    reference's margin is above twice that."""
    loaded = load_model(name, dtype, "cpu")
    vocab = loaded.info.vocab_size
    pools = [pool_for(loaded), pool_for(loaded)]
    runners = [Runner(loaded, pools[0]), PoolRunner(loaded, pools[1])]
    lengths = (37, 5, 90, 64)
    seqs = [ids(n, seed, vocab) for seed, n in enumerate(lengths)]
    kvs = [[pool.allocate(160) for _ in seqs] for pool in pools]
    scattered = pools[1].allocate(160)
    assert scattered is not None
    kvs[1][3], scattered = scattered, kvs[1][3]  # give row 3 blocks out of order: not one run
    kvs[1][3].blocks = kvs[1][3].blocks[::-1]
    kvs[1][3].table = torch.tensor(kvs[1][3].blocks)
    assert kvs[0][3].length == kvs[1][3].length == 0

    def both(make_rows):
        out = [runner.forward(make_rows(kv_list)) for runner, kv_list in zip(runners, kvs)]
        tol = 1e-4 if dtype == "float32" else 2**-5 * out[0].abs().max().item()
        assert (out[0] - out[1]).abs().max().item() <= tol
        top2 = out[0].topk(2, dim=-1).values
        clear = top2[:, 0] - top2[:, 1] > 2 * tol
        assert torch.equal(out[0].argmax(-1)[clear], out[1].argmax(-1)[clear])

    both(lambda kv: [Row(k, s[:30], 0) for k, s in zip(kv, seqs)])  # first chunks, ragged
    both(lambda kv: [Row(k, s[30:], k.length) for k, s in zip(kv, seqs) if len(s) > 30] + [Row(kv[1], [9], kv[1].length)])
    for _ in range(3):
        both(lambda kv: [Row(k, [7], k.length) for k in kv])  # decode rows
    assert runners[1].gathered_rows > 0
    for layer in range(loaded.info.num_layers):  # both wrote the same K/V at the same positions
        for a, b in zip(kvs[0], kvs[1]):
            ka, kb = (p.k[layer].reshape(-1, *p.k.shape[3:])[s.flat_slots[: s.length]] for p, s in ((pools[0], a), (pools[1], b)))
            tol = 1e-5 if dtype == "float32" else 2**-6 * ka.abs().max().item()
            assert (ka.float() - kb.float()).abs().max().item() <= tol


def run_tasks(engine: BatchEngine, specs: list[tuple[list[int], int]], pool: KVPool) -> list[list[int] | Exception]:
    """Each spec (prompt ids, max_new) as a greedy generate task on its own blocks, all added at
    once; the tokens (or the error) of each."""
    done = threading.Event()
    out: list[list[int] | Exception] = [[] for _ in specs]
    left = [len(specs)]
    lock = threading.Lock()
    seqs = []

    def sink_for(i):
        def sink(item):
            if isinstance(item, int):
                out[i].append(item)  # type: ignore[union-attr]
                return
            if isinstance(item, Exception):
                out[i] = item
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    done.set()

        return sink

    for i, (prompt, max_new) in enumerate(specs):
        seq = pool.allocate(len(prompt) + max_new)
        seqs.append(seq)
        engine.add(Task(seq, list(prompt), sink_for(i), Sampler(Sampling(), torch.device("cpu")), max_new))
    assert done.wait(60)
    for seq in seqs:
        engine.release(seq).result(10)
    return out


def rows_per_forward(engine: BatchEngine) -> list[int]:
    """The number of rows of each of the engine's forwards from now on, in order."""
    seen: list[int] = []
    forward = engine.runner.forward

    def counting(rows, *args, **kw):
        seen.append(len(rows))
        return forward(rows, *args, **kw)

    engine.runner.forward = counting  # type: ignore[method-assign]
    return seen


def test_batched_answers_equal_one_row_per_forward(loaded):
    vocab = loaded.info.vocab_size
    specs = [(ids(n, 100 + n, vocab), new) for n, new in ((40, 12), (7, 20), (130, 5), (64, 16), (3, 9))]
    answers, sizes = {}, {}
    for max_batch in (1, 8):
        pool = pool_for(loaded)
        engine = BatchEngine(loaded, pool, max_batch=max_batch, prefill_chunk=32, max_batch_tokens=64)
        sizes[max_batch] = rows_per_forward(engine)
        try:
            answers[max_batch] = run_tasks(engine, specs, pool)
            assert pool.free_blocks == pool.num_blocks  # every block back
        finally:
            engine.shutdown()
        assert len(sizes[max_batch]) == engine.stats.forwards and sum(sizes[max_batch]) == engine.stats.rows
    assert answers[1] == answers[8]
    assert [len(a) for a in answers[8]] == [new for _, new in specs]  # type: ignore[arg-type]
    # the batching happened: with room for 8, some forward ran all 5 requests together (with
    # max_batch 1, or a silent fallback to one row, every forward has one row), in far fewer forwards
    assert max(sizes[1]) == 1 and max(sizes[8]) == len(specs)
    assert 2 * len(sizes[8]) < len(sizes[1])


def test_the_engine_runs_an_iterations_prefill_and_decode_rows_in_one_forward(loaded):
    """The pool forward pads nothing: a prefill chunk and the decode rows of the same iteration are
    one forward (one pass over the weights), their answers those of one row per forward; a padding
    runner (the HF reference) keeps them apart."""
    vocab = loaded.info.vocab_size
    specs = [(ids(n, 300 + n, vocab), new) for n, new in ((8, 30), (5, 30), (200, 6), (90, 6))]
    answers, kinds = {}, {}
    for name, runner, max_batch in (("alone", PoolRunner, 1), ("pool", PoolRunner, 8), ("hf", Runner, 8)):
        pool = pool_for(loaded)
        engine = BatchEngine(loaded, pool, max_batch=max_batch, prefill_chunk=32, max_batch_tokens=64, runner=runner)
        seen: list[list[int]] = []
        forward = engine.runner.forward

        def recording(rows, *args, _seen=seen, _forward=forward, **kw):
            _seen.append([len(r.ids) for r in rows])
            return _forward(rows, *args, **kw)

        engine.runner.forward = recording  # type: ignore[method-assign]
        try:
            answers[name] = run_tasks(engine, specs, pool)
            assert pool.free_blocks == pool.num_blocks
        finally:
            engine.shutdown()
        kinds[name] = seen
    mixed = [rows for rows in kinds["pool"] if max(rows) > 1 and min(rows) == 1]
    assert mixed, kinds["pool"]  # the short prompts decode while the long ones prefill, in the same forwards
    assert len(kinds["pool"]) < len(kinds["hf"])  # fewer forwards for the same work
    assert answers["pool"] == answers["alone"] == answers["hf"]


@pytest.mark.parametrize("name", ["tiny-llama", "checkpoints/qa-tuned"])
def test_the_pool_forward_answers_as_the_hf_runner(name):
    """The engine's greedy answers, chunked prefill and batched decode, with the default runner
    (ours over the pool) and the Hugging Face one: the same tokens (float32)."""
    model = load_model(name, "float32", "cpu")
    vocab = model.info.vocab_size
    specs = [(ids(n, seed, vocab), new) for seed, (n, new) in enumerate([(70, 12), (9, 20), (130, 6), (33, 16), (64, 10)])]
    answers = {}
    for forward, runner in (("hf", Runner), ("pool", PoolRunner)):
        pool = pool_for(model)
        engine = BatchEngine(model, pool, max_batch=8, prefill_chunk=32, max_batch_tokens=64, runner=runner)
        try:
            answers[forward] = run_tasks(engine, specs, pool)
        finally:
            engine.shutdown()
    assert answers["pool"] == answers["hf"]
    assert [len(a) for a in answers["pool"]] == [new for _, new in specs]  # type: ignore[arg-type]


def test_decoding_writes_the_pool_in_place(loaded):
    pool = pool_for(loaded)
    storage = (pool.k.data_ptr(), pool.v.data_ptr(), pool.k.shape)
    engine = BatchEngine(loaded, pool, max_batch=4)
    try:
        before = torch.cuda.memory_allocated() if torch.cuda.is_available() else None
        out = run_tasks(engine, [(ids(50, 1, loaded.info.vocab_size), 40)], pool)
        assert len(out[0]) == 40  # type: ignore[arg-type]
        assert (pool.k.data_ptr(), pool.v.data_ptr(), pool.k.shape) == storage  # never grown, never replaced
        if before is not None:
            assert torch.cuda.memory_allocated() == before
    finally:
        engine.shutdown()


def test_a_row_with_absurd_values_fails_alone(loaded):
    """K = 3e38 in one layer of one request: that request gets DataLoss, the others of the same
    batches get exactly the tokens they get alone."""
    vocab = loaded.info.vocab_size
    good = [(ids(30, 7, vocab), 10), (ids(45, 8, vocab), 10)]
    pool = pool_for(loaded)
    engine = BatchEngine(loaded, pool, max_batch=8)
    try:
        alone = run_tasks(engine, good, pool)
        hostile_ctx = ids(40, 9, vocab)
        seq = pool.allocate(60)
        engine.submit(lambda: None).result(5)
        # the hostile request's context: a finite but absurd layer 1 written straight into its blocks
        engine.submit(lambda: Runner(loaded, pool).forward([Row(seq, hostile_ctx, 0)])).result(10)
        seq_len = seq.length
        blk, off = pool.slots(torch.arange(seq_len), seq.table)
        pool.k[1, blk, off] = 3e38
        pool.v[1, blk, off] = 3e38
        box: dict = {}
        got = threading.Event()

        def sink(item):
            if not isinstance(item, int):
                box["end"] = item
                got.set()

        engine.add(Task(seq, [5, 6, 7], sink, Sampler(Sampling(), torch.device("cpu")), 10))
        together = run_tasks(engine, good, pool)
        assert got.wait(30)
        assert isinstance(box["end"], DataLoss)
        assert together == alone
        assert engine.stats.failed_rows == 1
        engine.release(seq).result(10)
        assert pool.free_blocks == pool.num_blocks
        assert float(pool.k.abs().max()) == 0.0  # released blocks are zeroed: no stale absurd values
    finally:
        engine.shutdown()


def test_cancel_leaves_at_the_next_iteration_and_release_returns_blocks(loaded):
    pool = pool_for(loaded)
    engine = BatchEngine(loaded, pool, max_batch=4)
    try:
        seq = pool.allocate(1000)
        seen = []
        task = Task(seq, ids(20, 3, loaded.info.vocab_size), seen.append, Sampler(Sampling(), torch.device("cpu")), 900)
        engine.add(task)
        deadline = time.monotonic() + 20
        while len(seen) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        engine.cancel(task)
        engine.submit(lambda: None).result(10)  # one iteration boundary later
        engine.submit(lambda: None).result(10)
        n = len(seen)
        time.sleep(0.2)
        assert len(seen) == n < 900 and not any(isinstance(s, Finished) for s in seen)
        engine.release(seq).result(10)
        assert pool.free_blocks == pool.num_blocks
    finally:
        engine.shutdown()


async def test_kv_admission_limits_queue_and_release(loaded):
    pool = pool_for(loaded, tokens=64, block=16)  # 4 blocks
    admission = KVAdmission(pool, max_queue=1)
    soon = time.monotonic() + 5
    with pytest.raises(ResourceExhausted, match="kv_pool_bytes"):
        await admission.acquire(65, soon)
    first, waited = await admission.acquire(48, soon)  # 3 blocks
    assert waited == 0.0
    second = asyncio.ensure_future(admission.acquire(32, soon))  # waits: 1 block free
    await asyncio.sleep(0.05)
    assert admission.queued == 1 and not second.done()
    with pytest.raises(ResourceExhausted, match="max_queue 1"):
        await admission.acquire(16, soon)
    pool.release(first)
    assert pool.free_blocks == 1  # dropped, not free: only the owner's reclaim zeroes and frees
    pool.reclaim()  # what the engine does at its next boundary (it wakes admission)
    seq, waited = await asyncio.wait_for(second, 5)
    assert waited > 0 and pool.free_blocks == 2
    with pytest.raises(DeadlineExceeded):
        await admission.acquire(48, time.monotonic() + 0.1)
    third = asyncio.ensure_future(admission.acquire(48, time.monotonic() + 5))
    await asyncio.sleep(0.05)
    third.cancel()  # a caller that leaves while waiting takes nothing with it
    with pytest.raises(asyncio.CancelledError):
        await third
    pool.release(seq)
    pool.reclaim()
    await asyncio.sleep(0.05)
    assert pool.free_blocks == pool.num_blocks and admission.queued == 0


def test_pack_keeps_padding_under_twice_the_work():
    from consumer.engine.batch import pack

    rows = [(object(), n) for n in (5, 512, 7, 6, 300, 4)]
    groups = pack(rows)  # type: ignore[arg-type]
    assert sorted(n for g in groups for _, n in g) == sorted(n for _, n in rows)
    for g in groups:
        assert len(g) * max(n for _, n in g) <= 2 * sum(n for _, n in g) or len(g) == 1
    assert len(groups) == 2 and max(n for _, n in groups[-1]) <= 7  # the short questions share a forward


@pytest.mark.parametrize("start,n", [(0, 512), (0, 37), (16, 5), (5, 3), (5, 40), (3, 13), (32, 16), (7, 9)])
def test_pool_write_equals_token_by_token_and_touches_only_its_blocks(loaded, start, n):
    """SequenceKV.update (a codec's whole-layer write) places every token where the pool's slot map
    says (one index_copy_ over its flat slots, partial blocks at either end included); nothing
    else changes."""
    pool = pool_for(loaded, tokens=1024)
    other = pool.allocate(64)  # a neighbour whose blocks must stay as they are
    info = loaded.info
    g = torch.Generator().manual_seed(start * 1000 + n)
    shape = (1, info.num_kv_heads, 64, info.head_dim)
    other.update(torch.randn(shape, generator=g), torch.randn(shape, generator=g), 1)
    seq = pool.allocate(start + n)
    seq.first_write = start
    before_k, before_v = pool.k.clone(), pool.v.clone()
    keys = torch.randn(1, info.num_kv_heads, n, info.head_dim, generator=g)
    values = torch.randn(1, info.num_kv_heads, n, info.head_dim, generator=g)
    seq.update(keys, values, 1)
    expect_k, expect_v = before_k.clone(), before_v.clone()
    blk, off = pool.slots(torch.arange(start, start + n), seq.table)
    expect_k[1, blk, off] = keys[0].transpose(0, 1)
    expect_v[1, blk, off] = values[0].transpose(0, 1)
    assert torch.equal(pool.k, expect_k) and torch.equal(pool.v, expect_v)


@pytest.mark.parametrize("with_bad", [False, True])
@pytest.mark.parametrize("codec_name,options", [("raw", {}), ("quant", {"bits": "4", "group_size": "16"})])
def test_kv_codecs_rebuild_several_requests_into_the_pool_in_one_call(loaded, codec_name, options, with_bad):
    """Raw and quant layers of several requests queued together (shared.codecs.base.add_layers)
    are dequantized joined along tokens where groups allow and written to the pool in one copy:
    each request's blocks hold bitwise what its own add_layer writes, a request with a
    non-finite value (raw) or scale (quant: the joined dequantization fails, add_layers retries
    request by request) fails alone and writes nothing, and a request whose layer does not fit
    its reservation fails alone."""
    from shared import quantize
    from shared.codecs.base import LayerJob, StreamInfo, add_layers, create_codecs

    codec = create_codecs(loaded, [codec_name])[codec_name]
    info = loaded.info
    lengths = [32, 48, 16, 64]  # multiples of the group size: quant joins them
    bad, short = 1, 3
    streams = [StreamInfo(info.num_layers, T, "float32", dict(options)) for T in lengths]
    payloads = []
    for i, T in enumerate(lengths):
        g = torch.Generator().manual_seed(i)
        keys, values = (torch.randn(info.num_kv_heads, T, info.head_dim, generator=g) for _ in range(2))
        encoded = {"k": keys, "v": values} if codec_name == "raw" else quantize.encode_kv(keys, values, 4, 16)
        payloads.append({name: t.clone() for name, t in encoded.items()})  # plain tensors, as the wire gives
    if with_bad and codec_name == "raw":
        payloads[bad]["v"][0, 3, 1] = float("inf")
    elif with_bad:
        payloads[bad]["k_scale"][0, 0, 0] = float("nan")
    failing = [bad, short] if with_bad else [short]
    results = {}
    for how in ("alone", "together"):
        pool = pool_for(loaded, tokens=1024)
        seqs = [pool.allocate(T if i != short else T - 16) for i, T in enumerate(lengths)]
        decoders = [codec.decoder(s) for s in streams]
        for d, seq in zip(decoders, seqs):
            d.bind(seq)
        jobs = [LayerJob(d, 0, p) for d, p in zip(decoders, payloads)]
        if how == "alone":
            errors: list = []
            for job in jobs:
                try:
                    job.decoder.add_layer(0, job.payloads)
                    errors.append(None)
                except Exception as exc:
                    errors.append(exc)
        else:
            errors, shared = add_layers(jobs)
            assert shared == (0 if with_bad and codec_name == "quant" else len(jobs))
        assert [i for i, e in enumerate(errors) if e is not None] == failing, errors
        results[how] = (pool, seqs)
    (pa, _), (pb, sb) = results["alone"], results["together"]
    assert torch.equal(pa.k, pb.k) and torch.equal(pa.v, pb.v)  # same allocation order: same blocks
    for i in failing:  # wrote nothing
        assert not pb.k[:, sb[i].blocks].any() and not pb.v[:, sb[i].blocks].any()
    for i in (0, 2):
        assert pb.k[0, sb[i].blocks].any()


async def test_a_request_takes_the_tokens_that_arrived_together_in_one_message():
    """consumer.request.engine_stream.take_ready: what a loaded event loop sends as one TokenDelta. Everything
    queued up to the request's Finished, never past it; an error ends the batch and comes apart,
    after the tokens that preceded it."""
    from consumer.request.engine_stream import take_ready

    queue: asyncio.Queue = asyncio.Queue()
    assert take_ready(5, queue) == ([5], None)  # nothing else waiting: one token, as before
    done = Finished("stop")
    for item in (6, 7, done, 8):
        queue.put_nowait(item)
    assert take_ready(5, queue) == ([5, 6, 7, done], None) and queue.qsize() == 1
    queue.get_nowait()
    boom = DataLoss("non-finite")
    for item in (6, boom, 7):
        queue.put_nowait(item)
    batch, error = take_ready(5, queue)
    assert batch == [5, 6] and error is boom and queue.qsize() == 1
    assert take_ready(boom, asyncio.Queue()) == ([], boom)


def test_grouped_jobs_queued_together_run_as_one_call(loaded):
    """submit_grouped: the grouped jobs of one function queued one after another run as one call
    (a batched rebuild); a plain job between them splits the run; an item's exception reaches
    only that item's caller; a cancelled item is left out."""
    engine = BatchEngine(loaded, pool_for(loaded), max_batch=4)
    calls: list[list[int]] = []

    def many(items: list[int]) -> list:
        calls.append(list(items))
        return [ValueError(f"item {i}") if i == 2 else i * 10 for i in items]

    try:
        gate, holding = threading.Event(), threading.Event()

        def hold() -> None:
            holding.set()
            gate.wait(10)

        blocker = engine.submit(hold)  # holds the engine while the others queue ...
        assert holding.wait(10)  # ... once it runs: the engine took its jobs before the next ones came
        futures = [engine.submit_grouped(many, i) for i in (1, 2, 3)]
        plain = engine.submit(lambda: "plain")
        cancelled = engine.submit_grouped(many, 4)
        after = engine.submit_grouped(many, 5)
        assert cancelled.cancel()
        gate.set()
        blocker.result(10)
        assert futures[0].result(10) == 10 and futures[2].result(10) == 30
        with pytest.raises(ValueError, match="item 2"):
            futures[1].result(10)
        assert plain.result(10) == "plain" and after.result(10) == 50
        assert calls == [[1, 2, 3], [5]]
    finally:
        engine.shutdown()


async def test_a_deadline_during_decode_ends_the_request_after_the_tokens_before_it(loaded):
    """consumer.request.engine_stream: a request whose deadline passes while the engine still decodes for it gets
    the tokens sampled before the deadline, then DeadlineExceeded; the engine drops its task and
    its blocks can go back."""
    from consumer.request.engine_stream import engine_task
    from consumer.request.job import GenerateJob

    pool = pool_for(loaded)
    engine = BatchEngine(loaded, pool, max_batch=4)
    try:
        seq = pool.allocate(3000)
        job = GenerateJob(
            "r", [], ids(8, 1, loaded.info.vocab_size), None, {}, 2900, Sampling(), frozenset(), deadline=time.monotonic() + 0.4
        )
        task = Task(seq, list(job.question_ids), lambda _: None, Sampler(Sampling(), torch.device("cpu")), 2900)
        got: list[int] = []
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded, match="waiting for the engine"):
            async for items in engine_task(engine, job, task):
                got += [i for i in items if not isinstance(i, Finished)]
        assert 0 < len(got) < 2900 and time.monotonic() - started < 2.0
        await asyncio.wrap_future(engine.submit(lambda: None))  # an iteration boundary: the task has left
        await asyncio.wrap_future(engine.submit(lambda: None))
        assert task.cancelled and task not in engine.tasks
        await asyncio.wrap_future(engine.release(seq))
        assert pool.free_blocks == pool.num_blocks
    finally:
        engine.shutdown()


def test_no_flag_selects_the_hf_reference():
    """The Hugging Face runner is a test reference, not a serving option: --engine-forward is gone
    (an unknown flag is refused by the parser) and the config has no such field."""
    from shared.config import ConsumerConfig

    assert not hasattr(ConsumerConfig(), "engine_forward")
