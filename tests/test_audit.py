"""The cache audit (shared.audit) and its policies through the real services: an exact cache is a
fixed point (error 0), a foreign one is flagged, FALLBACK answers like the consumer's own
prefill, and SCD streams are judged against the threshold calibrated in their artifact."""

from __future__ import annotations

import pytest
import torch

from calibration.distill import distill
from shared import audit, kv
from shared.models import load_model
from shared.pb import common_pb2, consumer_pb2
from tests.conftest import perturbed_model, prompt, running_pair
from tests.test_scd import heldout, random_corpus

CONTEXT = "The producer reads a long context and the consumer writes the answer. " * 8
QUESTION = " Which layers are patched?"


def test_positions_always_include_the_last_ones_and_are_distinct():
    checked = audit.positions(100, 8, seed=3)
    assert len(set(checked)) == 8 and {96, 97, 98, 99} <= set(checked) and min(checked) >= 1
    assert audit.positions(3, 8) == (1, 2)


@pytest.mark.numeric
@pytest.mark.parametrize("name, dtype", [("tiny-llama", "float32"), ("tiny-qwen2", "bfloat16")])
def test_an_exact_cache_is_a_fixed_point_and_a_foreign_one_is_not(name, dtype):
    model = load_model(name, dtype, "cpu")
    ids = model.tokenizer(CONTEXT)["input_ids"]
    checked = audit.positions(len(ids), 8)
    own = kv.prefill_context(model, torch.tensor([ids]))
    assert audit.audit(model, ids, own, checked).max_error < 1e-2
    other = perturbed_model(name, 1, 0.02)
    foreign = kv.prefill_context(other, torch.tensor([ids]))
    report = audit.audit(model, ids, foreign, checked)
    assert len(report.layer_errors) == model.info.num_layers and report.max_error > 0.1


def fields(mode: str, policy: int, **kw) -> dict:
    return dict(context=prompt(CONTEXT), question=prompt(QUESTION), max_new_tokens=12, audit=policy,
                transfer=common_pb2.CodecSpec(name=mode, options=kw))


async def test_report_and_fallback_on_a_heterogeneous_pair(tmp_path):
    perturbed_model("tiny-llama", 7, 0.03, save_to=tmp_path)
    async with running_pair("tiny-llama", consumer_model=str(tmp_path)) as pair:
        oracle, _, _ = await pair.generate(**fields("oracle", consumer_pb2.AUDIT_POLICY_OFF))
        _, _, stats = await pair.generate(**fields("raw", consumer_pb2.AUDIT_POLICY_REPORT))
        assert stats.audit_decision == "diverged" and list(stats.audit_layer_thresholds) == pytest.approx([0.05] * 4)
        assert max(stats.audit_layer_errors) > 0.05
        ids, _, stats = await pair.generate(**fields("raw", consumer_pb2.AUDIT_POLICY_FALLBACK))
        assert stats.audit_decision == "diverged: prefilled locally" and ids == oracle
        _, _, stats = await pair.generate(**fields("raw", consumer_pb2.AUDIT_POLICY_OFF))
        assert stats.audit_decision == "" and list(stats.audit_layer_errors) == []


async def test_upgrade_retransfers_with_richer_options_then_prefills_locally(tmp_path):
    """UPGRADE: quant 4-bit flagged (a strict threshold) -> the same context again at 8 bits, which
    passes; a raw stream has nothing richer -> local prefill. Bytes of both transfers count."""
    async with running_pair("tiny-llama", consumer_kw={"audit_threshold": 0.02}) as pair:
        oracle, _, _ = await pair.generate(**fields("oracle", consumer_pb2.AUDIT_POLICY_OFF))
        _, _, q8 = await pair.generate(**fields("quant", consumer_pb2.AUDIT_POLICY_REPORT, bits="8"))
        _, _, q4 = await pair.generate(**fields("quant", consumer_pb2.AUDIT_POLICY_REPORT, bits="4"))
        assert q8.audit_decision == "ok" and q4.audit_decision == "diverged"
        _, _, up = await pair.generate(**fields("quant", consumer_pb2.AUDIT_POLICY_UPGRADE, bits="4"))
        assert up.audit_decision == "diverged: upgraded to bits=8,group_size=32: ok"
        assert up.bytes_received == q4.bytes_received + q8.bytes_received and dict(up.transfer.options)["bits"] == "8"
        assert up.audit_ms > 0 and len(up.audit_layer_errors) == 4
    perturbed_model("tiny-llama", 7, 0.03, save_to=tmp_path)
    async with running_pair("tiny-llama", consumer_model=str(tmp_path)) as pair:
        oracle, _, _ = await pair.generate(**fields("oracle", consumer_pb2.AUDIT_POLICY_OFF))
        ids, _, stats = await pair.generate(**fields("raw", consumer_pb2.AUDIT_POLICY_UPGRADE))
        assert stats.audit_decision == "diverged: no richer options: prefilled locally" and ids == oracle


async def test_an_exact_transfer_passes_the_audit(pair_llama):
    _, _, stats = await pair_llama.generate(**fields("raw", consumer_pb2.AUDIT_POLICY_FALLBACK))
    assert stats.audit_decision == "ok" and max(stats.audit_layer_errors) < 1e-4 and stats.audit_ms > 0


@pytest.mark.numeric
async def test_scd_uses_the_threshold_calibrated_in_its_artifact(tmp_path):
    model = load_model("tiny-llama", "float32", "cpu")
    art = distill(model, model, random_corpus(12, 96, 0), heldout(3, 1), corpus_name="random", generations=1, log=lambda m: None)
    assert set(art.meta["audit"]["thresholds"]) == {e.schedule for e in art.schedules}
    art.save(tmp_path / "a.safetensors")
    entry = art.schedules[-1]
    async with running_pair("tiny-llama", producer_kw={"artifacts": str(tmp_path)}, consumer_kw={"artifacts": str(tmp_path)}) as pair:
        _, _, stats = await pair.generate(**fields("scd", consumer_pb2.AUDIT_POLICY_REPORT, schedule=entry.name))
    assert list(stats.audit_layer_thresholds) == pytest.approx(art.meta["audit"]["thresholds"][entry.schedule])
    assert stats.audit_decision == "ok"  # in distribution


async def test_audit_positions_are_bounded(pair_llama):
    import grpc

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await pair_llama.generate(audit_positions=65, **fields("raw", consumer_pb2.AUDIT_POLICY_REPORT))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "audit_positions: 65 > limit 64" in err.value.details()
