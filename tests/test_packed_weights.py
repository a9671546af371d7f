"""The projections' prepacked weights (shared.model.packed) against F.linear's: bfloat16 bit for
bit (the same oneDNN kernel), float32 within 1e-5 of the largest |logit| (oneDNN instead of MKL's
sgemm), on the real pair (the QA pair and the tiny builtins are below the size where packing pays:
off, with that reason); a packed row's result does not depend on the rows beside it; packing is
off, with its reason, where it does not apply; the consumer's flags choose the forward."""

from __future__ import annotations

import pytest
import torch

from consumer.engine import fused_ops
from consumer.engine.kv_pool import KVPool
from consumer.engine.pool_forward import PoolRunner
from consumer.engine.rows import Row
from shared import model as own
from shared.model.packed import MIN_ELEMENTS, Packed, why_not
from shared.models import load_model

pytestmark = pytest.mark.numeric


def _ids(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(4, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["smollm2-135m", "smollm2-135m-tuned"])
@torch.inference_mode()
def test_a_packed_forward_equals_the_plain_one(name, dtype):
    loaded = load_model(name, dtype, "cpu")
    m = own.of(loaded)
    packed = Packed.of(m)
    if packed is None and dtype == "bfloat16" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert Packed.off_reason(m) == "this CPU has no oneDNN bfloat16 support"  # e.g. ONEDNN_MAX_CPU_ISA=AVX2
        return
    assert packed is not None, Packed.off_reason(m)
    assert packed.nbytes > 0
    ids = _ids(96, loaded.info.vocab_size)
    pos = torch.arange(96)
    plain = m.logits(m.hidden(ids, pos, own.causal))
    fast = m.logits(m.hidden(ids, pos, own.causal, packed), packed)
    err = (plain - fast).abs().max().item()
    if dtype == "bfloat16":
        assert err == 0.0
    else:
        assert err <= 1e-5 * plain.abs().max().item()


@torch.inference_mode()
def test_a_packed_row_does_not_depend_on_the_rows_beside_it():
    """float32: F.linear (MKL sgemm) may round a row differently by the batch's row count; the
    packed product gives each row the same bits alone or beside 31 others."""
    loaded = load_model("smollm2-135m", "float32", "cpu")
    m = own.of(loaded)
    packed = Packed.of(m)
    assert packed is not None
    x = torch.randn(32, m.lm_head.shape[1], generator=torch.Generator().manual_seed(1))
    together = m.logits(x, packed)
    alone = torch.cat([m.logits(x[i : i + 1], packed) for i in range(32)])
    assert torch.equal(together, alone)


@torch.inference_mode()
def test_the_engine_forward_packed_and_plain_pick_the_same_tokens():
    """The engine's forward with and without packing, decode steps from one prefill, float32 real
    pair: logits within 1e-4 of the largest, greedy tokens equal."""
    loaded = load_model("smollm2-135m", "float32", "cpu")
    pools = [KVPool(loaded.info, loaded.device, 8 * 256 * loaded.info.kv_bytes(1) + (1 << 20), 16) for _ in range(2)]
    runners = [PoolRunner(loaded, pools[0], packed=False), PoolRunner(loaded, pools[1], packed=True)]
    assert runners[0].packed is None and runners[1].packed is not None
    prompts = [_ids(40 + 7 * i, loaded.info.vocab_size, seed=i).tolist() for i in range(4)]
    seqs = [[pool.allocate(200) for _ in prompts] for pool in pools]
    outs = [r.forward([Row(s, p, 0) for s, p in zip(ss, prompts)]) for r, ss in zip(runners, seqs)]
    for _ in range(6):
        assert (outs[0] - outs[1]).abs().max().item() <= 1e-4 * outs[0].abs().max().item()
        assert torch.equal(outs[0].argmax(-1), outs[1].argmax(-1))
        nxt = outs[0].argmax(-1).tolist()
        outs = [r.forward([Row(s, [t], s.length) for s, t in zip(ss, nxt)]) for r, ss in zip(runners, seqs)]


def test_packing_is_off_with_its_reason_where_it_does_not_apply():
    assert "device" in (why_not(torch.device("cuda", 0), torch.bfloat16) or "")
    assert "dtype" in (why_not(torch.device("cpu"), torch.float16) or "")
    assert why_not(torch.device("cpu"), torch.float32) is None
    loaded = load_model("checkpoints/qa-tuned", "float32", "cpu")
    m = own.of(loaded)
    assert Packed.of(m) is None  # hidden 128: every projection under MIN_ELEMENTS
    assert Packed.off_reason(m) == f"every projection has fewer than {MIN_ELEMENTS} elements"
    pool = KVPool(loaded.info, loaded.device, 64 * loaded.info.kv_bytes(1) + (1 << 20), 16)
    assert PoolRunner(loaded, pool, packed=False).packed is None


def test_the_consumer_flags_are_validated():
    from shared.config import ConsumerConfig

    with pytest.raises(ValueError, match="decode_attention: 'flash' not in"):
        ConsumerConfig(model="tiny-llama", decode_attention="flash").validate()
    with pytest.raises(ValueError, match="prefill_attention: 'flash' not in"):
        ConsumerConfig(model="tiny-llama", prefill_attention="flash").validate()


@pytest.mark.parametrize("engine_process", [False, True])
async def test_the_consumer_runs_the_forward_its_flags_ask_for(engine_process):
    """--decode-attention sdpa --packed-weights false --fused-ops false: the served engine's runner (in this process or
    the engine process's frontend twin) runs per-row SDPA on plain weights, and its greedy answers
    equal those of a consumer on the defaults (real pair, float32: the paths agree within 1e-4)."""
    from shared.pb import consumer_pb2
    from tests.conftest import prompt, running_pair

    answers = []
    flags = {
        "decode_attention": "sdpa",
        "prefill_attention": "sdpa",
        "packed_weights": False,
        "fused_ops": False,
        "engine_process": engine_process,
    }
    for kw in ({}, flags):
        async with running_pair("smollm2-135m", consumer_kw=kw) as pair:
            c = await pair.stub.Describe(consumer_pb2.ConsumerServiceDescribeRequest())
            if kw:
                assert c.decode_attention == "sdpa: decode_attention='sdpa'"
                assert c.prefill_attention == "sdpa: prefill_attention='sdpa'"
                assert pair.consumer.servicer.packed_weights() == "off: --packed-weights false"
                assert c.elementwise_ops == "eager: --fused-ops false"
            else:
                assert pair.consumer.servicer.packed_weights() == "on"
                assert c.elementwise_ops == fused_ops.which()
            ids, _, _ = await pair.generate(context=prompt("the cat sat on the mat " * 8), question=prompt("where?"), max_new_tokens=8, mode="oracle")
            answers.append(ids)
    assert answers[0] == answers[1] and len(answers[0]) > 0
