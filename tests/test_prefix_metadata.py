"""The consumer's prefix cache names a codec's rebuilt KV by the codec metadata its stream carried
(an SCD artifact id and schedule), not only by the request's options: a request that leaves the
artifact to the producer is rebuilt with whichever the producer uses, so KV rebuilt under one
artifact is never served (nor continued) as another's. Lookups assume what the last stream of
the same codec and options said; a cached context reports the artifact that made it."""

from __future__ import annotations

import copy

import grpc
import pytest

from calibration.distill import distill
from consumer.api.client import ConsumerClient
from consumer.link.prefix_keys import PrefixKeys
from producer.server import ProducerServer
from shared import codecs as codec_lib
from shared.codecs.base import StreamInfo
from shared.config import ProducerConfig
from shared.models import load_model
from shared.pb import producer_pb2, producer_pb2_grpc
from shared.scd.artifact import Artifact
from tests.conftest import prompt
from tests.hostile import consumer_of, record
from tests.test_scd import heldout, random_corpus

C = 64  # chunk tokens of both sides


@pytest.fixture(scope="module")
def two_artifacts(tmp_path_factory):
    """Two artifacts of the tiny pair, A and B (A's maps, another default schedule: another id),
    each alone in a directory, and both in a third."""
    model = load_model("tiny-llama", "float32", "cpu")
    a = distill(model, model, random_corpus(12, 96, 0), heldout(3, 1), corpus_name="random", generations=1, log=lambda m: None)
    meta = copy.deepcopy(a.meta)
    meta.pop("artifact_id", None)
    meta["search"] = {**meta.get("search", {}), "note": "B: another default"}  # in the content id: a new artifact
    b = Artifact(a.tensors, meta)
    others = [e.name for e in a.schedules if e.schedule != a.default_entry().schedule]
    assert others, "the tiny artifact needs two schedules"
    b.set_default(others[-1], "a test")
    paths = {name: tmp_path_factory.mktemp(name) for name in ("a", "b", "both")}
    a.save(paths["a"] / "a.safetensors")
    b.save(paths["b"] / "b.safetensors")
    a.save(paths["both"] / "a.safetensors")
    b.save(paths["both"] / "b.safetensors")
    assert a.artifact_id != b.artifact_id and a.default_entry().schedule != b.default_entry().schedule
    return model, a, b, paths


async def _recorded(directory, contexts: list[list[int]], digest: str):
    producer = ProducerServer(
        ProducerConfig(port=0, model="tiny-llama", device="cpu", chunk_tokens=C, artifacts=str(directory), drain_grace_s=0)
    )
    await producer.start()
    await producer.load()
    try:
        streams = {tuple(c): await record(producer.address, c, "scd", {}, digest) for c in contexts}
        async with grpc.aio.insecure_channel(producer.address) as channel:
            described = await producer_pb2_grpc.ProducerServiceStub(channel).Describe(
                producer_pb2.ProducerServiceDescribeRequest()
            )
    finally:
        await producer.stop(0)
    return streams, described


async def test_kv_rebuilt_under_one_artifact_is_not_served_as_another(two_artifacts):
    model, a, b, paths = two_artifacts
    x, y = list(range(10, 110)), list(range(120, 220))  # a full chunk and a tail each
    digest = model.info.weight_digest
    by_a, described = await _recorded(paths["a"], [x], digest)
    by_b, _ = await _recorded(paths["b"], [x, y], digest)
    now = {"streams": by_a}
    asked: list[int] = []

    def script(request):  # the producer: A's, then (a new calibration rolled out) B's
        asked.append(len(request.token_ids))
        yield from now["streams"][tuple(request.token_ids)]

    question = prompt(ids=[5, 6, 7])
    async with consumer_of(script, describe=described, artifacts=str(paths["both"]), chunk_tokens=C) as (consumer, _):
        client = ConsumerClient(consumer.address)
        try:

            async def ask(context):
                return await client.generate(mode="scd", context=prompt(ids=context), question=question, max_new_tokens=6)

            first = await ask(x)
            again = await ask(x)  # cached: no transfer, and it says which artifact made the KV
            now["streams"] = by_b
            other = await ask(y)  # a stream of B: lookups now assume B
            after = await ask(x)  # A's KV of x is not B's: transferred again
            cached = await ask(x)
            fresh = await client.generate(
                mode="scd", context=prompt(ids=x), question=question, max_new_tokens=6, cache_salt="fresh"
            )
        finally:
            await client.channel.close()
    assert asked == [len(x), len(y), len(x), len(x)]  # the last: another tenant's cache, empty
    opts = lambda answer: dict(answer.stats.transfer.options)
    assert opts(first)["artifact"] == opts(again)["artifact"] == a.artifact_id
    assert again.stats.prefix_reused_tokens == len(x) and again.ids == first.ids
    assert opts(other)["artifact"] == opts(after)["artifact"] == opts(cached)["artifact"] == b.artifact_id
    assert opts(after)["schedule"] == b.default_entry().schedule
    assert after.stats.prefix_reused_tokens == 0 and after.stats.bytes_received > 0
    assert cached.stats.prefix_reused_tokens == len(x) and cached.stats.bytes_received == 0
    assert after.ids == cached.ids == fresh.ids  # B's answer, whether transferred or cached


def test_a_prefix_key_is_asked_only_under_the_metadata_the_cached_chunks_were_looked_up_with(two_artifacts):
    model, a, b, _ = two_artifacts
    keys = PrefixKeys(model.info, C, lambda: model.info.identity, lambda: model.info.dtype)
    scd = codec_lib.create_codecs(model, ["scd"], [a, b])["scd"]
    ids, tenant = list(range(10, 200)), ""
    assert keys.lookup_metadata(scd, {}) == {}  # nothing said yet
    meta_a = {"artifact": a.artifact_id, "schedule": a.default_entry().schedule}
    meta_b = {"artifact": b.artifact_id, "schedule": b.default_entry().schedule}

    def saw(meta):
        stream = StreamInfo(a.num_layers, len(ids), model.info.dtype, {}, meta, producer_identity=model.info.identity)
        keys.saw_stream(scd, {}, stream, C)

    saw(meta_a)
    assert keys.lookup_metadata(scd, {}) == meta_a and keys.lookup_metadata(scd, {"schedule": "s1"}) == {}
    under_a = keys.chain(scd, {}, ids, tenant)  # a lookup: under what the last stream said
    assert under_a == keys.chain(scd, {}, ids, tenant, (model.info.identity, model.info.dtype), meta_a)
    assert under_a[0].key != keys.chain(scd, {}, ids, tenant, (model.info.identity, model.info.dtype), meta_b)[0].key
    assert keys.partial(scd, {}, ids, 2, tenant, meta_a) is not None
    saw(meta_b)  # another stream between the lookup and the question to the producer: no partial transfer
    assert keys.partial(scd, {}, ids, 2, tenant, meta_a) is None
    assert keys.partial(scd, {}, ids, 2, tenant, meta_b) is not None
    assert keys.chain(scd, {}, ids, tenant)[0].key != under_a[0].key


async def test_a_heterogeneous_pairs_scd_follow_up_asks_only_for_the_tail():
    """The consumer learned an SCD stream's token layout from an encoder of its own, which a
    heterogeneous pair's artifact cannot give it (it is calibrated for the producer's weights), so
    an SCD follow-up on the QA pair re-sent the whole context. The layout now comes from the header's
    artifact and schedule: the cached chunks are reused, only the tail is sent, and the answer is
    a fresh pair's."""
    from pathlib import Path

    from shared.pb import common_pb2
    from tests.conftest import running_pair

    root = Path(__file__).resolve().parents[1]
    kw = {"artifacts": str(root / "artifacts" / "qa-base-to-tuned.safetensors"), "chunk_tokens": 32}
    ids = [(13 * i + 7) % 500 + 20 for i in range(200)]
    spec = common_pb2.CodecSpec(name="scd", options={"schedule": "s2"})
    fields = dict(question=prompt(ids=[30, 31, 32]), max_new_tokens=6, transfer=spec)
    base, tuned = str(root / "checkpoints" / "qa-base"), str(root / "checkpoints" / "qa-tuned")
    async with running_pair(base, tuned, producer_kw=kw, consumer_kw=kw) as pair:
        await pair.client.generate(context=prompt(ids=ids[:64]), timeout=60, **fields)
        follow = await pair.client.generate(context=prompt(ids=ids), timeout=60, **fields)
    async with running_pair(base, tuned, producer_kw={**kw, "store_bytes": 0}, consumer_kw={**kw, "prefix_cache_bytes": 0}) as pair:
        fresh = await pair.client.generate(context=prompt(ids=ids), timeout=60, **fields)
    assert follow.stats.prefix_reused_tokens == 64 and fresh.stats.prefix_reused_tokens == 0
    assert follow.stats.bytes_received < fresh.stats.bytes_received
    assert list(follow.ids) == list(fresh.ids)
