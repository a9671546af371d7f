"""SCD calibration, reconstruction, schedules and artifact checks on tiny models."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from calibration import search
from calibration.distill import distill, geometry
from shared import kv, layers
from shared.errors import FailedPrecondition, InvalidArgument
from shared.models import load_model
from shared.scd import ops
from shared.scd.artifact import Artifact
from shared.scd.schedule import Action, Schedule, bytes_per_token
from tests.conftest import perturbed_model


def random_corpus(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 380, (length,), generator=g).tolist() for _ in range(n)]


def heldout(n: int, seed: int) -> list[search.HeldOut]:
    return [search.HeldOut(ids[:80], ids[80:], 6) for ids in random_corpus(n, 92, seed)]


@pytest.fixture(scope="module")
def homogeneous():
    model = load_model("tiny-llama", "float32", "cpu")
    art = distill(model, model, random_corpus(12, 96, 0), heldout(3, 1), corpus_name="random", generations=2, log=lambda m: None)
    return model, art


def states_of(model, ids):
    return kv.capture_states(model, ids, kv.Capture.KV | kv.Capture.NORMED)[0]


def reconstruct(art, model, states, action, layer, T):
    payloads = {n: t.cpu() for n, t in ops.encode_layer(art, layer, action, states[layer]).items()}
    return ops.decode_layer(art, layer, action, payloads, model, layers.positions(model, T))


def test_full_rank_reuse_reproduces_raw_kv_and_error_falls_with_rank(homogeneous):
    model, art = homogeneous
    ids = random_corpus(1, 70, 7)[0]
    states = states_of(model, ids)
    full = art.geometry.kv_width
    for layer in range(model.info.num_layers):
        keys, values = reconstruct(art, model, states, Action("reuse", full), layer, len(ids))
        scale = states[layer].keys.abs().max()
        # exact linear algebra; the int8 code quantization is the only error
        assert (keys - states[layer].keys).abs().max() < 0.02 * scale
        assert (values - states[layer].values).abs().max() < 0.02 * states[layer].values.abs().max()
        errors = []
        for r in (2, 4, 8, 16, 32, full):
            k, v = reconstruct(art, model, states, Action("reuse", r), layer, len(ids))
            errors.append(float(torch.cat([(k - states[layer].keys).flatten(), (v - states[layer].values).flatten()]).norm()))
        assert all(a >= b for a, b in zip(errors, errors[1:])), errors


@pytest.mark.numeric
def test_patch_is_exact_when_producer_is_consumer(homogeneous):
    model, art = homogeneous
    ids = random_corpus(1, 50, 8)[0]
    states = states_of(model, ids)
    for layer in range(model.info.num_layers):
        keys, values = reconstruct(art, model, states, Action("patch"), layer, len(ids))
        torch.testing.assert_close(keys, states[layer].keys, atol=2e-3, rtol=1e-3)  # fp16 payload
        torch.testing.assert_close(values, states[layer].values, atol=2e-3, rtol=1e-3)


def test_pareto_set_is_sorted_non_dominated_and_budgets_pick_from_it(homogeneous):
    _, art = homogeneous
    entries = art.schedules
    assert len(entries) >= 2
    assert all(a.bytes_per_token < b.bytes_per_token and a.loss > b.loss for a, b in zip(entries, entries[1:]))
    g = art.geometry
    for e in entries:
        assert Schedule.parse(e.schedule, art.num_layers).bytes_per_token(g) == e.bytes_per_token
    mid = entries[len(entries) // 2]
    assert art.pick(max_loss=mid.loss).bytes_per_token <= mid.bytes_per_token
    assert art.pick(max_loss=mid.loss).loss <= mid.loss
    assert art.pick(max_bytes=mid.bytes_per_token).bytes_per_token <= mid.bytes_per_token
    assert art.pick(schedule=mid.name) == mid
    with pytest.raises(InvalidArgument, match="no schedule with loss <= -1"):
        art.pick(max_loss=-1.0)


def test_calibration_is_deterministic_for_a_seed():
    model = load_model("tiny-qwen2", "float32", "cpu")
    other = perturbed_model("tiny-qwen2", seed=3, scale=0.02)
    other.info = dataclasses.replace(other.info, weight_digest="perturbed")
    corpus = random_corpus(6, 64, 0)
    a = distill(model, other, corpus, heldout(2, 1), corpus_name="r", generations=1, log=lambda m: None)
    b = distill(model, other, corpus, heldout(2, 1), corpus_name="r", generations=1, log=lambda m: None)
    assert a.tensors.keys() == b.tensors.keys()
    assert all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)
    assert a.meta["schedules"] == b.meta["schedules"]
    assert not a.meta["calibration"]["homogeneous"]


def test_artifact_round_trips_and_refuses_other_weights_and_versions(homogeneous, tmp_path):
    model, art = homogeneous
    path = tmp_path / "a.safetensors"
    art.save(path)
    back = Artifact.load(path)
    assert back.artifact_id == art.artifact_id and back.schedules == art.schedules
    back.check_model("consumer", model.info)
    with pytest.raises(FailedPrecondition, match="consumer weight digest"):
        back.check_model("consumer", dataclasses.replace(model.info, weight_digest="0" * 64))
    back.meta["format_version"] = 99
    import json

    from safetensors.torch import save_file

    save_file(back.tensors, str(tmp_path / "v99.safetensors"), metadata={"scd": json.dumps(back.meta)})
    with pytest.raises(FailedPrecondition, match="format_version 99"):
        Artifact.load(tmp_path / "v99.safetensors")


def test_byte_costs():
    g = geometry(load_model("tiny-llama", "bfloat16", "cpu").info)
    assert bytes_per_token(Action("raw"), g) == 2 * 2 * 16 * 2 * 2 / 2 * 1 == 128  # 2*n_kv*hd elements * 2 bytes
    assert bytes_per_token(Action("reuse", 8), g) == 10
    assert bytes_per_token(Action("patch"), g) == 128
    assert bytes_per_token(Action("patch", 8), g) == 64 + 2  # int8 codes + one fp16 scale per token


def test_int8_patch_sends_what_its_schema_says_and_rebuilds_close_to_the_fp16_patch(homogeneous):
    model, art = homogeneous
    ids = random_corpus(1, 50, 9)[0]
    states = states_of(model, ids)
    p8 = Action.parse("P8")
    assert (p8, str(p8), Schedule.parse("P8.P", 2).actions) == (Action("patch", 8), "P8", (p8, Action("patch")))
    for layer in range(model.info.num_layers):
        payloads = ops.encode_layer(art, layer, p8, states[layer])
        schema = ops.layer_schema(p8, model, len(ids), torch.float32)
        assert {n: (t.dtype, tuple(t.shape)) for n, t in payloads.items()} == {
            n: (spec.dtype, tuple(spec.shape)) for n, spec in schema.items()
        }
        assert set(ops.token_layout(p8)) == set(payloads) and ops.per_token(p8)
        wire = sum(t.numel() * t.element_size() for t in payloads.values()) / len(ids)
        assert wire == bytes_per_token(p8, art.geometry)
        k8, v8 = reconstruct(art, model, states, p8, layer, len(ids))
        k16, v16 = reconstruct(art, model, states, Action("patch"), layer, len(ids))
        # per-token int8 of the normalized input: a few per cent of each K/V's range, not more
        assert (k8 - k16).abs().max() < 0.05 * k16.abs().max()
        assert (v8 - v16).abs().max() < 0.05 * v16.abs().max()
        assert (k8 - k16).abs().max() > 0  # it is quantized: not the fp16 payload under another name


def test_batched_rebuild_equals_each_requests_own_and_a_bad_payload_fails_alone(homogeneous):
    """Requests with the same artifact and schedule rebuild a layer together (a Reuse or Patch
    layer in one decode, a raw one stored in one call; shared.codecs.base.add_layers): every
    cache is bitwise the one its own add_layer gives, and a request whose codes decode to
    non-finite values fails alone."""
    from shared.codecs.base import LayerJob, StreamInfo, add_layers
    from shared.codecs.scd import ScdCodec, ScdDecoder

    model, art = homogeneous
    codec = ScdCodec(model, [art])
    actions = [Action("reuse", 8), Action("patch"), Action("reuse_fp16", 4), Action("raw")]
    schedule = Schedule(tuple(actions))
    lengths = [37, 64, 5, 50]
    streams = [StreamInfo(len(actions), T, "float32", {}) for T in lengths]
    contexts = [random_corpus(1, T, 20 + i)[0] for i, T in enumerate(lengths)]
    payloads = [
        [{n: t.cpu() for n, t in ops.encode_layer(art, layer, a, s[layer]).items()} for layer, a in enumerate(actions)]
        for s in (states_of(model, ids) for ids in contexts)
    ]
    alone = [ScdDecoder(codec, art, schedule, stream) for stream in streams]
    together = [ScdDecoder(codec, art, schedule, stream) for stream in streams]
    assert together[0].batch_key(0) == together[1].batch_key(0) != together[0].batch_key(1)
    bad = 2
    payloads[bad][1] = {"x": torch.full_like(payloads[bad][1]["x"], float("inf"))}  # a Patch of infinities
    for layer in range(len(actions)):
        errors = []
        for i, d in enumerate(alone):
            try:
                d.add_layer(layer, payloads[i][layer])
                errors.append(None)
            except Exception as exc:
                errors.append(exc)
        batched, shared = add_layers([LayerJob(d, layer, payloads[i][layer]) for i, d in enumerate(together)])
        assert shared == len(lengths)
        assert [type(e) for e in batched] == [type(e) for e in errors]
        assert [i for i, e in enumerate(batched) if e is not None] == ([bad] if layer == 1 else [])
    for i in range(len(lengths)):
        if i == bad:
            continue
        a, b = alone[i].finish(), together[i].finish()
        for layer in range(len(actions)):
            ka, va = kv.layer_kv(a, layer)
            kb, vb = kv.layer_kv(b, layer)
            assert torch.equal(ka, kb) and torch.equal(va, vb), (i, layer)


def test_a_batch_that_cannot_be_joined_is_rebuilt_request_by_request(homogeneous):
    """add_layers: when the joined decode fails as a whole (here one request's codes have the wrong
    width, so they cannot be joined), each job is rebuilt on its own: the good requests get
    exactly their own caches, the bad one its own error."""
    from shared.codecs.base import LayerJob, StreamInfo, add_layers
    from shared.codecs.scd import ScdCodec, ScdDecoder

    model, art = homogeneous
    codec = ScdCodec(model, [art])
    action = Action("reuse_fp16", 4)
    schedule = Schedule(tuple([action] * model.info.num_layers))
    lengths = [20, 33, 9]
    contexts = [random_corpus(1, T, 40 + i)[0] for i, T in enumerate(lengths)]
    payloads = [{n: t.cpu() for n, t in ops.encode_layer(art, 0, action, states_of(model, ids)[0]).items()} for ids in contexts]
    payloads[1] = {"z": torch.zeros(lengths[1], 5, dtype=torch.float16)}  # a rank-5 row under a rank-4 schedule
    alone = [ScdDecoder(codec, art, schedule, StreamInfo(len(schedule.actions), T, "float32", {})) for T in lengths]
    together = [ScdDecoder(codec, art, schedule, StreamInfo(len(schedule.actions), T, "float32", {})) for T in lengths]
    errors, shared = add_layers([LayerJob(d, 0, payloads[i]) for i, d in enumerate(together)])
    assert shared == 0 and errors[0] is None and errors[2] is None and errors[1] is not None
    for i in (0, 2):
        alone[i].add_layer(0, payloads[i])
        ka, va = kv.layer_kv(alone[i].cache, 0)
        kb, vb = kv.layer_kv(together[i].cache, 0)
        assert torch.equal(ka, kb) and torch.equal(va, vb)
    assert 0 not in together[1].received
