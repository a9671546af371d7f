"""A learned keep policy through the real services: the producer loads DistillCache weights beside
the pair's SCD artifact (`<artifact>.keep.safetensors`, producer.keep_weights) and a request naming
keep policy "distill" is scored with them.

- the keep sets on the wire are the weights' own (shared.keep.distill over the producer's states),
  not a heuristic's, and the answer is the offline kept cache's, for raw and scd;
- Describe names the weights' digest on the pair's artifact;
- a consumer the producer holds no weights for is FAILED_PRECONDITION naming keep.policy;
- a weights file for another geometry fails the producer's start, naming the file; a stored kept
  stream is keyed by the weights' digest (other weights, other tokens);
- calibration.keep_points prices distill's keep points with those weights, and auto offers one
  only where the producer holds the same weights.
"""

from __future__ import annotations

import dataclasses

import grpc
import pytest
import torch

from calibration.distill import distill as calibrate
from producer.keep_weights import KeepWeights
from shared import kv
from shared.codecs import create_codecs, keep_set
from shared.codecs.kept import KeepRequest
from shared.keep import distill
from shared.keep.distill import DistillNet
from shared.models import load_model
from shared.pb import common_pb2, producer_pb2
from shared.scd.artifact import Artifact, discover
from tests.conftest import running_pair
from tests.hostile import record
from tests.test_keep_service import CONTEXT, QUESTION, fields, keep_chunk, offline
from tests.test_scd import heldout, random_corpus


def probe_weights(info, seed: int, layers: int | None = None) -> DistillNet:
    """A probe with random weights: its keep sets are its own (neither recency nor key norm)."""
    net = DistillNet(layers or info.num_layers, inputs=("normed",), d_model=info.hidden_size, num_kv_heads=info.num_kv_heads)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        net.probe.copy_(torch.randn(net.probe.shape, generator=gen))
    return net


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    model = load_model("tiny-llama", "float32", "cpu")
    art = calibrate(
        model, model, random_corpus(12, 96, 0), heldout(3, 1), corpus_name="random", generations=1, log=lambda m: None
    )
    path = tmp_path_factory.mktemp("artifacts")
    art.save(path / "tiny.safetensors")
    weights = distill.weights_path(path / "tiny.safetensors")
    distill.save(probe_weights(model.info, 0), weights, {"test": "random probe, seed 0"})
    ids = model.tokenizer(CONTEXT)["input_ids"]
    question = model.tokenizer(QUESTION, add_special_tokens=False)["input_ids"]
    return {"model": model, "art": art, "path": str(path), "ids": ids, "question": question, "weights": weights}


@pytest.fixture(scope="module")
async def pair(world):
    kw = {"artifacts": world["path"]}
    async with running_pair("tiny-llama", producer_kw=kw, consumer_kw={**kw, "prefix_cache_bytes": 0}) as p:
        yield p


def wire_keep_sets(messages, num_tokens: int, num_kv_heads: int) -> list[torch.Tensor]:
    """Each layer's keep set as the producer sent it ([rows, kept]: one row when shared)."""
    header = messages[0].header
    rows = 1 if header.keep.heads == "shared" else num_kv_heads
    out = []
    for layer in range(header.num_layers):
        chunk = messages[keep_chunk(messages, layer)].chunk
        dtype, shape = keep_set.wire_shape(num_tokens, header.kept_tokens, rows)
        payload = torch.frombuffer(bytearray(chunk.data), dtype=dtype).view(shape)
        out.append(keep_set.decode(payload, num_tokens, header.kept_tokens, layer))
    return out


@pytest.mark.parametrize("codec, keep", [("raw", "distill:0.3:window=8"), ("scd", "distill:0.3:window=8")])
async def test_distill_served_keeps_the_weights_tokens_and_answers_as_offline(world, pair, codec, keep):
    model = world["model"]
    assert model.info.num_kv_heads == 2
    policy = distill.load(world["weights"])
    resolved = KeepRequest.parse(keep).for_codec(create_codecs(model, [codec], [world["art"]])[codec])
    want, n = offline(world, codec, resolved, policy=policy)
    ids, _, stats = await pair.generate(**fields(world, codec, keep))
    assert ids == want and stats.transfer.options["keep"].startswith("distill:0.3")

    spec = common_pb2.KeepSpec(policy="distill", fraction=0.3, window=8, heads=resolved.heads)
    options = {"schedule": "R8.P.F8.W"} if codec == "scd" else {}
    messages = await record(pair.producer.address, world["ids"], codec, options, model.info.weight_digest, spec)
    sent = wire_keep_sets(messages, len(world["ids"]), model.info.num_kv_heads)
    states, _ = kv.capture_states(model, world["ids"], kv.Capture.KV | kv.Capture.NORMED)
    rows = 1 if resolved.shared else model.info.num_kv_heads  # a shared keep set travels once per layer
    assert [s.tolist() for s in sent] == [s[:rows].tolist() for s in resolved.selection(policy).keep(model, states)]
    streaming = dataclasses.replace(resolved, policy="streaming")
    assert [s.tolist() for s in sent] != [s[:rows].tolist() for s in streaming.selection().keep(model, states)]
    assert all(int(s.shape[1]) == n for s in sent)


async def test_describe_names_the_keep_weights_and_a_pair_without_them_is_failed_precondition(world, pair):
    described = await pair.producer_stub.Describe(producer_pb2.ProducerServiceDescribeRequest())
    assert [a.keep_weights_digest for a in described.artifacts] == [distill.load(world["weights"]).digest]
    spec = common_pb2.KeepSpec(policy="distill", fraction=0.5)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await record(pair.producer.address, world["ids"], "raw", {}, "ab" * 32, spec)  # a consumer it has no weights for
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "keep.policy: 'distill'" in err.value.details() and "keep.safetensors" in err.value.details()
    ids, _, _ = await pair.generate(**fields(world, "raw", "h2o:0.3:window=8"))  # the pair still serves
    assert ids


async def test_a_producer_without_keep_weights_refuses_distill_by_name(world, tmp_path):
    world["art"].save(tmp_path / "tiny.safetensors")  # the artifact alone: no .keep.safetensors beside it
    kw = {"artifacts": str(tmp_path)}
    async with running_pair("tiny-llama", producer_kw=kw, consumer_kw=kw) as p:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await p.generate(**fields(world, "raw", "distill:0.5"))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "keep.policy: 'distill'" in err.value.details()
        described = await p.producer_stub.Describe(producer_pb2.ProducerServiceDescribeRequest())
        assert [a.keep_weights_digest for a in described.artifacts] == [""]


def test_keep_weights_for_another_geometry_fail_the_start_naming_the_file(world, tmp_path):
    model = world["model"]
    world["art"].save(tmp_path / "tiny.safetensors")
    bad = distill.weights_path(tmp_path / "tiny.safetensors")
    distill.save(probe_weights(model.info, 0, layers=model.info.num_layers + 1), bad, {})
    with pytest.raises(ValueError, match=f"{bad.name}.*layers"):
        KeepWeights(discover([tmp_path]), model.info)
    distill.save(probe_weights(model.info, 0), bad, {})
    weights = KeepWeights(discover([tmp_path]), model.info)
    keep = KeepRequest.parse("distill:0.5")
    assert weights.resolve(keep, model.info.weight_digest).digest == distill.load(bad).digest
    assert weights.resolve(KeepRequest.parse("h2o:0.5"), model.info.weight_digest) is None


async def test_a_stored_kept_stream_is_keyed_by_the_weights(world, tmp_path):
    """Producers one after another over the same disk tier: the same weights replay the stored kept
    stream (the tier persists it), other weights never do (their keep sets differ)."""
    model = world["model"]
    store = tmp_path / "store"
    seen = []
    for run, seed in enumerate((0, 0, 1)):
        arts = tmp_path / f"a{run}"
        arts.mkdir()
        world["art"].save(arts / "tiny.safetensors")
        distill.save(probe_weights(model.info, seed), distill.weights_path(arts / "tiny.safetensors"), {})
        kw = {"artifacts": str(arts), "store_disk_dir": str(store), "store_disk_bytes": 1 << 26}
        async with running_pair("tiny-llama", producer_kw=kw, consumer_kw={"artifacts": str(arts)}) as p:
            spec = common_pb2.KeepSpec(policy="distill", fraction=0.3, window=8)
            messages = await record(p.producer.address, world["ids"], "raw", {}, model.info.weight_digest, spec)
            seen.append(
                (
                    messages[-1].trailer.store_hit,
                    [s.tolist() for s in wire_keep_sets(messages, len(world["ids"]), model.info.num_kv_heads)],
                )
            )
    assert [hit for hit, _ in seen] == [False, True, False]
    assert seen[0][1] == seen[1][1] != seen[2][1]


async def test_auto_prices_and_picks_a_learned_keep_point_only_where_the_producer_holds_its_weights(world, tmp_path):
    """calibration.keep_points measures distill's keep points with the weights beside the artifact
    (their digest on each point; not streaming's tokens, so not its loss); auto offers one only
    while the producer's Describe names those weights for the artifact, and then runs the
    transfer with that keep set."""
    from calibration import keep_points
    from calibration.search import LossEvaluator
    from tests.test_keep_auto import auto, slow_link

    model = world["model"]
    kept, bare = tmp_path / "kept", tmp_path / "bare"
    kept.mkdir(), bare.mkdir()
    world["art"].save(kept / "tiny.safetensors")
    distill.save(probe_weights(model.info, 3), distill.weights_path(kept / "tiny.safetensors"), {"test": "seed 3"})
    art = Artifact.load(kept / "tiny.safetensors")
    held = heldout(3, 1)
    ev = LossEvaluator(art, model, model, held)
    rows = keep_points.measure(art, model, model, held, ["distill", "streaming"], ["0.5:window=8"], ["raw"], ev)
    digest = distill.load(distill.weights_path(kept / "tiny.safetensors")).digest
    learned, heuristic = (next(r for r in rows if r["keep"].startswith(p)) for p in ("distill:", "streaming:"))
    assert learned["keep_weights"] == digest and "keep_weights" not in heuristic
    assert learned["loss"] > 0 and learned["loss"] != pytest.approx(heuristic["loss"])
    art.meta["keep_points"] = [learned, {**heuristic, "loss": learned["loss"] * 10}]  # distill's loss admits it alone
    for where in (kept, bare):
        art.save(where / "tiny.safetensors")
    consumer_kw = {"artifacts": str(kept), "prefix_cache_bytes": 0, "probe_idle_s": 0}
    async with running_pair("tiny-llama", producer_kw={"artifacts": str(kept)}, consumer_kw=consumer_kw) as p:
        whole = await slow_link(p)
        _, _, stats = await p.generate(**{**fields(world, "raw"), "transfer": auto(learned["loss"])})
        named = f"{learned['keep']},weights={digest}"  # the request names the weights the point was measured with
        assert stats.transfer.name == "raw" and stats.transfer.options["keep"] == named, stats.auto.reason
        assert 0 < stats.bytes_received < 0.6 * whole
    async with running_pair("tiny-llama", producer_kw={"artifacts": str(bare)}, consumer_kw=consumer_kw) as p:
        await slow_link(p)
        _, _, stats = await p.generate(**{**fields(world, "raw"), "transfer": auto(learned["loss"])})
        assert "keep" not in stats.transfer.options
        assert not [c for c in stats.auto.candidates if c.options.get("keep", "").startswith("distill")]


async def test_a_request_naming_other_keep_weights_is_failed_precondition_naming_keep_weights(world, pair):
    """keep.weights pins the weights: the producer's own digest serves (the same answer as without
    it), another digest is FAILED_PRECONDITION naming keep.weights, a heuristic or a malformed digest
    INVALID_ARGUMENT naming it (on the consumer's side, before any transfer)."""
    digest = distill.load(world["weights"]).digest
    plain, _, _ = await pair.generate(**fields(world, "raw", "distill:0.3:window=8"))
    pinned, _, stats = await pair.generate(**fields(world, "raw", f"distill:0.3:window=8,weights={digest}"))
    assert pinned == plain and stats.transfer.options["keep"].endswith(f",weights={digest}")
    other = "0123456789abcdef"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await pair.generate(**fields(world, "raw", f"distill:0.3:window=8,weights={other}"))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"keep.weights: {other!r}" in err.value.details() and digest in err.value.details()
    spec = common_pb2.KeepSpec(policy="distill", fraction=0.3, window=8, weights=other)  # straight to the producer
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await record(pair.producer.address, world["ids"], "raw", {}, world["model"].info.weight_digest, spec)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "keep.weights" in err.value.details()
    for bad in (f"streaming:0.3:weights={digest}", "distill:0.3:weights=ABC"):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pair.generate(**fields(world, "raw", bad))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "keep.weights" in err.value.details(), bad
