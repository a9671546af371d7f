"""The names of a request's context KV: what the consumer's prefix cache keys its chunks by, and the
prefix key that asks the producer for only the tokens after a cached prefix.

A key names everything that shaped the bytes (shared.chunks): for the consumer's own prefill, its
model identity (weights at their precision, forward config, dtype); for a transfer, also the
producer's identity and the dtype its KV was computed in, the codec, its payload format and
resolved options. And whose it is: every key has the request's tenant (shared.tenants, the
request's cache_salt or the caller's token) in its root, so one tenant never reuses another's.
Lookups name the producer as the link check last saw it (consumer.link.readiness); inserts name the
producer and codec metadata the stream's own header named, so KV a swapped or unlike producer made is
never kept under another's key. A lookup, made before any header, assumes the codec metadata the
last stream of that codec and options from the producer the link sees now gave (`lookup_metadata`);
a partial transfer's header must then name the same (the pipeline checks it), so a prefix rebuilt
under one artifact or schedule is never joined to a tail rebuilt under another.

Also remembers, per codec and options, what the last stream header said about the producer's own
chunks (identity, dtype, codec metadata, chunk size): the producer's prefix key is computed from
it and the tenant the producer files the request under (GenerateJob.producer_tenant).
Runs on the event loop; knows nothing about gRPC, the pool or the engine.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from shared import chunks
from shared.codecs import Codec, EncodeRequest
from shared.codecs.base import StreamInfo, cut_at_chunks
from shared.errors import ServiceError
from shared.models import ModelInfo


@dataclass(frozen=True)
class StreamRoot:
    """What a stream header said that names the producer's chunks of a codec's payloads."""

    producer_identity: str
    kv_dtype: str
    metadata: dict[str, str]
    chunk_tokens: int


def stream_key(codec: Codec, options: dict[str, str]) -> str:
    return json.dumps([codec.name, sorted(options.items())])


class PrefixKeys:
    def __init__(
        self,
        info: ModelInfo,
        chunk_tokens: int | None,
        producer_identity: Callable[[], str],
        producer_dtype: Callable[[], str],
    ):
        self.info = info  # the consumer's model
        self.chunk_tokens = chunk_tokens  # the prefix cache's chunk size; None: no prefix cache
        self.producer_identity, self.producer_dtype = producer_identity, producer_dtype  # as the link last saw them
        self.stream_roots: dict[str, StreamRoot] = {}  # per codec and options: what the last header said
        self.chains = chunks.Chains()  # a request's chains hashed once, whoever asks

    def lookup_metadata(self, codec: Codec | None, options: dict[str, str]) -> dict[str, str]:
        """The codec metadata a lookup of `codec` and `options` assumes: what the last stream of
        them said, if it came from the producer the link sees now; else none (a codec whose streams
        carry metadata then finds nothing until a stream has said it)."""
        seen = self.stream_roots.get(stream_key(codec, options)) if codec is not None else None
        if seen is None or (seen.producer_identity, seen.kv_dtype) != (self.producer_identity(), self.producer_dtype()):
            return {}
        return dict(seen.metadata)

    def root(
        self,
        codec: Codec | None,
        options: dict[str, str],
        tenant: str,
        producer: tuple[str, str] | None = None,
        metadata: dict[str, str] | None = None,
    ) -> str | None:
        """The root of `tenant`'s KV made by `codec` (None: the own prefill) from `producer`'s
        (identity, kv dtype) with the codec `metadata` its stream's header gave; by default the
        producer as the link last saw it, with `lookup_metadata`. None when it cannot be named (the
        producer or its identity is not known yet, or no prefix cache). The consumer's own identity
        is in every root: its pool holds KV in its own dtype."""
        if self.chunk_tokens is None:
            return None
        if codec is None:
            return chunks.model_root(self.info.identity, self.info.dtype, tenant)
        if metadata is None:
            metadata = self.lookup_metadata(codec, options) if producer is None else {}
        identity, dtype = producer or (self.producer_identity(), self.producer_dtype())
        if not identity or not dtype:
            return None
        own = f"{self.info.identity}|{identity}"
        return chunks.codec_root(own, dtype, codec.name, codec.format_version, options, metadata, tenant)

    def chain(
        self,
        codec: Codec | None,
        options: dict[str, str],
        context_ids: list[int],
        tenant: str,
        producer: tuple[str, str] | None = None,
        metadata: dict[str, str] | None = None,
    ) -> list[chunks.ChunkRef]:
        """The context's chunk refs under `root` ([] when it cannot be named)."""
        root = self.root(codec, options, tenant, producer, metadata)
        if root is None or self.chunk_tokens is None:
            return []
        return self.chains.chain(root, context_ids, self.chunk_tokens)

    def saw_stream(self, codec: Codec, options: dict[str, str], stream: StreamInfo, chunk_tokens: int) -> None:
        self.stream_roots[stream_key(codec, options)] = StreamRoot(
            stream.producer_identity, stream.kv_dtype, dict(stream.metadata), chunk_tokens
        )

    def partial(
        self,
        codec: Codec,
        options: dict[str, str],
        context_ids: list[int],
        cached_chunks: int,
        producer_tenant: str,
        metadata: dict[str, str],
    ) -> tuple[int, str] | None:
        """(first_token, prefix_key) asking the producer for the context after `cached_chunks` full
        chunks, when it can: the codec's decoder takes such a stream, the producer cuts its chunks as
        we do, this codec's payloads cut along tokens there, and an earlier stream of this codec and
        options, from the producer the link sees now, told us its identity, dtype and codec metadata
        (its prefix key is computed from them and `producer_tenant`, the tenant the producer files
        this request under), and that metadata is the `metadata` the cached chunks were looked up
        under."""
        if not cached_chunks or self.chunk_tokens is None or not codec.partial_streams:
            return None
        seen = self.stream_roots.get(stream_key(codec, options))
        size = self.chunk_tokens
        if (
            seen is None
            or not seen.producer_identity
            or seen.chunk_tokens != size
            or (seen.producer_identity, seen.kv_dtype) != (self.producer_identity(), self.producer_dtype())
            or dict(seen.metadata) != metadata
        ):
            return None
        try:
            layouts = codec.stream_layouts(options, seen.metadata, EncodeRequest(len(context_ids), self.info.weight_digest))
        except ServiceError:
            return None
        if cut_at_chunks(layouts, size) is None:
            return None
        first = cached_chunks * size
        root = chunks.codec_root(
            seen.producer_identity, seen.kv_dtype, codec.name, codec.format_version, options, seen.metadata, producer_tenant
        )
        return first, chunks.prefix_key(root, context_ids, first, size)
