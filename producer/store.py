"""The producer's context store: encoded prefill streams kept for reuse, content-addressed by
(context token ids, codec, resolved options, codec metadata, tenant, keep selection),
least-recently-used first out within a byte budget. A hit skips the forward and the encode: the stored chunks are re-sent.

Knows nothing about gRPC or models; entries are opaque packed layers.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredPrefill:
    layers: tuple[Any, ...]  # EncodedLayer items, in layer order
    nbytes: int  # payload bytes held


def store_key(
    token_ids: Sequence[int],
    codec: str,
    options: Mapping[str, str],
    metadata: Mapping[str, str],
    tenant: str = "",
    keep: str = "",
) -> str:
    """The whole-context store's key, for `tenant`'s requests (shared.tenants), of a keep
    transfer's stream when `keep` names its resolved selection (KeepRequest.label; "": every
    token, a whole transfer). Neither the model
    nor its dtype is in it: the store is in memory only and one process serves one model in one
    dtype, so every entry was computed by this process's model (the chunk store, whose disk tier
    outlives the process, keys both: shared.chunks.model_root)."""
    digest = hashlib.sha256()
    digest.update(json.dumps([codec, sorted(options.items()), sorted(metadata.items()), tenant, keep]).encode())
    digest.update(b"|" + ",".join(map(str, token_ids)).encode())
    return digest.hexdigest()


class ContextStore:
    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.entries: OrderedDict[str, StoredPrefill] = OrderedDict()
        self.nbytes = 0
        self.hits = self.misses = self.evictions = 0  # lookups and evictions so far (metrics)

    def get(self, key: str) -> StoredPrefill | None:
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
            self.hits += 1
        else:
            self.misses += 1
        return entry

    def put(self, key: str, entry: StoredPrefill) -> bool:
        """Insert (evicting least recently used entries); False when it can never fit."""
        if entry.nbytes > self.budget_bytes:
            return False
        if key in self.entries:
            self.nbytes -= self.entries.pop(key).nbytes
        while self.nbytes + entry.nbytes > self.budget_bytes:
            _, evicted = self.entries.popitem(last=False)
            self.nbytes -= evicted.nbytes
            self.evictions += 1
        self.entries[key] = entry
        self.nbytes += entry.nbytes
        return True

    def clear(self) -> None:
        """Forget every entry (counters stay)."""
        self.entries.clear()
        self.nbytes = 0
