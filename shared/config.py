"""Service configuration: one frozen, validated dataclass per service, read once at start-up.

Every field can be set by a command-line flag (`--max-chunk-bytes`) or an environment variable
(`SCD_PRODUCER_MAX_CHUNK_BYTES`); a flag wins over the environment, which wins over the default.
Booleans read 1/true/yes/on and 0/false/no/off (`--reflection` alone means true). Secrets (the
bearer tokens) are best given by file (`--token-file`) or environment, never on a command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, NoReturn, Protocol, TypeVar

from shared import kernel_cache
from shared.compute_dtype import AUTO as AUTO_DTYPE
from shared.models import DTYPES
from shared.tracing import TRACE_MODES
from shared.wire import DEFAULT_MAX_CHUNK_BYTES


class Validated(Protocol):
    """What `load` and `replace` build: a dataclass that checks itself."""

    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    def validate(self) -> None: ...


C = TypeVar("C", bound=Validated)
ORACLE_MODE = "oracle"  # the consumer's own prefill, as consumer.pipeline.pipeline names it (shared never imports consumer)
AUTO_MODE = "auto"  # the consumer picks the fastest mode within a loss budget (consumer.auto.chooser)
LB_POLICIES = ("ring_hash", "round_robin", "pick_first")


def parse_bool(value: str | bool) -> bool:
    if isinstance(value, bool):
        return value
    text = value.strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {value!r}")


parse_bool.__name__ = "boolean (true/false/1/0/yes/no/on/off)"  # argparse names a bad value's type by it


def _integer(value: str | int) -> int:
    return int(value)


def _number(value: str | float) -> float:
    return float(value)


_integer.__name__ = "integer"
_number.__name__ = "number"
KINDS: dict[type, tuple[Callable[[Any], Any], str]] = {
    bool: (parse_bool, "not a boolean (use true/false, 1/0, yes/no or on/off)"),
    int: (_integer, "not an integer"),
    float: (_number, "not a number"),
    str: (str, "not text"),
}


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # listen address of every port (API, health, metrics)
    port: int = 0  # API port (0: any free port); services set their own default
    model: str = "tiny-llama"  # local directory, builtin tiny name, or hub id in the local cache (HF_HUB_OFFLINE=0 downloads)
    dtype: str = "auto"  # auto (bfloat16 where the device computes it natively, else float32; shared.compute_dtype), float32, bfloat16 or float16
    device: str = "auto"  # auto (cuda:0 when present, else cpu), cpu, cuda or cuda:N
    max_context_tokens: int = 8192  # longest context a request may carry, in tokens
    # what an API port holds before a handler runs (shared.grpc_server): grpc-core reads a call's whole
    # request message before admission sees it, so that memory is at most max_calls x the request limit
    max_connections: int = 2048  # connections each API port holds open at once (gRPC, HTTP); one more is closed
    max_calls: int = 0  # gRPC calls of every method in progress on the API port at once; past it RESOURCE_EXHAUSTED before the request is read; 0: max_inflight + 64
    drain_grace_s: float = 30.0  # SIGTERM: admitted calls get this long to finish; new ones get UNAVAILABLE
    log_level: str = "INFO"  # DEBUG, INFO, WARNING, ERROR: JSON log lines on stderr
    artifacts: str = ""  # comma-separated SCD artifact files or directories
    # transport security and caller authentication (shared.security)
    tls_cert: str = ""  # PEM server certificate chain; with tls_key the API port speaks TLS
    tls_key: str = ""  # PEM private key of tls_cert
    tls_client_ca: str = ""  # PEM CA bundle that signs client certificates (mTLS)
    require_client_cert: bool = True  # with tls_client_ca: refuse a client without a certificate from it
    token_file: str = ""  # file holding the bearer token callers must send (health Check exempt)
    token: str = field(default="", repr=False)  # the bearer token itself (prefer the env var or token_file)
    reflection: bool = False  # gRPC server reflection (v1 and v1alpha)
    # side ports: -1 off, 0 any free port (tests)
    health_port: int = -1  # plaintext port serving only grpc.health.v1 (kubelet gRPC probes)
    metrics_port: int = -1  # Prometheus text exposition over HTTP (shared.metrics)
    liveness_interval_s: float = 5.0  # how often the progress watchdog looks (liveness)
    trace: str = "off"  # OpenTelemetry spans: off | console (JSON on stderr) | memory (tests) | otlp; shared.tracing
    liveness_timeout_s: float = 30.0  # an iteration without progress this long: liveness NOT_SERVING
    torch_threads: int = 0  # torch's intra-op threads (0: one on CUDA, else one per core; shared.torch_threads)
    malloc_mmap_threshold: int = 33554432  # glibc: message-sized buffers reused from the heap (shared.malloc_tuning); 0 off
    onednn_cache_entries: int = kernel_cache.DEFAULT_ENTRIES  # CPU: matmul kernels oneDNN keeps (shared.kernel_cache); -1: 1024
    # KV cache events in vLLM's wire format (shared.kv_events): the producer's chunk store, the consumer's prefix cache
    kv_events_endpoint: str = ""  # ZMQ PUB address of KV events (tcp://*:5557 binds, tcp://host:port connects); "" off
    kv_events_replay_endpoint: str = ""  # ZMQ ROUTER address answering replay requests (tcp://*:5558); "" off
    kv_events_topic: str = ""  # topic frame of every event message (vLLM's default: empty)
    kv_events_block_size: int = 16  # vLLM block size the events' hashes use (a divisor of chunk_tokens)
    kv_events_hash: str = "sha256_cbor"  # block hash: sha256_cbor (cross-language) | sha256 (vLLM's pickle default)
    kv_events_hash_seed: str = "0"  # vLLM's PYTHONHASHSEED: the first block's parent is hash(seed); routers must use the same
    kv_events_layout: str = "vllm-0.24"  # named for the vLLM that decodes it: vllm-0.24 (events as maps) | vllm-0.23 (arrays)
    # what the publisher may hold (vLLM's KVEventsConfig names and defaults): messages queued per subscriber
    # that does not read (ZMQ's send high-water mark; past it that subscriber misses messages), batches kept
    # for replay, event records waiting for the publisher's thread (past it they are dropped and counted)
    kv_events_hwm: int = 100_000  # messages queued per subscriber that does not read (ZMQ SNDHWM); >= 1
    kv_events_buffer_steps: int = 10_000  # event batches kept for replay requests; >= 1
    kv_events_max_queue: int = 100_000  # event records waiting for the publisher's thread (then dropped, counted); >= 1

    @property
    def artifact_paths(self) -> list[str]:
        return [p for p in self.artifacts.split(",") if p]

    @property
    def calls_limit(self) -> int:
        """The API port's cap on calls in progress (`max_calls`, or the service's admission limit
        plus room for Describe, health watches and the refusals that name a limit of their own)."""
        return self.max_calls or getattr(self, "max_inflight", 64) + 64

    @property
    def request_bytes_limit(self) -> int:
        """The largest request message the API port takes (grpc.max_receive_message_length): twice
        what the longest allowed context's ids take (a uint32 is at most 5 bytes), so that a request
        a little over max_context_tokens still arrives and is refused naming its field, plus 64 KiB
        for the other fields."""
        return 2 * 5 * self.max_context_tokens + (64 << 10)

    def validate(self) -> None:
        if self.trace not in TRACE_MODES:
            raise ValueError(f"trace: {self.trace!r} not in {', '.join(TRACE_MODES)}")
        if self.dtype not in DTYPES and self.dtype != AUTO_DTYPE:
            raise ValueError(f"dtype: {self.dtype!r} not in {[AUTO_DTYPE, *sorted(DTYPES)]}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: {self.port} not in 0..65535")
        if self.max_context_tokens < 1:
            raise ValueError("max_context_tokens: must be >= 1")
        if self.max_calls < 0:
            raise ValueError(f"max_calls: {self.max_calls} must be >= 0 (0: max_inflight + 64)")
        if self.max_connections < 1:
            raise ValueError(f"max_connections: {self.max_connections} must be >= 1")
        if self.drain_grace_s < 0:
            raise ValueError("drain_grace_s: must be >= 0")
        for name in ("health_port", "metrics_port"):
            if not -1 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name}: {getattr(self, name)} not in -1..65535 (-1 off, 0 any free port)")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key: set both or neither")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("tls_client_ca: needs tls_cert and tls_key (mTLS is TLS with client certificates)")
        if self.malloc_mmap_threshold < 0:
            raise ValueError(f"malloc_mmap_threshold: {self.malloc_mmap_threshold} must be >= 0 (0: glibc's defaults)")
        if self.onednn_cache_entries < -1:
            raise ValueError(f"onednn_cache_entries: {self.onednn_cache_entries} must be >= -1 (-1: oneDNN's default)")
        if self.torch_threads < 0:
            raise ValueError(f"torch_threads: {self.torch_threads} must be >= 0 (0: torch's default)")
        if self.liveness_interval_s <= 0 or self.liveness_timeout_s <= 0:
            raise ValueError("liveness_interval_s and liveness_timeout_s: must be > 0")
        if self.kv_events_hash not in ("sha256_cbor", "sha256"):
            raise ValueError(f"kv_events_hash: {self.kv_events_hash!r} not in sha256_cbor, sha256")
        if self.kv_events_layout not in ("vllm-0.24", "vllm-0.23"):
            raise ValueError(
                f"kv_events_layout: {self.kv_events_layout!r} not in vllm-0.24 (events as maps, vLLM >= 0.24), "
                "vllm-0.23 (events as arrays, vLLM <= 0.23)"
            )
        for name in ("kv_events_hwm", "kv_events_buffer_steps", "kv_events_max_queue"):
            if getattr(self, name) < 1:  # ZMQ reads a high-water mark of 0 as no limit at all
                raise ValueError(f"{name}: {getattr(self, name)} must be >= 1 (it bounds the publisher's memory)")
        if self.kv_events_block_size < 1:
            raise ValueError(f"kv_events_block_size: {self.kv_events_block_size} must be >= 1")
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ValueError("kv_events_replay_endpoint: needs kv_events_endpoint")
        chunk_tokens = getattr(self, "chunk_tokens", 0)
        if self.kv_events_endpoint and (not chunk_tokens or chunk_tokens % self.kv_events_block_size):
            raise ValueError(
                f"kv_events_endpoint: needs chunk_tokens ({chunk_tokens}) a positive multiple of kv_events_block_size "
                f"{self.kv_events_block_size} (events name the chunk stores' blocks)"
            )


@dataclass(frozen=True)
class ProducerConfig(ServerConfig):
    port: int = 50051
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES  # payload chunk size on the wire, 1024 .. 4 MiB (announced in the header)
    max_inflight: int = 32  # concurrent Prefill calls; more get RESOURCE_EXHAUSTED
    store_bytes: int = 1 << 30  # context store budget (encoded streams kept for reuse); 0 disables
    max_prefill_batch: int = 8  # cold contexts prefilled together in one forward, at most
    max_prefill_batch_tokens: int = 8192  # padded tokens (contexts x longest) of one batched forward; a longer context runs alone
    encode_threads: int = 1  # threads encoding, copying to the host and packing layers beside the forward
    # prefix reuse (shared.chunks, producer.chunk_store): contexts cut into chunks of this many
    # tokens, K/V and encoded payloads kept per chunk within store_bytes; 0: the whole-context store
    chunk_tokens: int = 256  # store chunk size in tokens (prefix reuse); 0: whole-context store
    store_eviction: str = "cost"  # cost (value per byte from hits and position, leaves first) | lru
    store_disk_dir: str = ""  # chunk store's disk tier (safetensors files); "" off
    store_disk_bytes: int = 8 << 30  # disk tier budget
    store_disk_queue_bytes: int = 256 << 20  # disk writes queued (tensor bytes) at most; past it a write is skipped, counted
    # a Prefill's own limits (shared.call_watch, producer.flight.Unsent): a reader that stops or falls behind
    # costs its own call, never the others' slots or the process's memory
    default_timeout_s: float = 120.0  # deadline in seconds of a Prefill whose caller sets none
    max_timeout_s: float = 600.0  # no Prefill runs longer, whatever deadline its caller sets
    write_idle_timeout_s: float = 60.0  # one message waiting this long for the reader ends the call (0: no limit)
    max_request_unsent_bytes: int = 2 << 30  # encoded payload bytes one call holds unread, at most (0: no limit)
    max_unsent_bytes: int = 8 << 30  # the same over all calls; past it the furthest behind fails (0: no limit)

    def validate(self) -> None:
        super().validate()
        for name in ("max_prefill_batch", "max_prefill_batch_tokens", "encode_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: {getattr(self, name)} must be >= 1")
        if not 1024 <= self.max_chunk_bytes <= DEFAULT_MAX_CHUNK_BYTES:
            raise ValueError(f"max_chunk_bytes: {self.max_chunk_bytes} not in 1024..{DEFAULT_MAX_CHUNK_BYTES}")
        if self.store_bytes < 0:
            raise ValueError(f"store_bytes: {self.store_bytes} must be >= 0")
        if self.chunk_tokens < 0 or self.store_disk_bytes < 0:
            raise ValueError("chunk_tokens and store_disk_bytes: must be >= 0")
        if self.store_disk_queue_bytes < 1:
            raise ValueError(f"store_disk_queue_bytes: {self.store_disk_queue_bytes} must be >= 1")
        if self.store_eviction not in ("cost", "lru"):
            raise ValueError(f"store_eviction: {self.store_eviction!r} not in cost, lru")
        if self.max_inflight < 1:
            raise ValueError("max_inflight: must be >= 1")
        if not 0 < self.default_timeout_s <= self.max_timeout_s:
            raise ValueError(f"default_timeout_s: {self.default_timeout_s} must be > 0 and <= max_timeout_s {self.max_timeout_s}")
        for name in ("write_idle_timeout_s", "max_request_unsent_bytes", "max_unsent_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: {getattr(self, name)} must be >= 0 (0: no limit)")


@dataclass(frozen=True)
class ConsumerConfig(ServerConfig):
    port: int = 50052
    producer: str = "127.0.0.1:50051"  # any gRPC target: host:port, dns:///producer:50051, ipv4:a:p,b:p
    producer_lb: str = "ring_hash"  # ring_hash (context affinity by x-context-hash) | round_robin | pick_first
    producer_tls_ca: str = ""  # PEM CA that signs the producers' certificates; set: the channel uses TLS
    producer_tls_cert: str = ""  # PEM client certificate for mTLS to the producers
    producer_tls_key: str = ""  # PEM private key of producer_tls_cert
    producer_tls_server_name: str = ""  # expected name in the producer certificate when it differs from the target's
    producer_token_file: str = ""  # bearer token sent to the producers
    producer_token: str = field(default="", repr=False)  # the producers' bearer token itself (prefer the env var or file)
    keepalive_s: float = 30.0  # channel keepalive ping period to the producers
    max_question_tokens: int = 1024  # longest question, in tokens
    max_new_tokens: int = 512  # most tokens generated per request
    max_text_bytes: int = 1 << 20  # context or question text longer than this is refused before tokenizing
    max_inflight: int = 64  # concurrent Generate calls (running or waiting for KV memory); more get RESOURCE_EXHAUSTED
    audit_threshold: float = 0.05  # cache-audit error counted as divergence when the codec has no calibrated one
    default_timeout_s: float = 120.0  # deadline in seconds of a call whose caller sets none
    default_mode: str = ""  # mode of a request naming none; empty: auto (consumer.auto.defaults)
    allow_naive_reuse_default: bool = False  # allow a --default-mode raw/quant/recompute across unlike weights
    probe_idle_s: float = 60.0  # idle this long: one small background transfer keeps auto's estimates fresh (0: off)
    producer_check_interval_s: float = 10.0  # re-check of the producer link (reachable, authenticated, compatible)
    # the batch engine (consumer/engine/batch.py, docs/design.md "The serving engine")
    max_batch: int = 32  # rows per engine forward (1: one request per forward, the pre-batching behaviour)
    kv_pool_bytes: int = 0  # KV pool size; 0: max_batch requests of 2048 tokens or two of the largest allowed, capped by memory
    kv_block_tokens: int = 16  # tokens per KV pool block
    max_queue: int = 64  # requests waiting for KV memory; more get RESOURCE_EXHAUSTED
    prefill_chunk: int = 0  # tokens one request prefills per engine iteration (chunked prefill); 0: the device's default (consumer.engine.prefill_budget)
    max_batch_tokens: int = 0  # prefill tokens per engine iteration, all requests together; 0: the device's default
    stream_interval: int = 1  # tokens per streamed message after the first (1: each alone; as vLLM's --stream-interval)
    verify_draft_bytes: int = 32 << 20  # verified decoding: sampled drafts a request keeps, bytes (consumer.engine.speculative)
    engine_process: bool = False  # the engine's forwards in a child process, the KV pool in shared memory
    exact_by_transfer: bool = True  # exact answers may rest on a producer that describes this model and dtype (its raw / recompute K/V); false: only on the own forward
    decode_attention: str = "auto"  # CPU decode rows: auto (paged kernel, else SDPA), kernel (or fail start), sdpa
    prefill_attention: str = "auto"  # CPU prefill rows, bf16: auto (AVX-512 BF16 kernel where it runs, else SDPA), kernel, sdpa
    packed_weights: bool = True  # CPU: projections on oneDNN-prepacked weights (a second copy in memory)
    fused_ops: bool = True  # CPU: the forward's norms, residual adds, SiLU * up and RoPE fused (AVX-512 extension)
    chunk_tokens: int = 256  # context chunk size of the prefix cache (a multiple of kv_block_tokens)
    prefix_cache_bytes: int = -1  # KV pool bytes the prefix cache may keep; -1: half the pool, 0: off
    http_port: int = -1  # OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models; consumer.api.openai_api); -1 off, 0 any free port
    served_model_name: str = ""  # the model's one public name (/v1/models, Describe, logs, metrics); empty: --model's basename

    def _prompt_bytes_limit(self, bytes_per_id: int) -> int:
        """Twice the larger of a prompt's text (max_text_bytes) and the context's and question's ids
        at bytes_per_id each, plus 64 KiB for the other fields: a prompt a little over its limit still
        arrives, to be refused naming its field. The one rule of both API ports."""
        ids = bytes_per_id * (self.max_context_tokens + self.max_question_tokens)
        return 2 * max(self.max_text_bytes, ids) + (64 << 10)

    @property
    def request_bytes_limit(self) -> int:
        """A GenerateRequest (grpc.max_receive_message_length): ids as protobuf varints, at most 5 bytes each."""
        return self._prompt_bytes_limit(5)

    @property
    def http_body_limit(self) -> int:
        """The largest body the HTTP port reads (aiohttp's client_max_size): ids in JSON, at most 8
        bytes each (six digits and ", ")."""
        return self._prompt_bytes_limit(8)

    def validate(self) -> None:
        super().validate()
        if self.max_question_tokens < 1 or self.max_new_tokens < 1:
            raise ValueError("max_question_tokens and max_new_tokens: must be >= 1")
        if self.max_text_bytes < 1 or self.max_inflight < 1:
            raise ValueError("max_text_bytes and max_inflight: must be >= 1")
        if not self.audit_threshold > 0:
            raise ValueError("audit_threshold: must be > 0")
        if self.default_timeout_s <= 0:
            raise ValueError("default_timeout_s: must be > 0")
        if not self.producer or any(c.isspace() or not c.isprintable() for c in self.producer):
            raise ValueError(
                f"producer: {self.producer!r} is not a gRPC target (host:port, dns:///host:port, ipv4:a:p,b:p, unix:/path;"
                " no spaces)"
            )
        if self.producer_lb not in LB_POLICIES:
            raise ValueError(f"producer_lb: {self.producer_lb!r} not in {LB_POLICIES}")
        if bool(self.producer_tls_cert) != bool(self.producer_tls_key):
            raise ValueError("producer_tls_cert and producer_tls_key: set both or neither")
        if self.producer_tls_cert and not self.producer_tls_ca:
            raise ValueError("producer_tls_cert: needs producer_tls_ca (the client certificate rides on a TLS channel)")
        if self.keepalive_s <= 0:
            raise ValueError("keepalive_s: must be > 0")
        if self.producer_check_interval_s <= 0:
            raise ValueError("producer_check_interval_s: must be > 0")
        if self.probe_idle_s < 0:
            raise ValueError(f"probe_idle_s: {self.probe_idle_s} must be >= 0 (0: off)")
        for name in ("max_batch", "kv_block_tokens", "stream_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: {getattr(self, name)} must be >= 1")
        for name in ("prefill_chunk", "max_batch_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: {getattr(self, name)} must be >= 0 (0: the device's default)")
        if self.decode_attention not in DECODE_ATTENTION:
            raise ValueError(f"decode_attention: {self.decode_attention!r} not in {DECODE_ATTENTION}")
        if self.prefill_attention not in PREFILL_ATTENTION:
            raise ValueError(f"prefill_attention: {self.prefill_attention!r} not in {PREFILL_ATTENTION}")
        if self.kv_pool_bytes < 0 or self.max_queue < 0:
            raise ValueError("kv_pool_bytes and max_queue: must be >= 0")
        if self.verify_draft_bytes < 0:
            raise ValueError(f"verify_draft_bytes: {self.verify_draft_bytes} must be >= 0 (0: no sampled drafts)")
        if self.chunk_tokens < 1 or self.chunk_tokens % self.kv_block_tokens:
            raise ValueError(
                f"chunk_tokens: {self.chunk_tokens} must be a positive multiple of kv_block_tokens {self.kv_block_tokens}"
            )
        if not -1 <= self.http_port <= 65535:
            raise ValueError(f"http_port: {self.http_port} not in -1..65535 (-1 off, 0 any free port)")
        name = self.served_model_name
        if len(name) > 128 or not all("!" <= ch <= "~" for ch in name):
            raise ValueError(
                f"served_model_name: must be at most 128 printable ASCII characters without spaces, got {name[:40]!r}"
            )
        if self.prefix_cache_bytes < -1:
            raise ValueError("prefix_cache_bytes: must be >= -1 (-1: half the KV pool, 0: off)")
        modes = default_modes()
        if self.default_mode and self.default_mode not in modes:
            raise ValueError(f"default_mode: {self.default_mode!r} not in {', '.join(modes)} (empty: auto)")


def default_modes() -> list[str]:
    """What --default-mode may name: every registered codec, the consumer's own prefill and `auto`."""
    from shared.codecs import registered  # torch-heavy: only when a default mode is set

    return sorted([*registered(), ORACLE_MODE, AUTO_MODE])


DECODE_ATTENTION = ("auto", "kernel", "sdpa")  # consumer.engine.paged_attention.MODES
PREFILL_ATTENTION = ("auto", "kernel", "sdpa")  # consumer.engine.prefill_attention.MODES

_FIELD_LINE = re.compile(r"^\s+(\w+): [^=]+=.*?  # (.+)$")


def field_help(cls: type) -> dict[str, str]:
    """Each field's help line: the comment beside it in the class body (a subclass's wins)."""
    helps: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            try:
                source = inspect.getsource(klass)
            except (OSError, TypeError):  # no source shipped: flags keep their env and default only
                continue
            for line in source.splitlines():
                m = _FIELD_LINE.match(line)
                if m:
                    helps[m.group(1)] = m.group(2)
    return helps


class FlagError(ValueError):
    """A command line or environment variable that cannot be read (unknown flag, bad value)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # raise, so the caller reports it in one line
        raise FlagError(f"{message} ({self.prog} --help lists the flags)")


def parser_for(cls: type[C], service: str, env: Mapping[str, str]) -> argparse.ArgumentParser:
    """Flags of `cls`: no abbreviations (`--artifact` is an error, not `--artifacts`), a help line
    each; a bad flag or value raises FlagError instead of printing usage and exiting."""
    parser = _Parser(prog=f"python -m {service}", description=f"SCD {service} service", allow_abbrev=False)
    helps = field_help(cls)
    for f in fields(cls):
        var = f"SCD_{service.upper()}_{f.name.upper()}"
        kind, what = KINDS[type(f.default)]
        try:
            default = kind(env.get(var, f.default))
        except ValueError:
            raise FlagError(f"{var}={env.get(var)!r}: {what}") from None
        parser.add_argument(
            f"--{f.name.replace('_', '-')}",
            type=kind,
            default=default,
            nargs="?" if kind is parse_bool else None,
            const=True if kind is parse_bool else None,
            help=f"{helps.get(f.name, '')} (env {var}, default {'***' if not f.repr else repr(f.default)})".replace("%", "%%"),
        )
    return parser


# what Kubernetes' service links put in a pod for a Service named scd-<service>: SERVICE_HOST,
# SERVICE_PORT[_<NAME>], PORT_<n>_TCP[_PROTO|_PORT|_ADDR] after the prefix (not settings)
_SERVICE_LINK = re.compile(r"SERVICE_HOST$|SERVICE_PORT(_\w+)?$|PORT_\d+_(TCP|UDP|SCTP)(_\w+)?$")


def _unknown_variables(cls: type, service: str, env: Mapping[str, str]) -> None:
    """FlagError for an SCD_<SERVICE>_* variable that names no setting (a misspelled one would
    otherwise leave its setting at the default, silently), as an unknown flag is one. Compose's
    host-side port publishing variables (`*_PUBLISH`) and Kubernetes' service links are not
    settings and are let through."""
    prefix = f"SCD_{service.upper()}_"
    names = {prefix + f.name.upper() for f in fields(cls)}
    for var in sorted(env):
        if (
            var.startswith(prefix)
            and var not in names
            and not var.endswith("_PUBLISH")
            and not _SERVICE_LINK.match(var[len(prefix) :])
        ):
            near = difflib.get_close_matches(var, sorted(names), n=1)
            hint = f"; did you mean {near[0]}?" if near else ""
            raise FlagError(
                f"{var}: not a setting of the {service}{hint} (python -m {service} --help lists them with their variables)"
            )


def load(cls: type[C], service: str, argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> C:
    """Build `cls` from flags and SCD_<SERVICE>_<FIELD> environment variables, then validate."""
    env = os.environ if env is None else env
    _unknown_variables(cls, service, env)
    parser = parser_for(cls, service, env)
    config = cls(**vars(parser.parse_args(argv)))
    config.validate()
    return config


def replace(config: C, **changes) -> C:
    new = dataclasses.replace(config, **changes)
    new.validate()
    return new
