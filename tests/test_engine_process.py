"""The frontend/engine split (`--engine-process`, consumer.engine.process): real services whose
engine runs in a child process over a shared-memory KV pool. Same answers as the in-process
engine; a cancelled request's blocks are freed only once the engine has let its task go; an engine
process that dies fails its requests UNAVAILABLE and takes the service out of liveness and
readiness."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest
import torch

from consumer.api.client import prompt
from consumer.engine.batch import Finished, Task
from consumer.engine.decoding import Sampler, Sampling
from consumer.engine.kv_pool import KVPool
from consumer.engine.process import EngineProcess
from shared.models import load_model
from shared.pb import common_pb2, consumer_pb2
from tests.conftest import running_pair

SPLIT = {"engine_process": True, "prefix_cache_bytes": 0}


def requests(mode: str, n: int = 5) -> list[dict]:
    ctx = list(range(5, 260))
    return [
        dict(
            context=prompt(ids=ctx[i * 7 :]),
            question=prompt(ids=[7, 8, 9 + i]),
            max_new_tokens=10 + i,
            transfer=common_pb2.CodecSpec(name=mode),
        )
        for i in range(n)
    ]


async def test_the_split_answers_as_the_in_process_engine(pair_llama):
    """Concurrent requests of every kind of engine work (a transfer rebuilt by the frontend, a
    quantized one, the engine's own chunked prefill, seeded sampling): token for token the
    in-process engine's answers; every block back in the pool afterwards."""
    async with running_pair("tiny-llama", consumer_kw=SPLIT) as split:
        for mode in ("raw", "quant", "oracle"):
            batch = requests(mode)
            batch[0]["sampling"] = consumer_pb2.SamplingParams(temperature=0.8, seed=11)
            want = await asyncio.gather(*(pair_llama.generate(**r) for r in batch))
            got = await asyncio.gather(*(split.generate(**r) for r in batch))
            assert [g[0] for g in got] == [w[0] for w in want], mode
        engine = split.consumer.executor
        assert isinstance(engine, EngineProcess) and engine.stats.forwards > 0
        for _ in range(100):  # releases run once the answers went out
            if engine.pool.free_blocks == engine.pool.num_blocks:
                break
            await asyncio.sleep(0.02)
        assert engine.pool.free_blocks == engine.pool.num_blocks


def test_a_cancelled_tasks_blocks_are_freed_only_after_the_engine_let_it_go():
    """release() of a sequence whose task the child may still be running waits for the child's
    word that the task left its batch; then the blocks are free and zeroed."""
    loaded = load_model("tiny-llama", "float32", "cpu")
    pool = KVPool(loaded.info, loaded.device, 512 * loaded.info.kv_bytes(1), 16)
    engine = EngineProcess(loaded, pool, "tiny-llama", torch_threads=1)
    try:
        seq = pool.allocate(300)
        tokens: list = []  # the sink runs on the reader thread
        task = Task(seq, list(range(5, 40)), sink=tokens.append, sampler=Sampler(Sampling(), loaded.device), max_new=250)
        engine.add(task)
        deadline = time.monotonic() + 30
        while len(tokens) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(tokens) >= 3 and not any(isinstance(t, Finished) for t in tokens)
        engine.cancel(task)
        released = engine.release(seq)  # deferred while the child may still hold the task
        released.result(timeout=30)
        assert engine._on_seq.get(id(seq)) is None and seq.released
        assert pool.free_blocks == pool.num_blocks
        assert not pool.k[:, seq.blocks].any() and not pool.v[:, seq.blocks].any()
    finally:
        engine.shutdown()


async def test_a_dead_engine_process_fails_its_requests_unavailable_and_the_service_not_live():
    fast = dict(SPLIT, liveness_interval_s=0.05, liveness_timeout_s=0.3, health_port=0)
    async with running_pair("tiny-llama", consumer_kw=fast) as split:
        engine = split.consumer.executor
        assert isinstance(engine, EngineProcess)
        long = dict(requests("raw", 1)[0], max_new_tokens=400)
        call = asyncio.ensure_future(split.generate(**long))
        for _ in range(500):
            if engine.stats.forwards > 3:
                break
            await asyncio.sleep(0.01)
        os.kill(engine.pid, signal.SIGKILL)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "engine process exited" in err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await split.generate(**requests("raw", 1)[0])
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        for _ in range(200):
            if not split.consumer.server.alive and split.consumer.server.not_ready:
                break
            await asyncio.sleep(0.02)
        assert not split.consumer.server.alive
        assert "engine process exited" in split.consumer.server.not_ready


def test_a_pool_larger_than_shared_memory_is_refused_by_name(tmp_path):
    """--engine-process moves a CPU pool to /dev/shm: one that cannot fit there is a start-up error
    naming both sizes and the fix, not a bus error at the first write."""
    from consumer.engine.process import check_shm

    loaded = load_model("tiny-llama", "float32", "cpu")
    pool = KVPool(loaded.info, loaded.device, 64 * loaded.info.kv_bytes(1), 16)
    check_shm(pool)  # this host's /dev/shm holds a small pool
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    big = KVPool(loaded.info, torch.device("meta"), 0, 16)
    big.device = torch.device("cpu")
    big.k = big.v = torch.empty(free // 2 + 1, dtype=torch.uint8, device="meta")  # sizes only: nothing allocated
    with pytest.raises(ValueError, match="does not fit .* raise the container's shm_size or lower kv_pool_bytes"):
        check_shm(big, str(tmp_path))


async def test_verified_decodings_tasks_run_in_the_engine_process_as_in_this_one():
    """What verified decoding hands the engine (consumer.exact.verify) gives the same outcome in the
    child as in process: a sampled draft's tokens and the q rows it drew them from (sent back to
    the frontend's DraftSampler), a check task's kept logits (or only their argmax ids), and a
    continuation that counts on from the tokens it was given (`generated`)."""
    from consumer.engine.batch import BatchEngine
    from consumer.engine.speculative import DraftSampler
    from consumer.request.engine_stream import engine_task
    from consumer.request.job import GenerateJob

    loaded = load_model("tiny-llama", "float32", "cpu")
    context = list(range(5, 45))
    job = GenerateJob("t", context, [], None, {}, 1, Sampling(), frozenset(), time.monotonic() + 120)

    async def run(engine, pool) -> dict:
        async def drain(task: Task) -> list:
            return [item async for items in engine_task(engine, job, task) for item in items]

        seqs = [pool.allocate(64) for _ in range(4)]
        for seq in seqs:
            await drain(Task(seq, list(context), sink=lambda _: None))
        draft = DraftSampler(Sampling(0.8, 0.9, 3), loaded.device)
        out = {"draft": await drain(Task(seqs[0], [50, 51], lambda _: None, draft, 6))}
        out["q"] = torch.stack([row.dense() for row in draft.rows])
        logits = Task(seqs[1], [50, 51, 52, 53], lambda _: None, keep_logits=3)
        argmax = Task(seqs[2], [50, 51, 52, 53], lambda _: None, keep_logits=3, keep_argmax=True)
        out["filled"] = (await drain(logits), await drain(argmax))
        out["logits"], out["argmax"] = torch.cat(logits.scores), torch.cat(argmax.scores)
        cont = Task(seqs[3], [50], lambda _: None, Sampler(Sampling(), loaded.device), 5, generated=3)
        out["cont"] = (await drain(cont), seqs[3].length)
        for seq in seqs:
            await asyncio.wrap_future(engine.release(seq))
        assert pool.free_blocks == pool.num_blocks
        return out

    pool = KVPool(loaded.info, loaded.device, 512 * loaded.info.kv_bytes(1), 16)
    local = BatchEngine(loaded, pool)
    try:
        want = await run(local, pool)
    finally:
        local.shutdown()
    pool = KVPool(loaded.info, loaded.device, 512 * loaded.info.kv_bytes(1), 16)
    split = EngineProcess(loaded, pool, "tiny-llama", torch_threads=1)
    try:
        got = await run(split, pool)
    finally:
        split.shutdown()
    assert len(want["draft"]) == 7 and got["draft"] == want["draft"]  # 6 tokens, then Finished
    assert got["q"].shape[0] == 6
    torch.testing.assert_close(got["q"], want["q"], atol=1e-5, rtol=1e-4)
    assert got["filled"] == want["filled"] == ([Finished("filled")], [Finished("filled")])
    torch.testing.assert_close(got["logits"], want["logits"], atol=1e-4, rtol=1e-4)
    assert got["argmax"].tolist() == want["argmax"].tolist() == torch.argmax(want["logits"], dim=-1).tolist()
    assert len(want["cont"][0]) == 3 and got["cont"] == want["cont"]  # 2 tokens (3 of 5 were given), then Finished
