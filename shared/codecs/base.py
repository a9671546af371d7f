"""The transfer-codec interface: one pipeline, many ways to move a context's KV state.

A `Codec` is created once per service around that service's model (`create_codecs`). Per
request it makes, through one entry point on each side:
- on the producer, `Codec.encoder(options, request)`: a `LayerEncoder`, fed one `LayerState`
  per decoder layer as the prefill reaches it, returning the named tensors (`payloads`) to send;
- on the consumer, `Codec.decoder(stream)`: a `CacheDecoder` that declares, per layer, the exact
  payloads it accepts (`expected`: name -> element type and shape, from the stream header and
  the request), is fed each layer's payloads as they arrive (on the compute thread, while later
  layers are in flight) and finally hands over the rebuilt cache. Requests whose decoders give
  a layer the same `batch_key` have it rebuilt in one call (`add_layers`: the consumer engine
  groups the rebuilds queued together).
The services never look inside payloads; the consumer's stream reader validates every chunk
against `expected` before buffering it. Adding a codec means adding a module and registering
it here, nothing else. Codecs never import grpc or the servers. Taking the context locally
(mode "oracle") is the consumer's own path, not a codec.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

from shared import logs
from shared.errors import InvalidArgument
from shared.kv import Capture, KVSink, LayerState
from shared.models import DTYPES, LoadedModel

if TYPE_CHECKING:
    from shared.scd.artifact import Artifact


@dataclass(frozen=True)
class StreamInfo:
    """What the consumer's decoder learns from the stream header (already checked against the
    request: token count, codec name and options, dtype whitelist)."""

    num_layers: int
    num_tokens: int
    kv_dtype: str  # one of shared.models.DTYPES
    options: Mapping[str, str]
    metadata: Mapping[str, str] = field(default_factory=dict)
    format_version: int = 1
    producer_digest: str = ""  # the producer's artifact digest (weights rounded to bf16), as its header states it
    first_token: int = 0  # payloads cover tokens [first_token, num_tokens) (a consumer holding the prefix)
    producer_identity: str = ""  # what shaped the producer's K/V (ModelInfo.identity), as its header states it
    kept_tokens: int = 0  # a keep transfer (shared.codecs.kept): tokens kept per layer; 0: every token sent

    @property
    def sent_tokens(self) -> int:
        """Tokens along the payloads' token axis."""
        return self.kept_tokens or self.num_tokens - self.first_token

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        return DTYPES[self.kv_dtype]


@dataclass(frozen=True)
class EncodeRequest:
    """What the producer knows about the request an encoder serves."""

    num_tokens: int
    consumer_digest: str = ""  # the consumer's weight digest, "" when the caller did not say


@dataclass(frozen=True)
class PayloadSpec:
    """One payload a decoder accepts: element type and exact shape."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


Schema = dict[str, PayloadSpec]


class LayerEncoder(ABC):
    """Producer side, one per request."""

    captures: Capture = Capture.KV

    @abstractmethod
    def encode(self, state: LayerState) -> dict[str, torch.Tensor]:
        """Payloads for this layer, name -> CPU tensor in its wire dtype (may be empty)."""

    def metadata(self) -> dict[str, str]:
        """Codec metadata for the stream header."""
        return {}

    # Chunked reuse (shared.chunks, producer.reuse). True when a token's payloads depend on that
    # token's layer state alone: a continued prefill, which captures only the new tokens' states
    # on top of a stored prefix, then encodes them exactly as a whole-context encode would.
    # Causal encoders (a window over earlier tokens, a learned predictor) are not per token.
    per_token: bool = False
    # Layers whose payloads read earlier tokens' normalized input (a window, a learned predictor)
    # in an encoder that is otherwise per token: a continued prefill encodes them over the stored
    # prefix's normalized input joined with the new tokens' (producer.reuse), then cuts the new
    # tokens' payloads out.
    causal_layers: frozenset[int] = frozenset()
    # False when encode returns the layer's K/V as they are, {"k": keys, "v": values} (raw): the
    # producer then keeps those host copies as its chunks' K/V, and encodes stored K/V where they
    # are instead of moving them to the model's device and back (producer.reuse).
    computes: bool = True

    def token_layout(self, layer: int) -> dict[str, tuple[int, int]] | None:
        """How layer `layer`'s payloads cut along tokens: name -> (token axis, tokens per element
        along it: 1, or the quantization group). Given only for causal encoders, whose payloads
        over tokens [0, b) are the first tokens' payloads of any longer context. None (default):
        they cannot be cut, so they are only ever stored and sent whole."""
        return None


def chunk_layouts(encoder: LayerEncoder, num_layers: int, chunk_tokens: int) -> list[dict[str, tuple[int, int]]] | None:
    """Every layer's token layout when all of them cut at multiples of chunk_tokens (each
    group divides it), else None."""
    return cut_at_chunks([encoder.token_layout(layer) for layer in range(num_layers)], chunk_tokens)


def cut_at_chunks(
    layouts: Sequence[dict[str, tuple[int, int]] | None], chunk_tokens: int
) -> list[dict[str, tuple[int, int]]] | None:
    """The layouts when every layer's cut at multiples of chunk_tokens (each group divides it), else None."""
    out = []
    for layout in layouts:
        if layout is None or any(chunk_tokens % group for _, group in layout.values()):
            return None
        out.append(layout)
    return out


@dataclass(frozen=True)
class LayerJob:
    """One request's rebuild of one layer: its decoder, the layer and the layer's payloads."""

    decoder: CacheDecoder
    layer: int
    payloads: dict[str, torch.Tensor]


def add_layers(jobs: Sequence[LayerJob]) -> tuple[list[BaseException | None], int]:
    """Rebuild layers of several requests: jobs whose decoders give the same batch_key in one
    `add_layer_batch` call, the others one by one. Returns per job, in order, the exception its
    rebuild raised or None, and how many jobs shared a decode with another. A batched call that
    fails as a whole is retried job by job, so a request's bad payloads fail that request alone."""
    out: list[BaseException | None] = [None] * len(jobs)
    batched = 0
    groups: dict[Hashable, list[int]] = {}
    for i, job in enumerate(jobs):
        key = job.decoder.batch_key(job.layer)
        groups.setdefault(("single", i) if key is None else ("batch", type(job.decoder), key), []).append(i)
    for members in groups.values():
        if len(members) > 1:
            try:
                errors = type(jobs[members[0]].decoder).add_layer_batch([jobs[i] for i in members])
            except Exception as exc:  # retried one by one below; said, since every batch failing costs its speed
                logs.get("codecs").warning(
                    "batched_rebuild_failed", layer=jobs[members[0]].layer, jobs=len(members), error=repr(exc)
                )
            else:
                for i, error in zip(members, errors):
                    out[i] = error
                batched += len(members)
                continue
        for i in members:
            try:
                jobs[i].decoder.add_layer(jobs[i].layer, jobs[i].payloads)
            except Exception as exc:
                out[i] = exc
    return out, batched


class CacheDecoder(ABC):
    """Consumer side, one per request. add_layer and finish run on the consumer's compute thread."""

    @abstractmethod
    def expected(self, layer: int) -> Schema:
        """Exactly the payloads layer `layer` carries (may be empty)."""

    @abstractmethod
    def add_layer(self, layer: int, payloads: dict[str, torch.Tensor]) -> None:
        """Rebuild what this layer's payloads carry (called in layer order, payloads as `expected`)."""

    @abstractmethod
    def finish(self) -> KVSink:
        """The consumer model's cache over the context, once every layer was added: the decoder's
        own DynamicCache, or the target given to `bind`."""

    def batch_key(self, layer: int) -> Hashable | None:
        """Decoders whose keys for a layer are equal (not None) rebuild it together through
        `add_layer_batch`; None (the default): this layer is rebuilt on its own."""
        return None

    @classmethod
    def add_layer_batch(cls, jobs: Sequence[LayerJob]) -> list[BaseException | None]:
        """Rebuild one layer of several requests (their decoders share the layer's batch_key) in
        one decode: per job the exception its own rebuild raised, or None. Each job's result
        must be exactly what its own add_layer gives: one request's payloads never change
        another's cache."""
        raise NotImplementedError(f"{cls.__name__} has no batched rebuild")

    def check(self, layer: int, name: str, payload: torch.Tensor) -> None:
        """Called by the stream reader as each payload of a layer completes, before the layer is
        handed over: raise DataLoss to refuse the stream at that message. Default: nothing to check
        beyond the schema."""
        return None

    def at_positions(self, positions: torch.Tensor) -> None:
        """A keep transfer (shared.codecs.kept): the original positions [n] of the next add_layer's
        tokens, for decoders that rotate keys they rebuild; K/V sent post-RoPE ignore it (default)."""
        return None

    def bind(self, target: KVSink) -> None:
        """Write rebuilt layers into `target` (the consumer engine's KV pool blocks for this
        request) instead of a cache of its own; called before the first add_layer."""
        raise NotImplementedError(f"{type(self).__name__} cannot rebuild into an external cache")

    def audit_thresholds(self) -> tuple[float, ...] | None:
        """Per layer, the cache-audit error above which this stream's cache counts as diverged,
        when the codec has them calibrated (shared.audit); None: the consumer's default."""
        return None

    def richer_options(self) -> dict[str, str] | None:
        """Resolved options for a second transfer of the same context that this codec expects to
        rebuild more faithfully (the audit's `upgrade` policy), or None when there is none."""
        return None


class Codec(ABC):
    name: ClassVar[str]
    description: ClassVar[str]
    format_version: ClassVar[int] = 1  # bumped whenever the meaning of a payload changes
    # token selection (shared.codecs.kept): "" takes no keep set; "either" a set per KV head or one
    # shared by a layer's heads; "shared" only one shared by a layer's heads (payloads with one row
    # per token for every head)
    keep_heads: ClassVar[str] = ""
    # whether its decoder takes a stream of the tokens after a prefix the consumer holds
    # (StreamInfo.first_token > 0), so that a partial prefix-cache hit asks only for the rest
    partial_streams: ClassVar[bool] = True
    # option name -> (default, parser); parsers raise ValueError on bad values
    option_parsers: ClassVar[Mapping[str, tuple[str, Callable[[str], object]]]] = {}

    def __init__(self, model: LoadedModel, artifacts: Sequence[Artifact] = ()):
        self.model = model

    def resolve(self, options: Mapping[str, str]) -> dict[str, str]:
        """Validate options and fill defaults; errors name the option and what is allowed."""
        unknown = sorted(set(options) - set(self.option_parsers))
        if unknown:
            allowed = sorted(self.option_parsers) or "none"
            raise InvalidArgument(f"transfer.options: unknown option(s) {unknown} for codec '{self.name}'; allowed: {allowed}")
        resolved = {}
        for key, (default, parse) in self.option_parsers.items():
            value = options.get(key, default)
            try:
                parse(value)
            except ValueError as exc:
                raise InvalidArgument(f"transfer.options[{key!r}]={value!r} for codec '{self.name}': {exc}") from None
            resolved[key] = value
        return resolved

    def compute_start(self, options: Mapping[str, str]) -> tuple[float, float] | None:
        """Where the consumer's rebuild of this stream does its computing, for the transfer
        planner: (share of the stream's bytes, share of its layers) that must arrive before the
        work can start, the work then running at once for the rest of its length. None (the
        default): the work is spread evenly over the layers, each rebuilt as it arrives. Options
        are resolved."""
        return None

    @abstractmethod
    def encoder(self, options: Mapping[str, str], request: EncodeRequest) -> LayerEncoder:
        """The producer's entry point; options are resolved."""

    @abstractmethod
    def decoder(self, stream: StreamInfo) -> CacheDecoder:
        """The consumer's entry point; raises FailedPrecondition/DataLoss when the stream cannot be decoded here."""

    def stream_layouts(
        self, options: Mapping[str, str], metadata: Mapping[str, str], request: EncodeRequest
    ) -> list[dict[str, tuple[int, int]] | None]:
        """Per layer, the token layout (LayerEncoder.token_layout) of the stream a producer sends
        for these resolved options, whose header named `metadata`: what a consumer needs to ask for
        a stream's tail. Default: this side's own encoder's (the same codec computes the same
        layouts); a ServiceError when this side cannot build one."""
        encoder = self.encoder(options, request)
        return [encoder.token_layout(layer) for layer in range(self.model.info.num_layers)]


_REGISTRY: dict[str, type[Codec]] = {}


def register(cls: type[Codec]) -> type[Codec]:
    _REGISTRY[cls.name] = cls
    return cls


def registered() -> dict[str, type[Codec]]:
    return dict(_REGISTRY)


def create_codecs(model: LoadedModel, names: list[str] | None = None, artifacts: Sequence[Artifact] = ()) -> dict[str, Codec]:
    """Instantiate the named codecs (default: all registered) around one service's model."""
    chosen = names or sorted(_REGISTRY)
    missing = [n for n in chosen if n not in _REGISTRY]
    if missing:
        raise ValueError(f"codecs: unknown {missing}; registered: {sorted(_REGISTRY)}")
    return {n: _REGISTRY[n](model, artifacts) for n in chosen}


def lookup(codecs: Mapping[str, Codec], name: str) -> Codec:
    try:
        return codecs[name]
    except KeyError:
        raise InvalidArgument(f"transfer.name: unknown codec {name!r}; supported: {sorted(codecs)}") from None
