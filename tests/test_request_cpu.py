"""Per-request work done once (issue 32): chains hashed once with the same keys, the producer
memory hashed only when auto asks, the detokenizer decoding once per push, the engine's
deliveries waking the event loop once per burst, and a transfer's layers handed over without a
round trip each, still added in order per request."""

from __future__ import annotations

import asyncio
import random
import threading
from typing import Any, cast

from consumer.auto.producer_memory import ProducerMemory
from consumer.engine.decoding import Detokenizer
from consumer.request.engine_stream import mailbox
from consumer.request.transfer import Transfer
from shared import chunks
from shared.codecs.base import LayerJob
from shared.models import load_model


def test_chains_give_the_keys_of_chunk_key_once_per_context():
    rng = random.Random(0)
    root = chunks.model_root("w", "float32")
    memo = chunks.Chains(size=2)
    for n in (0, 1, 255, 256, 257, 1000):
        ids = [rng.randrange(1 << 32) for _ in range(n)]
        for size in (1, 7, 256):
            refs = chunks.chain(root, ids, size)
            parent = root
            for ref in refs:  # the persisted keys: chunk_key over each chunk's ids, chained
                assert ref.key == chunks.chunk_key(parent, ids[ref.start : ref.end]) and ref.parent == parent
                assert ref.tokens == tuple(ids[ref.start : ref.end])
                parent = ref.key
            assert [r.end for r in refs][-1:] == ([n] if n else [])
            assert memo.chain(root, ids, size) == refs == memo.chain(root, ids, size)
    ids = [rng.randrange(1000) for _ in range(600)]
    first = memo.chain(root, ids, 256)
    ids[-1] += 1  # a changed list (never done to a request's context) is not served stale keys
    assert memo.chain(root, ids, 256) == chunks.chain(root, ids, 256) != first


def test_producer_memory_hashes_only_when_asked_and_holds_the_same():
    rng = random.Random(1)
    contexts = [[rng.randrange(1000) for _ in range(rng.randrange(1, 900))] for _ in range(6)]
    lazy, eager = ProducerMemory(), ProducerMemory()
    for i, ids in enumerate(contexts):
        lazy.remember("p", "float32", f"raw{i % 2}", ids, 128)
        eager.remember("p", "float32", f"raw{i % 2}", ids, 128)
        eager.held("p", "float32", "raw0", ids)  # settles at once
    assert not lazy.keys and len(lazy.pending) == len(contexts)  # nothing hashed while auto never asks
    for i, ids in enumerate(contexts):
        assert lazy.held("p", "float32", f"raw{i % 2}", ids) == eager.held("p", "float32", f"raw{i % 2}", ids)
        assert lazy.held("p", "float32", f"raw{i % 2}", ids)[1] == len(ids)
    assert list(lazy.keys) == list(eager.keys)


class Counting:
    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, 0

    @property
    def all_special_ids(self):
        return self.tokenizer.all_special_ids

    def decode(self, ids, **kwargs):
        self.calls += 1
        return self.tokenizer.decode(ids, **kwargs)


def test_the_detokenizer_decodes_about_once_per_push():
    tokenizer = load_model("tiny-llama", "float32", "cpu").tokenizer
    words = [t for t in range(len(tokenizer)) if t not in tokenizer.all_special_ids][200:260]
    counting = Counting(tokenizer)
    detok = Detokenizer(counting)  # type: ignore[arg-type]
    ids = [words[i % len(words)] for i in range(120)]
    text = "".join(detok.push(t) for t in ids) + detok.flush()
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
    assert counting.calls <= 1.4 * len(ids), counting.calls  # was 2 per push


def test_the_mailbox_wakes_the_loop_once_per_burst():
    async def main():
        loop = asyncio.get_running_loop()
        queues: list[asyncio.Queue] = [asyncio.Queue() for _ in range(32)]
        box = mailbox(loop)
        assert mailbox(loop) is box
        scheduled = []
        real = loop.call_soon_threadsafe

        def counting(*args):
            scheduled.append(args)
            return real(*args)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign, assignment]
        try:

            def engine_step(step: int) -> None:  # every row of one forward
                for q in queues:
                    box.post(q, step)

            for step in range(3):
                t = threading.Thread(target=engine_step, args=(step,))
                t.start()
                t.join()
                await asyncio.sleep(0)
                await asyncio.sleep(0)
        finally:
            del loop.call_soon_threadsafe
        assert len(scheduled) == 3  # one wakeup per step, not 32
        for q in queues:
            assert [q.get_nowait() for _ in range(3)] == [0, 1, 2]

    asyncio.run(main())


class Recorder:
    """A decoder stand-in recording the order of its layers (only what add_layers calls)."""

    def __init__(self, log: list, name: str, fail_at: int | None = None):
        self.log, self.name, self.fail_at = log, name, fail_at

    def batch_key(self, layer: int):
        return None

    def add_layer(self, layer: int, payloads) -> None:
        if layer == self.fail_at:
            raise ValueError("bad payloads")
        self.log.append((self.name, layer))


def test_rebuild_waves_keep_each_requests_layers_in_order():
    log: list = []
    a, b, c = (cast(Any, Recorder(log, n, fail_at=1 if n == "c" else None)) for n in "abc")
    transfer = Transfer.__new__(Transfer)
    transfer.rebuilt_layers = transfer.batched_layers = 0
    jobs = [
        LayerJob(b, 1, {}),
        LayerJob(a, 0, {}),
        LayerJob(a, 1, {}),
        LayerJob(c, 0, {}),
        LayerJob(c, 1, {}),
        LayerJob(c, 2, {}),
        LayerJob(a, 2, {}),
    ]
    out = transfer._rebuild_many(jobs)  # type: ignore[arg-type]
    for name in "abc":
        layers = [layer for n, layer in log if n == name]
        assert layers == sorted(layers)
    assert ("c", 2) not in log  # after its failed layer 1, c's later layers are not run
    assert isinstance(out[4], ValueError) and out[5] is out[4]
    assert all(isinstance(x, float) for i, x in enumerate(out) if i not in (4, 5))
