"""Mode `auto`: the fastest way to this request's context KV whose calibrated loss meets its budget.

Candidates (`Chooser.candidates`): the consumer's own prefill (`oracle`, loss 0, exact); with the
producer's model identity equal to the consumer's (weights at their precision, forward config,
dtype: shared.models), `raw` and `recompute` (exact); and every transfer
point of an SCD artifact calibrated for this consumer (shared.scd.artifact.TransferPoint: the
SCD schedules, raw / quant / recompute measured on the same held-out KL, and the keep points:
a codec point sent with a keep set, options `keep` = the selection, shared.codecs.kept), the
non-SCD ones only when the producer's weights are known to be the artifact's (their loss holds for
that producer alone; the producer checks SCD artifacts itself), a learned policy's keep point only
while the producer says it holds the keep weights that point was measured with for that artifact
(Describe's ArtifactInfo.keep_weights_digest: other weights keep other tokens). A keep point is left out of a
request that asks for what a kept cache does not serve (`Budget.no_keep`); it is never served from
the prefix cache, and until its own transfer is measured its times borrow the other candidates'
(uncertain) while its bytes are its calibrated ones (the codec's x the kept share + the keep sets).

Budget (`transfer.options`): `max_loss` (nats/token), or `exact` = "true" (lossless candidates
only); neither: the loss of the default schedule of the pair's artifact (exact without one).
`candidates` = "raw,scd,oracle" narrows the set by mode.

Verified candidates: a request that asks for verified decoding (`GenerateRequest.verify`) gets
the consumer's exact output whatever the transfer (consumer.exact.verify), so under `exact` the lossy
candidates the default budget admits count as exact too, marked `how` = "verified" (transfer +
VERIFY; the default budget keeps drafts the check would mostly reject out). What the choice
compares is when the caller sees its first token: with provisional delivery the drafts' transfer
(their estimate as it is); with verified tokens only, no sooner than the exact cache the check
needs (the estimate is raised to the fastest exact candidate's, so an exact candidate wins the
tie at lower loss, and a verified one is chosen only where it really comes first).

Choice (`Chooser.choose`): each candidate's time from the planner's running estimates
(consumer.auto.planner), read under one canonical key per candidate (`Chooser.key`), and what is
known to be cached: the consumer's prefix cache (a candidate whose KV it holds whole needs
nothing; a cached prefix is not sent again) and the producer's store as this consumer's own
transfers left it (consumer.auto.producer_memory). The fastest within the budget wins, ties to the
lower loss; an uncertain estimate (extrapolated far from the lengths measured, or borrowed from
another candidate) counts UNCERTAIN_PENALTY times its value. While a remote candidate has no
estimate (no transfer measured yet), the lowest-loss such candidate is picked to learn it, and
the reason says so ("cold start"), unless the prefix cache already holds the context made by a
candidate within the budget.

Probes: a user request is a probe at most once in PROBE_EVERY auto choices, and its reason says
so ("probe ..."): when the link was last measured PROBE_STALE_CHOICES choices and PROBE_AFTER_S
seconds ago while the own prefill wins, or when an uncertain remote estimate is DOUBT_MARGIN
below the pick (it might win once measured).
The rest is measured by any request's stream (named modes teach the same keys) and by small
background probes (consumer.auto.probe, `probe_target`): when the consumer is idle, and while auto
serves locally where a faster link would make a remote candidate win (`local_choice_at`). Under
LOCAL_PREFILL a stream too slow to finish is abandoned mid-way, so a probe of a slow link costs
little. Remote candidates are left out while the producer link is unusable; the stats say how
many candidates were excluded and why. Knows nothing about grpc.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from consumer.auto.planner import Estimate, TransferPlanner, mode_key
from consumer.auto.producer_memory import ProducerMemory
from shared import codecs as codec_lib
from shared.codecs.kept import KEEP_OPTION, KeepRequest
from shared.codecs.scd import ScdCodec
from shared.codecs.scd import pick as scd_pick
from shared.config import AUTO_MODE, ORACLE_MODE
from shared.errors import InvalidArgument, ServiceError
from shared.models import LoadedModel
from shared.scd.artifact import Artifact

OPTIONS = ("max_loss", "exact", "candidates")
LOSS_SLACK = 1e-9  # a candidate whose loss equals the budget meets it
PROBE_EVERY = 20  # a user request is a probe at most once in this many auto choices
PROBE_STALE_CHOICES = 3  # a link estimate not measured for this many choices ...
PROBE_AFTER_S = 5.0  # ... and this long is stale
UNCERTAIN_PENALTY = 1.5  # an uncertain estimate must beat a confident one by this factor to win
KEYS_MEMO = 1024  # candidate keys kept computed (cleared when full: named requests' options vary)
DOUBT_MARGIN = 1.2  # an uncertain remote estimate this much below the pick is worth a probe
TRUE, FALSE = ("true", "1", "yes"), ("false", "0", "no", "")
VERIFIED = "verified"  # Candidate.how of a lossy transfer admitted under `exact` by verified decoding


@dataclass(frozen=True)
class Candidate:
    mode: str  # a codec name, or "oracle"
    options: Mapping[str, str]  # resolved as the codec resolves them
    loss: float  # calibrated loss (nats/token); NaN: not calibrated (a mode the caller named)
    how: str  # "exact" | "measured" | "named by the request" | "verified" (transfer + VERIFY)
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
    verify: str = "off"  # the request's verified decoding (consumer.request.job VERIFY_*): "off" | "verified" | "provisional"
    no_keep: str = ""  # the request field a kept cache does not serve ("": keep points are candidates)


@dataclass(frozen=True)
class Scored:
    candidate: Candidate
    within: bool
    estimate: Estimate
    chosen: bool = False
    key: str = ""  # the candidate's canonical key (Chooser.key)
    excluded: str = ""  # why it is not within reach ("" when it is)


@dataclass
class AutoChoice:
    budget: Budget
    chosen: Candidate
    reason: str
    scored: list[Scored] = field(default_factory=list)

    @property
    def picked(self) -> Scored | None:
        """The chosen candidate's entry in `scored`: its key and its estimate (None: not scored)."""
        return next((s for s in self.scored if s.chosen), None)

    @property
    def key(self) -> str:
        """The chosen candidate's key (Chooser.key; its plain label when it was not scored)."""
        picked = self.picked
        return picked.key if picked is not None and picked.key else self.chosen.key


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
        cached_tokens: Callable[[Candidate, list[int], str], int],
        producer_digest: Callable[[], str] = lambda: "",
        producer_usable: Callable[[], bool] = lambda: True,
        producer_dtype: Callable[[], str] = lambda: "",
        producer_identity: Callable[[], str] = lambda: "",
        producer_keep_weights: Callable[[], Mapping[str, str]] = dict,
        exact_by_transfer: bool = True,
    ):
        self.loaded, self.codecs, self.planner, self.memory = loaded, codecs, planner, memory
        # whether an exact answer may rest on the producer's word that its K/V are this model's
        # (--exact-by-transfer): its bytes are held to the stream contract's limits, not recomputed
        self.exact_by_transfer = exact_by_transfer
        self.cached_tokens = cached_tokens  # tokens of the context the prefix cache holds made as a candidate makes them
        self.producer_digest, self.producer_usable = producer_digest, producer_usable
        self.producer_dtype = producer_dtype  # the dtype the producer computes its KV in ("" unknown)
        self.producer_identity = producer_identity  # what shapes the producer's K/V (ModelInfo.identity; "" unknown)
        self.producer_keep_weights = producer_keep_weights  # artifact id -> the keep weights' digest it serves ({} unknown)
        self._cached: tuple[tuple, list[Candidate]] | None = None  # ((digest, dtype, identity, keep weights), candidates)
        self.choices_since_probe = PROBE_EVERY  # auto choices since a user request was last a probe
        self.local_choice_at = 0.0  # time.monotonic() of the last choice of the own prefill over a remote candidate
        self._keys: dict[tuple, str] = {}  # key() memo: (producer digest, mode, options) -> key
        planner.key = self.key  # the planner learns under the candidates' canonical keys

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
        weights = tuple(sorted(self.producer_keep_weights().items()))
        producer = (self.producer_digest(), self.producer_dtype(), self.producer_identity(), weights)
        if self._cached is None or self._cached[0] != producer:
            self._cached = (producer, self._build(dict(weights)))  # built from the keep weights its key names
        return self._cached[1]

    def _build(self, keep_weights: Mapping[str, str]) -> list[Candidate]:
        found: dict[tuple, Candidate] = {}

        def add(c: Candidate) -> None:
            key = (c.mode, tuple(sorted(c.options.items())))
            if key not in found or c.loss < found[key].loss:
                found[key] = c

        add(Candidate(ORACLE_MODE, {}, 0.0, "exact", 0.0))
        info, producer = self.loaded.info, self.producer_digest()
        # the producer's K/V are the consumer's own only from the same model identity: the same weights
        # at the same precision, the same forward config (rope, window, eps...), computed in the same
        # dtype (a bfloat16 producer's K/V cast to a float32 consumer, or back, is not exact)
        identity = self.producer_identity()
        if self.exact_by_transfer and identity and identity == info.identity and self.producer_dtype() == info.dtype:
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
                if point.keep_weights and keep_weights.get(art.artifact_id) != point.keep_weights:
                    continue  # a learned keep point's loss holds for the weights it was measured with only
                try:
                    options = self._resolved(point.mode, dict(point.options), point.keep_weights)
                except ServiceError:
                    continue
                add(Candidate(point.mode, options, point.loss, point.how, point.bytes_per_token))
        return sorted(found.values(), key=lambda c: (c.loss, c.bytes_per_token or 0.0))

    def _resolved(self, mode: str, options: dict[str, str], keep_weights: str = "") -> dict[str, str]:
        """A transfer point's options as the codec resolves them, its keep set (if any) resolved
        for the codec and naming the keep weights it was measured with, if learned, so that a
        producer holding others refuses it (ServiceError: not served here)."""
        codec = self.codecs[mode]
        keep = options.pop(KEEP_OPTION, None)
        resolved = codec.resolve(options)
        if keep is not None:
            request = KeepRequest.parse(keep).for_codec(codec)
            resolved[KEEP_OPTION] = dataclasses.replace(request, weights=keep_weights or request.weights).label
        return resolved

    def default_budget(self) -> Budget:
        """The loss of the default schedule of the pair's artifact (the one chosen on validation,
        Artifact.default_entry); exact without an artifact."""
        for art in self._artifacts():
            entry = art.default_entry()
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
    def key(self, mode: str, options: Mapping[str, str]) -> str:
        """`_key`, computed once per (mode, options) while the producer's artifacts stay the same
        (every choice asks it for every candidate)."""
        memo_key = (self.producer_digest(), mode, tuple(sorted(options.items())))
        key = self._keys.get(memo_key)
        if key is None:
            if len(self._keys) >= KEYS_MEMO:
                self._keys.clear()
            key = self._keys[memo_key] = self._key(mode, options)
        return key

    def _key(self, mode: str, options: Mapping[str, str]) -> str:
        """The one key of a candidate in the planner and the producer memory: a named mode with
        its default options and auto's candidate for the same codec and options are one key. SCD
        is keyed by the artifact and the schedule the options choose from it
        (`scd(artifact=26231e...,schedule=s5)`, whatever names them: a budget, the default, the
        name); every other mode by its options, empty ones dropped."""
        if mode == "scd" and isinstance(self.codecs.get("scd"), ScdCodec):
            wanted = options.get("artifact", "")
            arts = [a for a in self._artifacts() if not wanted or a.artifact_id == wanted]
            if not arts and wanted:
                scd = self.codecs["scd"]
                arts = [a for a in scd.artifacts if a.artifact_id == wanted]  # type: ignore[attr-defined]
            if arts:
                try:
                    entry = scd_pick(arts[0], options)
                except (ServiceError, ValueError):
                    return mode_key(mode, options)
                schedule = entry.name if entry.name != "custom" else entry.schedule
                keep = {KEEP_OPTION: options[KEEP_OPTION]} if options.get(KEEP_OPTION) else {}
                return mode_key(mode, {"artifact": arts[0].artifact_id, "schedule": schedule, **keep})
        return mode_key(mode, options)

    def _estimate(self, c: Candidate, key: str, context_ids: list[int], tenant: str = "") -> Estimate:
        T = len(context_ids)
        cached = 0 if KEEP_OPTION in c.options else self.cached_tokens(c, context_ids, tenant)  # a kept cache is never stored
        if cached >= T:
            return Estimate(0.0, "the consumer's prefix cache holds the whole context")
        if not c.remote:
            local = self.planner.estimate_local(T - cached)
            if not cached:
                return local
            return Estimate(local.ms, f"{local.detail}; {cached} cached", local.base_ms, local.confident, local.why)
        producer = f"{self.producer_identity()}|{tenant}" if self.producer_identity() else ""
        kv_held, payload_held = self.memory.held(producer, self.producer_dtype(), key, context_ids)
        compute = 0 if payload_held >= T else T - kv_held
        encode = max(0, T - max(payload_held, cached))
        L = self.loaded.info.num_layers
        return self.planner.estimate_remote(key, L, compute, encode, T - cached, c.bytes_per_token, self._compute_start(c))

    def _compute_start(self, c: Candidate) -> tuple[float, float] | None:
        """The codec's Codec.compute_start for the candidate's options (None: spread over the layers)."""
        codec = self.codecs.get(c.mode)
        try:
            options = {k: v for k, v in c.options.items() if k != KEEP_OPTION}
            return codec.compute_start(options) if codec is not None else None
        except (ServiceError, ValueError):
            return None

    def estimate_named(
        self, mode: str, options: Mapping[str, str], key: str, context_ids: list[int], tenant: str = ""
    ) -> Estimate:
        """The estimate for a mode the request named (nothing to choose; `key`: its Chooser.key, which
        the request carries): its measured TTFT is compared with it afterwards, so named requests
        teach the learned overhead as auto's own choices do (consumer.pipeline.learning)."""
        c = Candidate(mode, options, math.nan, "named by the request")
        return self._estimate(c, key, context_ids, tenant)

    def _verified(self, pool: list[Candidate]) -> list[Candidate]:
        """`pool` with its lossy candidates that the default budget admits marked VERIFIED: drafts
        as good as the default mode's answers (a transfer over it, naive reuse across weights say,
        would draft tokens the check mostly throws away)."""
        default = self.default_budget()
        if default.exact:
            return pool
        return [
            Candidate(c.mode, c.options, c.loss, VERIFIED, c.bytes_per_token)
            if c.how == "measured" and c.loss <= default.max_loss + LOSS_SLACK
            else c
            for c in pool
        ]

    def _excluded(self, c: Candidate, budget: Budget, usable: bool) -> str:
        """Why a candidate is not within this request's reach ("" when it is)."""
        if budget.modes is not None and c.mode not in budget.modes:
            return "not among the requested candidates"
        if budget.no_keep and KEEP_OPTION in c.options:
            return f"a keep set is not served with {budget.no_keep}"
        if c.how != "named by the request":
            if budget.exact and c.how not in ("exact", VERIFIED):
                return "not exact (verified decoding would admit it)"
            if not budget.exact and not c.loss <= budget.max_loss + LOSS_SLACK:
                return f"over the loss budget {budget.max_loss:.4g}"
        if c.remote and not usable:
            return "the producer link is unusable"
        return ""

    def choose(self, context_ids: list[int], budget: Budget, only: list[Candidate] | None = None, tenant: str = "") -> AutoChoice:
        """The candidate to run for `budget`, with every candidate's estimate (what `tenant`'s cached
        KV and the producer memory of its transfers save included)."""
        pool = only if only is not None else self.candidates()
        if budget.exact and budget.verify != "off":  # lossy transfers give the exact output once verified
            pool = self._verified(pool)
        usable = self.producer_usable()
        why_out = {id(c): self._excluded(c, budget, usable) for c in pool}
        within = [c for c in pool if not why_out[id(c)]]
        if not within:
            offered = ", ".join(f"{self.key(c.mode, c.options)} (loss {c.loss:.4g})" for c in pool)
            what = "exact" if budget.exact else f"max_loss {budget.max_loss:.4g}"
            raise InvalidArgument(f"transfer.options: no candidate meets {what} ({budget.source}); candidates: {offered}")
        keys = {id(c): self.key(c.mode, c.options) for c in pool}
        scored = [
            Scored(
                c,
                not why_out[id(c)],
                Estimate(None, "") if why_out[id(c)] else self._estimate(c, keys[id(c)], context_ids, tenant),
                key=keys[id(c)],
                excluded=why_out[id(c)],
            )
            for c in pool
        ]
        if budget.verify == "verified":  # verified tokens only (consumer.request.job VERIFY_VERIFIED)
            scored = _wait_for_exact(scored)
        live = [s for s in scored if s.within]
        unknown_remote = [s for s in live if s.estimate.ms is None and s.candidate.remote]
        known = [s for s in live if s.estimate.ms is not None]
        cached = [s for s in known if s.estimate.ms == 0.0]  # nothing to do: nothing unknown can beat it
        self.planner.choices_since_link_sample += 1
        self.choices_since_probe += 1
        if unknown_remote and not cached:
            pick = min(unknown_remote, key=lambda s: (_sort_loss(s.candidate), s.candidate.bytes_per_token or 0.0))
            reason = (
                f"cold start: {pick.estimate.detail}; picked {pick.key}, the lowest-loss candidate within"
                " the budget that needs the producer, to measure it"
            )
        elif known:
            pick = min(known, key=lambda s: (_score(s), _sort_loss(s.candidate)))
            reason = f"fastest within the budget: {pick.key} estimated {pick.estimate.ms:.1f} ms ({pick.estimate.detail})"
            if not pick.estimate.confident:
                reason += f"; uncertain estimates count x{UNCERTAIN_PENALTY:g}"
            probe = self._probe(known, pick, usable)
            if probe is not None:
                target, why = probe
                reason = (
                    f"probe (a user request is one at most 1 in {PROBE_EVERY}): {why}; trying {target.key} (estimated"
                    f" {target.estimate.ms:.1f} ms) instead of {pick.key} (estimated {pick.estimate.ms:.1f} ms); a stream"
                    " too slow to finish is abandoned for the own prefill"
                )
                pick = target
                self.choices_since_probe = 0
        else:  # only the own prefill, with no rate yet
            pick = live[0]
            reason = f"cold start: {pick.estimate.detail}; picked {pick.key}, the only candidate"
        if not usable:
            reason += "; the producer link is unusable: remote candidates left out"
        # the own prefill chosen where a faster link would make a remote candidate win: the link
        # decides whether this stays right, and no request measures it now (consumer.auto.probe)
        link_matters = any(
            s.candidate.remote and s.estimate.free_link_ms is not None and s.estimate.free_link_ms < (pick.estimate.ms or 0.0)
            for s in known
        )
        self.local_choice_at = time.monotonic() if not pick.candidate.remote and link_matters else 0.0
        marked = [Scored(s.candidate, s.within, s.estimate, s is pick, s.key, s.excluded) for s in scored]
        marked.sort(key=lambda s: (not s.within, s.estimate.ms is None, s.estimate.ms or 0.0))
        return AutoChoice(budget, pick.candidate, reason, marked)

    def _probe(self, known: list[Scored], pick: Scored, usable: bool) -> tuple[Scored, str] | None:
        """A remote candidate this user request should measure instead of the pick, and why; at most
        one request in PROBE_EVERY (background probes, consumer.auto.probe, do the rest when idle)."""
        if self.choices_since_probe < PROBE_EVERY or not usable or not pick.estimate.ms:
            return None
        remote = [s for s in known if s.candidate.remote and s is not pick]
        if not remote:
            return None
        age_s = time.monotonic() - self.planner.link_sampled_at
        stale = self.planner.choices_since_link_sample >= PROBE_STALE_CHOICES and age_s >= PROBE_AFTER_S
        if stale and not pick.candidate.remote:
            target = min(remote, key=lambda s: (s.estimate.ms or 0.0, _sort_loss(s.candidate)))
            return target, f"the link was last measured {self.planner.choices_since_link_sample} choices ago"
        doubtful = [
            s for s in remote if not s.estimate.confident and (s.estimate.ms or 0.0) * DOUBT_MARGIN < (pick.estimate.ms or 0.0)
        ]
        if doubtful:
            target = min(doubtful, key=lambda s: (s.estimate.ms or 0.0, _sort_loss(s.candidate)))
            return target, f"its estimate is uncertain ({target.estimate.why}) and may beat the pick"
        return None

    def probe_target(self, context_tokens: int, stale_after_s: float = PROBE_AFTER_S) -> Candidate | None:
        """What a background probe should measure now (consumer.auto.probe): the remote candidate within
        the default budget whose estimate at context_tokens is missing or uncertain (the lowest
        loss first), else the fastest remote one once the link was last measured stale_after_s
        ago; None when nothing needs measuring or the link is unusable."""
        if not self.producer_usable():
            return None
        budget = self.default_budget()
        remote = [c for c in self.candidates() if c.remote and not self._excluded(c, budget, True)]
        scored = [(c, self._estimate_cold(c, context_tokens)) for c in remote]
        unsure = [(c, e) for c, e in scored if e.ms is None or not e.confident]
        if unsure:
            return min(unsure, key=lambda ce: (ce[1].ms is not None, _sort_loss(ce[0])))[0]
        if scored and time.monotonic() - self.planner.link_sampled_at >= stale_after_s:
            return min(scored, key=lambda ce: ce[1].ms or 0.0)[0]
        return None

    def exact_transfer(self, context_ids: list[int]) -> Candidate | None:
        """Verified decoding's exact cache (consumer.exact.verify): the exact transfer (raw or recompute
        from a producer with these weights in this dtype) estimated faster than the own prefill of
        the context, or None: the own prefill (also while either estimate is missing)."""
        if not self.producer_usable():
            return None
        remote = [c for c in self.candidates() if c.remote and c.how == "exact"]
        local = self.planner.estimate_local(len(context_ids)).ms
        if not remote or local is None:
            return None
        scored = [(c, self._estimate(c, self.key(c.mode, c.options), context_ids).ms) for c in remote]
        known = [(c, ms) for c, ms in scored if ms is not None]
        if not known:
            return None
        best, ms = min(known, key=lambda cm: cm[1])
        return best if ms < local else None

    def _estimate_cold(self, c: Candidate, tokens: int) -> Estimate:
        """A remote candidate's estimate for a context nobody holds (no cache, no producer store)."""
        key = self.key(c.mode, c.options)
        L = self.loaded.info.num_layers
        return self.planner.estimate_remote(key, L, tokens, tokens, tokens, c.bytes_per_token, self._compute_start(c))


def _wait_for_exact(scored: list[Scored]) -> list[Scored]:
    """Verified tokens only: a verified candidate's first token waits for the exact cache, so its
    estimate is at least the fastest exact candidate's (unknown while none is known)."""
    exact = [s.estimate.ms for s in scored if s.within and s.candidate.how == "exact" and s.estimate.ms is not None]
    if not exact:
        return scored
    floor = min(exact)
    out = []
    for s in scored:
        e = s.estimate
        if s.candidate.how == VERIFIED and e.ms is not None and e.ms < floor:
            e = dataclasses.replace(
                e, ms=floor, detail=f"{e.detail}; verified tokens wait for the exact cache ({floor:.1f} ms)", base_ms=None
            )
        out.append(Scored(s.candidate, s.within, e, s.chosen, s.key, s.excluded))
    return out


def _score(s: Scored) -> float:
    """What the choice compares: the estimate, an uncertain one counted UNCERTAIN_PENALTY times."""
    ms = s.estimate.ms or 0.0
    return ms if s.estimate.confident else ms * UNCERTAIN_PENALTY


def _sort_loss(c: Candidate) -> float:
    return c.loss if c.loss == c.loss else 0.0  # NaN (a named mode) sorts as exact
