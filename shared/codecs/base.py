"""The transfer-codec interface: one pipeline, many ways to move a context's KV state.

A `Codec` is created once per service around that service's model. Per request it makes:
- on the producer, a `LayerEncoder`, fed one `LayerState` per decoder layer as the prefill
  reaches it, returning the named tensors (`payloads`) to send for that layer;
- on the consumer, a `CacheDecoder`, fed each layer's payloads as they arrive (on the compute
  thread, while later layers are in flight) and finally asked for the rebuilt cache.
The services never look inside payloads: adding a codec means adding a module and registering
it here, nothing else. Codecs never import grpc or the servers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, ClassVar, Mapping, Sequence

import torch
from transformers import DynamicCache

from shared.errors import InvalidArgument
from shared.kv import Capture, LayerState  # noqa: F401  (part of the codec interface)
from shared.models import LoadedModel

if TYPE_CHECKING:
    from shared.scd.artifact import Artifact


@dataclass(frozen=True)
class StreamInfo:
    """What the consumer's decoder learns from the stream header."""

    num_layers: int
    num_tokens: int
    kv_dtype: str
    options: Mapping[str, str]
    metadata: Mapping[str, str] = field(default_factory=dict)
    format_version: int = 1


class LayerEncoder(ABC):
    """Producer side, one per request."""

    captures: Capture = Capture.KV

    @abstractmethod
    def encode(self, state: LayerState) -> dict[str, torch.Tensor]:
        """Payloads for this layer, name -> CPU tensor in its wire dtype (may be empty)."""

    def metadata(self) -> dict[str, str]:
        """Codec metadata for the stream header."""
        return {}


class CacheDecoder(ABC):
    """Consumer side, one per request. Methods run on the consumer's compute thread."""

    @abstractmethod
    def add_layer(self, layer: int, payloads: dict[str, torch.Tensor]) -> None:
        """Rebuild what this layer's payloads carry (called in layer order)."""

    @abstractmethod
    def finish(self, context_ids: torch.Tensor) -> DynamicCache:
        """The consumer model's cache over the context; context_ids is [1, T] on its device."""


class Codec(ABC):
    name: ClassVar[str]
    description: ClassVar[str]
    uses_producer: ClassVar[bool] = True
    format_version: ClassVar[int] = 1
    # option name -> (default, parser); parsers raise ValueError on bad values
    option_parsers: ClassVar[Mapping[str, tuple[str, Callable[[str], object]]]] = {}

    def __init__(self, model: LoadedModel, artifacts: Sequence["Artifact"] = ()):
        self.model = model
        self.artifacts = list(artifacts)  # calibrated codec artifacts (shared.scd.artifact), if any

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

    @abstractmethod
    def encoder(self, options: Mapping[str, str], num_tokens: int) -> LayerEncoder: ...

    def make_encoder(self, options: Mapping[str, str], num_tokens: int, consumer_digest: str) -> LayerEncoder:
        """What the producer calls; codecs that depend on the consumer's weights override this."""
        return self.encoder(options, num_tokens)

    @abstractmethod
    def decoder(self, stream: StreamInfo) -> CacheDecoder: ...


_REGISTRY: dict[str, type[Codec]] = {}


def register(cls: type[Codec]) -> type[Codec]:
    _REGISTRY[cls.name] = cls
    return cls


def registered() -> dict[str, type[Codec]]:
    return dict(_REGISTRY)


def create_codecs(model: LoadedModel, names: list[str] | None = None, artifacts: Sequence["Artifact"] = ()) -> dict[str, Codec]:
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
