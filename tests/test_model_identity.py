"""A model's identity names everything that shapes its K/V (shared.models): the weights at their own
precision, the config fields the forward reads, the compute dtype; its artifact digest stays the
bfloat16-rounded, dtype-blind one that codec artifacts match. The chunk store's keys use the
identity, so a producer restarted on the same disk tier with another rope_theta, or with float32
weights that round to the same bfloat16, reuses nothing (on 2cf1243 both replayed the first
model's K/V: same digest, same keys); the consumer takes a producer's K/V as its own (raw is
exact) only for its own identity."""

from __future__ import annotations

import json
import shutil

import torch

from shared import models, tiny
from shared.pb import common_pb2
from tests.conftest import running_pair
from tests.test_prefill_engine import contexts
from tests.test_prefix_service import C, prefill, producer, same

RAW = common_pb2.CodecSpec(name="raw")


def rope_variant(tmp_path, theta: float):
    """tiny-llama's checkpoint (same weights, same tokenizer) with another rope_theta."""
    path = tmp_path / f"tiny-llama-rope-{theta:g}"
    shutil.copytree(tiny.ensure_tiny("tiny-llama"), path)
    config = json.loads((path / "config.json").read_text())
    config["rope_parameters"]["rope_theta"] = theta
    (path / "config.json").write_text(json.dumps(config))
    return path


def float32_twins(tmp_path):
    """Two float32 checkpoints whose weights round to the same bfloat16 but differ in float32: the
    first holds bfloat16-exact values, the second adds 2^-10 of each (under half a bfloat16 ulp)."""
    paths = []
    for name, nudge in (("twin-a", 0.0), ("twin-b", 2.0**-10)):
        loaded = models.load_model("tiny-llama", "float32", "cpu")
        with torch.no_grad():
            for p in loaded.model.parameters():
                exact = p.to(torch.bfloat16).to(torch.float32)
                p.copy_(exact + nudge * exact)
        loaded.model.save_pretrained(tmp_path / name)
        loaded.tokenizer.save_pretrained(tmp_path / name)
        paths.append(tmp_path / name)
    return paths


def test_the_identity_names_weights_at_their_precision_the_forward_config_and_the_dtype(tmp_path):
    base = models.load_model("tiny-llama", "float32", "cpu").info
    rope = models.load_model(str(rope_variant(tmp_path, 50000.0)), "float32", "cpu").info
    a, b = (models.load_model(str(p), "float32", "cpu").info for p in float32_twins(tmp_path))
    bf16 = models.load_model("tiny-llama", "bfloat16", "cpu").info
    assert rope.weight_digest == base.weight_digest and rope.identity != base.identity
    assert a.weight_digest == b.weight_digest and a.identity != b.identity
    assert bf16.weight_digest == base.weight_digest and bf16.identity != base.identity  # artifacts still match
    again = models.load_model("tiny-llama", "float32", "cpu").info
    assert again.identity == base.identity


def test_the_config_digest_normalizes_spelling_and_ignores_bookkeeping():
    config = models.load_model("tiny-llama", "float32", "cpu").model.config
    digest = models.config_digest(config)
    config.rope_parameters = {**config.rope_parameters, "rope_theta": int(config.rope_parameters["rope_theta"])}
    config._name_or_path, config.use_cache = "/elsewhere", False
    assert models.config_digest(config) == digest  # 10000 is 10000.0; paths and cache flags shape nothing
    for name, value in (("rms_norm_eps", 1e-5), ("head_dim", 32), ("sliding_window", 64)):
        old = getattr(config, name, None)
        setattr(config, name, value)
        assert models.config_digest(config) != digest, name
        setattr(config, name, old)
        if old is None:
            delattr(config, name)
        assert models.config_digest(config) == digest


async def _restarted_on_the_same_disk(tmp_path, first: str, second: str) -> None:
    """A producer of `first` fills a disk tier; one of `second` restarted on it sends what a
    producer of `second` on an empty disk sends, reusing nothing, request after request."""
    ids = contexts(2 * C + 40, seed=91)[0]
    longer = ids + contexts(50, seed=92)[0]  # continues a stored prefix
    disk = tmp_path / "chunks"
    async with producer(first, store_disk_dir=str(disk)) as (server, stub):
        old = [await prefill(stub, context, spec=RAW) for context in (ids, longer)]
        server.servicer.chunks.disk.flush()
    assert len(list(disk.glob("*.safetensors"))) >= 3
    async with producer(second, store_disk_dir=str(tmp_path / "empty")) as (_, stub):
        fresh = [await prefill(stub, context, spec=RAW) for context in (ids, longer)]
    async with producer(second, store_disk_dir=str(disk)) as (_, stub):
        got = [await prefill(stub, context, spec=RAW) for context in (ids, longer)]
    (_, first_bytes, trailer), (_, second_bytes, second_trailer) = got
    assert not trailer.store_hit and trailer.reused_tokens == 0  # nothing of the first model
    assert second_trailer.reused_tokens == fresh[1][2].reused_tokens > 0  # its own chunks only
    assert same(first_bytes, fresh[0][1]) and same(second_bytes, fresh[1][1])
    assert not same(first_bytes, old[0][1])  # the models' K/V do differ: a replay would have been wrong
    assert got[0][0].producer.identity == fresh[0][0].producer.identity != old[0][0].producer.identity


async def test_a_rope_theta_change_reuses_nothing_from_the_disk_tier(tmp_path):
    await _restarted_on_the_same_disk(tmp_path, "tiny-llama", str(rope_variant(tmp_path, 50000.0)))


async def test_a_float32_only_difference_reuses_nothing_from_the_disk_tier(tmp_path):
    a, b = float32_twins(tmp_path)
    await _restarted_on_the_same_disk(tmp_path, str(a), str(b))


async def test_the_consumer_takes_a_producers_kv_as_exact_only_for_its_own_identity(tmp_path):
    """Same weights, another rope_theta: the consumer's auto offers raw as exact for a producer of
    its own identity only (before: equal weight digests made the other rope's K/V "exact")."""
    other = str(rope_variant(tmp_path, 50000.0))
    for producer_model, exact in (("tiny-llama", True), (other, False)):
        async with running_pair(producer_model, "tiny-llama") as pair:
            await pair.consumer.link.check()
            chooser = pair.consumer.servicer.chooser
            modes = {c.mode for c in chooser.candidates() if c.how == "exact"}
            assert ("raw" in modes) is exact, (producer_model, modes)
