"""--stream-interval (consumer.request.engine_stream.engine_task): the first token goes out alone, then up
to N tokens per TokenDelta, the same tokens and text as one per message; the config refuses 0."""

from __future__ import annotations

import pytest

from shared.config import ConsumerConfig
from shared.pb import common_pb2, consumer_pb2
from tests.conftest import prompt, running_pair

FIELDS = dict(context=prompt("A long context about streams and messages. " * 6), question=prompt(" And so?"),
              max_new_tokens=24, stop_token_ids=[0], transfer=common_pb2.CodecSpec(name="raw"))


async def deltas(pair) -> list[consumer_pb2.TokenDelta]:
    return [m.token async for m in pair.stub.Generate(consumer_pb2.GenerateRequest(**FIELDS), timeout=120)
            if m.WhichOneof("kind") == "token"]


async def test_tokens_after_the_first_go_out_in_fours_with_the_same_answer():
    async with running_pair("tiny-llama") as one:
        single = await deltas(one)
    async with running_pair("tiny-llama", consumer_kw={"stream_interval": 4}) as four:
        grouped = await deltas(four)
    ids = [i for d in single for i in d.ids]
    assert len(ids) == 24 and [i for d in grouped for i in d.ids] == ids
    assert "".join(d.text for d in grouped) == "".join(d.text for d in single)
    sizes = [len(d.ids) for d in grouped if d.ids]
    assert sizes[0] == 1 and all(n >= 4 for n in sizes[1:-1]), sizes  # the first alone, then >= 4 (the last: the rest)
    assert len(sizes) <= 1 + -(-23 // 4) < len([d for d in single if d.ids])


def test_a_stream_interval_below_one_is_refused():
    with pytest.raises(ValueError, match="stream_interval: 0 must be >= 1"):
        ConsumerConfig(stream_interval=0).validate()


def test_the_holder_posts_the_first_token_alone_then_bursts_of_n_and_flushes_before_the_end():
    from consumer.engine.batch import Finished
    from consumer.request.engine_stream import Holder

    posted: list = []
    holder = Holder(posted.append, 3)
    for token in range(7):
        holder(token)
    assert posted == [0, 1, 2, 3, 4, 5, 6]  # 0 alone; 1-3, 4-6 in bursts of 3
    holder(7)
    assert posted[-1] == 6  # held: fewer than 3 since the last burst
    end = Finished("length")
    holder(end)
    assert posted[-2:] == [7, end]  # what was held, then the end
    error = RuntimeError("engine failed")
    again = Holder(posted.append, 4)
    for token in (10, 11, 12):
        again(token)
    again(error)
    assert posted[-3:] == [11, 12, error]  # an error goes out after the tokens before it


def test_the_holder_hands_over_what_it_holds_when_the_deadline_fires():
    from consumer.request.engine_stream import Holder

    posted: list = []
    holder = Holder(posted.append, 8)
    for token in range(5):
        holder(token)
    assert posted == [0] and holder.drain() == [1, 2, 3, 4] and holder.drain() == []
