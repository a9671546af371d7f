"""Service configuration: one frozen, validated dataclass per service, read once at start-up.

Every field can be set by a command-line flag (`--max-chunk-bytes`) or an environment variable
(`SCD_PRODUCER_MAX_CHUNK_BYTES`); a flag wins over the environment, which wins over the default.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TypeVar

from shared.models import DTYPES
from shared.wire import DEFAULT_MAX_CHUNK_BYTES

C = TypeVar("C")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0: pick a free port (tests); services set their own default
    model: str = "tiny-llama"  # local path, hub id, or builtin tiny name
    dtype: str = "float32"
    device: str = "auto"  # "auto": cuda:0 when present, else cpu
    max_context_tokens: int = 8192
    drain_grace_s: float = 30.0  # SIGTERM: admitted calls get this long to finish; new ones get UNAVAILABLE
    log_level: str = "INFO"
    artifacts: str = ""  # comma-separated SCD artifact files or directories

    @property
    def artifact_paths(self) -> list[str]:
        return [p for p in self.artifacts.split(",") if p]

    def validate(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: {self.dtype!r} not in {sorted(DTYPES)}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: {self.port} not in 0..65535")
        if self.max_context_tokens < 1:
            raise ValueError("max_context_tokens: must be >= 1")
        if self.drain_grace_s < 0:
            raise ValueError("drain_grace_s: must be >= 0")


@dataclass(frozen=True)
class ProducerConfig(ServerConfig):
    port: int = 50051
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES
    max_inflight: int = 8  # concurrent Prefill calls; more get RESOURCE_EXHAUSTED
    store_bytes: int = 1 << 30  # context store budget (encoded streams kept for reuse); 0 disables

    def validate(self) -> None:
        super().validate()
        if not 1024 <= self.max_chunk_bytes <= DEFAULT_MAX_CHUNK_BYTES:
            raise ValueError(f"max_chunk_bytes: {self.max_chunk_bytes} not in 1024..{DEFAULT_MAX_CHUNK_BYTES}")
        if self.store_bytes < 0:
            raise ValueError(f"store_bytes: {self.store_bytes} must be >= 0")
        if self.max_inflight < 1:
            raise ValueError("max_inflight: must be >= 1")


@dataclass(frozen=True)
class ConsumerConfig(ServerConfig):
    port: int = 50052
    producer: str = "127.0.0.1:50051"  # producer address, host:port
    max_question_tokens: int = 1024
    max_new_tokens: int = 512
    max_text_bytes: int = 1 << 20  # context or question text longer than this is refused before tokenizing
    max_inflight: int = 16  # concurrent Generate calls; more get RESOURCE_EXHAUSTED
    default_timeout_s: float = 120.0  # used when the caller sets no deadline

    def validate(self) -> None:
        super().validate()
        if self.max_question_tokens < 1 or self.max_new_tokens < 1:
            raise ValueError("max_question_tokens and max_new_tokens: must be >= 1")
        if self.max_text_bytes < 1 or self.max_inflight < 1:
            raise ValueError("max_text_bytes and max_inflight: must be >= 1")
        if self.default_timeout_s <= 0:
            raise ValueError("default_timeout_s: must be > 0")


def load(cls: type[C], service: str, argv: Sequence[str] | None = None, env: dict | None = None) -> C:
    """Build `cls` from flags and SCD_<SERVICE>_<FIELD> environment variables, then validate."""
    env = os.environ if env is None else env
    parser = argparse.ArgumentParser(prog=f"python -m {service}", description=f"SCD {service} service")
    for f in fields(cls):
        var = f"SCD_{service.upper()}_{f.name.upper()}"
        default = env.get(var, f.default)
        parser.add_argument(
            f"--{f.name.replace('_', '-')}",
            type=type(f.default),
            default=type(f.default)(default),
            help=f"(env {var}, default {f.default!r})",
        )
    config = cls(**vars(parser.parse_args(argv)))
    config.validate()
    return config


def replace(config: C, **changes) -> C:
    new = dataclasses.replace(config, **changes)
    new.validate()
    return new
