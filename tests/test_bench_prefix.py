"""bench.serving.prefix without services: its workloads have the shapes the issue asks for, and its
variant list names the consumer-side hook."""

from __future__ import annotations

import json

from bench.serving import prefix
from bench.serving.throughput import Model


def model(tmp_path) -> Model:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 1000}))
    return Model("random", str(tmp_path), str(tmp_path), "float32", "random", "", 512)


def test_multi_turn_grows_each_conversation_and_interleaves_them(tmp_path):
    work = prefix.multi_turn(model(tmp_path), conversations=3, ctx_tokens=1000)
    reqs = work.requests
    assert len(reqs) == 3 * 4 and [r.later for r in reqs] == [False] * 3 + [True] * 9
    for c in range(3):
        turns = reqs[c::3]  # turn t of conversation c
        for a, b in zip(turns, turns[1:]):
            assert b.context[: len(a.context)] == a.context and 200 <= len(b.context) - len(a.context) < 300
    assert work.context_tokens == sum(len(r.context) for r in reqs)


def test_one_document_and_a_shared_preamble(tmp_path):
    doc = prefix.one_doc(model(tmp_path), questions=4, ctx_tokens=1000)
    assert len({tuple(r.context) for r in doc.requests}) == 1 and len({tuple(r.question) for r in doc.requests}) == 4
    pre = prefix.shared_preamble(model(tmp_path), documents=3, ctx_tokens=1000)
    n = 400  # within the preamble (two pieces of 200-300 tokens)
    assert len({tuple(r.context[:n]) for r in pre.requests}) == 1 and len({tuple(r.context) for r in pre.requests}) == 3


def test_the_variants_name_the_consumer_side_hook():
    names = [v.name for v in prefix.VARIANTS]
    assert names == ["no-store", "whole", "producer-chunks", "producer+consumer-chunks"]
    consumer = prefix.VARIANTS[-1]
    assert consumer.needs_consumer_flag and any("{budget}" in a for a in consumer.consumer_args)
    assert all(v.evictions == ("lru", "cost") for v in prefix.VARIANTS[2:])
