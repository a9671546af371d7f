"""What each way of getting a context's KV costs on this consumer: running estimates learned from
its own finished requests, and the time estimate of one candidate for one request.

Learned (exponentially weighted; the link with alpha 0.5 so a rate change shows within 2-3
transfers; the rest 0.3):
- own prefill ms per context token it computed (mode oracle, a local fallback); until it has
  one, the producer's prefill rate stands in, else the question prefill's (every request
  measures one);
- producer prefill ms per token its forward computed (trailer prefill_ms / computed_tokens) and
  the time a computed context waited for that forward (trailer queue_ms);
- producer encode ms per encoded token, per mode;
- the link, from the stream itself: bytes over the time between the first and the last payload
  chunk; a sample more than RATE_JUMP x off the estimate replaces it (a step change, not noise). A span the link set (a store replay, or a producer whose forward took under half the
  span) is a sample; a span the producer's forward paced is only a lower bound on the link (it
  raises the estimate, never lowers it). Transfers under MIN_WIRE_BYTES say nothing;
- the round trip: the smallest of the last RTT_WINDOW times from call start to the header (the
  producer sends it on admission, before any forward);
- consumer rebuild ms per received token and bytes per token, per mode.

A candidate's time (`estimate`): remote = rtt + producer queue (when it computes) + the three
pipelined stages (producer compute, wire, rebuild; they overlap layer by layer, so the longest
plus the others' share of one layer); local = own ms/token x tokens to prefill; each plus the
overhead learned for its kind from auto's own choices (what the KV actually took, TTFT minus the
question prefill, minus what the model said). A mode never
seen yet borrows the cheapest encode and rebuild rates seen (optimistic, so it gets tried and
measured) and its calibrated bytes per token. Knows nothing about grpc or torch.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from shared.labels import mode_label, options_label

MIN_WIRE_BYTES = 16 * 1024  # smaller transfers say more about latency than about bandwidth
RTT_WINDOW = 16
OVERHEAD_RATIO = 2.0  # an estimate this far off the actual time is not a lesson in overhead
RATE_JUMP = 2.0  # a link sample this far off the estimate (either way) replaces it
LINK_BOUND_SHARE = 0.5  # a span counts as link-bound when the producer's forward took less than this share of it


@dataclass
class Ewma:
    alpha: float = 0.3
    value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else (1 - self.alpha) * self.value + self.alpha * x


def mode_key(mode: str, options: Mapping[str, str]) -> str:
    return mode_label(mode, options_label(options))


@dataclass(frozen=True)
class Observation:
    """What a finished request measured (GenerateResult and stream fields the planner reads)."""

    mode: str
    options: Mapping[str, str]
    context_tokens: int
    bytes_received: int
    rebuild_ms: float
    local_tokens: int = 0  # context tokens the consumer prefilled itself (oracle, a local fallback)
    sent_tokens: int = 0  # context tokens the stream's payloads covered (T - first_token)
    producer_prefill_ms: float = 0.0
    producer_encode_ms: float = 0.0
    producer_store_hit: bool = False
    computed_tokens: int = 0  # the producer's forward ran over these
    queue_ms: float = 0.0  # the producer's wait for that forward
    header_ms: float | None = None  # call start to the stream's header
    span_ms: float = 0.0  # the stream's first to last payload chunk
    span_bytes: int = 0  # payload bytes that arrived in that span (after the first chunk)
    question_tokens: int = 0
    question_prefill_ms: float = 0.0


@dataclass(frozen=True)
class Estimate:
    ms: float | None  # None: an estimate it needs has no sample yet
    detail: str  # the parts, or what is missing
    base_ms: float | None = None  # ms before the learned overhead of its kind (remote / local) was added


def pipelined(stages: list[float], layers: int) -> float:
    """Stages that overlap layer by layer: the longest, plus one layer's share of the others."""
    longest = max(stages)
    return longest + (sum(stages) - longest) / max(layers, 1)


@dataclass
class TransferPlanner:
    local_ms_per_token: Ewma = field(default_factory=Ewma)
    question_ms_per_token: Ewma = field(default_factory=Ewma)
    producer_ms_per_token: Ewma = field(default_factory=Ewma)  # prefill, per computed token
    producer_queue_ms: Ewma = field(default_factory=Ewma)
    link_bytes_per_ms: Ewma = field(default_factory=lambda: Ewma(alpha=0.5))
    encode_ms_per_token: dict[str, Ewma] = field(default_factory=dict)
    rebuild_ms_per_token: dict[str, Ewma] = field(default_factory=dict)
    bytes_per_token: dict[str, Ewma] = field(default_factory=dict)
    header_ms: collections.deque = field(default_factory=lambda: collections.deque(maxlen=RTT_WINDOW))
    overhead_ms: dict[str, Ewma] = field(default_factory=lambda: {"remote": Ewma(), "local": Ewma()})
    choices_since_link_sample: int = 0  # auto choices made since the link was last measured (consumer.auto's probes)
    link_sampled_at: float = 0.0  # time.monotonic() of the last link measurement

    # -- learning ---------------------------------------------------------------------------
    def observe(self, o: Observation) -> None:
        if o.question_tokens and o.question_prefill_ms > 0:
            self.question_ms_per_token.add(o.question_prefill_ms / o.question_tokens)
        if o.local_tokens:
            self.local_ms_per_token.add(o.rebuild_ms / o.local_tokens)
        if o.mode == "oracle" or not o.sent_tokens:
            return
        key = mode_key(o.mode, o.options)
        sent = o.sent_tokens
        self.bytes_per_token.setdefault(key, Ewma()).add(o.bytes_received / sent)
        self.rebuild_ms_per_token.setdefault(key, Ewma()).add(o.rebuild_ms / sent)
        if o.computed_tokens:
            self.producer_ms_per_token.add(o.producer_prefill_ms / o.computed_tokens)
            self.producer_queue_ms.add(o.queue_ms)
            self.encode_ms_per_token.setdefault(key, Ewma()).add(o.producer_encode_ms / o.computed_tokens)
        if o.header_ms is not None:
            self.header_ms.append(o.header_ms)
        self._observe_link(o)

    def observe_abandoned(self, span_bytes: int, span_ms: float) -> None:
        """A stream abandoned mid-way delivered span_bytes in span_ms: what it delivered is what the
        next choice must expect, whatever held it back (the link or the producer)."""
        self._link_sample(span_bytes, span_ms, link_bound=True)

    def _observe_link(self, o: Observation) -> None:
        link_bound = o.producer_store_hit or o.computed_tokens == 0 or o.producer_prefill_ms < LINK_BOUND_SHARE * o.span_ms
        self._link_sample(o.span_bytes, o.span_ms, link_bound)

    def _link_sample(self, span_bytes: int, span_ms: float, link_bound: bool) -> None:
        if span_bytes < MIN_WIRE_BYTES or span_ms <= 0.1:
            return
        self.choices_since_link_sample = 0
        self.link_sampled_at = time.monotonic()
        rate = span_bytes / span_ms
        current = self.link_bytes_per_ms.value
        if link_bound and current is not None and not current / RATE_JUMP <= rate <= current * RATE_JUMP:
            self.link_bytes_per_ms.value = rate  # a step change (the link was reshaped): start over from it
        elif link_bound:
            self.link_bytes_per_ms.add(rate)
        elif self.link_bytes_per_ms.value is None or rate > self.link_bytes_per_ms.value:
            self.link_bytes_per_ms.value = rate  # a lower bound above the estimate: the link is at least this fast

    # -- estimates --------------------------------------------------------------------------
    @property
    def rtt_ms(self) -> float:
        return min(self.header_ms) if self.header_ms else 0.0

    def local_rate(self) -> tuple[float | None, str]:
        """Own prefill ms per token; until one is measured, the producer's (the same architecture:
        a fine-tuned variant of its base), else the question prefill's (a few tokens per forward:
        an overestimate)."""
        if self.local_ms_per_token.value is not None:
            return self.local_ms_per_token.value, "own prefill"
        if self.producer_ms_per_token.value is not None:
            return self.producer_ms_per_token.value, "the producer's prefill rate (no own context prefill yet)"
        if self.question_ms_per_token.value is not None:
            return self.question_ms_per_token.value, "question prefill (no own context prefill yet)"
        return None, ""

    def observe_overhead(self, remote: bool, actual_ms: float, base_ms: float) -> None:
        """An auto choice came true: its KV was ready actual_ms after receipt (TTFT minus the
        question prefill) where the model said base_ms; the difference, learned per kind, is what
        the model leaves out (call setup, queueing, decode of the last layer, ...). Only a model
        that was roughly right (within OVERHEAD_RATIO either way) teaches it: a far-off one had a
        stale input (a link reshaped since it was measured), which the request's own measurements
        correct, and learning it as overhead would bias every later choice of its kind."""
        if base_ms > 0 and 1 / OVERHEAD_RATIO <= actual_ms / base_ms <= OVERHEAD_RATIO:
            self.overhead_ms["remote" if remote else "local"].add(actual_ms - base_ms)

    def _with_overhead(self, kind: str, base: float, detail: str) -> Estimate:
        extra = self.overhead_ms[kind].value
        if extra is None:
            return Estimate(base, detail, base)
        return Estimate(max(base + extra, 0.0), f"{detail} + learned overhead {extra:.1f}", base)

    def estimate_local(self, tokens: int) -> Estimate:
        rate, source = self.local_rate()
        if rate is None:
            return Estimate(None, "no own prefill rate yet")
        return self._with_overhead("local", tokens * rate, f"own prefill {tokens} tokens x {rate:.3f} ms ({source})")

    def _rate(self, table: dict[str, Ewma], key: str) -> tuple[float | None, bool]:
        """(ms per token, borrowed) of a mode; a mode not seen yet borrows the cheapest seen."""
        own = table.get(key)
        if own is not None and own.value is not None:
            return own.value, False
        seen = [e.value for e in table.values() if e.value is not None]
        return (min(seen), True) if seen else (None, True)

    def estimate_remote(
        self,
        key: str,
        layers: int,
        compute: int,
        encode: int,
        send: int,
        prior_bytes_per_token: float | None = None,
    ) -> Estimate:
        """A transfer of mode `key`: the producer prefills `compute` tokens and encodes `encode`,
        `send` tokens' payloads cross the link and are rebuilt here."""
        missing = []
        bpt = self.bytes_per_token.get(key, Ewma()).value
        bpt = bpt if bpt is not None else prior_bytes_per_token
        link = self.link_bytes_per_ms.value
        prefill = self.producer_ms_per_token.value
        encode_rate, _ = self._rate(self.encode_ms_per_token, key)
        rebuild_rate, _ = self._rate(self.rebuild_ms_per_token, key)
        if bpt is None:
            missing.append("bytes/token")
        if link is None and send:
            missing.append("link rate")
        if prefill is None and compute:
            missing.append("producer prefill rate")
        if rebuild_rate is None and send:
            missing.append("rebuild rate")
        if missing:
            return Estimate(None, "no estimate yet of " + ", ".join(missing))
        producer = max((prefill or 0.0) * compute, (encode_rate or 0.0) * encode)
        wire = (bpt or 0.0) * send / link if send and link else 0.0
        rebuild = (rebuild_rate or 0.0) * send
        queue = (self.producer_queue_ms.value or 0.0) if compute else 0.0
        base = self.rtt_ms + queue + pipelined([producer, wire, rebuild], layers)
        detail = (
            f"rtt {self.rtt_ms:.1f} + queue {queue:.1f} + pipelined(producer {producer:.1f} [{compute} prefilled,"
            f" {encode} encoded], wire {wire:.1f} [{send} tokens x {bpt:.0f} B at {(link or 0) * 8e-3:.1f} Mbit/s],"
            f" rebuild {rebuild:.1f})"
        )
        return self._with_overhead("remote", base, detail)

    def snapshot(self) -> dict[str, float]:
        """The current estimates, for Describe and logs (absent: no sample yet)."""
        out = {
            "rtt_ms": self.rtt_ms,
            "local_ms_per_token": self.local_ms_per_token.value,
            "question_ms_per_token": self.question_ms_per_token.value,
            "producer_prefill_ms_per_token": self.producer_ms_per_token.value,
            "producer_queue_ms": self.producer_queue_ms.value,
            "link_mbit_s": None if self.link_bytes_per_ms.value is None else self.link_bytes_per_ms.value * 8e-3,
            "remote_overhead_ms": self.overhead_ms["remote"].value,
            "local_overhead_ms": self.overhead_ms["local"].value,
        }
        for name, table in (("bytes_per_token", self.bytes_per_token), ("rebuild_ms_per_token", self.rebuild_ms_per_token)):
            out.update({f"{name}[{k}]": e.value for k, e in table.items()})
        return {k: float(v) for k, v in out.items() if v is not None}
