"""What each way of getting a context's KV costs on this consumer: running estimates learned from
its own finished requests (and background probes), and the time estimate of one candidate for
one request.

Every cost that grows with the context is a `Fit`: a fixed term plus a per-token term, fitted over
the last FIT_WINDOW samples of different lengths to the least absolute relative error (a request
a load spike slowed moves it little; recent samples weigh more: each new one multiplies the older
weights by 1 - FIT_ALPHA). A per-token rate is
never stretched from a handful of tokens: while the samples' lengths lie within MIN_SPREAD of each
other the two terms cannot be told apart, and a prediction far outside the lengths measured
(more than MIN_SPREAD beyond them) is marked uncertain, with the reason. Learned:
- own prefill: ms over the context tokens it prefilled (mode oracle, a local fallback); until it
  has one, the producer's prefill fit stands in, else the question prefill's (both uncertain);
- the producer: prefill ms over the tokens its forward computed (trailer prefill_ms /
  computed_tokens), the wait for that forward (trailer queue_ms, a mean), encode ms over the
  tokens encoded, per candidate;
- consumer rebuild ms over the tokens received, and bytes per token, per candidate;
- the link, from the stream itself: bytes over the time between the first and the last payload
  chunk; a sample more than RATE_JUMP x off the estimate replaces it (a step change, not noise).
  A span the link set (a store replay, or a producer whose forward took under half the span) is
  a sample; a span the producer's forward paced is only a lower bound on the link (it raises the
  estimate, never lowers it): the estimate says which (`link_lower_bound`). Transfers under
  MIN_WIRE_BYTES say nothing;
- the round trip: the smallest of the last RTT_WINDOW times from call start to the header;
- per kind (remote, local), the overhead the model leaves out: the median of the last misses of
  auto's confident estimates for its own choices (`observe_overhead`).

One canonical key per candidate (`key`, set by consumer.auto.chooser: a named mode with its default
options and auto's candidate for the same codec and options are one key), so a request that
names a mode teaches the estimate auto reads. A request's key is derived once, when its job is
built, and carried (GenerateJob.candidate_key): its observation reports under it (`Observation.key`).

A candidate's time (`estimate_remote` / `estimate_local`): remote = rtt + producer queue (when it
computes) + the three pipelined stages (producer compute, wire, rebuild; they overlap layer by
layer, so the longest plus the others' share of one layer; a codec whose rebuild computes once
part of the stream arrived, recompute's span, says where: `arrived_then_computed`); local = the
own prefill fit at the tokens to prefill; each plus the overhead learned for its kind from auto's
own choices. An estimate is `confident` only when every part of it is (measured near this length, for this
candidate); a candidate never measured borrows the cheapest encode and rebuild fits seen
(uncertain). A remote estimate also says whether the link paces the stream (`link_paced`: the
wire is its longest stage; the mid-stream watch measures such a stream from the call on) and
what it would be with the wire free (`free_link_ms`: whether a faster link could make it win,
which decides link probes, consumer.auto.probe). Knows nothing about grpc or torch.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from shared.labels import mode_label, options_label

MIN_WIRE_BYTES = 16 * 1024  # smaller transfers say more about latency than about bandwidth
RTT_WINDOW = 16
OVERHEAD_RATIO = 2.0  # an estimate this far off the actual time is not a lesson in overhead
RATE_JUMP = 2.0  # a link sample this far off the estimate (either way) replaces it
LINK_BOUND_SHARE = 0.5  # a span counts as link-bound when the producer's forward took less than this share of it
FIT_WINDOW = 24  # samples a Fit keeps
FIT_ALPHA = 0.1  # each new sample multiplies the weight of the older ones by 1 - FIT_ALPHA
ROBUST_ROUNDS = 6  # reweighting rounds of a Fit (towards the least absolute relative error)
ROBUST_FLOOR = 0.02  # residuals under this share of the sample count as this (no sample weighs unboundedly)
ESTIMATE_KEYS = 256  # candidate keys whose estimates are kept (the least recently learned dropped first)
MIN_SPREAD = 2.0  # lengths within this ratio cannot separate the fixed term; predictions beyond it are extrapolations


def mode_key(mode: str, options: Mapping[str, str]) -> str:
    """A mode and its options as one label, options left empty dropped ('scd', not
    'scd(artifact=,max_loss=,...)')."""
    return mode_label(mode, options_label({k: v for k, v in options.items() if v != ""}))


@dataclass
class Ewma:
    alpha: float = 0.3
    value: float | None = None
    count: int = 0  # samples taken
    at: float = 0.0  # time.monotonic() of the last one

    def add(self, x: float) -> None:
        self.value = x if self.value is None else (1 - self.alpha) * self.value + self.alpha * x
        self.count += 1
        self.at = time.monotonic()


@dataclass(frozen=True)
class Cost:
    ms: float
    confident: bool = True
    why: str = ""  # what makes it uncertain ("" when confident)


@dataclass
class Fit:
    """ms ~= fixed + per_token x tokens over recent samples of different lengths."""

    alpha: float = FIT_ALPHA
    samples: collections.deque = field(default_factory=lambda: collections.deque(maxlen=FIT_WINDOW))
    count: int = 0  # samples taken (the window keeps the last FIT_WINDOW)
    at: float = 0.0  # time.monotonic() of the last one
    _fitted: tuple[float, float, bool] | None = field(default=None, repr=False, compare=False)  # until the next add

    def add(self, tokens: int, ms: float) -> None:
        if tokens <= 0 or not ms >= 0:
            return
        self.samples.append((float(tokens), float(ms)))
        self.count += 1
        self.at = time.monotonic()
        self._fitted = None

    def coefficients(self) -> tuple[float, float, bool] | None:
        """`_coefficients`, fitted once per sample added (every choice predicts from every fit)."""
        if self._fitted is None:
            self._fitted = self._coefficients()
        return self._fitted

    def _coefficients(self) -> tuple[float, float, bool] | None:
        """(fixed ms, ms per token, separated); separated is False while the samples' lengths are
        too close (within MIN_SPREAD) to tell the two terms apart. None without samples.

        Robust: a fit of the relative error in absolute value (ROBUST_ROUNDS of iteratively
        reweighted least squares), so a request slowed by something else (a load spike: the
        noise is one-sided and proportional) moves it little, and a long request's ms do not
        outweigh a short one's."""
        if not self.samples:
            return None
        n = len(self.samples)
        recency = [(1 - self.alpha) ** (n - 1 - i) for i in range(n)]
        xs, ys = [x for x, _ in self.samples], [y for _, y in self.samples]
        if max(xs) < MIN_SPREAD * min(xs):
            # as if all per-token: only used near the lengths measured; the weighted median rate
            rates = sorted(zip((y / x for x, y in zip(xs, ys)), recency))
            half, acc, rate = sum(recency) / 2, 0.0, rates[-1][0]
            for r, wi in rates:
                acc += wi
                if acc >= half:
                    rate = r
                    break
            mx = sum(wi * x for wi, x in zip(recency, xs)) / sum(recency)
            return rate * mx, rate, False
        w = [wi / max(y, 1e-3) ** 2 for wi, y in zip(recency, ys)]  # relative: ms off over ms measured
        fixed, per_token = _weighted_line(xs, ys, w)
        for _ in range(ROBUST_ROUNDS):
            scale = [max(abs(y - fixed - per_token * x), ROBUST_FLOOR * y, 1e-3) for x, y in zip(xs, ys)]
            fixed, per_token = _weighted_line(xs, ys, [wi / (max(y, 1e-3) * r) for wi, y, r in zip(recency, ys, scale)])
        return fixed, per_token, True

    def predict(self, tokens: int) -> Cost | None:
        coef = self.coefficients()
        if coef is None:
            return None
        if tokens <= 0:
            return Cost(0.0)
        fixed, per_token, separated = coef
        xs = [x for x, _ in self.samples]
        lo, hi = min(xs), max(xs)
        near = lo / MIN_SPREAD <= tokens <= hi * MIN_SPREAD
        if separated:
            why = "" if near else f"extrapolated from {lo:.0f}-{hi:.0f} tokens to {tokens}"
            return Cost(fixed + per_token * tokens, near, why)
        # one length: the truth lies between all-fixed (ms) and all-per-token (ms x tokens / length);
        # the midpoint is at most MIN_SPREAD off near the length measured, uncertain far from it
        ms = (fixed + per_token * tokens) / 2
        return Cost(ms, near, "" if near else f"measured at {hi:.0f} tokens only, asked for {tokens}")

    def describe(self, name: str, now: float) -> dict[str, float]:
        coef = self.coefficients()
        if coef is None:
            return {}
        return {
            f"{name}.fixed_ms": coef[0] if coef[2] else 0.0,
            f"{name}.ms_per_token": coef[1],
            f"{name}.samples": float(self.count),
            f"{name}.age_s": now - self.at,
        }


def _weighted_line(xs: list[float], ys: list[float], w: list[float]) -> tuple[float, float]:
    """(fixed, per_token) >= 0 of the weighted least-squares line through (xs, ys)."""
    sw = sum(w)
    mx, my = sum(wi * x for wi, x in zip(w, xs)) / sw, sum(wi * y for wi, y in zip(w, ys)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(w, xs))
    sxy = sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, xs, ys))
    per_token = sxy / sxx if sxx > 0 else 0.0
    fixed = my - per_token * mx
    if per_token < 0:  # longer was not slower: the noise is larger than the per-token cost
        return my, 0.0
    if fixed < 0:
        return 0.0, sum(wi * x * y for wi, x, y in zip(w, xs, ys)) / sum(wi * x * x for wi, x in zip(w, xs))
    return fixed, per_token


V = TypeVar("V")


class Recent(collections.OrderedDict[str, V], Generic[V]):
    """Estimates by candidate key, at most ESTIMATE_KEYS: a caller's own options (a keep set, a
    schedule given by text) make keys without end, and each one's estimates are kept (and listed by
    Describe) only while it is among the most recently learned."""

    def learn(self, key: str, make: Callable[[], V]) -> V:
        value = self.get(key)
        if value is None:
            value = self[key] = make()
            if len(self) > ESTIMATE_KEYS:
                self.popitem(last=False)
        else:
            self.move_to_end(key)
        return value


@dataclass
class RunningMedian:
    """The median of the last `window` samples (an outlier moves it at most one rank)."""

    window: int = 9
    samples: collections.deque = field(default_factory=collections.deque)
    count: int = 0
    at: float = 0.0

    def add(self, x: float) -> None:
        self.samples.append(x)
        while len(self.samples) > self.window:
            self.samples.popleft()
        self.count += 1
        self.at = time.monotonic()

    @property
    def value(self) -> float | None:
        if not self.samples:
            return None
        ordered = sorted(self.samples)
        mid = len(ordered) // 2
        return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


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
    local_prefill_ms: float = 0.0  # the own prefill's share of rebuild_ms (0: all of it when local_tokens)
    rebuilt: bool = True  # False: a background probe (nothing rebuilt here)
    # the candidate's key as the request carried it (GenerateJob.candidate_key; a probe's own);
    # "": derived here from mode and options (a planner used alone)
    key: str = ""


@dataclass(frozen=True)
class Estimate:
    ms: float | None  # None: an estimate it needs has no sample yet
    detail: str  # the parts, or what is missing
    # ms before the learned overhead of its kind (remote / local) was added; set only on a
    # confident estimate: what observe_overhead learns from (an uncertain one's miss is the model's)
    base_ms: float | None = None
    confident: bool = True  # every part measured near this length for this candidate
    why: str = ""  # what makes it uncertain
    link_paced: bool = False  # remote: the wire is the longest stage (a stream paced by the link, not a forward)
    free_link_ms: float | None = None  # remote: the estimate were the link free (no wire time): can the link matter?


def pipelined(stages: list[float], layers: int) -> float:
    """Stages that overlap layer by layer: the longest, plus one layer's share of the others."""
    longest = max(stages)
    return longest + (sum(stages) - longest) / max(layers, 1)


def arrived_then_computed(producer: float, wire: float, rebuild: float, layers: int, start: tuple[float, float]) -> float:
    """A stream whose rebuild computes once a part of it arrived (codec `compute_start`: that
    part's share of the bytes and of the layers) and then runs its whole length: the later of the
    last layer's arrival (plus one layer's share of the rebuild) and that part's arrival plus the
    rebuild. The part arrives when both the producer (paced by layers) and the wire (by bytes)
    delivered it."""
    bytes_share, layers_share = start
    arrived = max(producer * layers_share, wire * bytes_share)
    return max(pipelined([producer, wire], layers) + rebuild / max(layers, 1), arrived + rebuild)


class TransferPlanner:
    def __init__(self) -> None:
        self.key: Callable[[str, Mapping[str, str]], str] = mode_key  # canonical key (consumer.auto.chooser sets it)
        self.local = Fit()  # own context prefill
        self.question = Fit()  # question prefill (a few tokens per forward)
        self.producer_prefill = Fit()  # per computed token
        self.producer_queue_ms = Ewma()
        self.link_bytes_per_ms = Ewma(alpha=0.5)
        self.link_lower_bound = False  # the estimate came from a compute-paced span: the link is at least this fast
        self.encode: Recent[Fit] = Recent()  # by candidate key, as are the two below
        self.rebuild: Recent[Fit] = Recent()
        self.bytes_per_token: Recent[Ewma] = Recent()
        self.header_ms: collections.deque = collections.deque(maxlen=RTT_WINDOW)
        self.overhead_ms: dict[str, RunningMedian] = {"remote": RunningMedian(), "local": RunningMedian()}
        self.choices_since_link_sample = 0  # auto choices made since the link was last measured
        self.link_sampled_at = 0.0  # time.monotonic() of the last link measurement

    # -- learning ---------------------------------------------------------------------------
    def observe(self, o: Observation) -> None:
        if o.question_tokens and o.question_prefill_ms > 0:
            self.question.add(o.question_tokens, o.question_prefill_ms)
        if o.local_tokens:
            self.local.add(o.local_tokens, o.local_prefill_ms or o.rebuild_ms)
        if o.mode == "oracle" or not o.sent_tokens:
            return
        key = o.key or self.key(o.mode, o.options)
        sent = o.sent_tokens
        self.bytes_per_token.learn(key, Ewma).add(o.bytes_received / sent)
        if o.rebuilt and not o.local_tokens:
            self.rebuild.learn(key, Fit).add(sent, o.rebuild_ms)
        if o.computed_tokens:
            self.producer_prefill.add(o.computed_tokens, o.producer_prefill_ms)
            self.producer_queue_ms.add(o.queue_ms)
        if o.computed_tokens or o.producer_encode_ms > 0:  # a replay of stored payloads encodes nothing
            self.encode.learn(key, Fit).add(sent, o.producer_encode_ms)
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
        link = self.link_bytes_per_ms
        current = link.value
        if link_bound and current is not None and not current / RATE_JUMP <= rate <= current * RATE_JUMP:
            link.value = None  # a step change (the link was reshaped): start over from it
            link.add(rate)
            self.link_lower_bound = False
        elif link_bound:
            link.add(rate)
            self.link_lower_bound = False
        elif current is None or rate > current:
            link.value = None  # a lower bound above the estimate: the link is at least this fast
            link.add(rate)
            self.link_lower_bound = True

    # -- estimates --------------------------------------------------------------------------
    @property
    def rtt_ms(self) -> float:
        return min(self.header_ms) if self.header_ms else 0.0

    def local_cost(self, tokens: int) -> tuple[Cost | None, str]:
        """Own prefill of `tokens`; until one is measured, the producer's (the same architecture:
        a fine-tuned variant of its base), else the question prefill's; both uncertain."""
        own = self.local.predict(tokens)
        if own is not None:
            return own, "own prefill"
        for fit, source in ((self.producer_prefill, "the producer's prefill"), (self.question, "question prefill")):
            cost = fit.predict(tokens)
            if cost is not None:
                return Cost(cost.ms, False, f"no own context prefill yet: {source} stands in"), source
        return None, ""

    def observe_overhead(self, remote: bool, actual_ms: float, base_ms: float) -> None:
        """An auto choice came true: its KV was ready actual_ms after receipt (TTFT minus the
        question prefill) where the model said base_ms; the difference, learned per kind, is what
        the model leaves out (call setup, queueing, decode of the last layer, ...). Only a model
        that was roughly right (within OVERHEAD_RATIO either way) teaches it: a far-off one had a
        stale input (a link reshaped since it was measured), which the request's own measurements
        correct, and learning it as overhead would bias every later choice of its kind. Only a
        confident estimate carries base_ms (Estimate): an extrapolated or borrowed one's miss is
        the fit's, and learned as overhead it would shift every length of its kind."""
        if base_ms > 0 and 1 / OVERHEAD_RATIO <= actual_ms / base_ms <= OVERHEAD_RATIO:
            self.overhead_ms["remote" if remote else "local"].add(actual_ms - base_ms)

    def _with_overhead(
        self,
        kind: str,
        base: float,
        detail: str,
        confident: bool,
        why: str,
        link_paced: bool = False,
        free_link_base: float | None = None,
    ) -> Estimate:
        extra = self.overhead_ms[kind].value
        if extra is not None:
            detail = f"{detail} + learned overhead {extra:.1f}"
        ms = base if extra is None else max(base + extra, 0.0)
        free = None if free_link_base is None else max(free_link_base + (extra or 0.0), 0.0)
        return Estimate(
            ms, detail + (f"; uncertain: {why}" if why else ""), base if confident else None, confident, why, link_paced, free
        )

    def estimate_local(self, tokens: int) -> Estimate:
        cost, source = self.local_cost(tokens)
        if cost is None:
            return Estimate(None, "no own prefill rate yet")
        return self._with_overhead(
            "local", cost.ms, f"own prefill {tokens} tokens {cost.ms:.1f} ({source})", cost.confident, cost.why
        )

    def _fit(self, table: Mapping[str, Fit], key: str, tokens: int, what: str) -> Cost | None:
        """The candidate's own fit at `tokens` when it is confident there; else the cheapest
        confident prediction of another candidate (a schedule of the same codec costs about the
        same), else its own or the others' uncertain one. Borrowed costs are uncertain."""
        own_fit = table.get(key)
        own = own_fit.predict(tokens) if own_fit is not None else None
        if own is not None and own.confident:
            return own
        others = [c for k, f in table.items() if k != key for c in [f.predict(tokens)] if c is not None]
        sure = [c for c in others if c.confident]
        if sure:
            best = min(sure, key=lambda c: c.ms)
            why = (
                f"{what} measured for it only far from {tokens} tokens" if own is not None else f"{what} not measured for it yet"
            )
            return Cost(best.ms, False, f"{why} (borrowed from another candidate)")
        if own is not None:
            return own
        if not others:
            return None
        return Cost(min(c.ms for c in others), False, f"{what} not measured for it yet (borrowed)")

    def estimate_remote(
        self,
        key: str,
        layers: int,
        compute: int,
        encode: int,
        send: int,
        prior_bytes_per_token: float | None = None,
        compute_start: tuple[float, float] | None = None,
    ) -> Estimate:
        """A transfer of candidate `key`: the producer prefills `compute` tokens and encodes
        `encode`, `send` tokens' payloads cross the link and are rebuilt here; `compute_start`:
        the codec's (Codec.compute_start), None when the rebuild is spread over the layers."""
        missing = []
        measured_bpt = self.bytes_per_token.get(key, Ewma()).value
        bpt = measured_bpt if measured_bpt is not None else prior_bytes_per_token
        link = self.link_bytes_per_ms.value
        prefill = self.producer_prefill.predict(compute)
        encoding = self._fit(self.encode, key, encode, "encode") if encode else Cost(0.0)
        rebuilding = self._fit(self.rebuild, key, send, "rebuild") if send else Cost(0.0)
        if bpt is None:
            missing.append("bytes/token")
        if link is None and send:
            missing.append("link rate")
        if prefill is None and compute:
            missing.append("producer prefill rate")
        if rebuilding is None:
            missing.append("rebuild rate")
        if missing:
            return Estimate(None, "no estimate yet of " + ", ".join(missing))
        parts = [c for c in (prefill, encoding, rebuilding) if c is not None]
        producer = max(prefill.ms if prefill is not None else 0.0, encoding.ms if encoding is not None else 0.0)
        wire = (bpt or 0.0) * send / link if send and link else 0.0
        rebuild = rebuilding.ms if rebuilding is not None else 0.0
        queue = (self.producer_queue_ms.value or 0.0) if compute else 0.0
        whys = [c.why for c in parts if not c.confident]
        if encoding is None:
            whys.append("encode not measured yet")
        stages = [producer, wire, rebuild]
        bound = ""
        wire_hidden = False
        if self.link_lower_bound and send:
            # only compute-paced streams measured the link: it is at least this fast, so a wire
            # time within the producer's is hidden behind it, and a longer one is an upper bound
            if wire <= producer:
                wire_hidden = True
                stages, bound = [producer, rebuild], " (a lower bound: compute-paced; hidden behind the producer)"
            else:
                bound = " (a lower bound: compute-paced)"
                whys.append("the link rate is only a lower bound (every stream measured was compute-paced)")
        shape = "pipelined"
        if compute_start is None:
            overlapped = pipelined(stages, layers)
            free_link = pipelined([producer, rebuild], layers)
        else:  # the rebuild computes once part of the stream arrived: not spread over the layers
            overlapped = arrived_then_computed(producer, 0.0 if wire_hidden else wire, rebuild, layers, compute_start)
            free_link = arrived_then_computed(producer, 0.0, rebuild, layers, compute_start)
            shape = f"computed after {compute_start[0]:.0%} of the bytes"
        base = self.rtt_ms + queue + overlapped
        detail = (
            f"rtt {self.rtt_ms:.1f} + queue {queue:.1f} + {shape}(producer {producer:.1f} [{compute} prefilled,"
            f" {encode} encoded], wire {wire:.1f} [{send} tokens x {bpt:.0f} B at {(link or 0) * 8e-3:.1f} Mbit/s{bound}],"
            f" rebuild {rebuild:.1f})"
        )
        link_paced = not wire_hidden and wire > 0 and wire >= producer
        free_base = self.rtt_ms + queue + free_link
        return self._with_overhead("remote", base, detail, not whys, "; ".join(whys), link_paced, free_base)

    def snapshot(self) -> dict[str, float]:
        """The current estimates, for Describe and logs (absent: no sample yet): each fit's fixed ms,
        ms per token, sample count and age in seconds."""
        now = time.monotonic()
        link = self.link_bytes_per_ms
        out: dict[str, float | None] = {
            "rtt_ms": self.rtt_ms,
            "producer_queue_ms": self.producer_queue_ms.value,
            "link_mbit_s": None if link.value is None else link.value * 8e-3,
            "remote_overhead_ms": self.overhead_ms["remote"].value,
            "local_overhead_ms": self.overhead_ms["local"].value,
        }
        if self.producer_queue_ms.count:
            out["producer_queue.samples"] = float(self.producer_queue_ms.count)
            out["producer_queue.age_s"] = now - self.producer_queue_ms.at
        if link.count:
            out["link_lower_bound"] = float(self.link_lower_bound)
            out["link.samples"] = float(link.count)
            out["link.age_s"] = now - link.at
        out.update(self.local.describe("local_prefill", now))
        out.update(self.question.describe("question_prefill", now))
        out.update(self.producer_prefill.describe("producer_prefill", now))
        for key, fit in self.encode.items():
            out.update(fit.describe(f"producer_encode[{key}]", now))
        for key, fit in self.rebuild.items():
            out.update(fit.describe(f"rebuild[{key}]", now))
        out.update({f"bytes_per_token[{k}]": e.value for k, e in self.bytes_per_token.items()})
        return {k: float(v) for k, v in out.items() if v is not None}
