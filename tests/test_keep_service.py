"""Token selection through the real services (a keep set per transfer, PrefillRequest.keep): the
producer scores its own prefill and sends the kept tokens' payloads with each layer's keep set; the
consumer stores only those and answers at the context's logical positions.

- keeping every token answers as the whole transfer does, token for token, for raw, quant, scd;
- a kept subset answers as the offline kept cache does (shared.keep.kept_cache over the mode's
  whole rebuilt cache: raw and scd exactly; quant over its kept K/V quantized per KV head), and the
  bytes shrink by the kept share (plus the keep sets);
- a hostile producer's bad keep sets fail at the first bad message with the field and the limit,
  and every KV block comes back;
- a keep request never reads nor fills a stored chunk or cached prefix of a whole transfer (nor
  the other way round); a repeated one is the producer's stored kept stream (tests/test_keep_store.py:
  its keys); requests with and without keep in one batch do not change each other.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from calibration.candidates import codec_kv
from calibration.distill import distill
from consumer.api.client import ConsumerClient
from shared import keep_wire, kv, quantize
from shared.codecs import create_codecs, keep_set
from shared.codecs.kept import KeepRequest
from shared.keep import KeptCache, kept_cache, next_positions
from shared.keep.cache import gather
from shared.models import load_model
from shared.pb import common_pb2, consumer_pb2, producer_pb2
from tests.conftest import running_pair
from tests.hostile import all_back, consumer_of, copy, record, set_data
from tests.test_scd import heldout, random_corpus

CONTEXT = "The producer reads a long context and the consumer writes the answer from its cache. " * 7
QUESTION = " Which model writes the answer?"
NEW = 8
SCHEDULE = "R8.P.F8.W"  # Reuse int8 codes, a Patch, Reuse fp16 codes, raw: every per-token action
CODECS = {"raw": {}, "quant": {"bits": "8", "group_size": "32"}, "scd": {"schedule": SCHEDULE}}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    model = load_model("tiny-llama", "float32", "cpu")
    art = distill(model, model, random_corpus(12, 96, 0), heldout(3, 1), corpus_name="random", generations=1, log=lambda m: None)
    path = tmp_path_factory.mktemp("artifacts")
    art.save(path / "tiny.safetensors")
    ids = model.tokenizer(CONTEXT)["input_ids"]
    question = model.tokenizer(QUESTION, add_special_tokens=False)["input_ids"]
    return {"model": model, "art": art, "path": str(path), "ids": ids, "question": question}


@pytest.fixture(scope="module")
async def pair(world):
    kw = {"artifacts": world["path"]}  # no prefix cache: every whole transfer's bytes are on the wire
    async with running_pair("tiny-llama", producer_kw=kw, consumer_kw={**kw, "prefix_cache_bytes": 0}) as p:
        yield p


def fields(world, codec: str, keep: str = "", **more) -> dict:
    options = dict(CODECS[codec], **({"keep": keep} if keep else {}))
    return dict(
        context=consumer_pb2.Prompt(token_ids=consumer_pb2.TokenIds(ids=world["ids"])),
        question=consumer_pb2.Prompt(token_ids=consumer_pb2.TokenIds(ids=world["question"])),
        max_new_tokens=NEW,
        transfer=common_pb2.CodecSpec(name=codec, options=options),
        **more,
    )


def greedy(model, cache, question: list[int], stop: int | None) -> list[int]:
    """Greedy ids after `question` on a (kept) cache, positions from its logical length."""
    out, ids = [], torch.tensor([question])
    with torch.inference_mode():
        for _ in range(NEW):
            logits = model.model(
                input_ids=ids, cache=cache, position_ids=next_positions(cache, ids.shape[1]), use_cache=True
            ).logits
            token = int(logits[0, -1].argmax())
            out.append(token)
            if token == stop:
                break
            ids = torch.tensor([[token]])
    return out


def offline(world, codec: str, keep: KeepRequest, quant_kept: bool = True, policy=None) -> tuple[list[int], int]:
    """(greedy ids, kept count) of the offline path: the producer's states scored by the selection
    (shared.keep), the mode's cache over the whole context (calibration.candidates.codec_kv), the
    kept tokens gathered (shared.keep.kept_cache); quant: its kept K/V quantized per KV head, as a
    keep transfer's grouped payloads are (quant_kept=False: real.quality's quant@POLICY, the whole
    cache quantized, then the kept tokens)."""
    model = world["model"]
    states, _ = kv.capture_states(model, world["ids"], kv.Capture.KV | kv.Capture.NORMED)
    sets = keep.selection(policy).keep(model, states)
    layers = range(model.info.num_layers)
    if codec == "quant" and quant_kept:
        cache = KeptCache(config=model.model.config)
        for layer, idx in zip(layers, sets):
            k, v = (gather(t, idx) for t in states[layer].kv())
            keys, values = quantize.decode_kv(quantize.encode_kv(k, v, 8, 32), 8, 32, tuple(k.shape))
            kv.put_layer(cache, layer, keys.to(model.dtype), values.to(model.dtype))
        cache.logical_length, cache.dropped = len(world["ids"]), len(world["ids"]) - int(sets[0].shape[1])
    else:
        codecs = create_codecs(model, [codec], [world["art"]])[codec]
        options = codecs.resolve(CODECS[codec])
        whole = (
            codec_kv(codecs, codecs, options, states, len(world["ids"])) if codec != "raw" else [states[i].kv() for i in layers]
        )
        cache = kept_cache(model, whole, sets)
    return greedy(model, cache, world["question"], model.tokenizer.eos_token_id), int(sets[0].shape[1])


@pytest.mark.parametrize("codec", list(CODECS))
async def test_keeping_every_token_answers_as_the_whole_transfer(world, pair, codec):
    whole, _, full = await pair.generate(**fields(world, codec))
    ids, _, stats = await pair.generate(**fields(world, codec, "snapkv:1.0"))
    assert ids == whole and len(ids) > 1
    T, layers, heads = len(world["ids"]), 4, 1 if codec == "scd" else world["model"].info.num_kv_heads
    _, shape = keep_set.wire_shape(T, T, heads)
    assert stats.bytes_received == full.bytes_received + layers * shape[0] * shape[1]  # + the bitmaps


@pytest.mark.parametrize(
    "codec, keep",
    [
        ("raw", "h2o:0.3:window=8"),
        ("raw", "snapkv:40:sinks=2,window=8,heads=shared"),
        ("quant", "knorm:0.3:window=8"),
        ("scd", "snapkv:0.3:window=8"),
        ("scd", "h2o:6:window=4"),  # few kept: the keep sets travel as deltas
    ],
)
async def test_a_kept_subset_answers_as_the_offline_kept_cache_with_fewer_bytes(world, pair, codec, keep):
    resolved = KeepRequest.parse(keep).for_codec(create_codecs(world["model"], [codec], [world["art"]])[codec])
    want, n = offline(world, codec, resolved)
    ids, _, stats = await pair.generate(**fields(world, codec, keep))
    assert ids == want
    if codec == "quant":  # real.quality's quant@POLICY (quantized whole, then kept) answers the same here
        assert ids == offline(world, codec, resolved, quant_kept=False)[0]
    _, _, full = await pair.generate(**fields(world, codec))
    T = len(world["ids"])
    heads = 1 if resolved.shared else world["model"].info.num_kv_heads
    dtype, shape = keep_set.wire_shape(T, n, heads)
    index = 4 * shape[0] * shape[1] * dtype.itemsize
    if codec != "quant":  # one row per token: exactly the kept share of the whole transfer's rows
        assert stats.bytes_received - index == full.bytes_received * n // T
    assert stats.bytes_received < full.bytes_received * (n / T) * 1.1 + index
    assert stats.context_tokens == T


async def test_one_batch_with_and_without_keep_changes_no_answer(world, pair):
    alone = [(await pair.generate(**fields(world, "raw", keep)))[0] for keep in ("", "h2o:0.3:window=8", "")]
    together = await asyncio.gather(*[pair.generate(**fields(world, "raw", keep)) for keep in ("", "h2o:0.3:window=8", "")])
    assert [ids for ids, _, _ in together] == alone and alone[0] != alone[1]


async def test_keep_never_meets_a_stored_chunk_or_a_cached_prefix_of_a_whole_transfer(world):
    kw = {"chunk_tokens": 32}
    async with running_pair("tiny-llama", producer_kw=kw, consumer_kw={**kw, "prefix_cache_bytes": 1 << 24}) as p:
        keep = "h2o:0.3:window=8"
        whole, _, first = await p.generate(**fields(world, "raw"))
        kept, _, stats = await p.generate(**fields(world, "raw", keep))  # the whole context is stored and cached now
        assert stats.prefix_reused_tokens == 0 and not stats.producer_store_hit and stats.bytes_received < first.bytes_received
        again, _, stats2 = await p.generate(**fields(world, "raw", keep))  # the producer's stored kept stream
        assert again == kept and stats2.prefix_reused_tokens == 0 and stats2.producer_store_hit
        assert stats2.bytes_received == stats.bytes_received and stats2.producer_prefill_ms == 0
        whole2, _, full2 = await p.generate(**fields(world, "raw"))  # the kept transfers stored nothing of theirs
        assert whole2 == whole and full2.prefix_reused_tokens > 0
    async with running_pair("tiny-llama", producer_kw=kw, consumer_kw={**kw, "prefix_cache_bytes": 1 << 24}) as p:
        assert (await p.generate(**fields(world, "raw", keep)))[0] == kept  # kept first, on a cold pair
        ids, _, stats = await p.generate(**fields(world, "raw"))
        assert ids == whole and stats.prefix_reused_tokens == 0 and not stats.producer_store_hit
        reply = await p.producer_stub.Describe(producer_pb2.ProducerServiceDescribeRequest())
        assert reply.stats.prefill_tokens_reused == 0


@pytest.mark.parametrize(
    "codec, keep, field",
    [
        ("oracle", "h2o:0.5", "mode 'oracle' cannot take a keep set"),
        ("recompute", "h2o:0.5", "codec 'recompute' takes no keep set"),
        ("scd", "h2o:0.5:heads=each", "keep.heads='each'"),
        ("raw", "h2o:0", "budget"),
        ("raw", "lru:0.5", "is not one of"),
        ("raw", "snapkv-q:0.5", "keep.policy: 'snapkv-q' is not served over the wire"),
        # past the wire's uint32: INTERNAL (protobuf's ValueError filling KeepSpec) after admission
        ("raw", "h2o:4294967296", "not in 1..4294967295"),
        ("raw", "h2o:0.5:sinks=4294967296", "above 4294967295"),
        ("raw", "h2o:0.5:window=99999999999", "above 4294967295"),
    ],
)
async def test_keep_requests_a_codec_cannot_serve_are_invalid_argument(world, pair, codec, keep, field):
    spec = common_pb2.CodecSpec(name=codec, options={"keep": keep})
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await pair.generate(**{**fields(world, "raw"), "transfer": spec})
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.value.details()


@pytest.mark.parametrize("codec", ["raw", "scd"])
async def test_verify_over_a_kept_cache_answers_as_the_oracle(world, pair, codec):
    """Verified decoding drafts on the kept cache and checks on the consumer's own prefill of the
    whole context (never a kept one): greedy, the oracle's tokens, however few tokens were kept.
    The kept cache alone answers otherwise at 10 % (so the check had drafts to correct)."""
    oracle, _, _ = await pair.generate(**{**fields(world, "raw"), "transfer": common_pb2.CodecSpec(name="oracle")})
    kept_only, _, _ = await pair.generate(**fields(world, codec, "h2o:0.1"))
    verified, _, stats = await pair.generate(**fields(world, codec, "h2o:0.1", verify=consumer_pb2.VERIFY_POLICY_VERIFIED))
    assert verified == oracle
    assert kept_only != oracle, "the kept cache alone already gave the oracle's answer: nothing was verified"
    assert stats.transfer.options["keep"].startswith("h2o:0.1")
    await all_back(pair.consumer)


async def test_keep_with_a_policy_the_kept_cache_does_not_serve_yet_is_invalid_argument(world, pair):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await pair.generate(**fields(world, "raw", "h2o:0.5", audit=consumer_pb2.AUDIT_POLICY_REPORT))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("audit:")
    request = producer_pb2.PrefillRequest(
        token_ids=world["ids"],
        codec=common_pb2.CodecSpec(name="scd"),
        keep=common_pb2.KeepSpec(policy="h2o", fraction=0.5, heads="each"),
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in pair.producer_stub.Prefill(request, timeout=30):
            pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "keep.heads='each'" in err.value.details()
    for policy in ("snapkv-q",):  # offline only: the producer refuses it by name too
        request = producer_pb2.PrefillRequest(
            token_ids=world["ids"], codec=common_pb2.CodecSpec(name="raw"), keep=common_pb2.KeepSpec(policy=policy, fraction=0.5)
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in pair.producer_stub.Prefill(request, timeout=30):
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"keep.policy: {policy!r} is not served over the wire" in err.value.details()
    described = await pair.producer_stub.Describe(producer_pb2.ProducerServiceDescribeRequest())
    assert {c.name: c.keep_heads for c in described.codecs} == {
        "quant": "either",
        "raw": "either",
        "recompute": "",
        "scd": "shared",
    }
    for changes, words in (
        ({"first_token": 32}, "first_token must be 0"),
        ({"codec": common_pb2.CodecSpec(name="recompute")}, "codec 'recompute' takes no keep set"),
    ):
        bad = producer_pb2.PrefillRequest(token_ids=world["ids"], keep=common_pb2.KeepSpec(policy="h2o", count=16), **changes)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in pair.producer_stub.Prefill(bad, timeout=30):
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.value.details()


# --- a hostile producer's keep sets ------------------------------------------------------------
def keep_chunk(messages, layer: int) -> int:
    return next(
        i
        for i, m in enumerate(messages)
        if m.WhichOneof("kind") == "chunk" and m.chunk.layer == layer and m.chunk.kind == keep_set.KEEP_PAYLOAD
    )


def bitmap(messages, layer: int, mutate) -> list:
    out = [copy(m) for m in messages]
    i = keep_chunk(out, layer)
    bits = bytearray(out[i].chunk.data)
    mutate(bits)
    set_data(out[i], bytes(bits))
    return out


def deltas(messages, layer: int, mutate) -> list:
    out = [copy(m) for m in messages]
    i = keep_chunk(out, layer)
    values = torch.frombuffer(bytearray(out[i].chunk.data), dtype=torch.int32).clone()
    mutate(values)
    set_data(out[i], values.numpy().tobytes())
    return out


def keep_after_v(messages, layer: int) -> list:
    """The layer's keep set moved after its v payload (the contract: keep comes first)."""
    out = [copy(m) for m in messages]
    m = out.pop(keep_chunk(out, layer))
    v = max(i for i, x in enumerate(out) if x.WhichOneof("kind") == "chunk" and x.chunk.layer == layer and x.chunk.kind == "v")
    out.insert(v + 1, m)
    return out


def header_with(messages, **changes) -> list:
    out = [copy(m) for m in messages]
    for name, value in changes.items():
        if value is None:
            out[0].header.ClearField(name)
        elif name == "keep":
            out[0].header.keep.CopyFrom(value)
        else:
            setattr(out[0].header, name, value)
    return out


def _past_the_end(bits: bytearray) -> None:
    bits[-1] |= 0x80  # bit 8 * ceil(T / 8) - 1 >= T (T is not a multiple of 8 here)


def _one_more(bits: bytearray) -> None:
    for b in range(len(bits) * 8):
        if not bits[b // 8] >> (b % 8) & 1 and b < 100:
            bits[b // 8] |= 1 << (b % 8)
            return


HOSTILE = {  # name -> (keep asked, what the producer recorded with, mutate, the error's words)
    "bit_past_the_context": (
        "h2o:0.3:window=8",
        None,
        lambda r: bitmap(r, 2, _past_the_end),
        "layer 2, payload 'keep': a kept position >= num_tokens",
    ),
    "one_extra_position": ("h2o:0.3:window=8", None, lambda r: bitmap(r, 1, _one_more), "layer 1, payload 'keep': row 0 keeps"),
    "delta_zero": (
        "h2o:6:window=2",
        None,
        lambda r: deltas(r, 0, lambda v: v.__setitem__(3, 0)),
        "layer 0, payload 'keep': row 0 is not strictly ascending",
    ),
    "delta_past_the_end": (
        "h2o:6:window=2",
        None,
        lambda r: deltas(r, 3, lambda v: v.__setitem__(5, 10_000)),
        "layer 3, payload 'keep': row 0 reaches position",
    ),
    "keep_after_the_layers_k_and_v": (
        "h2o:0.3:window=8",
        None,
        lambda r: keep_after_v(r, 1),
        "layer 1, payload 'k': arrived before the layer's 'keep' payload",
    ),
    "kept_count_not_the_request's": ("h2o:0.3:window=8", None, lambda r: header_with(r, kept_tokens=49), "header.kept_tokens=49"),
    "keep_not_echoed": ("h2o:0.3:window=8", None, lambda r: header_with(r, keep=None, kept_tokens=0), "header.keep=unset"),
    "keep_not_asked": ("", "h2o:0.3:window=8", lambda r: r, "header.keep=h2o:0.3"),
    "another_policy": ("h2o:0.3:window=8", "knorm:0.3:window=8", lambda r: r, "header.keep=knorm:0.3"),
    "shared_instead_of_each": (
        "h2o:0.3:window=8",
        "h2o:0.3:window=8,heads=shared",
        lambda r: r,
        "heads=shared, the request asked for",
    ),
}


@pytest.fixture(scope="module")
async def hostile(world):
    holder: dict = {}
    async with running_pair("tiny-llama") as real, consumer_of(lambda request: holder["script"](request)) as (consumer, _):
        client = ConsumerClient(consumer.address)
        yield holder, client, consumer, real.producer.address
        await client.channel.close()


@pytest.mark.parametrize("name", list(HOSTILE))
async def test_a_hostile_keep_set_fails_at_its_message_and_every_block_comes_back(world, hostile, name):
    holder, client, consumer, producer = hostile
    asked, sent, mutate, words = HOSTILE[name]
    spec = keep_wire.to_pb(KeepRequest.parse(sent or asked).for_codec(create_codecs(world["model"], ["raw"])["raw"]))
    recorded = await record(producer, world["ids"], "raw", keep=spec)
    holder["script"] = lambda request: mutate(recorded)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.generate(timeout=60, **fields(world, "raw", asked))
    assert err.value.code() == grpc.StatusCode.DATA_LOSS, err.value.details()
    assert words in err.value.details()
    await all_back(consumer)
    if sent is None:  # the same stream untouched answers
        holder["script"] = lambda request: recorded
        assert (await client.generate(timeout=60, **fields(world, "raw", asked))).ids


async def test_the_http_api_passes_keep_through_or_names_it(world):
    from consumer.api import openai_schema as schema
    from tests.http_api import post

    async with running_pair("tiny-llama", consumer_kw={"http_port": 0, "chunk_tokens": 32, "prefix_cache_bytes": 0}) as p:
        body = {"model": "tiny-llama", "prompt": world["ids"], "max_tokens": NEW, "temperature": 0, "return_token_ids": True}
        context, question = schema.split_prompt(world["ids"], p.consumer.config, "prompt")
        keep = "h2o:0.3:window=8"
        status, reply = await post(p, "/v1/completions", {**body, "scd": {"mode": "raw", "options": {"keep": keep}}})
        assert status == 200, reply
        ids, _, stats = await p.generate(
            context=consumer_pb2.Prompt(token_ids=consumer_pb2.TokenIds(ids=context)),
            question=consumer_pb2.Prompt(token_ids=consumer_pb2.TokenIds(ids=question)),
            max_new_tokens=NEW,
            transfer=common_pb2.CodecSpec(name="raw", options={"keep": keep}),
        )
        assert reply["choices"][0]["token_ids"] == ids and reply["scd"]["bytes_received"] == stats.bytes_received
        assert stats.transfer.options["keep"] == "h2o:0.3:sinks=4,window=8,heads=each"
        assert stats.bytes_received < 0.4 * stats.raw_kv_bytes
        status, reply = await post(p, "/v1/completions", {**body, "scd": {"mode": "raw", "options": {"keep": "h2o:2.5"}}})
        assert status == 400 and "keep" in reply["error"]["message"], reply


async def test_a_kept_sequence_answers_the_same_from_the_engine_process(world):
    """--engine-process: the child's copy of the sequence carries `dropped` (the logical length)."""
    keep = "h2o:0.3:window=8"
    resolved = KeepRequest.parse(keep).for_codec(create_codecs(world["model"], ["raw"])["raw"])
    want, _ = offline(world, "raw", resolved)
    async with running_pair("tiny-llama", consumer_kw={"engine_process": True, "prefix_cache_bytes": 0}) as p:
        ids, _, _ = await p.generate(**fields(world, "raw", keep))
        assert ids == want


@pytest.mark.parametrize("policy", ["streaming", "knorm", "h2o", "snapkv"])
async def test_a_context_no_longer_than_the_observation_window_is_served_by_every_policy(world, pair, policy):
    """Contexts of 1, 40 and 64 tokens (SnapKV's observation window is then the whole context, every
    token in it alike): each policy answers as the offline kept cache, never an error; everything
    kept is the whole transfer's answer."""
    raw = create_codecs(world["model"], ["raw"])["raw"]
    for n in (1, 40, 64):
        short = {**world, "ids": world["ids"][:n]}
        for keep in (f"{policy}:0.25", f"{policy}:1.0"):
            want, kept = offline(short, "raw", KeepRequest.parse(keep).for_codec(raw))
            ids, _, stats = await pair.generate(**fields(short, "raw", keep))
            assert ids == want and stats.context_tokens == n, (keep, n)
            if kept == n:
                assert ids == (await pair.generate(**fields(short, "raw")))[0]
