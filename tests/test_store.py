"""The producer's context store: LRU within a byte budget, and warm requests through the services."""

from producer.store import ContextStore, StoredPrefill, store_key
from shared.pb import common_pb2
from tests.conftest import prompt, running_pair


def test_lru_eviction_within_budget():
    store = ContextStore(budget_bytes=100)
    assert store.put("a", StoredPrefill((), 40)) and store.put("b", StoredPrefill((), 40))
    assert store.get("a") is not None  # a is now most recent
    assert store.put("c", StoredPrefill((), 40))  # evicts b
    assert store.get("b") is None and store.get("a") is not None and store.get("c") is not None
    assert store.nbytes == 80
    assert not store.put("huge", StoredPrefill((), 101))


def test_key_separates_tokens_codecs_and_options():
    base = store_key([1, 2, 3], "quant", {"bits": "8"}, {})
    assert base == store_key([1, 2, 3], "quant", {"bits": "8"}, {})
    assert (
        len(
            {
                base,
                store_key([1, 2, 4], "quant", {"bits": "8"}, {}),
                store_key([1, 2, 3], "quant", {"bits": "4"}, {}),
                store_key([1, 2, 3], "raw", {}, {}),
                store_key([12, 3], "quant", {"bits": "8"}, {}),
            }
        )
        == 5
    )
    kept = [
        store_key([1, 2, 3], "quant", {"bits": "8"}, {}, "", keep)
        for keep in ("h2o:0.3:sinks=4,window=64,heads=each", "h2o:0.4:sinks=4,window=64,heads=each")
    ]
    assert len({base, *kept}) == 3  # a keep transfer's stream never under a whole one's key, nor another selection's


async def test_repeated_context_is_served_from_the_store():
    async with running_pair(
        "tiny-llama", consumer_kw={"prefix_cache_bytes": 0}
    ) as pair:  # the producer store, not the consumer cache
        fields = dict(context=prompt("alpha beta gamma delta " * 40), question=prompt(" zeta"), max_new_tokens=6)
        cold_ids, _, cold = await pair.generate(transfer=common_pb2.CodecSpec(name="quant", options={"bits": "4"}), **fields)
        warm_ids, _, warm = await pair.generate(transfer=common_pb2.CodecSpec(name="quant", options={"bits": "4"}), **fields)
        other_ids, _, other = await pair.generate(transfer=common_pb2.CodecSpec(name="quant", options={"bits": "8"}), **fields)
    assert not cold.producer_store_hit and warm.producer_store_hit
    # quant reads only K/V: the chunk store keeps the producer's K/V, and another option re-encodes it
    # (no forward); the whole-context store (--chunk-tokens 0) keys by codec options and misses
    assert other.producer_store_hit and other.bytes_received > cold.bytes_received
    assert warm_ids == cold_ids and warm.bytes_received == cold.bytes_received
    assert warm.producer_prefill_ms == 0 and cold.producer_prefill_ms > 0
