"""A hostile producer against a real consumer: every way a stream can break the contract is
refused at the first bad message with DATA_LOSS or FAILED_PRECONDITION naming what broke, no
token is ever sent, memory stays bounded, and the consumer keeps serving afterwards.

Streams are recorded from a real producer (raw, quant, scd over the same context) and mutated
self-consistently (CRCs recomputed), so each case breaks exactly one rule.
"""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
import torch

from calibration.distill import distill
from consumer.api.client import ConsumerClient
from producer.server import ProducerServer
from shared.config import ProducerConfig
from shared.models import load_model
from shared.pb import common_pb2, consumer_pb2, producer_pb2
from tests.conftest import prompt
from tests.hostile import all_back, chunks, consumer_of, copy, poke, record, rss_bytes, set_data
from tests.test_scd import heldout, random_corpus

CONTEXT = "The producer reads a long context and the consumer writes the answer. " * 8
QUESTION = " Which layers are patched?"
CASES: dict[str, tuple] = {}  # name -> (codec, options, mutate(rec, request) -> messages, status, text)


def tokens(messages) -> list[int]:
    """The token ids a Generate stream carried (a message may hold several: TokenDelta.ids)."""
    return [t for m in messages if m.WhichOneof("kind") == "token" for t in m.token.ids]

def case(name: str, codec: str, status: grpc.StatusCode, text: str, options: dict | None = None):
    def register(mutate):
        CASES[name] = (codec, options or {}, mutate, status, text)
        return mutate

    return register


DL, FP = grpc.StatusCode.DATA_LOSS, grpc.StatusCode.FAILED_PRECONDITION
P8 = "P8.P8.P8.P8"  # every layer an int8 Patch


@pytest.fixture(scope="module")
async def world(tmp_path_factory):
    """A real producer (chunks of 1 KiB, a homogeneous SCD artifact), the context's ids, the
    recorded streams of the producer for it (and for its first half), and the right answer."""
    model = load_model("tiny-llama", "float32", "cpu")
    art = distill(model, model, random_corpus(12, 96, 0), heldout(3, 1), corpus_name="random", generations=1, log=lambda m: None)
    path = tmp_path_factory.mktemp("artifacts")
    art.save(path / "tiny.safetensors")
    producer = ProducerServer(ProducerConfig(port=0, model="tiny-llama", device="cpu", max_chunk_bytes=1024, artifacts=str(path),
                                             drain_grace_s=0))
    await producer.start()
    await producer.load()
    ids = model.tokenizer(CONTEXT)["input_ids"]
    digest = model.info.weight_digest
    rec = {
        "raw": await record(producer.address, ids, "raw"),
        "quant": await record(producer.address, ids, "quant", {"bits": "8", "group_size": "32"}),
        "quant4": await record(producer.address, ids, "quant", {"bits": "4", "group_size": "32"}),
        "scd": await record(producer.address, ids, "scd", {}, digest),
        "raw_half": await record(producer.address, ids[: len(ids) // 2], "raw"),
        "cheap_scd": await record(producer.address, ids, "scd", {"schedule": art.schedules[0].name}, digest),
        "p8_scd": await record(producer.address, ids, "scd", {"schedule": P8}, digest),
        "recompute": await record(producer.address, ids, "recompute", {"start": "1", "end": "2"}),
    }
    yield {"rec": rec, "ids": ids, "path": path, "art": art, "producer": producer}
    await producer.stop(0)


@pytest.fixture(scope="module")
async def hostile(world):
    """One real consumer in front of a hostile producer whose script each case sets."""
    holder: dict = {}
    async with consumer_of(lambda request: holder["script"](request), artifacts=str(world["path"])) as (consumer, fake):
        client = ConsumerClient(consumer.address)
        yield holder, client, fake, consumer
        await client.channel.close()


def header(messages):
    return messages[0].header


# --- the header against the request ------------------------------------------------------
@case("half_the_tokens", "raw", DL, "header.num_tokens=")
def _(rec, request):
    return rec["raw_half"]  # a self-consistent stream for the first half of the context


@case("another_codec", "raw", DL, "header.codec.name='quant'")
def _(rec, request):
    return rec["quant"]


@case("fewer_quant_bits", "quant", DL, "header.codec.options=", {"bits": "8"})
def _(rec, request):
    return rec["quant4"]


@case("cheaper_scd_schedule", "scd", DL, "scd stream header: schedule")
def _(rec, request):
    out = [copy(m) for m in rec["cheap_scd"]]
    out[0].header.codec.options["schedule"] = ""  # claims the request's options, sends a cheaper schedule
    return out


@case("another_producer_digest", "scd", FP, "producer weight digest")
def _(rec, request):
    out = [copy(m) for m in rec["scd"]]
    out[0].header.producer.weight_digest = "0" * 64
    return out


@case("artifact_of_another_pair", "scd", FP, "is not loaded here")
def _(rec, request):
    out = [copy(m) for m in rec["scd"]]
    out[0].header.codec_metadata["artifact"] = "feedfacefeedface"
    return out


@case("huge_num_tokens", "raw", DL, "header.num_tokens=33554432")
def _(rec, request):
    out = [copy(m) for m in rec["raw"]]
    out[0].header.num_tokens = 1 << 25
    return out


@case("format_version", "raw", FP, "header.codec_format_version=7")
def _(rec, request):
    out = [copy(m) for m in rec["raw"]]
    out[0].header.codec_format_version = 7
    return out


@case("kv_dtype_not_whitelisted", "raw", DL, "header.kv_dtype='int64'")
def _(rec, request):
    out = [copy(m) for m in rec["raw"]]
    out[0].header.kv_dtype = "int64"
    return out


@case("chunk_size_above_the_ceiling", "raw", DL, "header.max_chunk_bytes=8388608")
def _(rec, request):
    out = [copy(m) for m in rec["raw"]]
    out[0].header.max_chunk_bytes = 8 << 20
    return out


@case("two_headers", "raw", DL, "second header")
def _(rec, request):
    return [rec["raw"][0], *rec["raw"]]


@case("chunk_before_header", "raw", DL, "before the header")
def _(rec, request):
    return [rec["raw"][1], *rec["raw"]]


# --- values ------------------------------------------------------------------------------
@case("nan_in_raw_k", "raw", DL, "non-finite")
def _(rec, request):
    out = [copy(m) for m in rec["raw"]]
    poke(out[chunks(out, "k", layer=2)[1]], torch.float32, 3, float("nan"))
    return out


@case("inf_in_quant_scale", "quant", DL, "payload 'k_scale' holds non-finite values")
def _(rec, request):
    out = [copy(m) for m in rec["quant"]]
    poke(out[chunks(out, "k_scale", layer=1)[0]], torch.float16, 0, float("inf"))
    return out


@case("nan_in_scd_scale", "scd", DL, "non-finite")
def _(rec, request):
    out = [copy(m) for m in rec["scd"]]
    target = chunks(out, "z_scale") or chunks(out, "z") or chunks(out, "x")
    poke(out[target[0]], torch.float16, 0, float("nan"))
    return out


@case("negative_quant_scale", "quant", DL, "layer 1: payload 'k_scale' holds negative scales", {"bits": "8"})
def _(rec, request):  # decoded values below each group's min: bounded, but no encoder makes them
    out = [copy(m) for m in rec["quant"]]
    poke(out[chunks(out, "k_scale", layer=1)[0]], torch.float16, 0, -0.5)
    return out


@case("negative_int8_row_scale", "scd", DL, "holds negative scales", {"schedule": P8})
def _(rec, request):
    out = [copy(m) for m in rec["p8_scd"]]
    poke(out[chunks(out, "x_scale", layer=1)[0]], torch.float16, 0, -0.01)
    return out


@case("int8_code_of_minus_128", "scd", DL, "layer 1: payload 'x' holds int8 codes of -128", {"schedule": P8})
def _(rec, request):
    out = [copy(m) for m in rec["p8_scd"]]
    poke(out[chunks(out, "x", layer=1)[0]], torch.int8, 3, -128)
    return out


@case("layer_chunks_of_two_layers", "raw", DL, "layer_chunks: chunks of layers [0, 1] in one message")
def _(rec, request):
    out = [copy(m) for m in rec["raw"]]
    first, second = chunks(out, layer=0), chunks(out, layer=1)
    both = producer_pb2.PrefillResponse(layer_chunks=producer_pb2.LayerChunks(chunks=[out[i].chunk for i in first + second]))
    rest = [m for i, m in enumerate(out) if i not in first + second]
    return [rest[0], both, *rest[1:]]


# --- payload schema and chunking ---------------------------------------------------------
@case("dtype_label_lies", "raw", DL, "dtype 2, the codec sends torch.float32")
def _(rec, request):
    out = [copy(m) for m in rec["raw"]]
    out[chunks(out, "k", layer=0)[0]].chunk.dtype = common_pb2.ELEMENT_TYPE_FLOAT16
    return out


@case("unknown_payload_kind", "raw", DL, "not one of the layer's payloads")
def _(rec, request):
    out = [copy(m) for m in rec["raw"]]
    out[chunks(out, "k", layer=0)[0]].chunk.kind = "junk"
    return out


@case("layer_out_of_range", "raw", DL, "layer index out of range (num_layers=4)")
def _(rec, request):
    out = [copy(m) for m in rec["raw"]]
    out[chunks(out, "k", layer=0)[0]].chunk.layer = 4
    return out


@case("chunk_count_2_32", "raw", DL, "chunk_count=4294967295")
def _(rec, request):
    out = [copy(m) for m in rec["raw"]]
    out[chunks(out, "v", layer=0)[0]].chunk.chunk_count = (1 << 32) - 1
    return out


@case("rows_inconsistent_with_header", "scd", DL, "the codec sends")
def _(rec, request):
    out = [copy(m) for m in rec["scd"]]
    first = out[chunks(out)[0]].chunk
    first.shape[0] = first.shape[0] * 100
    return out


@case("oversized_chunk", "raw", DL, "data bytes, the contract says 1024")
def _(rec, request):
    out = [copy(m) for m in rec["raw"]]
    set_data(out[chunks(out, "k", layer=0)[0]], bytes(6 << 20))
    return out


@case("crc_mismatch", "raw", DL, "CRC32C mismatch")
def _(rec, request):
    out = [copy(m) for m in rec["raw"]]
    data = bytearray(out[chunks(out)[4]].chunk.data)
    data[7] ^= 1
    out[chunks(out)[4]].chunk.data = bytes(data)
    return out


@case("chunk_gap", "raw", DL, "expected chunk 1")
def _(rec, request):
    out = [copy(m) for m in rec["raw"]]
    del out[chunks(out, "k", layer=0)[1]]
    return out


@case("missing_layer", "raw", DL, "layer 1: payload(s) ['k', 'v'] missing")
def _(rec, request):
    return [m for i, m in enumerate(rec["raw"]) if i not in chunks(rec["raw"], layer=1)]


@case("layers_out_of_order", "raw", DL, "layer 1: payload(s) ['k', 'v'] missing (stream went on to layer 2)")
def _(rec, request):
    out = list(rec["raw"])
    by_layer = [[out[i] for i in chunks(out, layer=layer)] for layer in range(4)]
    return [out[0], *by_layer[0], *by_layer[2], *by_layer[1], *by_layer[3], out[-1]]


@case("layer_sent_again", "raw", DL, "layers must arrive in increasing order")
def _(rec, request):
    out = list(rec["raw"])
    layer0 = [out[i] for i in chunks(out, layer=0)]
    return [*out[:-1], *layer0, out[-1]]


@case("duplicate_payload", "raw", DL, "payload sent twice")
def _(rec, request):
    out = list(rec["raw"])
    v0 = chunks(out, "v", layer=0)
    return out[: v0[-1] + 1] + [out[i] for i in v0] + out[v0[-1] + 1 :]


# --- the end of the stream ---------------------------------------------------------------
@case("no_trailer", "raw", DL, "ended without a trailer")
def _(rec, request):
    return rec["raw"][:-1]


@case("trailer_totals_lie", "raw", DL, "trailer.payload_bytes=")
def _(rec, request):
    out = [copy(m) for m in rec["raw"]]
    out[-1].trailer.payload_bytes += 1
    return out


@case("chunk_after_trailer", "raw", DL, "after the trailer")
def _(rec, request):
    return [*rec["raw"], rec["raw"][1]]


@case("trailer_reused_and_computed_both_every_token", "raw", DL, "trailer.reused_tokens=")
def _(rec, request):
    out = [copy(m) for m in rec["raw"]]
    out[-1].trailer.reused_tokens = out[-1].trailer.computed_tokens = out[0].header.num_tokens
    return out


@case("trailer_absurd_duration", "raw", DL, "trailer.prefill_ms: 1.7e+308 is not a number of milliseconds")
def _(rec, request):
    out = [copy(m) for m in rec["raw"]]
    out[-1].trailer.prefill_ms = 1.7e308  # finite: it would feed the auto planner
    return out


# --- header sizes ------------------------------------------------------------------------
@case("producer_identity_of_megabytes", "raw", DL, "header.producer.identity: 2000000 characters")
def _(rec, request):
    out = [copy(m) for m in rec["raw"]]
    out[0].header.producer.identity = "i" * 2_000_000  # kept per request: unbounded, it grew the consumer
    return out


@case("message_past_the_receive_limit", "raw", DL, "past this consumer's receive limit of 8388608 bytes")
def _(rec, request):
    out = [copy(m) for m in rec["raw"]]
    out[0].header.producer.architecture = "a" * (9 << 20)  # a broken producer, not an overloaded one
    return out


# --- recompute's hidden state --------------------------------------------------------------
@case("recompute_hidden_of_1e30", "recompute", DL, "layer 1: payload 'hidden' values reach |1e+30|",
      {"start": "1", "end": "2"})
def _(rec, request):
    out = [copy(m) for m in rec["recompute"]]
    poke(out[chunks(out, "hidden", layer=1)[0]], torch.float32, 7, 1e30)  # its square overflows the RMSNorm: zero K/V
    return out


# --- producer statuses -------------------------------------------------------------------
@case("producer_details_hold_addresses", "raw", FP, "producer refused the request (INVALID_ARGUMENT): refused by <address>")
def _(rec, request):
    where = "10.1.2.3 via http://internal.corp/x, unix:///var/run/p.sock, unix:p.sock, [fe80::1] and producer-0:50051"
    return [(grpc.StatusCode.INVALID_ARGUMENT, f"refused by {where}")]


@case("producer_refused_the_requests_size", "raw", FP, "producer refused a request of 9000000 bytes: its receive limit is 4194304")
def _(rec, request):
    return [(grpc.StatusCode.RESOURCE_EXHAUSTED, "Received message larger than max (9000000 vs. 4194304)")]


@case("producer_overloaded", "raw", grpc.StatusCode.UNAVAILABLE, "producer overloaded (RESOURCE_EXHAUSTED)")
def _(rec, request):
    return [grpc.StatusCode.RESOURCE_EXHAUSTED]


@case("producer_cancelled_the_call", "raw", grpc.StatusCode.UNAVAILABLE, "producer cancelled the transfer (CANCELLED)")
def _(rec, request):
    return [rec["raw"][0], rec["raw"][1], grpc.StatusCode.CANCELLED]


@case("producer_gone_mid_stream", "raw", grpc.StatusCode.UNAVAILABLE, "producer connection lost mid-stream (UNAVAILABLE)")
def _(rec, request):  # a plaintext producer killed mid-stream: "Socket closed" was read as a TLS mismatch
    return [rec["raw"][0], rec["raw"][1], (grpc.StatusCode.UNAVAILABLE, "Socket closed")]


@case("producer_internal_error", "raw", grpc.StatusCode.UNAVAILABLE, "producer failed (INTERNAL)")
def _(rec, request):
    return [rec["raw"][0], grpc.StatusCode.INTERNAL]


def generate_fields(codec: str, options: dict) -> dict:
    return dict(context=prompt(CONTEXT), question=prompt(QUESTION), max_new_tokens=4,
                transfer=common_pb2.CodecSpec(name=codec, options=options))


async def ask(client: ConsumerClient, timeout: float = 20, **fields) -> tuple[list, grpc.aio.AioRpcError | None]:
    received = []
    try:
        async for msg in client.stub.Generate(consumer_pb2.GenerateRequest(**fields), timeout=timeout):
            received.append(msg)
    except grpc.aio.AioRpcError as err:
        return received, err
    return received, None


@pytest.mark.parametrize("name", sorted(CASES))
async def test_hostile_stream_is_refused_at_once_and_the_consumer_keeps_serving(world, hostile, name):
    holder, client, fake, consumer = hostile
    codec, options, mutate, status, text = CASES[name]
    holder["script"] = lambda request: mutate(world["rec"], request)
    before = rss_bytes()
    received, err = await ask(client, **generate_fields(codec, options))
    assert err is not None, f"{name}: status OK with {len(received)} messages: a hostile stream was accepted"
    assert (err.code(), text in err.details()) == (status, True), f"{name}: {err.code()} {err.details()!r}"
    for where in ("10.1.2.3", "127.0.0.1", "internal.corp", "/var/run", "p.sock", "fe80", "producer-0"):
        assert where not in err.details(), f"{name}: an internal address in {err.details()!r}"
    assert received == []  # nothing was answered
    assert rss_bytes() - before < 64 << 20, f"{name}: RSS grew by {(rss_bytes() - before) >> 20} MiB"
    assert consumer.servicer.admission.inflight == 0
    # the same consumer still answers a valid stream
    holder["script"] = lambda request: world["rec"]["raw"]
    received, err = await ask(client, **generate_fields("raw", {}))
    assert err is None and received[-1].WhichOneof("kind") == "stats"


async def test_the_unmutated_recordings_are_accepted_and_match_the_real_producer(world, hostile):
    """The control: each recording replayed as is gives the tokens of the real pair."""
    holder, client, _, _ = hostile
    for codec, key, options in (("raw", "raw", {}), ("quant", "quant", {"bits": "8"}), ("scd", "scd", {})):
        holder["script"] = lambda request, key=key: world["rec"][key]
        received, err = await ask(client, **generate_fields(codec, options))
        assert err is None, (codec, err)
        assert received[-1].stats.transfer.name == codec


async def test_a_stalled_producer_ends_at_the_deadline(world, hostile):
    holder, client, _, _ = hostile
    holder["script"] = lambda request: [world["rec"]["raw"][0], world["rec"]["raw"][1], 30]
    received, err = await ask(client, timeout=1.5, **generate_fields("raw", {}))
    assert err is not None and err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and received == []


async def test_local_prefill_policy_turns_a_corrupt_stream_into_the_oracle_answer(world, hostile):
    holder, client, _, consumer = hostile
    fields = generate_fields("raw", {})
    holder["script"] = lambda request: CASES["nan_in_raw_k"][2](world["rec"], request)
    oracle, err = await ask(client, **{**fields, "transfer": common_pb2.CodecSpec(name="oracle")})
    assert err is None
    # the mid-stream watch off (tests/test_auto.py covers it): on a loaded host it could abandon
    # this stream as too slow before its corrupt layer is read, and the failure would be a deadline
    engine = consumer.servicer.pipeline
    planner, engine.planner = engine.planner, None
    try:
        received, err = await ask(client, on_transfer_failure=consumer_pb2.TRANSFER_FAILURE_POLICY_LOCAL_PREFILL, **fields)
    finally:
        engine.planner = planner
    assert err is None
    stats = received[-1].stats
    assert stats.transfer.name == "oracle" and stats.transfer_failure.startswith("DATA_LOSS: ") and "non-finite" in stats.transfer_failure
    assert tokens(received) == tokens(oracle)


async def test_a_failed_streams_rebuild_still_running_never_lands_on_the_local_prefill(world, monkeypatch):
    """With --engine-process the own prefill a failed transfer falls back to runs in the child,
    not behind the frontend's rebuilds: a rebuild still running when the stream failed (here
    layer 0's, held here until the fallback's first token; in the fuzz a layer's rebuild over a
    long context) wrote its K/V
    over the fallback's, and the request was answered OK as "oracle" with other tokens (and the
    prefix cache kept that K/V as the consumer's own). The transfer now returns only once its
    running rebuilds have written, so the fallback's K/V is the last word."""
    from consumer.engine.process import EngineProcess
    from consumer.request.transfer import Transfer

    stream = [copy(m) for m in world["rec"]["raw"]]
    for i in chunks(stream, "k", layer=0):  # in bounds, CRC-valid: other tokens if it lands
        flat = torch.frombuffer(bytearray(stream[i].chunk.data), dtype=torch.float32).clone()
        set_data(stream[i], (-flat).view(torch.uint8).numpy().tobytes())
    # layer 0 is handed over as layer 1's first chunk arrives; its second one fails the stream
    second = chunks(stream, "k", layer=1)[1]
    stream[second].chunk.crc32c ^= 1
    stream.insert(second, 0.3)  # by then layer 0's rebuild runs
    rebuild, add, answering = Transfer._rebuild_many, EngineProcess.add, threading.Event()

    def late(self, jobs):  # layer 0's rebuild writes once the fallback answers (3 s at most)
        if any(job.layer == 0 for job in jobs):
            answering.wait(timeout=3)
        return rebuild(self, jobs)

    def watched(self, task):
        sink = task.sink

        def tell(item):
            answering.set()
            return sink(item)

        task.sink = tell
        return add(self, task)

    monkeypatch.setattr(Transfer, "_rebuild_many", late)
    monkeypatch.setattr(EngineProcess, "add", watched)
    async with consumer_of(lambda request: stream, artifacts=str(world["path"]), engine_process=True) as (consumer, _):
        client = ConsumerClient(consumer.address)
        try:
            consumer.servicer.pipeline.planner = None  # no mid-stream watch: the failure is the CRC's
            fields = {**generate_fields("raw", {}), "max_new_tokens": 24}
            oracle, err = await ask(client, **{**fields, "transfer": common_pb2.CodecSpec(name="oracle"), "cache_salt": "o"})
            assert err is None
            for rep in range(2):
                answering.clear()
                received, err = await ask(client, on_transfer_failure=consumer_pb2.TRANSFER_FAILURE_POLICY_LOCAL_PREFILL,
                                          cache_salt=f"r{rep}", **fields)
                assert err is None
                stats = received[-1].stats
                assert stats.transfer.name == "oracle" and "CRC32C mismatch" in stats.transfer_failure
                assert tokens(received) == tokens(oracle), rep
            await all_back(consumer)
        finally:
            await client.channel.close()


async def test_the_producers_own_deadline_is_not_reported_as_the_callers(world, hostile):
    """A producer ending the call DEADLINE_EXCEEDED (its --max-timeout-s fired) while the caller's
    deadline is far off was reported as the caller's ("deadline passed during the transfer", and
    counted as a cancelled request): it is UNAVAILABLE naming the producer's limit."""
    holder, client, _, consumer = hostile
    holder["script"] = lambda request: [world["rec"]["raw"][0], (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")]
    received, err = await ask(client, timeout=30, **generate_fields("raw", {}))
    assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE, err
    assert "producer ended the transfer at its own time limit" in err.details() and "--max-timeout-s" in err.details()
    assert received == []
    await all_back(consumer)


async def test_local_prefill_policy_covers_an_unreachable_producer():
    from consumer.server import ConsumerServer
    from shared.config import ConsumerConfig

    consumer = ConsumerServer(ConsumerConfig(port=0, model="tiny-llama", device="cpu", producer="127.0.0.1:1", drain_grace_s=0))
    await consumer.start()
    await consumer.load()
    client = ConsumerClient(consumer.address)
    try:
        fields = generate_fields("raw", {})
        _, err = await ask(client, timeout=10, **fields)
        assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE and "127.0.0.1" not in err.details()
        received, err = await ask(client, timeout=10, on_transfer_failure=consumer_pb2.TRANSFER_FAILURE_POLICY_LOCAL_PREFILL,
                                  **fields)
        assert err is None and received[-1].stats.transfer_failure.startswith("UNAVAILABLE: ")
    finally:
        await client.channel.close()
        await consumer.stop(0)


async def test_a_second_stream_prefix_cannot_touch_a_handed_over_layer(world):
    """The reader hands a payload over only once it is complete and never writes it again:
    feeding the rest of a stream after the trailer fails without changing earlier tensors."""
    from consumer.link.stream_reader import Expectation, LayerPayloads, StreamReader
    from shared.codecs import create_codecs

    model = load_model("tiny-llama", "float32", "cpu")
    codecs = create_codecs(model)
    messages = world["rec"]["raw"]
    reader = StreamReader(Expectation(len(world["ids"]), codecs["raw"], {}, model.info))
    layers = [e for m in messages for e in reader.feed(m) if isinstance(e, LayerPayloads)]
    snapshot = [{k: v.clone() for k, v in lp.payloads.items()} for lp in layers]
    with pytest.raises(Exception, match="after the trailer"):
        reader.feed(messages[1])
    assert all(torch.equal(a[k], lp.payloads[k]) for a, lp in zip(snapshot, layers) for k in a)


def test_every_contract_rule_has_a_case():
    assert len(CASES) >= 40
    assert {status for _, _, _, status, _ in CASES.values()} >= {DL, FP, grpc.StatusCode.UNAVAILABLE}


_ = producer_pb2  # the recordings are PrefillResponse messages


@pytest.mark.parametrize("second, code", [("overloaded", "UNAVAILABLE"), ("wrong_codec", "DATA_LOSS")])
async def test_upgrade_whose_second_transfer_fails_answers_from_a_local_prefill(world, second, code):
    """AUDIT_POLICY_UPGRADE: the 4-bit stream is flagged (strict threshold), the 8-bit retry the
    producer refuses or corrupts: the answer is the consumer's own prefill's, status OK, the
    decision names the failed upgrade, and no slot is left taken."""

    def script(request):
        if request.codec.options["bits"] == "4":
            return world["rec"]["quant4"]
        return [grpc.StatusCode.RESOURCE_EXHAUSTED] if second == "overloaded" else world["rec"]["raw"]

    async with consumer_of(script, audit_threshold=0.02) as (consumer, fake):
        client = ConsumerClient(consumer.address)
        fields = generate_fields("quant", {"bits": "4"})
        oracle, err = await ask(client, **{**fields, "transfer": common_pb2.CodecSpec(name="oracle")})
        assert err is None
        received, err = await ask(client, audit=consumer_pb2.AUDIT_POLICY_UPGRADE, **fields)
        await client.channel.close()
        assert err is None and fake.calls >= 2  # the 4-bit stream, then the 8-bit retry (gRPC may retry an overload)
        stats = received[-1].stats
        assert stats.audit_decision == f"diverged: upgrade to bits=8,group_size=32 failed ({code}): prefilled locally"
        assert tokens(received) == tokens(oracle)
        assert consumer.servicer.admission.inflight == 0


def absurd_keys(rec, layer: int = 1) -> list:
    """The raw recording with every key of one layer set to 3e38: finite, CRC-valid, absurd."""
    out = [copy(m) for m in rec["raw"]]
    for i in chunks(out, "k", layer=layer):
        n = len(out[i].chunk.data) // 4
        set_data(out[i], torch.full((n,), 3e38, dtype=torch.float32).view(torch.uint8).numpy().tobytes())
    return out


async def test_absurd_values_inside_a_batch_fail_alone(world, hostile):
    """Finite but absurd keys (3e38 in one layer) are refused at that layer's rebuild, past the
    limit of the consumer's layer (shared.kv_bound): the request gets DATA_LOSS naming the layer,
    never an answer with status OK, before any forward reads them; the good requests decoded in
    the same batches get exactly the tokens they get alone (tests/test_hostile_values.py covers
    values, 1e30, just past the limit and both dtypes)."""
    await absurd_values_fail_alone(world, hostile)


async def test_absurd_values_fail_alone_with_the_engine_in_its_own_process(world):
    """The same with --engine-process: the frontend's rebuild refuses the layer, the engine
    process never runs the request, the good rows of the same forwards are untouched, every block
    returns once the engine process let go of each task."""
    holder: dict = {}
    script = lambda request: holder["script"](request)  # noqa: E731
    async with consumer_of(script, artifacts=str(world["path"]), engine_process=True) as (consumer, fake):
        client = ConsumerClient(consumer.address)
        try:
            await absurd_values_fail_alone(world, (holder, client, fake, consumer))
        finally:
            await client.channel.close()


async def absurd_values_fail_alone(world, hostile) -> None:
    holder, client, _, consumer = hostile
    holder["script"] = lambda request: absurd_keys(world["rec"]) if request.request_id.startswith("hostile") else world["rec"]["raw"]
    fields = {**generate_fields("raw", {}), "max_new_tokens": 12}
    alone, err = await ask(client, **fields)
    assert err is None
    alone_ids = tokens(alone)
    # the prefix cache on for raw (it needs the producer's weights, which a hostile producer does
    # not describe): a hostile stream's KV must never be kept for the next request of its context
    engine = consumer.servicer.pipeline
    engine.producer_identity, engine.producer_dtype = (lambda: "hostile-producer"), (lambda: "float32")
    await asyncio.wrap_future(consumer.servicer.batch.submit(consumer.servicer.prefix.clear))  # the engine's to change
    received, err = await ask(client, request_id="hostile-first", **fields)
    assert err is not None and err.code() == DL
    received, err = await ask(client, request_id="good-after", **fields)
    assert err is None and received[-1].stats.prefix_reused_tokens == 0
    assert tokens(received) == alone_ids
    engine.producer_identity = lambda: ""
    await asyncio.wrap_future(consumer.servicer.batch.submit(consumer.servicer.prefix.clear))
    failed_before = consumer.servicer.batch.stats.failed_rows
    results = await asyncio.gather(
        *(ask(client, request_id=f"{'hostile' if i % 3 == 1 else 'good'}-{i}", **fields) for i in range(9))
    )
    for i, (received, err) in enumerate(results):
        if i % 3 == 1:
            assert err is not None and err.code() == DL and "layer 1: rebuilt keys reach |" in err.details(), (i, err)
            assert received == []
        else:
            assert err is None, (i, err)
            assert tokens(received) == alone_ids, i
    assert consumer.servicer.batch.stats.failed_rows == failed_before  # refused at the rebuild: no row ran
    await all_back(consumer)  # every request's blocks came back


def test_passed_on_details_lose_addresses_and_keep_the_fields_they_name():
    from consumer.link.producer_client import upstream_error

    def passed(details: str) -> str:
        error = grpc.aio.AioRpcError(grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(), grpc.aio.Metadata(), details)
        return str(upstream_error(error))

    for where in ("10.1.2.3", "http://internal.corp/x", "unix:///var/run/p.sock", "[fe80::1]", "producer-0:50051",
                  "ipv4:10.0.0.1:50051", "dns:///producer:50051", "[::1]:80"):
        assert where not in passed(f"refused by {where} now") and "<address>" in passed(f"refused by {where} now")
    for kept in ("transfer.options['start']='1:2'", "keep 'snapkv:0.25:sinks=4'", "payload [8] of shape [4096, 64]"):
        assert kept in passed(f"bad {kept}: must be"), passed(f"bad {kept}: must be")
