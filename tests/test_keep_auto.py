"""The keep fraction as a candidate dimension of mode `auto` (issue 48 item 3):
calibration.keep_points prices each (codec point x policy x fraction) on the artifact's loss scale,
the artifact lists them as transfer points, and auto picks one where it is the fastest within the
budget, running the transfer with that keep set (real services, tiny models; artifacts built here
or copied from the committed QA ones)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from calibration import keep_points
from calibration.distill import distill
from calibration.kl import layer_cache
from calibration.search import LossEvaluator
from shared import kv
from shared.codecs import keep_set
from shared.keep import kept_cache, next_positions, parse_selection
from shared.models import load_model
from shared.pb import common_pb2, consumer_pb2
from shared.scd.artifact import Artifact, _content_id
from tests.conftest import prompt, running_pair
from tests.test_end_to_end import CONTEXT, QUESTION
from tests.test_planner import slow_own_prefill
from tests.test_scd import heldout, random_corpus

ROOT = Path(__file__).resolve().parent.parent
QA_CORPUS = ["--corpus", "qa.corpus:calibration_corpus", "--corpus-arg", "task=tuned", "--corpus-arg", "ctx=256"]
FRACTIONS = ("0.25", "0.5", "0.75")


def test_the_command_prices_keep_points_and_their_loss_grows_as_fewer_tokens_are_kept(tmp_path, monkeypatch):
    """On the committed P == C QA artifact (raw is exact there): each codec point's keep points
    lose more the fewer tokens they keep, every one more than the codec point alone; bytes are the
    codec's x the kept share + the keep sets; the artifact's id, digests and other sections stay."""
    monkeypatch.chdir(ROOT)  # the artifact names its checkpoints relative to the repository
    for suffix in (".safetensors", ".json"):
        shutil.copy(ROOT / "artifacts" / f"qa-tuned-to-tuned{suffix}", tmp_path / f"qa-tuned-to-tuned{suffix}")
    path = tmp_path / "qa-tuned-to-tuned.safetensors"
    before = Artifact.load(path)
    keep_points.main(
        [
            "--artifact",
            str(path),
            *QA_CORPUS,
            "--dtype",
            "bfloat16",
            "--policies",
            "streaming,snapkv",
            "--fractions",
            ",".join(FRACTIONS),
            "--codecs",
            "raw,scd:DEFAULT",
        ]
    )
    art = Artifact.load(path)
    assert art.artifact_id == before.artifact_id == _content_id(art.tensors, art.meta)
    assert {k: v for k, v in art.meta.items() if k != "keep_points"} == before.meta
    assert json.loads(path.with_suffix(".json").read_text()) == art.meta
    rows = art.meta["keep_points"]
    assert len(rows) == 2 * 2 * len(FRACTIONS)
    stored = {"raw": 0.0, "scd": art.default_entry().loss}
    for mode in ("raw", "scd"):
        for policy in ("streaming", "snapkv"):
            mine = [r for r in rows if r["mode"] == mode and r["keep"].startswith(policy + ":")]
            losses = [r["loss"] for r in sorted(mine, key=lambda r: r["kept_share"])]
            assert len(losses) == 3 and losses[0] > losses[1] > losses[2] > stored[mode], (mode, policy, losses)
    raw = next(c["bytes_per_token"] for c in art.meta["candidates"] if c["mode"] == "raw")
    layers, heads = art.num_layers, 4  # qa models: 4 KV heads, a keep set each under raw
    for r in rows:
        if r["mode"] == "raw":  # contexts of 256 tokens: bitmaps of 32 bytes per layer and head
            assert keep_set.is_bitmap(256, int(256 * r["kept_share"]))
            assert r["bytes_per_token"] == pytest.approx(raw * r["kept_share"] + layers * heads / 8)
    points = [p for p in art.transfer_points() if any(k == "keep" for k, _ in p.options)]
    assert sorted((p.mode, dict(p.options)["keep"], p.loss) for p in points) == sorted(
        (r["mode"], r["keep"], r["loss"]) for r in rows
    )


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """tiny-llama P == C: one artifact with keep points of raw and of its default schedule
    (streaming at three fractions), one without (the same fitted content, the same id)."""
    model = load_model("tiny-llama", "float32", "cpu")
    held = heldout(3, 1)
    art = distill(model, model, random_corpus(12, 96, 0), held, corpus_name="random", generations=1, log=lambda m: None)
    plain, kept = tmp_path_factory.mktemp("plain"), tmp_path_factory.mktemp("kept")
    art.save(plain / "tiny.safetensors")
    ev = LossEvaluator(art, model, model, held)
    art.meta["keep_points"] = keep_points.measure(
        art, model, model, held, ["streaming"], list(FRACTIONS), ["raw", "scd:DEFAULT"], ev
    )
    art.save(kept / "tiny.safetensors")
    return {"plain": str(plain), "kept": str(kept), "rows": art.meta["keep_points"], "model": model, "held": held}


def test_a_keep_points_loss_is_the_kl_of_the_offline_kept_cache(artifacts):
    """raw with P == C sends C's own K/V: its keep point's loss is the KL of shared.keep's offline
    kept cache (the policy's keep sets over C's own prefill, the answer at the positions after the
    whole context) against the whole cache, over the same held-out answer tokens."""
    model, held = artifacts["model"], artifacts["held"]
    for row in [r for r in artifacts["rows"] if r["mode"] == "raw"]:
        selection = parse_selection(row["keep"])
        total, count = 0.0, 0
        for ex in held:
            states = kv.capture_states(model, ex.context_ids, kv.Capture.KV | kv.Capture.NORMED)[0]
            own = [states[layer].kv() for layer in range(model.info.num_layers)]
            logps = []
            for cache in (layer_cache(model, own), kept_cache(model, own, selection.keep(model, states))):
                ids = torch.tensor([ex.qa_ids])
                with torch.inference_mode():
                    logits = model.model(
                        input_ids=ids, cache=cache, position_ids=next_positions(cache, ids.shape[1]), use_cache=True
                    ).logits
                logps.append(torch.log_softmax(logits[0].float(), -1)[ex.answer_start - 1 : len(ex.qa_ids) - 1])
            total += float((logps[0].exp() * (logps[0] - logps[1])).sum())
            count += logps[0].shape[0]
        assert row["loss"] == pytest.approx(total / count, rel=1e-4), row["keep"]


def fields(**kw) -> dict:
    return dict(context=prompt(CONTEXT), question=prompt(QUESTION), max_new_tokens=8, **kw)


async def slow_link(pair) -> int:
    """A measured raw transfer (its bytes returned), then a slow link and a slower own prefill:
    the fewest bytes win."""
    await pair.generate(transfer=common_pb2.CodecSpec(name="oracle"), **fields())
    _, _, stats = await pair.generate(transfer=common_pb2.CodecSpec(name="raw"), **fields())
    planner = pair.consumer.servicer.planner
    slow_own_prefill(planner)
    planner.link_bytes_per_ms.value, planner.link_lower_bound = 50.0, False  # 0.4 Mbit/s
    return stats.bytes_received


def auto(max_loss: float) -> common_pb2.CodecSpec:
    return common_pb2.CodecSpec(name="auto", options={"max_loss": repr(max_loss), "candidates": "raw,oracle"})


async def test_auto_picks_a_keep_point_within_the_budget_on_a_slow_link(artifacts):
    rows = {r["keep"].split(":")[1]: r for r in artifacts["rows"] if r["mode"] == "raw"}
    half, quarter = rows["0.5"], rows["0.25"]
    assert quarter["loss"] > half["loss"] > rows["0.75"]["loss"] > 0  # a budget of half's admits 0.5 and 0.75, not 0.25
    kw = {"artifacts": artifacts["kept"]}
    consumer_kw = {**kw, "prefix_cache_bytes": 0, "probe_idle_s": 0}
    async with running_pair("tiny-llama", producer_kw=kw, consumer_kw=consumer_kw) as pair:
        whole = await slow_link(pair)
        (listed,) = (await pair.client.describe()).artifacts  # Describe lists them with the option keep
        assert sorted(t.options["keep"] for t in listed.transfer_points if "keep" in t.options) == sorted(
            r["keep"] for r in artifacts["rows"]
        )
        ids, _, stats = await pair.generate(transfer=auto(half["loss"]), **fields())
        assert stats.transfer.name == "raw" and stats.transfer.options["keep"] == half["keep"], stats.auto.reason
        assert f"keep={half['keep']}" in stats.auto.reason
        assert 0 < stats.bytes_received < 0.6 * whole  # the kept half and its keep sets
        over = [e for e in stats.auto.excluded if e.reason.startswith("over the loss budget")]
        assert any(f"keep={quarter['keep']}" in c for e in over for c in e.candidates)
        others = [e for e in stats.auto.excluded if e.reason == "not among the requested candidates"]
        scd_keys = {c for e in others for c in e.candidates if c.startswith("scd(") and "keep=" in c}
        assert len(scd_keys) == 3 and all("heads=shared" in c for c in scd_keys)  # one key per keep set
        named = common_pb2.CodecSpec(name="raw", options={"keep": half["keep"]})
        same, _, again = await pair.generate(transfer=named, **fields())
        assert same == ids and again.bytes_received == stats.bytes_received  # the kept path, token for token
        # both kept transfers taught the keep point's own key, per context token (not raw's)
        learned = {k: e.value for k, e in pair.consumer.servicer.planner.bytes_per_token.items()}
        (key,) = [k for k in learned if "keep=" in k]
        assert learned[key] == pytest.approx(again.bytes_received / stats.context_tokens)
        assert learned[pair.consumer.servicer.chooser.key("raw", {})] == pytest.approx(whole / stats.context_tokens)
        # a tight budget admits no keep point: the whole raw transfer
        _, _, tight = await pair.generate(transfer=auto(min(r["loss"] for r in rows.values()) / 2), **fields())
        assert tight.transfer.name == "raw" and "keep" not in tight.transfer.options and tight.bytes_received == whole
        # a request that asks for what a kept cache does not serve leaves them out
        _, _, audited = await pair.generate(transfer=auto(half["loss"]), audit=consumer_pb2.AUDIT_POLICY_REPORT, **fields())
        assert "keep" not in audited.transfer.options
        assert any(e.reason.startswith("a keep set is not served with audit") for e in audited.auto.excluded)


async def test_an_artifact_without_keep_points_offers_none(artifacts):
    kw = {"artifacts": artifacts["plain"]}
    consumer_kw = {**kw, "prefix_cache_bytes": 0, "probe_idle_s": 0}
    async with running_pair("tiny-llama", producer_kw=kw, consumer_kw=consumer_kw) as pair:
        await slow_link(pair)
        _, _, stats = await pair.generate(transfer=auto(1e9), **fields())
        assert stats.transfer.name == "raw" and "keep" not in stats.transfer.options
        assert not [c for c in stats.auto.candidates if "keep" in c.options]


def test_a_learned_keep_point_is_a_candidate_only_where_the_producer_holds_its_weights():
    """A keep point measured with keep weights (calibration.keep_points `keep_weights`) is offered
    only while the producer's Describe names the same weights' digest for its artifact: none, or
    other weights, leave it out (a heuristic's point stays); offered, its keep option names the
    digest, so that a producer with other weights refuses it rather than keep other tokens."""
    import copy

    from consumer.auto.chooser import Chooser
    from consumer.auto.planner import TransferPlanner
    from consumer.auto.producer_memory import ProducerMemory
    from shared import codecs as codec_lib
    from shared.scd.artifact import discover

    loaded = load_model(str(ROOT / "checkpoints" / "qa-tuned"), "float32", "cpu")
    (art,) = discover([ROOT / "artifacts" / "qa-base-to-tuned.safetensors"])
    art = Artifact(art.tensors, copy.deepcopy(art.meta), art.path)
    schedule = art.default_entry()
    scd = {"artifact": art.artifact_id, "schedule": schedule.name}
    point = {"mode": "scd", "options": scd, "loss": 0.5, "bytes_per_token": 10.0, "kept_share": 0.25, "how": "measured"}
    mine = "0123456789abcdef"
    art.meta["keep_points"] = [
        {**point, "keep": "distill:0.25:sinks=4,window=64,heads=shared", "keep_weights": mine},
        {**point, "keep": "streaming:0.25:sinks=4,window=64,heads=shared"},
    ]
    codecs = codec_lib.create_codecs(loaded, artifacts=[art])
    held: dict[str, str] = {}
    chooser = Chooser(
        loaded, codecs, TransferPlanner(), ProducerMemory(), lambda c, ids, tenant="": 0,
        lambda: art.meta["producer"]["weight_digest"], lambda: True, lambda: "float32", lambda: "", lambda: held,
    )  # fmt: skip

    def kept() -> list[str]:
        return sorted(c.options["keep"] for c in chooser.candidates() if "keep" in c.options)

    assert kept() == ["streaming:0.25:sinks=4,window=64,heads=shared"]  # the producer names no weights
    held[art.artifact_id] = "fedcba9876543210"
    assert kept() == ["streaming:0.25:sinks=4,window=64,heads=shared"]  # other weights
    held[art.artifact_id] = mine
    assert kept() == [
        f"distill:0.25:sinks=4,window=64,heads=shared,weights={mine}",
        "streaming:0.25:sinks=4,window=64,heads=shared",
    ]
