"""Every transfer mode on an SCD artifact's loss scale: calibration.candidates on the shipped
artifacts and the trained checkpoints, Artifact.transfer_points, and Describe's transfer_points."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from calibration import candidates
from calibration import corpus as corpus_lib
from calibration.distill import distill
from calibration.search import LossEvaluator
from shared import kv
from shared.codecs import EncodeRequest, create_codecs
from shared.models import load_model
from shared.pb import consumer_pb2, producer_pb2
from shared.scd import ops
from shared.scd.artifact import SIDECAR_SUFFIXES, Artifact, TransferPoint, _content_id
from shared.scd.schedule import Action, Schedule
from tests.conftest import perturbed_model, running_pair
from tests.test_scd import heldout, random_corpus

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = sorted(f for f in (ROOT / "artifacts").glob("*.safetensors") if not f.name.endswith(SIDECAR_SUFFIXES))
QA_CORPUS = ["--corpus", "qa.corpus:calibration_corpus", "--corpus-arg", "task=tuned", "--corpus-arg", "ctx=256"]


# A candidate's loss is a KL averaged over the held-out answers, recomputed here through bf16
# kernels: another CPU's (AVX2 vs AVX-512 ATen reductions, oneDNN's bf16 GEMM path) moves it by
# ~1.5e-4 relative (9.515636 committed vs 9.514215 on AVX2). rel 1e-3 keeps a ranking-relevant
# change visible; abs 1e-6 nats covers the near-zero losses (int8 quant of the same model,
# 2.93e-6 vs 2.92e-6), where a relative bound measures only rounding noise.
LOSS_REL, LOSS_ABS = 1e-3, 1e-6


def same_candidates(got: list[dict], want: list[dict]) -> bool:
    """Same modes, options, bytes and how, in order; losses within LOSS_REL / LOSS_ABS."""
    def key(c):
        return {k: v for k, v in c.items() if k != "loss"}

    return [key(c) for c in got] == [key(c) for c in want] and all(
        g["loss"] == pytest.approx(w["loss"], rel=LOSS_REL, abs=LOSS_ABS) for g, w in zip(got, want)
    )


def copy_artifact(name: str, into: Path) -> Path:
    for suffix in (".safetensors", ".json"):
        shutil.copy(ROOT / "artifacts" / f"{name}{suffix}", into / f"{name}{suffix}")
    return into / f"{name}.safetensors"


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_transfer_points_are_the_schedules_the_candidates_and_the_oracle_by_bytes(path):
    art = Artifact.load(path)
    points = art.transfer_points()
    kept = [p for p in points if "keep" in dict(p.options)]  # keep points (calibration.keep_points): tests/test_keep_auto.py
    assert len(kept) == len(art.meta.get("keep_points", []))
    points = [p for p in points if p not in kept]
    assert points[0] == TransferPoint("oracle", (), 0.0, 0.0, "exact")
    assert [p.bytes_per_token for p in points] == sorted(p.bytes_per_token for p in points)
    scd = sorted((dict(p.options)["schedule"], p.loss, p.bytes_per_token) for p in points if p.mode == "scd")
    assert scd == sorted((e.name, e.loss, e.bytes_per_token) for e in art.schedules)
    assert all(dict(p.options)["artifact"] == art.artifact_id and p.how == "measured" for p in points if p.mode == "scd")
    others = [p for p in points if p.mode not in ("scd", "oracle")]
    assert all(p.how == "measured" and p.options == tuple(sorted(p.options)) for p in others)
    options = {(p.mode, p.options) for p in others}
    spans = candidates.recorded_spans(art.meta)
    assert options == {("raw", ()), *(("quant", (("bits", b), ("group_size", "32"))) for b in ("8", "4"))} | {
        ("recompute", (("end", str(e)), ("start", str(s)))) for s, e in spans
    }
    n, g = art.num_layers, art.geometry
    costs = {(p.mode, p.options): p.bytes_per_token for p in others}
    assert costs["raw", ()] == Schedule((Action("raw"),) * n).bytes_per_token(g) == n * g.kv_width * g.kv_element_bytes  # K and V
    assert costs["quant", (("bits", "8"), ("group_size", "32"))] == Schedule((Action("quant", 8),) * n).bytes_per_token(g)
    for s, e in spans:  # raw K/V outside the span, the hidden state entering it (both in the artifact's dtype)
        width = g.kv_element_bytes
        assert costs["recompute", (("end", str(e)), ("start", str(s)))] == (n - (e - s)) * g.kv_width * width + g.hidden * width
    bare = Artifact(art.tensors, {k: v for k, v in art.meta.items() if k not in ("candidates", "keep_points")})
    assert [p.mode for p in bare.transfer_points()] == ["oracle"] + ["scd"] * len(art.schedules)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_candidates_are_measured_not_fitted_so_the_id_keeps(path):
    art = Artifact.load(path)
    assert art.meta["candidates"] and _content_id(art.tensors, art.meta) == art.artifact_id
    without = {k: v for k, v in art.meta.items() if k != "candidates"}
    assert _content_id(art.tensors, without) == art.artifact_id
    assert json.loads(path.with_suffix(".json").read_text()) == art.meta  # the readable copy is the header's


def test_rewrite_keeps_the_id_and_refuses_a_fitted_change(tmp_path):
    art = Artifact.load(copy_artifact("qa-tuned-to-tuned", tmp_path))
    art.meta["candidates"] = art.meta["candidates"][:1]
    art.rewrite()
    back = Artifact.load(art.path)
    assert back.artifact_id == art.artifact_id and back.meta["candidates"] == art.meta["candidates"]
    assert json.loads(art.path.with_suffix(".json").read_text()) == back.meta
    back.meta["calibration"]["ridge_rel"] = 1.0
    with pytest.raises(ValueError, match="fitted content changed"):
        back.rewrite()


@pytest.fixture(scope="module")
def base_to_tuned():
    """The 2-layer heterogeneous artifact, its checkpoints (bf16, as calibrated) and held-out set."""
    art = Artifact.load(ROOT / "artifacts/qa-base-to-tuned.safetensors")
    producer = load_model(str(ROOT / "checkpoints/qa-base"), "bfloat16", "cpu")
    consumer = load_model(str(ROOT / "checkpoints/qa-tuned"), "bfloat16", "cpu")
    held = corpus_lib.load("qa.corpus:calibration_corpus", consumer.tokenizer, 0, 12, {"task": "tuned", "ctx": "256"}).heldout
    return art, producer, consumer, LossEvaluator(art, producer, consumer, held)


@pytest.mark.numeric
def test_the_codecs_measure_what_the_schedule_actions_measure(base_to_tuned):
    """raw and quant through their codecs give exactly the loss of the same action on every layer
    in a schedule (ops' quant action is the codec's encoding byte for byte), and a re-run
    reproduces the committed candidates (up to LOSS_REL / LOSS_ABS: other CPUs' kernels)."""
    art, producer, consumer, ev = base_to_tuned
    measured = candidates.measure(art, producer, consumer, ev.heldout, ev)
    n = art.num_layers
    by_mode = {(c["mode"], c["options"].get("bits")): c["loss"] for c in measured}
    # exact: the same caches (byte for byte, checked below) through the same evaluator in this
    # process, i.e. the same computation replayed on the same kernels
    assert by_mode["raw", None] == ev.loss([Action("raw")] * n)
    for bits in (8, 4):
        assert by_mode["quant", str(bits)] == ev.loss([Action("quant", bits)] * n)
    assert same_candidates(measured, art.meta["candidates"]), (measured, art.meta["candidates"])
    profiled = {(r["start"], r["end"]): r["kl"] for r in art.meta["recompute_profile"]}
    for c in measured:
        if c["mode"] == "recompute":  # the profile's (committed) loss of that span, up to another CPU's kernels
            assert c["loss"] == pytest.approx(profiled[int(c["options"]["start"]), int(c["options"]["end"])], rel=LOSS_REL, abs=LOSS_ABS)
    states, _ = kv.capture_states(producer, ev.heldout[0].context_ids, kv.Capture.KV)
    codec = create_codecs(producer, ["quant"])["quant"]
    for bits in ("8", "4"):
        encoder = codec.encoder(codec.resolve({"bits": bits}), EncodeRequest(len(ev.heldout[0].context_ids)))
        for layer in range(n):
            ours, theirs = ops.encode_layer(art, layer, Action("quant", int(bits)), states[layer]), encoder.encode(states[layer])
            assert ours.keys() == theirs.keys()
            assert all(ours[k].dtype == theirs[k].dtype and ours[k].numpy().tobytes() == theirs[k].numpy().tobytes() for k in ours)


def test_distill_records_the_candidates_of_a_new_artifact(tmp_path):
    model = load_model("tiny-llama", "float32", "cpu")
    art = distill(
        model, model, random_corpus(6, 64, 0), heldout(2, 1), corpus_name="r", schedules=["R8.R8.R8.R8"], log=lambda m: None
    )
    assert [(c["mode"], c["options"]) for c in art.meta["candidates"]] == [
        ("raw", {}),
        ("quant", {"bits": "8", "group_size": "32"}),
        ("quant", {"bits": "4", "group_size": "32"}),
        ("recompute", {"start": "1", "end": "2"}),  # the default span of 4 layers, exact for P == C
    ]
    assert {c["mode"]: c["loss"] for c in art.meta["candidates"]}["recompute"] == pytest.approx(0.0, abs=1e-6)
    art.save(tmp_path / "tiny.safetensors")
    modes = [p.mode for p in Artifact.load(art.path).transfer_points()]
    assert modes == ["oracle", "scd", "quant", "quant", "raw", "recompute"]  # tiny-llama's hidden is wider than its K/V


@pytest.mark.numeric
def test_the_command_adds_candidates_in_place(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)  # the artifact names its checkpoints relative to the repository
    path = copy_artifact("qa-tuned-to-tuned", tmp_path)
    art = Artifact.load(path)
    committed = art.meta.pop("candidates")
    art.rewrite()
    candidates.main([str(path), *QA_CORPUS, "--dtype", "bfloat16"])
    back = Artifact.load(path)
    assert back.artifact_id == art.artifact_id and same_candidates(back.meta["candidates"], committed)
    assert json.loads(path.with_suffix(".json").read_text()) == back.meta
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [{k: v for k, v in row.items() if k != "artifact"} for row in printed] == back.meta["candidates"]  # what it wrote


def test_the_command_refuses_another_heldout_set_or_dtype(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    path = copy_artifact("qa-tuned-to-tuned", tmp_path)
    before = path.read_bytes()
    with pytest.raises(SystemExit) as refused:  # 11 of the 12 held-out examples: other losses
        candidates.main([str(path), *QA_CORPUS, "--dtype", "bfloat16", "--heldout", "11"])
    message = str(refused.value.code)
    assert "refused" in message and "re-measure to another loss" in message and "s1 (R2.R16)" in message
    with pytest.raises(SystemExit, match="2-byte K/V elements; --dtype float32 has 4"):
        candidates.main([str(path), *QA_CORPUS, "--dtype", "float32"])
    assert path.read_bytes() == before


async def test_describe_lists_every_transfer_point():
    path = ROOT / "artifacts/qa-base-to-tuned.safetensors"
    art = Artifact.load(path)
    want = [(p.mode, dict(p.options), p.loss, p.bytes_per_token, p.how) for p in art.transfer_points()]
    kw = {"artifacts": str(path)}
    async with running_pair(
        str(ROOT / "checkpoints/qa-base"), str(ROOT / "checkpoints/qa-tuned"), "bfloat16", producer_kw=kw, consumer_kw=kw
    ) as pair:
        for reply in (
            await pair.stub.Describe(consumer_pb2.ConsumerServiceDescribeRequest()),
            await pair.producer_stub.Describe(producer_pb2.ProducerServiceDescribeRequest()),
        ):
            (listed,) = reply.artifacts
            got = [(t.mode, dict(t.options), t.calibrated_loss, t.bytes_per_token, t.how) for t in listed.transfer_points]
            assert got == want
            assert {t.mode for t in listed.transfer_points} == {"oracle", "scd", "raw", "quant", "recompute"}


def test_a_given_recompute_span_is_measured_without_a_profile_and_a_bad_one_is_refused_first():
    """distill(recompute_span=...): as given schedules skip the search, a given span skips the
    profile (on 30 layers most of a small calibration's time) and is the span the candidates measure."""
    producer = load_model("tiny-llama", "float32", "cpu")
    consumer = perturbed_model("tiny-llama", seed=1, scale=0.05)  # unlike weights: the profile would run
    with pytest.raises(ValueError, match=r"recompute_span: \[3, 9\] is not \[start, end\) within 4 layers"):
        distill(producer, consumer, [], [], corpus_name="none", recompute_span=(3, 9), log=lambda m: None)
    art = distill(producer, consumer, random_corpus(6, 64, 0), heldout(2, 1), corpus_name="random",
                  schedules=["R8.R8.R8.R8"], recompute_span=(1, 3), log=lambda m: None)
    assert art.meta["recompute_span"] == [1, 3] and "recompute_profile" not in art.meta
    assert candidates.recorded_spans(art.meta) == [(1, 3)]
    assert [c["options"] for c in art.meta["candidates"] if c["mode"] == "recompute"] == [{"start": "1", "end": "3"}]
