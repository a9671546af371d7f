"""Chunked content addressing: what both services use to name a prefix of a context.

A context's token ids are cut into fixed chunks of `chunk_tokens` tokens (the last one may be
shorter: the tail). A chunk's key chains its parent's key (the previous chunk's, or the root's
for the first chunk), its token ids and, through the root, what the stored state depends on:
- `model_root(identity, dtype, tenant)`: the model's identity (shared.models.ModelInfo.identity:
  its weights at their own precision, the config fields its forward reads, its compute dtype),
  the dtype its KV was computed in, and the tenant (shared.tenants: whose requests may reuse it);
  chunks under it name the model's own KV;
- `codec_root(identity, dtype, codec, format_version, options, metadata, tenant)`: also the codec,
  its payload format, its resolved options and its metadata (for SCD: the artifact and the
  schedule); chunks under it name encoded payloads.
A keep transfer's payloads are stored whole under `kept_key` (the whole context's key under the
codec's root and the resolved selection): a keep set depends on every token.
Everything that shaped a chunk's bytes is in its key, so a chunk made one way is never found
under another's key, on any tier, after any restart; and the tenant is, so one tenant's chunks
are never found by another's requests.
Equal keys mean equal prefixes under the same model (and codec), so the longest stored prefix is
one lookup per chunk (`longest`), as vLLM's and nano-vllm's chained block hashes. Keys are hex
sha256 strings, safe as file names.

Routing (`route_key`) hashes only the first chunk(s) of token ids: the turns of one conversation
and the questions of one document share it, whatever comes later.

`Chains` computes a request's chains once: its token ids packed to bytes once for every root, and
each (root, chunk size) chain hashed once, however many callers ask (the prefix cache's lookup and
insert, auto's candidates, the producer memory). Same keys as `chain`, byte for byte.

Knows nothing about stores, models or the wire.
"""

from __future__ import annotations

import collections
import hashlib
import json
import sys
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

DEFAULT_CHUNK_TOKENS = 256
ROUTE_CHUNKS = 1  # chunks of a context its ring_hash routing key covers


@dataclass(frozen=True)
class ChunkRef:
    """One chunk of a context: tokens [start, end), its key and its parent's key."""

    key: str
    parent: str  # the previous chunk's key, or the root for the first chunk
    start: int
    end: int
    # its token ids as keyed (uint32 little-endian; the bytes its key hashed, so no copy is made
    # for requests that never read them): `tokens` decodes them (KV events: shared.kv_events)
    token_bytes: bytes = field(default=b"", compare=False, repr=False)

    @property
    def tokens(self) -> tuple[int, ...]:
        ids = array("I", self.token_bytes)
        if sys.byteorder == "big":
            ids.byteswap()
        return tuple(ids)


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    packed = array("I", token_ids)  # uint32 each
    if sys.byteorder == "big":
        packed.byteswap()  # keys are the same on every machine: little-endian
    return packed.tobytes()


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


def model_root(identity: str, dtype: str, tenant: str = "") -> str:
    """The root of chunks that hold a model's own KV computed in `dtype` ("bfloat16", ...), for
    `tenant`'s requests ("": the shared tenant)."""
    if not identity or not dtype:
        raise ValueError("model_root: identity and dtype are required (KV of another model or dtype has other bytes)")
    return _digest(b"scd.chunks.model.v3", identity.encode(), dtype.encode(), tenant.encode())


def codec_root(
    identity: str,
    dtype: str,
    codec: str,
    format_version: int,
    options: Mapping[str, str],
    metadata: Mapping[str, str],
    tenant: str = "",
) -> str:
    """The root of chunks that hold one codec's encoded payloads of KV computed in `dtype` under one
    model, options and metadata (an SCD artifact id and schedule are in the metadata), for
    `tenant`'s requests."""
    spec = json.dumps([codec, format_version, sorted(options.items()), sorted(metadata.items())])
    return _digest(b"scd.chunks.codec.v3", model_root(identity, dtype, tenant).encode(), spec.encode())


_CHUNK_TAG = b"scd.chunks.chunk.v1"
_CHUNK_HASH = hashlib.sha256(len(_CHUNK_TAG).to_bytes(8, "little") + _CHUNK_TAG)  # the tag, fed once


def chunk_key(parent: str, token_ids: Sequence[int]) -> str:
    return _packed_chunk_key(parent, _token_bytes(token_ids))


def _packed_chunk_key(parent: str, packed: bytes) -> str:
    """_digest(_CHUNK_TAG, parent, packed ids), the tag's part hashed once for every key."""
    p = parent.encode()
    h = _CHUNK_HASH.copy()
    for part in (p, packed):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


def chain(root: str, token_ids: Sequence[int], chunk_tokens: int) -> list[ChunkRef]:
    """Every chunk of the context in order, the tail (shorter than chunk_tokens) included."""
    return _chain(root, token_ids, _token_bytes(token_ids), chunk_tokens)


def _chain(root: str, token_ids: Sequence[int], packed: bytes, chunk_tokens: int) -> list[ChunkRef]:
    """`chain` with the ids already packed (`_token_bytes(token_ids)`): the keys of `chunk_key`."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    refs: list[ChunkRef] = []
    parent = root
    for start in range(0, len(token_ids), chunk_tokens):
        end = min(start + chunk_tokens, len(token_ids))
        piece = packed[4 * start : 4 * end]
        key = _packed_chunk_key(parent, piece)  # = chunk_key(parent, token_ids[start:end])
        refs.append(ChunkRef(key, parent, start, end, piece))
        parent = key
    return refs


class Chains:
    """Chains computed once per context: token ids packed once for every root, each (root, chunk
    size) chain hashed once. Remembers the last `size` contexts by identity (their length and end
    tokens checked): a context's list must not change once it was named (a request's never does).
    Returns a fresh list each call (the refs themselves are frozen)."""

    def __init__(self, size: int = 8):
        self.size = size
        self._packed: collections.OrderedDict[int, tuple[Sequence[int], bytes]] = collections.OrderedDict()
        self._chains: dict[tuple[int, str, int], list[ChunkRef]] = {}

    def packed(self, token_ids: Sequence[int]) -> bytes:
        ident, n = id(token_ids), len(token_ids)
        held = self._packed.get(ident)
        if held is not None:
            ids, packed = held
            same = ids is token_ids and len(packed) == 4 * n
            if same and n:
                same = packed[:4] == _token_bytes(token_ids[:1]) and packed[-4:] == _token_bytes(token_ids[-1:])
            if same:
                self._packed.move_to_end(ident)
                return packed
            self._forget(ident)
        packed = _token_bytes(token_ids)
        self._packed[ident] = (token_ids, packed)  # held here: its id is not reused meanwhile
        while len(self._packed) > self.size:
            self._forget(next(iter(self._packed)))
        return packed

    def _forget(self, ident: int) -> None:
        self._packed.pop(ident, None)
        for key in [k for k in self._chains if k[0] == ident]:
            del self._chains[key]

    def chain(self, root: str, token_ids: Sequence[int], chunk_tokens: int) -> list[ChunkRef]:
        packed = self.packed(token_ids)
        key = (id(token_ids), root, chunk_tokens)
        refs = self._chains.get(key)
        if refs is None:
            refs = self._chains[key] = _chain(root, token_ids, packed, chunk_tokens)
        return list(refs)


def kept_key(context_key: str, selection: str) -> str:
    """The key of a keep transfer's stored payloads (the producer's chunk store): the whole
    context's key under the codec's root (the last chunk's: model, dtype, tenant, codec, options,
    metadata and every token id) and the resolved keep selection
    (shared.codecs.kept.KeepRequest.label: policy, budget, sinks, window, heads). A keep set
    depends on every token, so the entry is one whole context: no prefix of it, and no other
    selection, codec or context, shares its key."""
    if not selection:
        raise ValueError("kept_key: a selection is required (a whole transfer's key is its chain's)")
    return _digest(b"scd.chunks.kept.v1", context_key.encode(), selection.encode())


def prefix_key(root: str, token_ids: Sequence[int], upto: int, chunk_tokens: int) -> str:
    """The key naming token_ids[:upto] (upto a multiple of chunk_tokens, or len(token_ids)):
    the key of the chunk that ends there; the root for upto = 0."""
    if upto == 0:
        return root
    refs = chain(root, token_ids[:upto], chunk_tokens)
    return refs[-1].key


def longest(refs: Sequence[ChunkRef], has: Callable[[str], bool]) -> int:
    """How many leading chunks of refs `has` holds (a chunk without its parent is no prefix)."""
    n = 0
    for ref in refs:
        if not has(ref.key):
            break
        n += 1
    return n


def route_key(token_ids: Sequence[int], chunk_tokens: int = DEFAULT_CHUNK_TOKENS, chunks: int = ROUTE_CHUNKS) -> str:
    """The ring_hash key of a context: a hash of its first `chunks` chunks of token ids (all of a
    shorter context), so contexts that share that opening land on the same producer."""
    return _digest(b"scd.route.v1", _token_bytes(token_ids[: chunk_tokens * chunks]))
