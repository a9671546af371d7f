"""What this consumer's own transfers left in the producer's store, as far as it can know: the
context chunks whose KV the producer computed, and per mode the chunks whose payloads it encoded.
`auto` (consumer.auto.chooser) reads it to estimate what the producer still has to compute.

A memory, not a view: the producer evicts on its own budget, and other consumers warm it too; the
estimate it gives errs both ways and the planner's measured times correct the rest. Keys chain
like the stores' (shared.chunks) at the producer's chunk size as its last stream header gave it
(a producer without chunked reuse stores whole contexts: one key for the whole context). Bounded:
the least recently used keys go first. Lazy: a transfer's chains are hashed only once `held` is
asked (auto), so a consumer whose requests never use auto does no work for it; at most
`PENDING` transfers wait (older ones are dropped: a memory errs anyway). Knows nothing about grpc or
torch.
"""

from __future__ import annotations

import collections

from shared import chunks

CAPACITY = 1 << 16  # chunk keys remembered
PENDING = 32  # transfers remembered but not hashed yet (each holds its context's ids until then)
ROOTS_MEMO = 256  # (producer, dtype, candidate) roots kept hashed (cleared when full)


class ProducerMemory:
    def __init__(self, capacity: int = CAPACITY, chains: chunks.Chains | None = None):
        self.capacity = capacity
        self.keys: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.chunk_tokens = chunks.DEFAULT_CHUNK_TOKENS
        self.pending: collections.deque[tuple[str, str, str, list[int], int]] = collections.deque(maxlen=PENDING)
        # one context's token bytes packed once for its chains; the consumer passes the prefix
        # keys' instance (consumer.link.prefix_keys), so a request's ids are packed once for both
        self.chains = chains if chains is not None else chunks.Chains()
        self._root_memo: dict[tuple[str, str, str], tuple[str, str]] = {}

    def _roots(self, producer: str, dtype: str, mode_key: str) -> tuple[str, str]:
        """(KV root, payload root) of a producer, dtype and candidate: hashed once each."""
        key = (producer, dtype, mode_key)
        roots = self._root_memo.get(key)
        if roots is None:
            if len(self._root_memo) >= ROOTS_MEMO:
                self._root_memo.clear()
            kv_root = chunks.model_root(producer, dtype or "?")
            roots = self._root_memo[key] = (kv_root, chunks.codec_root(producer, dtype or "?", mode_key, 0, {}, {}))
        return roots

    def _chains(self, producer: str, dtype: str, mode_key: str, context_ids: list[int], size: int) -> tuple[list, list]:
        size = size or max(len(context_ids), 1)
        kv_root, payload_root = self._roots(producer, dtype, mode_key)
        return self.chains.chain(kv_root, context_ids, size), self.chains.chain(payload_root, context_ids, size)

    def remember(self, producer: str, dtype: str, mode_key: str, context_ids: list[int], chunk_tokens: int) -> None:
        """A transfer of mode_key over context_ids completed: the producer holds its KV and payloads
        (hashed when `held` is next asked)."""
        if not producer:
            return
        self.pending.append((producer, dtype, mode_key, context_ids, chunk_tokens))

    def _settle(self) -> None:
        """The transfers remembered since the last `held`, in order, into the keys."""
        while self.pending:
            producer, dtype, mode_key, context_ids, chunk_tokens = self.pending.popleft()
            self.chunk_tokens = chunk_tokens
            for refs in self._chains(producer, dtype, mode_key, context_ids, chunk_tokens):
                for ref in refs:
                    self.keys[ref.key] = None
                    self.keys.move_to_end(ref.key)
            while len(self.keys) > self.capacity:
                self.keys.popitem(last=False)

    def held(self, producer: str, dtype: str, mode_key: str, context_ids: list[int]) -> tuple[int, int]:
        """(tokens of KV, tokens of mode_key's payloads) the producer is believed to hold: the
        longest remembered prefix of each chain."""
        if not producer or not context_ids:
            return 0, 0
        self._settle()
        kv, payloads = self._chains(producer, dtype, mode_key, context_ids, self.chunk_tokens)
        held = []
        for refs in (kv, payloads):
            n = chunks.longest(refs, self.keys.__contains__)
            held.append(refs[n - 1].end if n else 0)
        return held[0], held[1]
