"""Transfer-or-prefill choice for requests that allow a fallback (GenerateRequest.fallback_to_oracle).

Keeps running estimates (exponentially weighted) from this consumer's own finished requests:
- local ms per context token: its own context prefill (mode oracle, `rebuild_ms`);
- producer ms per context token: producer prefill + encode, on requests that missed its store;
- link bytes per ms: payload bytes / (transfer time - producer prefill - encode);
- bytes per context token of each (mode, options) it has seen.
For a request of n context tokens it compares n * local against n * (producer + bytes/link) and
picks the smaller. Remote is assumed cold (a producer store hit would make it cheaper), so
the fallback errs toward the consumer's own prefill only when that is clearly estimated faster.
Until every estimate it needs has a sample it keeps the requested mode and says which is missing.
Knows nothing about grpc or torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from shared.labels import mode_label, options_label

MIN_WIRE_BYTES = 16 * 1024  # smaller transfers say more about latency than about bandwidth


@dataclass
class Ewma:
    alpha: float = 0.3
    value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else (1 - self.alpha) * self.value + self.alpha * x


@dataclass(frozen=True)
class Observation:
    """What a finished request measured (GenerateResult fields the planner reads)."""

    mode: str
    options: Mapping[str, str]
    context_tokens: int
    bytes_received: int
    transfer_ms: float
    rebuild_ms: float
    producer_prefill_ms: float
    producer_encode_ms: float
    producer_store_hit: bool


@dataclass(frozen=True)
class Decision:
    local: bool  # True: prefill locally (oracle)
    reason: str


def mode_key(mode: str, options: Mapping[str, str]) -> str:
    return mode_label(mode, options_label(options))


@dataclass
class TransferPlanner:
    local_ms_per_token: Ewma = field(default_factory=Ewma)
    producer_ms_per_token: Ewma = field(default_factory=Ewma)
    link_bytes_per_ms: Ewma = field(default_factory=Ewma)
    bytes_per_token: dict[str, Ewma] = field(default_factory=dict)

    def observe(self, o: Observation) -> None:
        n = max(o.context_tokens, 1)
        if o.mode == "oracle":
            self.local_ms_per_token.add(o.rebuild_ms / n)
            return
        self.bytes_per_token.setdefault(mode_key(o.mode, o.options), Ewma()).add(o.bytes_received / n)
        producer_ms = o.producer_prefill_ms + o.producer_encode_ms
        if not o.producer_store_hit:
            self.producer_ms_per_token.add(producer_ms / n)
        wire_ms = o.transfer_ms - (0.0 if o.producer_store_hit else producer_ms)
        if o.bytes_received >= MIN_WIRE_BYTES and wire_ms > 0.1:
            self.link_bytes_per_ms.add(o.bytes_received / wire_ms)

    def decide(self, mode: str, options: Mapping[str, str], context_tokens: int) -> Decision:
        per_token = self.bytes_per_token.get(mode_key(mode, options), Ewma()).value
        local_ms = self.local_ms_per_token.value
        producer_ms = self.producer_ms_per_token.value
        link = self.link_bytes_per_ms.value
        needs = {
            "local prefill ms/token (an oracle request)": local_ms,
            "producer ms/token": producer_ms,
            "link bytes/ms": link,
            f"bytes/token of {mode_key(mode, options)}": per_token,
        }
        if local_ms is None or producer_ms is None or link is None or per_token is None:
            missing = [name for name, value in needs.items() if value is None]
            return Decision(False, f"remote: no estimate yet for {', '.join(missing)}")
        local = context_tokens * local_ms
        remote = context_tokens * (producer_ms + per_token / link)
        where = "local" if local < remote else "remote"
        return Decision(local < remote, f"{where}: estimated local {local:.1f} ms vs remote {remote:.1f} ms")
