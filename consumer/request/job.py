"""A Generate request as the consumer's pipeline sees it (`GenerateJob`: what to do, built by
consumer.api.job_builder from the proto) and what it reports (`GenerateResult`: the stats), with the
policy names they use. Plain data: knows nothing about gRPC, the engine or codecs' internals.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from consumer.auto.chooser import AutoChoice
from consumer.auto.planner import Estimate
from consumer.engine.decoding import Sampling, TokenLogprobs
from consumer.link.stream_reader import StreamTrailer
from shared.codecs import Codec
from shared.codecs.kept import KeepRequest
from shared.errors import DeadlineExceeded

ORACLE_MODE = "oracle"  # the consumer's own prefill: only token ids cross
FAIL, LOCAL_PREFILL = "fail", "local_prefill"  # on_transfer_failure policies
AUDIT_OFF, AUDIT_REPORT, AUDIT_FALLBACK, AUDIT_UPGRADE = "off", "report", "fallback", "upgrade"  # cache audit policies
AUDIT_REPAIR = "repair"  # audit; when flagged, anchor-repair, audit again, else the own prefill
VERIFY_OFF, VERIFY_VERIFIED, VERIFY_PROVISIONAL = "off", "verified", "provisional"  # verified decoding (consumer.exact.verify)


def left(job: GenerateJob, what: str) -> float:
    """Seconds to the job's deadline; DeadlineExceeded naming `what` when none are left."""
    remaining = job.deadline - time.monotonic()
    if remaining <= 0:
        raise DeadlineExceeded(f"deadline passed before {what}")
    return remaining


@dataclass(frozen=True)
class Repair:
    """What the request asked: a fraction of the context's tokens or a token count."""

    fraction: float | None = None
    count: int | None = None
    anchors: str = "attention"  # how anchors are chosen (consumer.exact.repair ANCHOR_CHOICES)

    def tokens(self, context_tokens: int) -> int:
        """Anchors for a context of `context_tokens` tokens: at least 1, at most all of them."""
        want = math.ceil(self.fraction * context_tokens) if self.fraction is not None else self.count or 0
        return max(1, min(context_tokens, want))

    def label(self) -> str:
        """As the request can write it back: a fraction always with its point ("1.0"; "1" is a count)."""
        return str(self.fraction) if self.fraction is not None else str(self.count)


@dataclass
class GenerateJob:
    request_id: str
    context_ids: list[int]
    question_ids: list[int]
    codec: Codec | None  # None: the consumer prefills the context itself (mode "oracle")
    options: dict[str, str]
    max_new_tokens: int
    sampling: Sampling
    stop_ids: frozenset[int]
    deadline: float  # time.monotonic() value
    received_at: float = field(default_factory=time.perf_counter)
    fallback: str = ""  # why the transfer planner kept or replaced the requested mode ("" = not asked)
    on_failure: str = FAIL  # FAIL | LOCAL_PREFILL
    transfer_budget_s: float | None = None  # LOCAL_PREFILL: the share of the deadline the transfer may use
    audit: str = AUDIT_OFF  # AUDIT_OFF | AUDIT_REPORT | AUDIT_FALLBACK | AUDIT_UPGRADE | AUDIT_REPAIR
    audit_positions: int = 8
    audit_threshold: float = 0.05  # used when the codec has no calibrated threshold
    auto: AutoChoice | None = None  # how mode auto (or fallback_to_oracle) chose codec and options
    # auto's key for this job's codec and options (consumer.auto.chooser Chooser.key), derived once
    # by the job builder: the planner's estimates, the mid-stream watch, what the finished request
    # teaches and the producer memory all read it under this key
    candidate_key: str = ""
    estimate: Estimate | None = None  # a named mode's TTFT estimate at admission (teaches the learned overhead)
    verify: str = VERIFY_OFF  # VERIFY_OFF | VERIFY_VERIFIED (stream verified tokens only) | VERIFY_PROVISIONAL
    repair: Repair | None = None  # anchor-token repair after the rebuild (consumer.exact.repair); None: off
    stream_interval: int = 1  # tokens per streamed message after the first (--stream-interval)
    # the answer ends at the first token whose text completes one (consumer.request.ending: finish "stop",
    # that token kept, the text cut before the string)
    stop_strings: tuple[str, ...] = ()
    verify_draft_bytes: int | None = None  # verified decoding: kept draft rows, bytes (consumer.engine.speculative); None: no cap
    # whose cached KV it may reuse (shared.tenants: its cache_salt, else the caller's token): in the
    # root of its prefix cache keys, and sent to the producer as PrefillRequest.cache_salt
    tenant: str = ""
    producer_tenant: str = ""  # the tenant the producer files it under (its prefix key's root)
    # token selection (the transfer option `keep`, resolved for the codec): the producer sends the
    # kept tokens only and the request's blocks hold only those; None: every token
    keep: KeepRequest | None = None

    @property
    def stored_context(self) -> int:
        """Context tokens its blocks hold: the kept ones under a keep set, else the whole context."""
        return self.keep.kept(len(self.context_ids)) if self.keep is not None else len(self.context_ids)

    @property
    def mode(self) -> str:
        return self.codec.name if self.codec is not None else ORACLE_MODE


@dataclass(frozen=True)
class Extras:
    """What a Generate may ask beyond the GenerateRequest message: the OpenAI endpoint's fields
    that gRPC has no field for (consumer.api.openai_schema reads them, JobBuilder checks them against
    the model and the other fields). Defaults: none asked."""

    stop_strings: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()  # besides the model's end-of-sequence id (vLLM's meaning)
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    top_k: int = 0
    logprobs: int | None = None  # each sampled id's log-probability and this many alternatives


@dataclass
class TokenOut:
    ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] | None = None  # one per id, when the request asked (Extras.logprobs)


@dataclass
class Commit:
    """Verified decoding, provisional delivery: of the provisional tokens streamed so far the first
    `accepted` stand, the rest are withdrawn and `ids` follow in their place; `text` is the whole
    verified answer's text so far."""

    accepted: int
    ids: list[int]
    text: str


@dataclass
class GenerateResult:
    request_id: str
    codec: str
    options: dict[str, str]
    context_tokens: int
    question_tokens: int
    generated_tokens: int = 0
    ttft_ms: float = 0.0
    transfer_ms: float = 0.0
    rebuild_ms: float = 0.0  # the context's KV: codec rebuild plus any own prefill (local_prefill_ms)
    local_prefill_ms: float = 0.0  # the part of rebuild_ms that was the consumer's own context prefill
    exact_transfer: str = ""  # verified decoding's exact cache came from this transfer ("": own prefill)
    question_prefill_ms: float = 0.0
    decode_ms: float = 0.0
    total_ms: float = 0.0
    bytes_received: int = 0
    raw_kv_bytes: int = 0
    finish_reason: str = "length"  # "length" | "stop"
    producer_prefill_ms: float = 0.0
    producer_encode_ms: float = 0.0
    producer_store_hit: bool = False
    transfer_failure: str = ""  # why LOCAL_PREFILL replaced the transfer
    audit_layer_errors: tuple[float, ...] = ()
    audit_thresholds: tuple[float, ...] = ()
    audit_decision: str = ""
    audit_ms: float = 0.0
    queue_wait_ms: float = 0.0  # waiting for KV memory before any work
    prefix_reused_tokens: int = 0  # context tokens whose KV came from the prefix cache
    auto: AutoChoice | None = None
    transfer_abandoned: bool = False  # the stream was too slow to finish: prefilled locally instead
    local_tokens: int = 0  # context tokens the consumer prefilled itself
    sent_tokens: int = 0  # context tokens the last stream's payloads covered
    trailer: StreamTrailer | None = None  # the last stream's trailer (its timings feed the planner)
    chunk_tokens: int = 0  # the producer's chunk size as the last stream header gave it
    stream_producer: tuple[str, str] | None = None  # (model identity, kv dtype) the last stream's header named
    stream_metadata: dict[str, str] = field(default_factory=dict)  # the codec metadata it named (SCD: artifact, schedule)
    abandoned_span: tuple[int, float] | None = None  # (bytes, ms) an abandoned stream delivered after its first layer
    verify_decision: str = ""  # what verified decoding did ("" off; "verified: ...", "skipped: ...")
    drafted_tokens: int = 0  # tokens drafted on the transferred cache before the exact one was complete
    accepted_tokens: int = 0  # the prefix of them the exact model accepted
    time_to_verified_ms: float = 0.0  # receipt to the first verified token
    verify_ms: float = 0.0  # the exact prefill and the verification forward, wall time (overlaps drafting)
    repair_tokens: int = 0  # context tokens whose K/V anchor repair recomputed (consumer.exact.repair)
    repair_ms: float = 0.0  # the repair's engine job: anchor choice, recompute and write
    repair_choice: str = ""  # "" off; "attention: 12 of 120 context tokens (0.1); layer 0 whole", "skipped: ..."
