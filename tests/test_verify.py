"""Verified decoding (consumer/exact/verify.py): the acceptance rules, the runner's and engine's logits at
every position of a row, the sampled answer's distribution (the oracle's, by a total-variation
bound over many seeded runs that the unverified draft distribution fails), and through the real
services: greedy answers equal the oracle's on a heterogeneous pair and on a hostile-but-finite
stream, provisional tokens followed by one commit, the composition with the audit, and every KV
block back on every path (success, cancel, deadline, a broken stream)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import torch

from consumer.engine.batch import BatchEngine, Task
from consumer.engine.decoding import Sampler, Sampling
from consumer.engine.hf_reference import Runner
from consumer.engine.kv_pool import KVPool
from consumer.engine.process import EngineProcess
from consumer.engine.rows import Row
from consumer.engine.speculative import Nucleus, accept_greedy, accept_sampled
from consumer.exact.verify import Verifier
from consumer.request.engine_stream import engine_task
from consumer.request.job import VERIFY_VERIFIED, GenerateJob, GenerateResult, TokenOut
from shared import logs
from shared.errors import DataLoss
from shared.models import load_model
from shared.pb import common_pb2, consumer_pb2
from tests.conftest import ConsumerClient, perturbed_model, prompt, running_pair
from tests.greedy import assert_greedy_agrees
from tests.hostile import chunks, consumer_of, record, set_data
from tests.test_end_to_end import local_greedy

CONTEXT = "The producer reads a long context and the consumer writes the answer. " * 8
QUESTION = " Which layers are patched?"
VERIFIED, PROVISIONAL = consumer_pb2.VERIFY_POLICY_VERIFIED, consumer_pb2.VERIFY_POLICY_PROVISIONAL
SMALL_CHUNKS = {"prefill_chunk": 8, "prefix_cache_bytes": 0}  # the exact prefill takes many iterations: drafts happen


@pytest.fixture(scope="module")
def loaded():
    return load_model("tiny-llama", "float32", "cpu")


def ids(n: int, seed: int, vocab: int = 384) -> list[int]:
    return torch.randint(4, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# --- the acceptance rules ------------------------------------------------------------------------


def test_greedy_keeps_the_agreeing_prefix_and_replaces_the_first_disagreement():
    exact = [3, 5, 7, 2]  # the exact model's argmax after the question and drafts[:i]
    assert accept_greedy([3, 5, 9], exact) == (2, 7)  # 3, 5 stand; 9 -> the exact 7
    assert accept_greedy([3, 5, 7], exact) == (3, 2)  # all stand; the exact next token follows
    assert accept_greedy([4], exact[:2]) == (0, 3)
    assert accept_greedy([], exact[:1]) == (0, 3)


def chain_probs(prefix: tuple[int, ...], salt: int, vocab: int, sharp: float) -> torch.Tensor:
    """A toy model's next-token distribution after `prefix` (fixed by prefix and salt)."""
    g = torch.Generator().manual_seed(hash((prefix, salt)) & 0xFFFFFFFF)
    return torch.softmax(sharp * torch.randn(vocab, generator=g), dim=-1)


def sequence_distribution(length: int, vocab: int) -> dict[tuple[int, ...], float]:
    """The exact model's (salt 0) distribution over whole sequences of `length` tokens."""
    out = {(): 1.0}
    for _ in range(length):
        out = {s + (t,): w * float(chain_probs(s, 0, vocab, 2.0)[t]) for s, w in out.items() for t in range(vocab)}
    return out


def speculative_run(rng: torch.Generator, length: int, vocab: int, rule) -> tuple[int, ...]:
    """Draft up to `length` tokens from the draft model (salt 1), check them with `rule`, then
    sample the rest from the exact model: one answer."""
    k = int(torch.randint(0, length + 1, (), generator=rng))
    drafts, q = [], []
    for _ in range(k):
        qi = chain_probs(tuple(drafts), 1, vocab, 2.0)
        q.append(qi)
        drafts.append(int(torch.multinomial(qi, 1, generator=rng)))
    p = [Nucleus.of(None, chain_probs(tuple(drafts[:i]), 0, vocab, 2.0), vocab) for i in range(k + 1)]
    accepted, following = rule(drafts, [Nucleus.of(None, qi, vocab) for qi in q], p, rng)
    out = drafts[:accepted] + [following]
    while len(out) < length:
        out.append(int(torch.multinomial(chain_probs(tuple(out), 0, vocab, 2.0), 1, generator=rng)))
    return tuple(out[:length])


def total_variation(samples: list[tuple[int, ...]], exact: dict[tuple[int, ...], float]) -> float:
    counts: dict[tuple[int, ...], int] = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    return 0.5 * sum(abs(counts.get(s, 0) / len(samples) - w) for s, w in exact.items())


def no_residual(drafts, q, p, rng):
    """A wrong rule (on rejection draw from p, not from norm(max(0, p - q))): the test must catch it."""
    for i, d in enumerate(drafts):
        if float(torch.rand((), generator=rng)) * q[i].prob(d) >= p[i].prob(d):
            return i, p[i].draw(rng)
    return len(drafts), p[-1].draw(rng)


def test_speculative_sampling_gives_the_exact_models_sequence_distribution():
    """3-token answers over a 4-token vocabulary (64 outcomes), 6000 seeded runs: the empirical
    distribution is within 0.045 total variation of the exact model's (expected ~0.03 from
    sampling alone); the draft model's own distribution, and the rule without its residual, are
    far outside it."""
    length, vocab, runs = 3, 4, 6000
    exact = sequence_distribution(length, vocab)
    rng = torch.Generator().manual_seed(0)
    got = total_variation([speculative_run(rng, length, vocab, accept_sampled) for _ in range(runs)], exact)
    drafted = {}
    for s in exact:
        drafted[s] = float(torch.prod(torch.stack([chain_probs(s[:i], 1, vocab, 2.0)[s[i]] for i in range(length)])))
    draft_tv = 0.5 * sum(abs(drafted[s] - w) for s, w in exact.items())
    rng = torch.Generator().manual_seed(0)
    wrong = total_variation([speculative_run(rng, length, vocab, no_residual) for _ in range(runs)], exact)
    assert got < 0.045, got
    assert draft_tv > 0.2 and wrong > 0.08, (draft_tv, wrong)


# --- all-position logits in the runner and the engine --------------------------------------------


@torch.inference_mode()
def test_the_runner_returns_the_logits_of_a_rows_last_positions_only_when_asked(loaded):
    pool = KVPool(loaded.info, loaded.device, 512 * loaded.info.kv_bytes(1))
    runner = Runner(loaded, pool)
    a, b = ids(40, 1), ids(25, 2)
    sa, sb = pool.allocate(64), pool.allocate(64)
    rows = [Row(sa, a, 0, tail_logits=6), Row(sb, b, 0)]
    last = runner.forward(rows)
    ref = loaded.model(torch.tensor([a])).logits[0]  # [40, vocab]
    torch.testing.assert_close(rows[0].logits, ref[-6:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(last[0], ref[-1], atol=1e-4, rtol=1e-4)
    assert rows[1].logits is None


async def test_a_chunked_prefill_task_keeps_the_logits_of_its_last_positions(loaded):
    pool = KVPool(loaded.info, loaded.device, 512 * loaded.info.kv_bytes(1))
    engine = BatchEngine(loaded, pool, prefill_chunk=8)
    try:
        tokens = ids(30, 3)
        task = Task(pool.allocate(32), list(tokens), sink=lambda _: None, keep_logits=12)  # 12 of 30, over 3 chunks
        job = GenerateJob("t", tokens, [], None, {}, 1, Sampling(), frozenset(), time.monotonic() + 60)
        async for _ in engine_task(engine, job, task):
            pass
        with torch.inference_mode():
            ref = loaded.model(torch.tensor([tokens])).logits[0, -12:]
        assert [s.shape[0] for s in task.scores] == [6, 6]  # positions 18..23 of chunk 16..23, then 24..29
        torch.testing.assert_close(torch.cat(task.scores), ref, atol=1e-4, rtol=1e-4)
        greedy = Task(pool.allocate(32), list(tokens), sink=lambda _: None, keep_logits=12, keep_argmax=True)
        async for _ in engine_task(engine, job, greedy):
            pass
        assert torch.cat(greedy.scores).tolist() == torch.argmax(ref, dim=-1).tolist()
    finally:
        engine.shutdown()


@pytest.mark.parametrize("split", [False, True], ids=["in_process", "engine_process"])
async def test_non_finite_kept_logits_fail_the_verification_task(loaded, split):
    """Keys of 3e38 in the cache (finite, absurd) make the kept logits non-finite: the check task
    fails DataLoss in the engine (in this process or its own) instead of handing them to the
    acceptance; its blocks come back."""
    pool = KVPool(loaded.info, loaded.device, 256 * loaded.info.kv_bytes(1), 16)
    engine = EngineProcess(loaded, pool, "tiny-llama", torch_threads=1) if split else BatchEngine(loaded, pool)
    try:
        seq = pool.allocate(48)
        pool.k[:, seq.blocks] = 3e38
        seq.length = 32
        job = GenerateJob("t", ids(32, 4), [], None, {}, 1, Sampling(), frozenset(), time.monotonic() + 60)
        check = Task(seq, ids(5, 5), sink=lambda _: None, keep_logits=5, keep_argmax=True)
        with pytest.raises(DataLoss, match="non-finite logits"):
            async for _ in engine_task(engine, job, check):
                pass
        await asyncio.wrap_future(engine.release(seq))
        assert pool.free_blocks == pool.num_blocks
    finally:
        engine.shutdown()


# --- the sampled answer's distribution on a tiny model ---------------------------------------------


@pytest.mark.parametrize("split", [False, True], ids=["in_process", "engine_process"])
async def test_sampled_verified_answers_follow_the_exact_caches_distribution(loaded, split):
    """The first token of 400 seeded verified answers whose drafts come from a wrong cache (the KV
    of a context whose last 4 tokens differ: finite, its next-token distribution overlapping the
    exact one by about half, so drafts are accepted and rejected): binned into the exact
    distribution's 8 likeliest tokens and the rest, within 0.13 total variation of it (sampling
    alone gives ~0.05), while the drafts' own distribution is more than 0.3 away. The same with
    the engine in its own process (the drafts' q rows and the check's logits sent back)."""
    sampling = Sampling(temperature=0.3, top_p=1.0)
    ctx, q = ids(64, 11), ids(4, 13)
    wrong = ctx[:-4] + ids(4, 12)
    with torch.inference_mode():
        p = Sampler(sampling, loaded.device).probs(loaded.model(torch.tensor([ctx + q])).logits[0, -1])
        d = Sampler(sampling, loaded.device).probs(loaded.model(torch.tensor([wrong + q])).logits[0, -1])
    p, d = p / p.sum(), d / d.sum()
    pool = KVPool(loaded.info, loaded.device, 32 * 160 * loaded.info.kv_bytes(1))
    engine: BatchEngine | EngineProcess
    if split:
        engine = EngineProcess(loaded, pool, "tiny-llama", torch_threads=1, prefill_chunk=16)
    else:
        engine = BatchEngine(loaded, pool, prefill_chunk=16)
    verifier = Verifier(loaded, engine)
    runs, counts = 400, torch.zeros_like(p)
    try:
        template = pool.allocate(64)
        fill = GenerateJob("fill", wrong, [], None, {}, 1, Sampling(), frozenset(), time.monotonic() + 60)
        async for _ in engine_task(engine, fill, Task(template, list(wrong), sink=lambda _: None)):
            pass

        async def one(seed: int) -> int:
            job = GenerateJob(
                f"r{seed}",
                ctx,
                q,
                None,
                {},
                1,
                Sampling(0.3, 1.0, seed),
                frozenset(),
                time.monotonic() + 60,
                verify=VERIFY_VERIFIED,
            )
            draft, exact = pool.allocate(69), pool.allocate(69)
            await logs.run_in(engine, pool.copy_blocks, template.blocks, draft.blocks)
            draft.length = 64
            result = GenerateResult(job.request_id, "raw", {}, 64, 4)
            out = [item async for item in verifier.answer(job, result, draft, exact, engine.release)]
            await asyncio.wrap_future(engine.release(exact))
            assert result.drafted_tokens == 1 and result.verify_decision.startswith("verified")
            tokens = [i for item in out if isinstance(item, TokenOut) for i in item.ids]
            assert len(tokens) == 1
            return tokens[0]

        for start in range(0, runs, 16):
            for token in await asyncio.gather(*(one(seed) for seed in range(start, start + 16))):
                counts[token] += 1
        await asyncio.wrap_future(engine.release(template))
    finally:
        engine.shutdown()
    top = p.topk(8).indices

    def binned(dist: torch.Tensor) -> torch.Tensor:
        return torch.cat([dist[top], (dist.sum() - dist[top].sum()).reshape(1)])

    got = 0.5 * float((binned(counts / runs) - binned(p)).abs().sum())
    draft_tv = 0.5 * float((binned(d) - binned(p)).abs().sum())
    assert draft_tv > 0.3, draft_tv
    assert got < 0.13, got
    assert pool.free_blocks == pool.num_blocks


# --- through the real services -----------------------------------------------------------------------


def fields(mode: str, verify: int, new: int = 12, **kw) -> dict:
    return dict(
        context=prompt(CONTEXT),
        question=prompt(QUESTION),
        max_new_tokens=new,
        verify=verify,
        transfer=common_pb2.CodecSpec(name=mode),
        **kw,
    )


async def all_blocks_back(consumer) -> None:
    """Every KV block free again (no prefix cache in these consumers), within 5 s."""
    pool = consumer.servicer.batch.pool
    for _ in range(100):
        if pool.free_blocks == pool.num_blocks and consumer.servicer.admission.inflight == 0:
            return
        await asyncio.sleep(0.05)
    assert pool.free_blocks == pool.num_blocks, f"{pool.num_blocks - pool.free_blocks} blocks not returned"


@pytest.mark.numeric
async def test_greedy_verified_answers_equal_the_oracles_on_a_heterogeneous_pair(tmp_path):
    """Producer P, consumer a perturbed C: raw is naive reuse and its drafts go wrong; verified,
    the answer is the oracle's (tests/greedy.py's near-tie rule against C's own in-process
    answer), delivered as verified tokens only or as provisional ones and a commit."""
    local = perturbed_model("tiny-llama", 7, 0.05, save_to=tmp_path)
    tok = local.tokenizer
    ctx_ids, q_ids = tok(CONTEXT)["input_ids"], tok(QUESTION, add_special_tokens=False)["input_ids"]
    own, margins = local_greedy(local.model, ctx_ids, q_ids, 64, tok.eos_token_id)
    async with running_pair("tiny-llama", consumer_model=str(tmp_path), consumer_kw=SMALL_CHUNKS) as pair:
        oracle, _, _ = await pair.generate(**fields("oracle", consumer_pb2.VERIFY_POLICY_OFF, 64))
        assert_greedy_agrees(oracle, own, margins, what="oracle")
        naive, _, _ = await pair.generate(**fields("raw", consumer_pb2.VERIFY_POLICY_OFF, 12))
        assert naive[:12] != oracle[:12]  # the drafts are wrong somewhere: verification has work to do

        answer = await pair.client.generate(timeout=120, **fields("raw", VERIFIED))  # all 12 drafted first
        s = answer.stats
        assert_greedy_agrees(answer.ids, own[:12], margins, what="verified")
        assert answer.text == tok.decode(answer.ids, skip_special_tokens=True) and answer.commit is None
        assert s.drafted_tokens == 12 and s.accepted_draft_tokens < 12 and s.generated_tokens == len(answer.ids)
        assert s.verify_decision.startswith(f"verified: {s.accepted_draft_tokens} of 12 drafts accepted, draft ")
        assert s.time_to_verified_ms >= s.ttft_ms > 0 and s.verify_ms > 0 and s.transfer.name == "raw"

        # drafts, the commit, then decoding on the exact cache (its prefill: ~24 iterations; 64 drafts would take 64)
        answer = await pair.client.generate(timeout=120, **fields("raw", PROVISIONAL, 64))
        s = answer.stats
        assert_greedy_agrees(answer.ids, own, margins, what="provisional")
        assert answer.text == tok.decode(answer.ids, skip_special_tokens=True)
        assert answer.commit is not None and len(answer.provisional_ids) == s.drafted_tokens > 0
        assert answer.ids[: s.accepted_draft_tokens] == answer.provisional_ids[: s.accepted_draft_tokens]
        assert answer.commit.accepted_tokens == s.accepted_draft_tokens and len(answer.commit.ids) == 1
        assert s.ttft_ms < s.time_to_verified_ms  # provisional tokens came first
        assert s.drafted_tokens < 64 == len(answer.ids)  # the exact cache was complete before the draft: decoded on it

        # composition: audit first, then verify (or not, when the audit's fallback made the cache exact)
        audited = await pair.client.generate(timeout=120, audit=consumer_pb2.AUDIT_POLICY_REPORT, **fields("raw", VERIFIED))
        assert audited.stats.audit_decision == "diverged" and audited.stats.verify_decision.startswith("verified")
        assert_greedy_agrees(audited.ids, own[:12], margins, what="audit report + verify")
        fell_back = await pair.client.generate(timeout=120, audit=consumer_pb2.AUDIT_POLICY_FALLBACK, **fields("raw", VERIFIED))
        assert fell_back.stats.audit_decision == "diverged: prefilled locally"
        assert fell_back.stats.verify_decision == "skipped: the context was prefilled locally"
        assert fell_back.stats.drafted_tokens == 0 and fell_back.ids == oracle[:12]
        own_prefill = await pair.client.generate(timeout=120, **fields("oracle", VERIFIED))
        assert own_prefill.stats.verify_decision == "skipped: mode oracle is exact" and own_prefill.ids == oracle[:12]
        await all_blocks_back(pair.consumer)


async def test_sampled_verification_through_the_services(tmp_path):
    perturbed_model("tiny-llama", 7, 0.05, save_to=tmp_path)
    async with running_pair("tiny-llama", consumer_model=str(tmp_path), consumer_kw=SMALL_CHUNKS) as pair:
        sampling = consumer_pb2.SamplingParams(temperature=0.8, top_p=0.9, seed=5)
        answer = await pair.client.generate(timeout=120, sampling=sampling, **fields("raw", PROVISIONAL, 20))
        s = answer.stats
        assert answer.commit is not None and s.accepted_draft_tokens <= s.drafted_tokens == len(answer.provisional_ids)
        assert len(answer.ids) == s.generated_tokens
        assert len(answer.ids) == 20 or s.finish_reason == consumer_pb2.FINISH_REASON_STOP
        await all_blocks_back(pair.consumer)


@pytest.mark.numeric  # greedy tokens compared across kernels (tests/greedy.py)
async def test_verified_answers_with_the_engine_in_its_own_process(tmp_path):
    """--engine-process: drafting, the exact prefill, the check and the continuation run in the
    engine's process, the acceptance in the frontend over the rows it sends back. Greedy (drafts
    from a perturbed consumer's transfer, so some are replaced): the same consumer's oracle answer
    token for token, as verified tokens and as provisional ones and a commit; sampled: the
    acceptance's counts and lengths hold; every answered request, one cancelled mid-way and one
    past its deadline give every block back."""
    perturbed_model("tiny-llama", 7, 0.05, save_to=tmp_path)
    async with running_pair(
        "tiny-llama", consumer_model=str(tmp_path), consumer_kw={**SMALL_CHUNKS, "engine_process": True}
    ) as pair:
        assert isinstance(pair.consumer.executor, EngineProcess)
        oracle, _, _ = await pair.generate(**fields("oracle", consumer_pb2.VERIFY_POLICY_OFF, 64))
        naive, _, _ = await pair.generate(**fields("raw", consumer_pb2.VERIFY_POLICY_OFF, 12))
        assert naive[:12] != oracle[:12]  # the drafts are wrong somewhere: verification has work to do

        answer = await pair.client.generate(timeout=120, **fields("raw", VERIFIED))
        s = answer.stats
        assert answer.ids == oracle[:12] and answer.commit is None
        assert s.drafted_tokens == 12 and s.accepted_draft_tokens < 12 and s.generated_tokens == 12
        assert s.verify_decision.startswith(f"verified: {s.accepted_draft_tokens} of 12 drafts accepted, draft ")

        answer = await pair.client.generate(timeout=120, **fields("raw", PROVISIONAL, 64))
        s = answer.stats
        assert answer.ids == oracle and s.generated_tokens == 64  # the continuation counts on from the verified tokens
        assert answer.commit is not None and len(answer.provisional_ids) == s.drafted_tokens > 0
        assert answer.ids[: s.accepted_draft_tokens] == answer.provisional_ids[: s.accepted_draft_tokens]
        assert s.drafted_tokens < 64

        sampling = consumer_pb2.SamplingParams(temperature=0.8, top_p=0.9, seed=5)
        for verify in (VERIFIED, PROVISIONAL):
            answer = await pair.client.generate(timeout=120, sampling=sampling, **fields("raw", verify, 20))
            s = answer.stats
            assert s.verify_decision.startswith("verified: ") and s.accepted_draft_tokens <= s.drafted_tokens
            assert len(answer.ids) == s.generated_tokens <= 20
            assert len(answer.ids) == 20 or s.finish_reason == consumer_pb2.FINISH_REASON_STOP
        await all_blocks_back(pair.consumer)

        call = pair.client.stub.Generate(consumer_pb2.GenerateRequest(**fields("raw", PROVISIONAL, 200)), timeout=60)
        first = await call.read()
        assert first.WhichOneof("kind") == "token"
        call.cancel()
        await all_blocks_back(pair.consumer)
        with pytest.raises(grpc.aio.AioRpcError) as err:  # the deadline passes while drafting and verifying
            await pair.client.generate(timeout=0.15, **fields("raw", VERIFIED, 400))
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await all_blocks_back(pair.consumer)


def garbled(messages, seed: int = 0) -> list:
    """A raw stream whose every payload is replaced by finite noise of the same size (CRCs fixed):
    it passes the stream contract, and every draft from it is wrong."""
    g = torch.Generator().manual_seed(seed)
    out = [type(m)() for m in messages]
    for o, m in zip(out, messages):
        o.CopyFrom(m)
    for i in chunks(out):
        n = len(out[i].chunk.data) // 4
        set_data(out[i], (torch.randn(n, generator=g) * 3).numpy().tobytes())
    return out


@pytest.mark.numeric  # greedy tokens compared across kernels (tests/greedy.py)
async def test_a_hostile_but_finite_stream_still_gives_the_oracles_answer(loaded):
    async with running_pair("tiny-llama") as real:
        ctx_ids = loaded.tokenizer(CONTEXT)["input_ids"]
        stream = garbled(await record(real.producer.address, ctx_ids, "raw"))
    own, margins = local_greedy(
        loaded.model,
        ctx_ids,
        loaded.tokenizer(QUESTION, add_special_tokens=False)["input_ids"],
        24,
        loaded.tokenizer.eos_token_id,
    )
    async with consumer_of(lambda request: stream, **SMALL_CHUNKS) as (consumer, _):
        async with ConsumerClient(consumer.address) as client:
            wrong = await client.generate(**fields("raw", consumer_pb2.VERIFY_POLICY_OFF, 24))
            assert wrong.ids != own  # the stream was accepted, and its answer is wrong
            answer = await client.generate(**fields("raw", PROVISIONAL, 24))
            assert_greedy_agrees(answer.ids, own, margins, what="verified over a garbled stream")
            assert answer.stats.drafted_tokens > 0 and answer.stats.accepted_draft_tokens < answer.stats.drafted_tokens
        await all_blocks_back(consumer)


@pytest.mark.numeric  # greedy tokens compared across kernels (tests/greedy.py)
async def test_every_block_comes_back_after_cancel_deadline_and_a_broken_stream(loaded):
    async with running_pair("tiny-llama") as real:
        ctx_ids = loaded.tokenizer(CONTEXT)["input_ids"]
        stream = await record(real.producer.address, ctx_ids, "raw")
    script = {"messages": stream}
    async with consumer_of(lambda request: script["messages"], **SMALL_CHUNKS) as (consumer, _):
        async with ConsumerClient(consumer.address) as client:
            # cancelled after the first provisional token, while the exact prefill is running
            call = client.stub.Generate(consumer_pb2.GenerateRequest(**fields("raw", PROVISIONAL, 200)), timeout=60)
            first = await call.read()
            assert first.WhichOneof("kind") == "token"
            call.cancel()
            await all_blocks_back(consumer)
            # the deadline passes while drafting and verifying
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.generate(timeout=0.15, **fields("raw", VERIFIED, 400))
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await all_blocks_back(consumer)
            # a stream that breaks mid-way (after its first layer): DATA_LOSS, both caches' blocks back
            broken = list(stream)
            last = chunks(broken)[-1]
            broken[last] = type(broken[last])()
            broken[last].CopyFrom(stream[last])
            broken[last].chunk.crc32c ^= 1
            script["messages"] = broken
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.generate(**fields("raw", VERIFIED))
            assert err.value.code() == grpc.StatusCode.DATA_LOSS
            await all_blocks_back(consumer)
            script["messages"] = stream
            answer = await client.generate(**fields("raw", VERIFIED))  # same weights: every draft stands
            assert answer.stats.accepted_draft_tokens == answer.stats.drafted_tokens
        await all_blocks_back(consumer)


async def test_admission_names_the_double_reservation(loaded):
    """A request whose KV fits the pool once but not twice: refused under verify, naming why."""
    tok = loaded.tokenizer
    tokens = len(tok(CONTEXT)["input_ids"]) + len(tok(QUESTION, add_special_tokens=False)["input_ids"]) + 12
    pool_bytes = (tokens + 48) * loaded.info.kv_bytes(1)  # room for one cache of this request, not two
    async with running_pair("tiny-llama", consumer_kw={"kv_pool_bytes": pool_bytes, "prefix_cache_bytes": 0}) as pair:
        once, _, _ = await pair.generate(**fields("raw", consumer_pb2.VERIFY_POLICY_OFF))
        assert len(once) == 12
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pair.generate(**fields("raw", VERIFIED))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "verify reserves context + question + max_new_tokens twice" in err.value.details()
        await all_blocks_back(pair.consumer)


@pytest.mark.numeric  # greedy tokens compared across kernels (tests/greedy.py)
async def test_the_exact_cache_starts_from_the_consumers_own_cached_prefill(tmp_path):
    """With the prefix cache on, a context the consumer prefilled before (here by mode oracle) is
    copied into the exact cache instead of prefilled again; a verified answer's exact cache is kept
    as the own prefill for the next request."""
    perturbed_model("tiny-llama", 7, 0.05, save_to=tmp_path)
    async with running_pair("tiny-llama", consumer_model=str(tmp_path), consumer_kw={"prefill_chunk": 8}) as pair:
        first = await pair.client.generate(timeout=120, **fields("raw", VERIFIED))
        assert "prefix cache" not in first.stats.verify_decision
        oracle, _, _ = await pair.generate(**fields("oracle", consumer_pb2.VERIFY_POLICY_OFF))
        again = await pair.client.generate(timeout=120, **fields("raw", VERIFIED))
        tokens = again.stats.context_tokens
        assert again.stats.verify_decision.endswith(f"; exact cache: {tokens} context tokens from the prefix cache")
        assert again.ids == first.ids and oracle == first.ids


@pytest.mark.numeric  # greedy tokens compared across kernels (tests/greedy.py)
async def test_identical_weights_build_the_exact_cache_by_a_raw_transfer_beside_the_drafts(loaded):
    """Producer and consumer with the same weights and dtype: when auto's estimates say the raw
    transfer beats the own prefill, verified decoding of a lossy (4-bit) transfer takes its exact
    cache from a second, raw, transfer; the answer is the oracle's, both transfers' bytes count,
    and every block comes back."""
    tok = loaded.tokenizer
    ctx_ids, q_ids = tok(CONTEXT)["input_ids"], tok(QUESTION, add_special_tokens=False)["input_ids"]
    own, margins = local_greedy(loaded.model, ctx_ids, q_ids, 24, tok.eos_token_id)
    async with running_pair("tiny-llama", consumer_kw=SMALL_CHUNKS) as pair:
        servicer = pair.consumer.servicer
        raw = next(c for c in servicer.chooser.candidates() if c.mode == "raw")
        asked: list[int] = []

        def raw_is_faster(context_ids: list[int]):
            asked.append(len(context_ids))
            return raw  # the decision under test below is the mechanism, not the estimate

        servicer.chooser.exact_transfer = raw_is_faster
        lossy = common_pb2.CodecSpec(name="quant", options={"bits": "4"})
        quant = await pair.client.generate(
            timeout=120, **{**fields("quant", consumer_pb2.VERIFY_POLICY_OFF, 24), "transfer": lossy}
        )
        answer = await pair.client.generate(timeout=120, **{**fields("quant", VERIFIED, 24), "transfer": lossy})
        s = answer.stats
        assert asked == [len(ctx_ids)]
        assert_greedy_agrees(answer.ids, own, margins, what="verified, exact cache by raw")
        assert "; exact cache: raw transfer (" in s.verify_decision, s.verify_decision
        raw_bytes = loaded.info.kv_bytes(len(ctx_ids))
        assert s.bytes_received > raw_bytes  # the quant stream's and the raw stream's bytes
        assert quant.stats.bytes_received < raw_bytes
        await all_blocks_back(pair.consumer)


def raw_transfer(tokens: int, producer_ms_per_token: float):
    """A raw transfer's observation: the producer's prefill at the given rate, a fast link."""
    from consumer.auto.planner import Observation

    return Observation(
        "raw",
        {},
        tokens,
        tokens * 100,
        producer_ms_per_token * tokens,
        sent_tokens=tokens,
        producer_prefill_ms=producer_ms_per_token * tokens,
        computed_tokens=tokens,
        header_ms=0.1,
        span_ms=0.01 * tokens,
        span_bytes=tokens * 100,
    )


async def test_the_exact_transfer_is_chosen_only_when_estimated_faster_than_the_own_prefill():
    """Chooser.exact_transfer: None without estimates, without an exact remote candidate (other
    weights) or when the own prefill is faster; the raw candidate when its estimate is lower."""
    from consumer.auto.planner import Observation

    async with running_pair("tiny-llama") as pair:
        chooser, planner = pair.consumer.servicer.chooser, pair.consumer.servicer.planner
        ids = list(range(4, 260))
        assert chooser.exact_transfer(ids) is None  # nothing measured yet
        fresh = type(planner)()
        chooser.planner = fresh
        for tokens in (64, 128, 256, 512):  # the own prefill: 1 ms per token
            fresh.observe(Observation("oracle", {}, tokens, 0, float(tokens), local_tokens=tokens))
        for tokens in (64, 128, 256, 512):  # raw: the producer prefill at 0.01 ms per token, a fast link
            fresh.observe(raw_transfer(tokens, 0.01))
        picked = chooser.exact_transfer(ids)
        raw = next(c for c in chooser.candidates() if c.mode == "raw")
        why = (chooser._estimate(raw, chooser.key("raw", raw.options), ids), fresh.estimate_local(len(ids)))
        assert picked is not None and picked.mode in ("raw", "recompute"), why
        slow = type(planner)()
        slow.key, chooser.planner = chooser.key, slow
        for tokens in (64, 128, 256, 512):  # now the own prefill is cheap and the producer slow
            slow.observe(Observation("oracle", {}, tokens, 0, 0.001 * tokens, local_tokens=tokens))
            slow.observe(raw_transfer(tokens, 5.0))
        assert chooser.exact_transfer(ids) is None
        chooser.planner = fresh
        chooser._cached = None
        assert chooser.exact_transfer(ids) is not None
        chooser.exact_by_transfer = False  # --exact-by-transfer false: exactness rests on the own forward only
        chooser._cached = None
        assert chooser.exact_transfer(ids) is None
        assert not [c for c in chooser.candidates() if c.how == "exact" and c.mode != "oracle"]
        chooser.exact_by_transfer = True
        chooser.producer_identity = lambda: "another"  # another model: raw is naive reuse, never exact
        chooser._cached = None
        assert chooser.exact_transfer(ids) is None
