"""Mode `auto`: the fastest way to this request's context KV whose calibrated loss meets its budget.

Candidates (`Chooser.candidates`): the consumer's own prefill (`oracle`, loss 0, exact); with the
producer's weights equal to the consumer's, `raw` and `recompute` (exact); and every transfer
point of an SCD artifact calibrated for this consumer (shared.scd.artifact.TransferPoint: the
SCD schedules, and raw / quant / recompute measured on the same held-out KL), the non-SCD ones
only when the producer's weights are known to be the artifact's (their loss holds for that
producer alone; the producer checks SCD artifacts itself).

Budget (`transfer.options`): `max_loss` (nats/token), or `exact` = "true" (lossless candidates
only); neither: the loss of the default schedule of the pair's artifact (exact without one).
`candidates` = "raw,scd,oracle" narrows the set by mode.

Choice (`Chooser.choose`): each candidate's time from the planner's running estimates
(consumer.planner) and what is known to be cached: the consumer's prefix cache (a candidate
whose KV it holds whole needs nothing; a cached prefix is not sent again) and the producer's store
as this consumer's own transfers left it (consumer.producer_memory). The fastest within the budget
wins, ties to the lower loss. While a remote candidate has no estimate (no transfer measured yet),
the lowest-loss such candidate is picked to learn it, and the reason says so ("cold start"),
unless the prefix cache already holds the context made by a candidate within the budget. A link
estimate goes stale while only the own prefill is chosen: after PROBE_EVERY choices and
PROBE_AFTER_S seconds without a link measurement the fastest remote candidate is tried instead ("probe"; under LOCAL_PREFILL a
stream too slow to finish is abandoned mid-way, so a probe of a slow link costs little).
Remote candidates are left out while the producer link is unusable. Knows nothing about grpc.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from consumer.planner import Estimate, TransferPlanner, mode_key
from consumer.producer_memory import ProducerMemory
from shared import codecs as codec_lib
from shared.codecs.scd import ScdCodec
from shared.config import AUTO_MODE, ORACLE_MODE
from shared.errors import InvalidArgument, ServiceError
from shared.models import LoadedModel
from shared.scd.artifact import Artifact

OPTIONS = ("max_loss", "exact", "candidates")
LOSS_SLACK = 1e-9  # a candidate whose loss equals the budget meets it
PROBE_EVERY = 3  # after this many choices without a link measurement ...
PROBE_AFTER_S = 5.0  # ... and this long, a remote candidate is tried (a probe)
TRUE, FALSE = ("true", "1", "yes"), ("false", "0", "no", "")


@dataclass(frozen=True)
class Candidate:
    mode: str  # a codec name, or "oracle"
    options: Mapping[str, str]  # resolved as the codec resolves them
    loss: float  # calibrated loss (nats/token); NaN: not calibrated (a mode the caller named)
    how: str  # "exact" | "measured" | "named by the request"
    bytes_per_token: float | None = None  # calibrated, a prior until a transfer of it is measured

    @property
    def key(self) -> str:
        return mode_key(self.mode, self.options)

    @property
    def remote(self) -> bool:
        return self.mode != ORACLE_MODE


@dataclass(frozen=True)
class Budget:
    max_loss: float
    exact: bool = False
    modes: frozenset[str] | None = None  # None: every mode
    source: str = "request"

    def admits(self, c: Candidate) -> bool:
        if self.modes is not None and c.mode not in self.modes:
            return False
        if c.how == "named by the request":
            return True
        if self.exact:
            return c.how == "exact"
        return c.loss <= self.max_loss + LOSS_SLACK


@dataclass(frozen=True)
class Scored:
    candidate: Candidate
    within: bool
    estimate: Estimate
    chosen: bool = False


@dataclass
class AutoChoice:
    budget: Budget
    chosen: Candidate
    reason: str
    scored: list[Scored] = field(default_factory=list)


def _loss(value: str) -> float:
    try:
        loss = float(value)
    except ValueError:
        raise InvalidArgument(f"transfer.options['max_loss']: {value[:32]!r} is not a number") from None
    if not math.isfinite(loss) or loss < 0:
        raise InvalidArgument(f"transfer.options['max_loss']: {loss} must be a finite number >= 0")
    return loss


class Chooser:
    def __init__(
        self,
        loaded: LoadedModel,
        codecs: Mapping[str, codec_lib.Codec],
        planner: TransferPlanner,
        memory: ProducerMemory,
        cached_tokens: Callable[[Candidate, list[int]], int],
        producer_digest: Callable[[], str] = lambda: "",
        producer_usable: Callable[[], bool] = lambda: True,
        producer_dtype: Callable[[], str] = lambda: "",
    ):
        self.loaded, self.codecs, self.planner, self.memory = loaded, codecs, planner, memory
        self.cached_tokens = cached_tokens  # tokens of the context the prefix cache holds made as a candidate makes them
        self.producer_digest, self.producer_usable = producer_digest, producer_usable
        self.producer_dtype = producer_dtype  # the dtype the producer computes its KV in ("" unknown)
        self._cached: tuple[tuple[str, str], list[Candidate]] | None = None  # ((digest, dtype), candidates) last built

    # -- the candidate set ------------------------------------------------------------------
    def _artifacts(self) -> list[Artifact]:
        scd = self.codecs.get("scd")
        own, producer = self.loaded.info.weight_digest, self.producer_digest()
        return [
            a
            for a in (scd.artifacts if isinstance(scd, ScdCodec) else [])
            if a.meta["consumer"]["weight_digest"] == own and (not producer or a.meta["producer"]["weight_digest"] == producer)
        ]

    def candidates(self) -> list[Candidate]:
        """The candidate set for what is known of the producer now (built again when that changes)."""
        producer = (self.producer_digest(), self.producer_dtype())
        if self._cached is None or self._cached[0] != producer:
            self._cached = (producer, self._build())
        return self._cached[1]

    def _build(self) -> list[Candidate]:
        found: dict[tuple, Candidate] = {}

        def add(c: Candidate) -> None:
            key = (c.mode, tuple(sorted(c.options.items())))
            if key not in found or c.loss < found[key].loss:
                found[key] = c

        add(Candidate(ORACLE_MODE, {}, 0.0, "exact", 0.0))
        info, producer = self.loaded.info, self.producer_digest()
        # the producer's K/V are the consumer's own only with the same weights computed in the same
        # dtype: a bfloat16 producer's K/V cast to a float32 consumer (or back) is not exact
        if producer and producer == info.weight_digest and self.producer_dtype() == info.dtype:
            raw_bytes = info.kv_bytes(1)
            for name in ("raw", "recompute"):
                if name in self.codecs:
                    add(Candidate(name, self.codecs[name].resolve({}), 0.0, "exact", raw_bytes))
        for art in self._artifacts():
            for point in art.transfer_points():
                if point.mode == ORACLE_MODE or point.mode not in self.codecs:
                    continue
                if point.mode != "scd" and producer != art.meta["producer"]["weight_digest"]:
                    continue  # a raw / quant / recompute loss holds for the artifact's producer only
                try:
                    options = self.codecs[point.mode].resolve(dict(point.options))
                except ServiceError:
                    continue
                add(Candidate(point.mode, options, point.loss, point.how, point.bytes_per_token))
        return sorted(found.values(), key=lambda c: (c.loss, c.bytes_per_token or 0.0))

    def default_budget(self) -> Budget:
        """The loss of the default (lowest-loss) schedule of the pair's artifact; exact without one."""
        for art in self._artifacts():
            entry = art.pick()
            return Budget(entry.loss, source=f"default schedule {entry.name} ({entry.schedule}) of artifact {art.artifact_id}")
        return Budget(0.0, exact=True, source="no SCD artifact for this pair: lossless candidates only")

    def budget(self, options: Mapping[str, str]) -> Budget:
        """The budget a request's `auto` options give (INVALID_ARGUMENT naming the option)."""
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise InvalidArgument(
                f"transfer.options: unknown option {unknown[0]!r} for mode '{AUTO_MODE}'; known: {list(OPTIONS)}"
            )
        exact_text = options.get("exact", "").lower()
        if exact_text not in TRUE + FALSE:
            raise InvalidArgument(f"transfer.options['exact']: {exact_text[:16]!r} is not true or false")
        exact = exact_text in TRUE
        if exact and "max_loss" in options:
            raise InvalidArgument("transfer.options: set max_loss or exact, not both")
        modes = None
        if options.get("candidates"):
            names = [n.strip() for n in options["candidates"].split(",") if n.strip()]
            known = sorted([*self.codecs, ORACLE_MODE])
            bad = next((n for n in names if n not in known), None)
            if bad is not None:
                raise InvalidArgument(f"transfer.options['candidates']: unknown mode {bad[:32]!r}; known: {known}")
            modes = frozenset(names)
        if exact:
            return Budget(0.0, exact=True, modes=modes)
        if "max_loss" in options:
            return Budget(_loss(options["max_loss"]), modes=modes)
        default = self.default_budget()
        return Budget(default.max_loss, default.exact, modes, default.source)

    # -- the choice -------------------------------------------------------------------------
    def _estimate(self, c: Candidate, context_ids: list[int]) -> Estimate:
        T = len(context_ids)
        cached = self.cached_tokens(c, context_ids)
        if cached >= T:
            return Estimate(0.0, "the consumer's prefix cache holds the whole context")
        if not c.remote:
            local = self.planner.estimate_local(T - cached)
            return local if not cached else Estimate(local.ms, f"{local.detail}; {cached} cached", local.base_ms)
        kv_held, payload_held = self.memory.held(self.producer_digest(), self.producer_dtype(), c.key, context_ids)
        compute = 0 if payload_held >= T else T - kv_held
        encode = max(0, T - max(payload_held, cached))
        estimate = self.planner.estimate_remote(
            c.key, self.loaded.info.num_layers, compute, encode, T - cached, c.bytes_per_token
        )
        return estimate

    def choose(self, context_ids: list[int], budget: Budget, only: list[Candidate] | None = None) -> AutoChoice:
        pool = only if only is not None else self.candidates()
        usable = self.producer_usable()
        within = [c for c in pool if budget.admits(c) and (usable or not c.remote)]
        if not within:
            offered = ", ".join(f"{c.key} (loss {c.loss:.4g})" for c in pool)
            what = "exact" if budget.exact else f"max_loss {budget.max_loss:.4g}"
            raise InvalidArgument(f"transfer.options: no candidate meets {what} ({budget.source}); candidates: {offered}")
        scored = [Scored(c, c in within, self._estimate(c, context_ids) if c in within else Estimate(None, "")) for c in pool]
        live = [s for s in scored if s.within]
        unknown_remote = [s for s in live if s.estimate.ms is None and s.candidate.remote]
        known = [s for s in live if s.estimate.ms is not None]
        cached = [s for s in known if s.estimate.ms == 0.0]  # nothing to do: nothing unknown can beat it
        if unknown_remote and not cached:
            pick = min(unknown_remote, key=lambda s: (_sort_loss(s.candidate), s.candidate.bytes_per_token or 0.0))
            reason = (
                f"cold start: {pick.estimate.detail}; picked {pick.candidate.key}, the lowest-loss candidate within"
                " the budget that needs the producer, to measure it"
            )
        elif known:
            pick = min(known, key=lambda s: (s.estimate.ms, _sort_loss(s.candidate)))
            reason = (
                f"fastest within the budget: {pick.candidate.key} estimated {pick.estimate.ms:.1f} ms ({pick.estimate.detail})"
            )
        else:  # only the own prefill, with no rate yet
            pick = live[0]
            reason = f"cold start: {pick.estimate.detail}; picked {pick.candidate.key}, the only candidate"
        remote_known = [s for s in known if s.candidate.remote]
        self.planner.choices_since_link_sample += 1
        age_s = time.monotonic() - self.planner.link_sampled_at
        stale = self.planner.choices_since_link_sample >= PROBE_EVERY and age_s >= PROBE_AFTER_S
        if stale and not pick.candidate.remote and pick.estimate.ms and remote_known and usable:
            probe = min(remote_known, key=lambda s: (s.estimate.ms, _sort_loss(s.candidate)))
            reason = (
                f"probe: the link was last measured {self.planner.choices_since_link_sample} choices ago; trying"
                f" {probe.candidate.key} (estimated {probe.estimate.ms:.1f} ms) instead of {pick.candidate.key}"
                f" (estimated {pick.estimate.ms:.1f} ms); a stream too slow to finish is abandoned for the own prefill"
            )
            pick = probe
        if not usable:
            reason += "; the producer link is unusable: remote candidates left out"
        marked = [Scored(s.candidate, s.within, s.estimate, s is pick) for s in scored]
        marked.sort(key=lambda s: (not s.within, s.estimate.ms is None, s.estimate.ms or 0.0))
        return AutoChoice(budget, pick.candidate, reason, marked)


def _sort_loss(c: Candidate) -> float:
    return c.loss if c.loss == c.loss else 0.0  # NaN (a named mode) sorts as exact
