"""Background probes: keep mode auto's estimates fresh without charging users.

Every request's stream teaches the planner (consumer.auto.planner), whatever mode it named; a user
request is a probe at most once in consumer.auto.chooser.PROBE_EVERY auto choices. The rest is measured
here, by one small transfer of a random context (nothing is rebuilt, no user waits on it, at most
one runs at a time), in two cases:
- idle: the consumer has had no Generate call in flight for `--probe-idle-s` seconds. The probe
  (a fresh context of PROBE_TOKENS tokens, alternating lengths so that each fit can tell its
  fixed term from its per-token term) measures the candidate auto most needs
  (`Chooser.probe_target`: one whose estimate is missing or uncertain, else the fastest remote
  one once the link estimate is older than `--probe-idle-s`); at most one per `--probe-idle-s`.
- link: auto's last choice (within `--probe-idle-s`) was the own prefill over a remote candidate
  that a faster link would make win (`Estimate.free_link_ms`: its estimate with the wire free
  beats the pick) and no producer stream is open, so no request measures the link while auto
  keeps choosing not to use it: a rate step up would never be seen. A LINK_PROBE_TOKENS
  transfer measures it once the link estimate is older than max(LINK_PROBE_MIN_S, the last link
  probe's time / LINK_PROBE_SHARE): the probes hold the link at most that share of the time.
  Link probes ask for one context again and again: after the first, the producer replays it
  from its store, so the stream is paced by the link, not by a forward (a computed one only
  tells the planner the link is at least that fast).
Each reads the whole stream through the stream contract and feeds what it measured (link, round
trip, the producer's queue, prefill and encode) to the planner. Logged as `probe.done` (with
`why`: idle | link) / `probe.failed`; a failure inside the loop is logged, never ends it. Knows
nothing about the servicer.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Mapping

from consumer.auto.chooser import Chooser
from consumer.auto.planner import Observation, TransferPlanner
from consumer.link.producer_client import ProducerClient
from consumer.link.stream_reader import Expectation, LayerPayloads, StreamTrailer
from shared import background, logs
from shared import codecs as codec_lib
from shared.codecs.kept import KEEP_OPTION, KeepRequest
from shared.models import ModelInfo

log = logs.get("consumer.auto.probe")

PROBE_TOKENS = (64, 512)  # context lengths of idle probes, alternating
LINK_PROBE_TOKENS = 64  # context length of a link probe
LINK_PROBE_SHARE = 0.1  # link probes hold the link at most this share of the time ...
LINK_PROBE_MIN_S = 2.0  # ... and come at most once in this many seconds
PROBE_TIMEOUT_S = 30.0


class BackgroundProbe:
    def __init__(
        self,
        chooser: Chooser,
        planner: TransferPlanner,
        client: ProducerClient,
        codecs: Mapping[str, codec_lib.Codec],
        info: ModelInfo,
        idle_s: float,
        busy: Callable[[], bool],
        max_tokens: int,
        link_busy: Callable[[], bool] = lambda: False,
    ):
        self.chooser, self.planner, self.client, self.codecs, self.info = chooser, planner, client, codecs, info
        self.idle_s, self.busy, self.max_tokens, self.link_busy = idle_s, busy, max_tokens, link_busy
        self.last_request = time.monotonic()  # the servicer calls touch() on every Generate
        self.last_probe = 0.0
        self.link_every_s = LINK_PROBE_MIN_S  # link probes' spacing (LINK_PROBE_SHARE of the last one's time)
        self.runs = 0  # probes started
        self.done = {"idle": 0, "link": 0}  # probes measured, by why (the scd_background_probes metric)
        self.link_context: list[int] = []  # the link probes' context (replayed by the producer's store)
        self.last_link: Observation | None = None  # what the last link probe measured
        self.failures = 0
        self._task: asyncio.Task | None = None

    @property
    def link_runs(self) -> int:
        return self.done["link"]

    def touch(self) -> None:
        self.last_request = time.monotonic()

    def start(self) -> None:
        if self._task is None and self.idle_s > 0:
            self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        await background.stop_task(self._task)
        self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(min(self.idle_s / 4, 0.5))
            try:
                if self.link_due():
                    await self.probe_link()
                elif self.idle_due():
                    await self.probe_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug here must not end the probes silently
                self.failures += 1
                log.warning("probe.failed", error=f"{type(exc).__name__}: {str(exc)[:200]}")

    def idle_due(self) -> bool:
        now = time.monotonic()
        return not self.busy() and now - self.last_request >= self.idle_s and now - self.last_probe >= self.idle_s

    def link_due(self) -> bool:
        """Auto serves locally over a remote candidate, recently, with the link idle and its
        estimate older than the link probes' spacing."""
        now = time.monotonic()
        chose_local = self.chooser.local_choice_at
        return (
            chose_local > 0
            and now - chose_local < self.idle_s
            and not self.link_busy()
            and now - self.planner.link_sampled_at >= self.link_every_s
            and now - self.last_probe >= self.link_every_s
        )

    async def probe_link(self) -> Observation | None:
        """One link probe now (LINK_PROBE_TOKENS); the next no sooner than LINK_PROBE_SHARE of the
        link's time allows."""
        started = time.monotonic()
        if not self.link_context:
            self.link_context = self._random_context(min(LINK_PROBE_TOKENS, self.max_tokens))
        observed = await self.probe_once(len(self.link_context), self.link_every_s, "link", self.link_context)
        if observed is not None:
            self.last_link = observed
        self.link_every_s = max(LINK_PROBE_MIN_S, (time.monotonic() - started) / LINK_PROBE_SHARE)
        return observed

    def _random_context(self, tokens: int) -> list[int]:
        rng = random.Random(time.monotonic_ns())
        return [rng.randrange(self.info.vocab_size) for _ in range(tokens)]

    async def probe_once(
        self, tokens: int = 0, stale_after_s: float = 0.0, why: str = "idle", context: list[int] | None = None
    ) -> Observation | None:
        """One probe now, if auto needs one (None: nothing to measure, or it failed); of `context`
        when given, else of a fresh random context (the producer computes it)."""
        tokens = max(1, min(tokens or PROBE_TOKENS[self.runs % len(PROBE_TOKENS)], self.max_tokens))
        candidate = self.chooser.probe_target(tokens, stale_after_s=stale_after_s or self.idle_s)
        if candidate is None:
            return None
        self.last_probe = time.monotonic()
        self.runs += 1
        key = self.chooser.key(candidate.mode, candidate.options)
        ids = context or self._random_context(tokens)
        codec, options = self.codecs[candidate.mode], dict(candidate.options)
        label = options.pop(KEEP_OPTION, None)  # a keep point: its selection travels as PrefillRequest.keep
        keep = KeepRequest.parse(label).for_codec(codec) if label is not None else None
        expect = Expectation(tokens, codec, options, self.info, keep=keep)
        received, trailer = 0, None
        try:
            async for event in self.client.open(f"probe-{self.runs}", ids, expect, PROBE_TIMEOUT_S):
                if isinstance(event, LayerPayloads):
                    received += event.nbytes
                elif isinstance(event, StreamTrailer):
                    trailer = event
        except Exception as exc:
            self.failures += 1
            log.warning("probe.failed", why=why, candidate=key, tokens=tokens, error=str(exc)[:200])
            return None
        if trailer is None:
            return None
        observed = Observation(
            candidate.mode,
            candidate.options,
            tokens,
            received,
            0.0,
            sent_tokens=tokens,
            producer_prefill_ms=trailer.prefill_ms,
            producer_encode_ms=trailer.encode_ms,
            producer_store_hit=trailer.store_hit,
            computed_tokens=trailer.computed_tokens,
            queue_ms=trailer.queue_ms,
            header_ms=trailer.header_ms,
            span_ms=trailer.span_ms,
            span_bytes=trailer.span_bytes,
            rebuilt=False,
            key=key,
        )
        self.planner.observe(observed)
        self.done[why] = self.done.get(why, 0) + 1
        log.info(
            "probe.done",
            why=why,
            candidate=key,
            tokens=tokens,
            bytes=received,
            prefill_ms=round(trailer.prefill_ms, 2),
            encode_ms=round(trailer.encode_ms, 2),
            span_ms=round(trailer.span_ms, 2),
            store_hit=trailer.store_hit,
        )
        return observed
