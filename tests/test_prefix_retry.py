"""A consumer that asks only for the tail of a context it holds a prefix of (first_token, prefix_key)
and is refused by its producer (the producer no longer holds that prefix, or names it otherwise)
retries the whole context at once and answers as from a cold transfer: no cached token is reused,
the bytes are the whole stream's, the answer is the consumer's own prefill's."""

from __future__ import annotations

import grpc
import pytest

from consumer.api.client import ConsumerClient
from producer.server import ProducerServer
from shared.config import ProducerConfig
from shared.pb import common_pb2, producer_pb2, producer_pb2_grpc
from tests.conftest import prompt, running_pair
from tests.hostile import consumer_of, record

C = 64  # the chunk size of both sides


async def test_a_refused_prefix_key_is_retried_with_the_whole_context():
    first = list(range(10, 10 + 100))  # one full chunk and a tail
    longer = first + list(range(200, 280))  # the next turn: extends the first context
    producer = ProducerServer(ProducerConfig(port=0, model="tiny-llama", device="cpu", chunk_tokens=C, drain_grace_s=0))
    await producer.start()
    await producer.load()
    try:
        recorded = {
            len(first): await record(producer.address, first, "raw"),
            len(longer): await record(producer.address, longer, "raw"),
        }
        async with grpc.aio.insecure_channel(producer.address) as channel:  # the consumer learns its weights from it
            described = await producer_pb2_grpc.ProducerServiceStub(channel).Describe(
                producer_pb2.ProducerServiceDescribeRequest()
            )
    finally:
        await producer.stop(0)
    asked: list[tuple[int, int]] = []

    def script(request):
        asked.append((len(request.token_ids), request.first_token))
        if request.first_token:
            yield grpc.StatusCode.FAILED_PRECONDITION  # "prefix_key: does not name tokens [0, first_token) ..."
            return
        yield from recorded[len(request.token_ids)]

    question = prompt(ids=[5, 6, 7])
    async with consumer_of(script, describe=described, chunk_tokens=C) as (consumer, _):
        client = ConsumerClient(consumer.address)
        try:
            await client.generate(mode="raw", context=prompt(ids=first), question=question, max_new_tokens=4)
            answer = await client.generate(mode="raw", context=prompt(ids=longer), question=question, max_new_tokens=4)
            own = await client.generate(mode="oracle", context=prompt(ids=longer), question=question, max_new_tokens=4)
        finally:
            await client.channel.close()
    assert asked == [(len(first), 0), (len(longer), C), (len(longer), 0)]  # the tail, refused; then the whole context
    whole = sum(len(m.chunk.data) for m in recorded[len(longer)] if m.WhichOneof("kind") == "chunk")
    s = answer.stats
    assert s.transfer.name == "raw" and s.prefix_reused_tokens == 0 and s.bytes_received == whole
    assert not s.transfer_failure and answer.ids == own.ids


async def test_a_codec_whose_decoder_takes_only_whole_streams_is_never_asked_for_a_tail():
    """recompute's span is recomputed over the whole context: on a partial prefix-cache hit the
    consumer asks for the whole context at once (before, it asked for the tail, refused the stream
    it got and asked again)."""

    first = list(range(3, 303))  # a full chunk and a tail (the default chunk size: 256)
    longer = first[:256] + list(range(10, 110))
    spec = common_pb2.CodecSpec(name="recompute")
    question = prompt(ids=[17, 42, 99])
    async with running_pair("tiny-llama") as pair:
        try:
            await pair.client.generate(context=prompt(ids=first), question=question, max_new_tokens=4, transfer=spec)
            before = (await pair.producer_stub.Describe(producer_pb2.ProducerServiceDescribeRequest())).stats
            answer = await pair.client.generate(context=prompt(ids=longer), question=question, max_new_tokens=4, transfer=spec)
            after = (await pair.producer_stub.Describe(producer_pb2.ProducerServiceDescribeRequest())).stats
            own = await pair.client.generate(context=prompt(ids=longer), question=question, max_new_tokens=4, mode="oracle")
        finally:
            await pair.close()
    assert after.prefills_started - before.prefills_started == 1
    assert after.prefills_cancelled == before.prefills_cancelled and after.prefills_failed == before.prefills_failed
    assert answer.stats.prefix_reused_tokens == 0 and answer.ids == own.ids


async def test_auto_never_serves_as_exact_a_stream_whose_producer_is_not_this_model():
    """The link check saw a producer of this model and dtype, so auto offers its raw K/V as exact;
    a producer swapped since (other weights on the same address, within the check interval) sends
    a stream whose header names another model: answered OK as exact with that model's K/V. The
    header is now held to this model's identity and dtype for an exact choice: the request falls
    back to the own prefill (the oracle's answer) or, without that fallback, fails DATA_LOSS."""
    context = list(range(10, 150))
    producer = ProducerServer(ProducerConfig(port=0, model="tiny-llama", device="cpu", drain_grace_s=0))
    await producer.start()
    await producer.load()
    try:
        recorded = await record(producer.address, context, "raw")
        async with grpc.aio.insecure_channel(producer.address) as channel:
            described = await producer_pb2_grpc.ProducerServiceStub(channel).Describe(
                producer_pb2.ProducerServiceDescribeRequest()
            )
    finally:
        await producer.stop(0)
    swapped = [producer_pb2.PrefillResponse() for _ in recorded]
    for new, old in zip(swapped, recorded):
        new.CopyFrom(old)
    swapped[0].header.producer.identity = "f" * 64  # another model's K/V (the same bytes here: what matters is the claim)
    question = prompt(ids=[5, 6, 7])
    async with consumer_of(lambda request: swapped, describe=described) as (consumer, _):
        client = ConsumerClient(consumer.address)
        try:
            own = await client.generate(mode="oracle", context=prompt(ids=context), question=question, max_new_tokens=4)
            answer = await client.generate(
                mode="auto",
                options={"exact": "true"},
                context=prompt(ids=context),
                question=question,
                max_new_tokens=4,
                cache_salt="a",
            )
            assert answer.ids == own.ids
            s = answer.stats
            assert s.transfer.name == "oracle" and "is not this model" in s.transfer_failure, (s.transfer, s.transfer_failure)
            with pytest.raises(grpc.aio.AioRpcError) as err:  # a narrowed auto: no own-prefill fallback
                await client.generate(
                    mode="auto",
                    options={"exact": "true", "candidates": "raw"},
                    context=prompt(ids=context),
                    question=question,
                    max_new_tokens=4,
                    cache_salt="b",
                )
            assert err.value.code() == grpc.StatusCode.DATA_LOSS and "is not this model" in err.value.details()
        finally:
            await client.channel.close()
