"""Anchor-token repair (consumer/exact/repair.py): the option's validation; the recompute of every token
is the consumer's own prefill whatever the rebuilt cache held (one forward, or in chunks); the
question's attention mass equals transformers' eager attention weights; a partial repair writes
the anchors' blocks only; and through the real services: a hostile-but-finite stream repaired at
fraction 1.0 answers like the oracle, at a small fraction answers at all, every block comes back,
and the composition with the audit and the oracle mode is recorded in the stats."""

from __future__ import annotations

import copy
import math

import grpc
import pytest
import torch
from transformers import DynamicCache

from consumer.engine.decoding import Sampling
from consumer.engine.kv_pool import KVPool
from consumer.exact import repair
from consumer.request.job import GenerateJob
from shared import kv
from shared.errors import InvalidArgument
from shared.models import load_model
from shared.pb import common_pb2, consumer_pb2
from tests.conftest import ConsumerClient, perturbed_model, prompt, running_pair
from tests.greedy import assert_greedy_agrees
from tests.hostile import consumer_of, record
from tests.test_end_to_end import local_greedy
from tests.test_verify import all_blocks_back, garbled

CONTEXT = "The producer reads a long context and the consumer writes the answer. " * 8
QUESTION = " Which layers are patched?"
NO_CACHE = {"prefix_cache_bytes": 0}


@pytest.fixture(scope="module")
def loaded():
    return load_model("tiny-llama", "float32", "cpu")


def hostile_cache(like, seed: int = 0):
    """A finite cache of the same shapes as `like`, every value noise."""
    g = torch.Generator().manual_seed(seed)
    out = DynamicCache()
    for layer in range(len(like.layers)):
        keys, values = kv.layer_kv(like, layer)
        noise = [(torch.randn(t.shape, generator=g) * 3).to(t.dtype) for t in (keys, values)]
        out.update(*noise, layer)
    return out


def max_diff(new, own) -> float:
    return max(
        max(float((k - kv.layer_kv(own, i)[0][0]).abs().max()), float((v - kv.layer_kv(own, i)[1][0]).abs().max()))
        for i, (k, v) in enumerate(new)
    )


# --- the option -------------------------------------------------------------------------------


def test_the_option_is_a_fraction_or_a_count_and_names_itself_when_wrong():
    assert repair.parse_repair("0.1", 100).tokens(95) == 10 and repair.parse_repair("1.0", 100).tokens(95) == 95
    assert repair.parse_repair("64", 100).tokens(95) == 64 and repair.parse_repair("64", 100).tokens(20) == 20
    assert repair.parse_repair("1e-9", 100).tokens(50) == 1  # at least one anchor
    assert repair.parse_repair("1", 100).tokens(50) == 1 and repair.parse_repair("1", 100).label() == "1"  # a count
    assert repair.parse_repair("1.0", 100).label() == "1.0" and repair.parse_repair("0.05", 100).label() == "0.05"
    for bad, says in [("0", "not in 1..100"), ("101", "not in 1..100"), ("1.5", "not in (0, 1]"), ("nan", "not in (0, 1]"),
                      ("-0.1", "not in (0, 1]"), ("abc", "neither a fraction"), ("", "neither a fraction")]:
        with pytest.raises(InvalidArgument, match="transfer.options.repair") as err:
            repair.parse_repair(bad, 100)
        assert says in str(err.value), (bad, str(err.value))


# --- the recompute ----------------------------------------------------------------------------


@pytest.mark.numeric
@pytest.mark.parametrize("name, dtype, tol", [("tiny-llama", "float32", 1e-4), ("tiny-qwen2", "bfloat16", 0.1)])
def test_recomputing_every_token_gives_the_own_prefill_whatever_the_cache_held(name, dtype, tol, monkeypatch):
    model = load_model(name, dtype, "cpu")
    ids = model.tokenizer(CONTEXT)["input_ids"]
    own = kv.prefill_context(model, torch.tensor([ids]))
    every = list(range(len(ids)))
    assert max_diff(repair.recompute(model, ids, own, every), own) < tol
    noise = hostile_cache(own)
    assert max_diff(repair.recompute(model, ids, noise, every), own) < tol  # nothing of the noise is read
    monkeypatch.setattr(repair, "ANCHOR_CHUNK", 7)  # chunks: later ones read the earlier ones' results
    assert max_diff(repair.recompute(model, ids, noise, every), own) < tol
    # a partial repair reads the rebuilt cache elsewhere: over noise, anchors are not the own K/V
    some = every[::3]
    new = repair.recompute(model, ids, noise, some)
    exact = [(kv.layer_kv(own, i)[0][0][:, some], kv.layer_kv(own, i)[1][0][:, some]) for i in range(len(new))]
    assert max(float((n[0] - e[0]).abs().max()) for n, e in zip(new[1:], exact[1:])) > 10 * tol


@pytest.mark.numeric
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_the_attention_mass_is_the_eager_attention_of_the_question(name):
    model = load_model(name, "float32", "cpu")
    ids = model.tokenizer(CONTEXT)["input_ids"]
    q = model.tokenizer(QUESTION, add_special_tokens=False)["input_ids"]
    T = len(ids)
    own = kv.prefill_context(model, torch.tensor([ids]))
    mass = repair.attention_mass(model, copy.deepcopy(own), T, q)
    eager = load_model(name, "float32", "cpu")
    eager.model.config._attn_implementation = "eager"
    with torch.inference_mode():
        out = eager.model(input_ids=torch.tensor([q]), cache=copy.deepcopy(own), position_ids=torch.arange(T, T + len(q))[None],
                          output_attentions=True, use_cache=True)
    reference = sum(a[0, :, :, :T].sum(dim=(0, 1)) for a in out.attentions)
    assert mass.shape == (T,) and torch.allclose(mass, reference.float(), atol=1e-4)
    anchors = repair.choose(mass, 10)
    assert anchors == sorted(anchors) and len(set(anchors)) == 10
    assert float(mass[anchors].min()) >= float(mass[[p for p in range(T) if p not in anchors]].max())


def test_a_partial_repair_writes_the_anchors_blocks_and_nothing_else(loaded):
    ids = loaded.tokenizer(CONTEXT)["input_ids"]
    q = loaded.tokenizer(QUESTION, add_special_tokens=False)["input_ids"]
    T = len(ids)
    own = kv.prefill_context(loaded, torch.tensor([ids]))
    pool = KVPool(loaded.info, loaded.device, 64 * loaded.info.kv_bytes(16))
    seq = pool.allocate(T + len(q) + 4)
    assert seq is not None
    noise = hostile_cache(own)
    for layer in range(loaded.info.num_layers):
        seq.update(*kv.layer_kv(noise, layer), layer)
    seq.length = T
    job = GenerateJob("r", ids, q, None, {}, 4, Sampling(0.0, 1.0, 0), frozenset(), math.inf)
    before = seq.to_dynamic(T)
    anchors, ms = repair.repair(loaded, seq, job, 12)
    after = seq.to_dynamic(T)
    assert len(anchors) == 12 and ms > 0
    # layer 0 depends on the token ids alone: written whole, exact, before the anchors are chosen over it
    for which in (0, 1):
        assert torch.allclose(kv.layer_kv(after, 0)[which], kv.layer_kv(own, 0)[which], atol=1e-5)
    chosen_over = DynamicCache()
    for layer in range(loaded.info.num_layers):
        chosen_over.update(*kv.layer_kv(after if layer == 0 else before, layer), layer)
    assert anchors == repair.choose(repair.attention_mass(loaded, chosen_over, T, q), 12)
    others = [p for p in range(T) if p not in anchors]
    for layer in range(1, loaded.info.num_layers):
        (k0, v0), (k1, v1) = kv.layer_kv(before, layer), kv.layer_kv(after, layer)
        assert torch.equal(k0[:, :, others], k1[:, :, others]) and torch.equal(v0[:, :, others], v1[:, :, others])
        assert not torch.equal(k0[:, :, anchors], k1[:, :, anchors])
    # layer 1 of an anchor reads layer 0 alone: exact over the exact layer 0
    assert torch.allclose(kv.layer_kv(after, 1)[0][:, :, anchors], kv.layer_kv(own, 1)[0][:, :, anchors], atol=1e-4)


@pytest.mark.numeric  # layers 0-1 written exact compared with the own prefill (tolerance)
def test_audit_error_anchors_are_where_the_rebuilt_layer_1_is_wrong(loaded):
    """`audit_error`: layers 0 and 1 written exact whole; the anchors are the positions whose
    rebuilt layer 1 was furthest from the exact one (here: exactly the ones corrupted), and
    `both` still picks them when they also draw attention."""
    ids = loaded.tokenizer(CONTEXT)["input_ids"]
    q = loaded.tokenizer(QUESTION, add_special_tokens=False)["input_ids"]
    T = len(ids)
    own = kv.prefill_context(loaded, torch.tensor([ids]))
    bad = sorted(torch.randperm(T, generator=torch.Generator().manual_seed(3))[:9].tolist())
    for choice in (repair.AUDIT_ERROR, repair.BOTH):
        pool = KVPool(loaded.info, loaded.device, 64 * loaded.info.kv_bytes(16))
        seq = pool.allocate(T + len(q) + 4)
        assert seq is not None
        for layer in range(loaded.info.num_layers):
            keys, values = (t.clone() for t in kv.layer_kv(own, layer))
            if layer == 1:
                keys[:, :, bad] += 5 * torch.randn(keys[:, :, bad].shape, generator=torch.Generator().manual_seed(4))
            seq.update(keys, values, layer)
        seq.length = T
        job = GenerateJob("r", ids, q, None, {}, 4, Sampling(0.0, 1.0, 0), frozenset(), math.inf)
        anchors, _ = repair.repair(loaded, seq, job, len(bad), choice)
        after = seq.to_dynamic(T)
        for layer in (0, 1):
            for which in (0, 1):
                assert torch.allclose(kv.layer_kv(after, layer)[which], kv.layer_kv(own, layer)[which], atol=1e-4)
        if choice == repair.AUDIT_ERROR:
            assert anchors == bad
        else:
            assert len(anchors) == len(bad) and set(anchors) & set(bad)
    with pytest.raises(InvalidArgument, match="transfer.options.repair_anchors: 'nearest'"):
        repair.parse_repair("0.1", 100, "nearest")
    assert repair.parse_repair("8", 100, repair.BOTH) == repair.Repair(count=8, anchors=repair.BOTH)


# --- through the services ---------------------------------------------------------------------


def fields(mode: str, new: int = 12, repair_value: str | None = None, **kw) -> dict:
    options = {"repair": repair_value} if repair_value is not None else {}
    return dict(context=prompt(CONTEXT), question=prompt(QUESTION), max_new_tokens=new,
                transfer=common_pb2.CodecSpec(name=mode, options=options), **kw)


@pytest.mark.numeric  # greedy tokens compared across kernels (tests/greedy.py)
async def test_a_hostile_but_finite_stream_repaired_whole_gives_the_oracles_answer(loaded):
    tok = loaded.tokenizer
    async with running_pair("tiny-llama") as real:
        ctx_ids = tok(CONTEXT)["input_ids"]
        stream = garbled(await record(real.producer.address, ctx_ids, "raw"))
    own, margins = local_greedy(loaded.model, ctx_ids, tok(QUESTION, add_special_tokens=False)["input_ids"], 24,
                                tok.eos_token_id)
    async with consumer_of(lambda request: stream, **NO_CACHE) as (consumer, _):
        async with ConsumerClient(consumer.address) as client:
            wrong = await client.generate(**fields("raw", 24))
            assert wrong.ids != own and wrong.stats.repair_choice == "" and wrong.stats.repair_tokens == 0
            whole = await client.generate(**fields("raw", 24, "1.0"))
            assert_greedy_agrees(whole.ids, own, margins, what="repaired at 1.0 over a garbled stream")
            s = whole.stats
            T = len(ctx_ids)
            assert s.repair_tokens == T and s.repair_choice == f"all: {T} of {T} context tokens (1.0); layer 0 whole" and s.repair_ms > 0
            assert s.transfer.name == "raw" and "repair" not in s.transfer.options
            for value, k in [("0.05", math.ceil(0.05 * T)), ("3", 3)]:
                small = await client.generate(**fields("raw", 24, value))
                assert small.stats.repair_tokens == k and len(small.ids) > 0
                assert small.stats.repair_choice == f"attention: {k} of {T} context tokens ({value}); layer 0 whole"
        await all_blocks_back(consumer)


@pytest.mark.numeric
async def test_repair_on_a_heterogeneous_pair_and_its_place_among_the_policies(tmp_path):
    """Producer P, consumer a perturbed C: raw is naive reuse; repaired whole it is C's own
    answer; after the audit's fallback (an exact cache) repair is skipped, and so under oracle;
    a bad value is refused before any work, naming the option."""
    local = perturbed_model("tiny-llama", 7, 0.05, save_to=tmp_path)
    tok = local.tokenizer
    ctx_ids, q_ids = tok(CONTEXT)["input_ids"], tok(QUESTION, add_special_tokens=False)["input_ids"]
    own, margins = local_greedy(local.model, ctx_ids, q_ids, 12, tok.eos_token_id)
    async with running_pair("tiny-llama", consumer_model=str(tmp_path), consumer_kw=NO_CACHE) as pair:
        naive, _, _ = await pair.generate(**fields("raw"))
        assert naive != own
        ids, _, s = await pair.generate(**fields("raw", 12, "1.0"))
        assert_greedy_agrees(ids, own, margins, what="raw repaired whole")
        ids, _, s = await pair.generate(audit=consumer_pb2.AUDIT_POLICY_REPORT, **fields("raw", 12, "0.2"))
        assert s.audit_decision == "diverged" and s.repair_choice.startswith("attention: ") and s.repair_tokens > 0
        ids, _, s = await pair.generate(audit=consumer_pb2.AUDIT_POLICY_FALLBACK, **fields("raw", 12, "0.2"))
        assert s.audit_decision == "diverged: prefilled locally" and ids == own
        assert s.repair_choice == "skipped: the context was prefilled locally" and s.repair_tokens == 0
        ids, _, s = await pair.generate(**fields("oracle", 12, "0.2"))
        assert s.repair_choice == "skipped: mode oracle is exact" and ids == own
        # repair then verify: the verified answer is the oracle's too
        ids, _, s = await pair.generate(verify=consumer_pb2.VERIFY_POLICY_VERIFIED, **fields("raw", 12, "0.1"))
        assert s.repair_tokens > 0 and s.verify_decision.startswith("verified") and ids == own
        by_error = fields("raw", 12, "0.2")
        by_error["transfer"].options["repair_anchors"] = "audit_error"
        ids, _, s = await pair.generate(**by_error)
        assert s.repair_choice.startswith("audit_error: ") and s.repair_choice.endswith("layers 0-1 whole") and s.repair_tokens > 0
        for bad in ["0", "1.5", "abc", str(10**6)]:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await pair.generate(**fields("raw", 12, bad))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "transfer.options.repair" in err.value.details()
        for options, says in [({"repair": "0.1", "repair_anchors": "x"}, "is not one of"), ({"repair_anchors": "both"}, "set only with")]:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await pair.generate(**{**fields("raw"), "transfer": common_pb2.CodecSpec(name="raw", options=options)})
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in err.value.details()
            assert "transfer.options.repair_anchors" in err.value.details()
        await all_blocks_back(pair.consumer)


@pytest.mark.numeric
async def test_audit_policy_repair_repairs_only_a_flagged_cache(tmp_path):
    """AUDIT_POLICY_REPAIR: an exact transfer passes the audit and nothing is repaired; naive reuse
    on a heterogeneous pair is flagged, repaired (whole: the option "1.0") and audited again,
    which it then passes with the consumer's own answer; repaired by the default 10% it is
    still flagged and the own prefill answers. Every block comes back."""
    async with running_pair("tiny-llama", consumer_kw=NO_CACHE) as pair:
        _, _, s = await pair.generate(audit=consumer_pb2.AUDIT_POLICY_REPAIR, **fields("raw", 4))
        assert s.audit_decision == "ok" and s.repair_tokens == 0
        assert s.repair_choice == "skipped: the audit did not flag the cache"
    local = perturbed_model("tiny-llama", 7, 0.05, save_to=tmp_path)
    tok = local.tokenizer
    ctx_ids, q_ids = tok(CONTEXT)["input_ids"], tok(QUESTION, add_special_tokens=False)["input_ids"]
    own, margins = local_greedy(local.model, ctx_ids, q_ids, 12, tok.eos_token_id)
    T = len(ctx_ids)
    async with running_pair("tiny-llama", consumer_model=str(tmp_path), consumer_kw=NO_CACHE) as pair:
        ids, _, s = await pair.generate(audit=consumer_pb2.AUDIT_POLICY_REPAIR, **fields("raw", 12, "1.0"))
        assert s.audit_decision == f"diverged: repaired {T} tokens: ok" and s.repair_tokens == T
        assert_greedy_agrees(ids, own, margins, what="raw flagged, then repaired whole")
        ids, _, s = await pair.generate(audit=consumer_pb2.AUDIT_POLICY_REPAIR, **fields("raw", 12))
        k = -(-T // 10)
        assert s.repair_tokens == k and s.repair_choice.startswith(f"attention: {k} of {T} context tokens (0.1)")
        assert s.audit_decision == f"diverged: repaired {k} tokens: diverged: prefilled locally" and ids == own
        await all_blocks_back(pair.consumer)


async def test_a_repaired_cache_is_never_kept_nor_built_on_a_cached_one():
    """Under repair the request reuses no cached chunks (its repair writes into its context's
    blocks) and keeps none (its K/V are neither the codec's nor the own prefill's)."""
    async with running_pair("tiny-llama") as pair:
        oracle, _, _ = await pair.generate(**fields("oracle", 4))
        first_ids, _, first = await pair.generate(**fields("raw", 4, "0.1"))
        assert first_ids == oracle  # raw of the same weights is exact: its anchors recompute to what they were
        _, _, second = await pair.generate(**fields("raw", 4, "0.1"))
        assert first.repair_tokens > 0 and second.prefix_reused_tokens == 0 and second.bytes_received > 0
        _, _, plain = await pair.generate(**fields("raw", 4))
        assert plain.prefix_reused_tokens == 0 and plain.bytes_received > 0  # nothing was kept by the repaired ones
        _, _, again = await pair.generate(**fields("raw", 4))
        assert again.prefix_reused_tokens == again.context_tokens  # the unrepaired one was kept
        _, _, repaired = await pair.generate(**fields("raw", 4, "0.1"))
        assert repaired.prefix_reused_tokens == 0 and repaired.bytes_received > 0 and repaired.repair_tokens > 0
