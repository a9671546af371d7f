"""Property tests (hypothesis):
- the stream reader, fed a real recorded stream with random structural damage (messages dropped,
  repeated, swapped, truncated, fields rewritten, bytes flipped), either refuses it with
  DATA_LOSS / FAILED_PRECONDITION or hands over payloads byte-identical to the original ones:
  never a different tensor with no error; the same as protobuf messages and as their serialized
  bytes (the serving path's own parser, shared.wire_bytes), and for raw bytes damaged anywhere in
  a message (one chunk per message, a layer's chunks in one `layer_chunks` message, or stream
  messages joined in one `batch`); and joining any runs of a damaged stream's messages into
  batches changes nothing: the same error, or the same payloads;
- the consumer, sent random GenerateRequests (and undecodable bytes), answers OK or a documented
  client-side status, never INTERNAL/UNKNOWN, and keeps serving.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumer.link.stream_reader import Expectation, LayerPayloads, StreamReader
from producer.server import ProducerServer
from shared import wire_bytes
from shared.codecs import create_codecs
from shared.config import ProducerConfig
from shared.errors import ServiceError
from shared.grpc_server import GRPC_OPTIONS
from shared.models import load_model
from shared.pb import common_pb2, consumer_pb2, producer_pb2
from tests.conftest import running_pair
from tests.hostile import batch, copy, record

CONTEXT = "Semantic cache distillation sends compact codes instead of the raw key value cache. " * 3


@pytest.fixture(scope="module")
def recorded():
    """A real producer's raw and quant streams (1 KiB chunks) for one context, recorded once."""

    async def go():
        producer = ProducerServer(ProducerConfig(port=0, model="tiny-llama", device="cpu", max_chunk_bytes=1024, drain_grace_s=0))
        await producer.start()
        await producer.load()
        ids = producer.servicer.loaded.tokenizer(CONTEXT)["input_ids"]
        try:
            return ids, {"raw": await record(producer.address, ids, "raw"),
                         "quant": await record(producer.address, ids, "quant", {"bits": "4", "group_size": "32"}),
                         "raw_batched": await record_bytes(producer.address, ids)}
        finally:
            await producer.stop(0)

    return asyncio.run(go())


async def record_bytes(address: str, ids: list[int]) -> list[bytes]:
    """A raw stream as the serving consumer receives it: serialized, layer_chunks accepted."""
    async with grpc.aio.insecure_channel(address, options=GRPC_OPTIONS) as channel:
        prefill = channel.unary_stream("/scd.v1.ProducerService/Prefill",
                                       request_serializer=producer_pb2.PrefillRequest.SerializeToString)
        request = producer_pb2.PrefillRequest(token_ids=ids, codec=common_pb2.CodecSpec(name="raw"), accept_layer_chunks=True)
        return [m async for m in prefill(request, timeout=60)]


MODEL = load_model("tiny-llama", "float32", "cpu")
CODECS = create_codecs(MODEL)
OPTIONS = {"raw": {}, "quant": {"bits": "4", "group_size": "32"}}


def read(ids, codec: str, messages, as_bytes: bool = False) -> dict[int, dict[str, torch.Tensor]]:
    reader = StreamReader(Expectation(len(ids), CODECS[codec], OPTIONS[codec], MODEL.info))
    out = {}
    for m in messages:
        m = m.SerializeToString() if as_bytes and not isinstance(m, bytes) else m
        for event in reader.feed(m):
            if isinstance(event, LayerPayloads):
                out[event.layer] = event.payloads
    reader.end()
    return out


FIELDS = ["layer", "chunk_index", "chunk_count", "dtype", "payload_bytes", "kind", "shape0", "crc32c"]
damage = st.lists(
    st.one_of(
        st.tuples(st.just("drop"), st.integers(0, 10_000)),
        st.tuples(st.just("repeat"), st.integers(0, 10_000)),
        st.tuples(st.just("swap"), st.integers(0, 10_000), st.integers(0, 10_000)),
        st.tuples(st.just("truncate"), st.integers(0, 10_000)),
        st.tuples(st.just("field"), st.integers(0, 10_000), st.sampled_from(FIELDS), st.integers(0, (1 << 32) - 1)),
        st.tuples(st.just("flip"), st.integers(0, 10_000), st.integers(0, 10_000)),
    ),
    min_size=1,
    max_size=3,
)


def apply(messages, ops):
    out = [copy(m) for m in messages]
    for op in ops:
        i = op[1] % len(out) if out else 0
        if not out:
            break
        if op[0] == "drop":
            del out[i]
        elif op[0] == "repeat":
            out.insert(i, copy(out[i]))
        elif op[0] == "swap":
            j = op[2] % len(out)
            out[i], out[j] = out[j], out[i]
        elif op[0] == "truncate":
            out = out[:i]
        elif op[0] == "field" and out[i].WhichOneof("kind") == "chunk":
            c, name, value = out[i].chunk, op[2], op[3]
            if name == "kind":
                c.kind = ["k", "v", "x", "k_codes", "", "v_min"][value % 6]
            elif name == "shape0":
                c.shape[0] = value
            elif name == "dtype":
                c.dtype = value % 8
            else:
                setattr(c, name, value if name in ("chunk_count", "crc32c") else value % 64 if name != "payload_bytes" else value)
        elif op[0] == "flip" and out[i].WhichOneof("kind") == "chunk" and out[i].chunk.data:
            data = bytearray(out[i].chunk.data)
            data[op[2] % len(data)] ^= 0x5A  # CRC left as it was: must be caught
            out[i].chunk.data = bytes(data)
    return out


@pytest.mark.parametrize("as_bytes", [False, True], ids=["messages", "bytes"])
@pytest.mark.parametrize("codec", ["raw", "quant"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=damage)
def test_a_damaged_stream_is_refused_or_identical(recorded, codec, as_bytes, ops):
    ids, streams = recorded
    original = read(ids, codec, streams[codec])
    try:
        got = read(ids, codec, apply(streams[codec], ops), as_bytes)
    except ServiceError as exc:
        assert exc.code in ("DATA_LOSS", "FAILED_PRECONDITION"), exc
        return
    same(got, original, ops)


def same(got, original, ops) -> None:
    assert sorted(got) == sorted(original)
    for layer, payloads in original.items():
        assert sorted(got[layer]) == sorted(payloads)
        for name, tensor in payloads.items():
            assert got[layer][name].dtype == tensor.dtype and torch.equal(got[layer][name], tensor), (layer, name, ops)


byte_damage = st.lists(
    st.one_of(
        st.tuples(st.just("flip"), st.integers(0, 10_000), st.integers(0, 1 << 24), st.integers(1, 255)),
        st.tuples(st.just("cut"), st.integers(0, 10_000), st.integers(0, 1 << 24)),
        st.tuples(st.just("insert"), st.integers(0, 10_000), st.integers(0, 1 << 24), st.binary(min_size=1, max_size=12)),
    ),
    min_size=1,
    max_size=3,
)


@pytest.mark.parametrize("stream", ["raw", "raw_batched", "raw_batches"])
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=byte_damage)
def test_damaged_bytes_are_refused_or_identical(recorded, stream, ops):
    """Any byte of a serialized message damaged (flipped, cut off, inserted): the serving path's
    parser and the reader refuse it with DATA_LOSS / FAILED_PRECONDITION, never another error,
    or (damage protobuf skips: an unknown field) hand over the original payloads."""
    ids, streams = recorded
    if stream == "raw_batches":  # what a replay from the store sends: everything after the header in one batch
        messages = [streams["raw_batched"][0], wire_bytes.batch_message(streams["raw_batched"][1:])]
    else:
        messages = [m if isinstance(m, bytes) else m.SerializeToString() for m in streams[stream]]
    if stream == "raw_batched":
        assert {producer_pb2.PrefillResponse.FromString(m).WhichOneof("kind") for m in messages[1:-1]} == {"layer_chunks"}
    original = read(ids, "raw", messages)
    for op in ops:
        i = op[1] % len(messages)
        m = bytearray(messages[i])
        at = op[2] % (len(m) + 1)
        if op[0] == "flip" and m:
            m[at % len(m)] ^= op[3]
        elif op[0] == "cut":
            del m[at:]
        elif op[0] == "insert":
            m[at:at] = op[3]
        messages[i] = bytes(m)
    try:
        got = read(ids, "raw", messages)
    except ServiceError as exc:
        assert exc.code in ("DATA_LOSS", "FAILED_PRECONDITION"), exc
        return
    same(got, original, ops)


def joined(messages, cuts: list[int], as_bytes: bool) -> list:
    """messages with the runs between the cut points (indices, any order) each in one batch."""
    edges = sorted({0, len(messages), *(c % (len(messages) + 1) for c in cuts)})
    out = []
    for a, b in zip(edges, edges[1:]):
        if b - a == 1 and a % 2:  # some runs of one stay plain messages
            out.append(messages[a])
        elif as_bytes:
            out.append(wire_bytes.batch_message([m.SerializeToString() for m in messages[a:b]]))
        else:
            out.append(batch(*messages[a:b]))
    return out


def outcome(ids, codec: str, messages) -> object:
    try:
        return read(ids, codec, messages)
    except ServiceError as exc:
        assert exc.code in ("DATA_LOSS", "FAILED_PRECONDITION"), exc
        return f"{exc.code}: {exc}"


@pytest.mark.parametrize("as_bytes", [False, True], ids=["messages", "bytes"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=damage, cuts=st.lists(st.integers(0, 10_000), max_size=6))
def test_batching_a_damaged_stream_changes_nothing(recorded, as_bytes, ops, cuts):
    """The same damaged stream, plain or with runs of its messages joined into batches: the same
    error at the same message, or the same payloads (a batch's entries are read as if alone)."""
    ids, streams = recorded
    damaged = apply(streams["raw"], ops)
    plain = outcome(ids, "raw", damaged)
    got = outcome(ids, "raw", joined(damaged, cuts, as_bytes))
    if isinstance(plain, str) or isinstance(got, str):
        assert got == plain, ops
    else:
        same(got, plain, ops)


OK_OR_CLIENT_ERROR = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                      grpc.StatusCode.DEADLINE_EXCEEDED}
prompts = st.one_of(
    st.builds(lambda t: consumer_pb2.Prompt(text=t), st.text(max_size=80)),
    st.builds(lambda ids: consumer_pb2.Prompt(token_ids=consumer_pb2.TokenIds(ids=ids)),
              st.lists(st.integers(0, 1 << 20), max_size=40)),
    st.just(consumer_pb2.Prompt()),
)
requests = st.builds(
    consumer_pb2.GenerateRequest,
    request_id=st.one_of(st.just(""), st.text(max_size=200)),
    context=prompts,
    question=prompts,
    max_new_tokens=st.integers(0, 1000),
    sampling=st.builds(consumer_pb2.SamplingParams, temperature=st.one_of(st.floats(-1, 20, width=32), st.just(float("nan"))),
                       top_p=st.one_of(st.floats(-1, 2, width=32), st.just(float("nan"))), seed=st.integers(0, (1 << 64) - 1)),
    transfer=st.builds(common_pb2.CodecSpec, name=st.sampled_from(["", "raw", "oracle", "quant", "recompute", "scd", "nope"]),
                       options=st.dictionaries(st.sampled_from(["bits", "group_size", "start", "end", "schedule", "x"]),
                                               st.text(max_size=8), max_size=3)),
    stop_token_ids=st.lists(st.integers(0, 1 << 20), max_size=4),
    fallback_to_oracle=st.booleans(),
    on_transfer_failure=st.integers(0, 5),
)


@pytest.fixture(scope="module")
async def pair():
    async with running_pair("tiny-llama") as p:
        yield p


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request=requests)
async def test_random_requests_get_ok_or_a_client_error_never_internal(pair, request):
    code = grpc.StatusCode.OK
    try:
        async for _ in pair.stub.Generate(request, timeout=30):
            pass
    except grpc.aio.AioRpcError as err:
        code = err.code()
        assert "internal error" not in err.details()
    assert code in OK_OR_CLIENT_ERROR, (code, request)


async def test_undecodable_request_bytes_are_refused_and_the_service_keeps_serving(pair):
    async with grpc.aio.insecure_channel(pair.consumer.address) as channel:
        call = channel.unary_stream("/scd.v1.ConsumerService/Generate", request_serializer=lambda b: b,
                                    response_deserializer=lambda b: b)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in call(b"\xff\xff\xff\xff\x0f", timeout=5):
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "do not parse as scd.v1.GenerateRequest" in err.value.details()
    ids, _, stats = await pair.generate(context=consumer_pb2.Prompt(text=CONTEXT), question=consumer_pb2.Prompt(text=" q"),
                                        max_new_tokens=2)
    assert stats.generated_tokens == len(ids)


_ = producer_pb2
