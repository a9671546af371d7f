"""A kept sequence in the consumer's KV pool (consumer.engine): the pool stores only the kept
tokens (each with the K/V of its own position) and `SequenceKV.dropped` keeps the logical length,
so both runners (ours over the pool in place, and the Hugging Face one) read the question and
decode at the original positions: their logits equal transformers' forward on the kept cache
(shared.keep.KeptCache, itself checked against masked full attention in tests/test_keep_cache.py)
within float32 rounding. Without `dropped` the same stored tokens give other logits.
"""

from __future__ import annotations

import pytest
import torch

from consumer.engine.hf_reference import Runner
from consumer.engine.kv_pool import KVPool
from consumer.engine.pool_forward import PoolRunner
from consumer.engine.rows import Row
from shared import kv
from shared.keep import kept_cache, next_positions, parse_selection
from shared.keep.cache import gather
from shared.models import load_model

pytestmark = pytest.mark.numeric  # logits against a reference within a tolerance: run under lowered ISAs too

T, QUESTION, TOL = 160, [5, 9, 13, 17, 21, 25], 1e-4


@pytest.fixture(scope="module")
def loaded():
    return load_model("tiny-llama", "float32", "cpu")


@pytest.fixture(scope="module")
def kept(loaded):
    """(the context's K/V per layer, the keep sets, the kept cache's logits for the question and
    for one decode step after it)."""
    ids = torch.randint(3, 200, (T,), generator=torch.Generator().manual_seed(11)).tolist()
    states, _ = kv.capture_states(loaded, ids, kv.Capture.KV | kv.Capture.NORMED)
    layer_kv = [states[i].kv() for i in range(len(states))]
    keep = parse_selection("h2o:0.4:window=16").keep(loaded, states)
    cache = kept_cache(loaded, layer_kv, keep)
    with torch.inference_mode():
        q = torch.tensor([QUESTION])
        first = loaded.model(input_ids=q, cache=cache, position_ids=next_positions(cache, 6), use_cache=True).logits[0, -1]
        step = torch.tensor([[int(first.argmax())]])
        second = loaded.model(input_ids=step, cache=cache, position_ids=next_positions(cache, 1), use_cache=True).logits[0, -1]
    return layer_kv, keep, first, second


def pooled(loaded, layer_kv, keep, dropped: bool):
    pool = KVPool(loaded.info, loaded.device, 512 * loaded.info.kv_bytes(1), 16)
    n = keep[0].shape[-1]
    seq = pool.allocate(n + len(QUESTION) + 4)
    for layer, ((k, v), idx) in enumerate(zip(layer_kv, keep)):
        seq.update(gather(k, idx)[None], gather(v, idx)[None], layer)
    seq.length = n
    seq.dropped = T - n if dropped else 0
    return pool, seq


@pytest.mark.parametrize("runner_type", [PoolRunner, Runner])
def test_a_kept_sequence_in_the_pool_continues_at_the_logical_positions(loaded, kept, runner_type):
    layer_kv, keep, first, second = kept
    pool, seq = pooled(loaded, layer_kv, keep, dropped=True)
    runner = runner_type(loaded, pool)
    got = runner.forward([Row(seq, QUESTION, seq.length)])[0]
    assert (got - first).abs().max().item() < TOL
    got2 = runner.forward([Row(seq, [int(first.argmax())], seq.length)])[0]
    assert (got2 - second).abs().max().item() < TOL
    # the same stored tokens read at their storage indices (no logical length) answer otherwise
    pool, plain = pooled(loaded, layer_kv, keep, dropped=False)
    wrong = runner_type(loaded, pool).forward([Row(plain, QUESTION, plain.length)])[0]
    assert (wrong - first).abs().max().item() > 100 * TOL
