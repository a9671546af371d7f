"""Background probes: keep mode auto's estimates fresh without charging users.

Every request's stream teaches the planner (consumer.planner), whatever mode it named; a user
request is a probe at most once in consumer.auto.PROBE_EVERY auto choices. The rest is measured
here: once the consumer has had no Generate call in flight for `--probe-idle-s` seconds, it asks
the producer for one small transfer of a fresh random context (PROBE_TOKENS tokens, alternating
lengths so that each fit can tell its fixed term from its per-token term) in the mode auto most
needs to measure (`Chooser.probe_target`: a candidate whose estimate is missing or uncertain,
else the fastest remote one once the link estimate is older than `--probe-idle-s`), reads the
whole stream through the stream contract and feeds what it measured (link, round trip, the
producer's queue, prefill and encode) to the planner. Nothing is rebuilt and no user waits on it;
at most one probe runs at a time and at most one per `--probe-idle-s`. Logged as `probe.done` /
`probe.failed`. Knows nothing about the servicer.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable, Mapping

from consumer.auto import Chooser
from consumer.planner import Observation, TransferPlanner
from consumer.producer_client import ProducerClient
from consumer.stream_reader import Expectation, LayerPayloads, StreamTrailer
from shared import codecs as codec_lib
from shared import logs, serving
from shared.models import ModelInfo

log = logs.get("consumer.probe")

PROBE_TOKENS = (64, 512)  # context lengths, alternating
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
    ):
        self.chooser, self.planner, self.client, self.codecs, self.info = chooser, planner, client, codecs, info
        self.idle_s, self.busy, self.max_tokens = idle_s, busy, max_tokens
        self.last_request = time.monotonic()  # the servicer calls touch() on every Generate
        self.last_probe = 0.0
        self.runs = 0
        self.failures = 0
        self._task: asyncio.Task | None = None

    def touch(self) -> None:
        self.last_request = time.monotonic()

    def start(self) -> None:
        if self._task is None and self.idle_s > 0:
            self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        await serving.stop_task(self._task)
        self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(min(self.idle_s / 4, 1.0))
            now = time.monotonic()
            if self.busy() or now - self.last_request < self.idle_s or now - self.last_probe < self.idle_s:
                continue
            with contextlib.suppress(Exception):
                await self.probe_once()

    async def probe_once(self) -> Observation | None:
        """One probe now, if auto needs one (None: nothing to measure, or it failed)."""
        tokens = max(1, min(PROBE_TOKENS[self.runs % len(PROBE_TOKENS)], self.max_tokens))
        candidate = self.chooser.probe_target(tokens, stale_after_s=self.idle_s)
        if candidate is None:
            return None
        self.last_probe = time.monotonic()
        self.runs += 1
        key = self.chooser.key(candidate.mode, candidate.options)
        rng = random.Random(time.monotonic_ns())
        ids = [rng.randrange(self.info.vocab_size) for _ in range(tokens)]  # a fresh context: the producer computes it
        expect = Expectation(tokens, self.codecs[candidate.mode], dict(candidate.options), self.info)
        received, trailer = 0, None
        try:
            async for event in self.client.open(f"probe-{self.runs}", ids, expect, PROBE_TIMEOUT_S):
                if isinstance(event, LayerPayloads):
                    received += event.nbytes
                elif isinstance(event, StreamTrailer):
                    trailer = event
        except Exception as exc:
            self.failures += 1
            log.warning("probe.failed", candidate=key, tokens=tokens, error=str(exc)[:200])
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
        )
        self.planner.observe(observed)
        log.info(
            "probe.done",
            candidate=key,
            tokens=tokens,
            bytes=received,
            prefill_ms=round(trailer.prefill_ms, 2),
            encode_ms=round(trailer.encode_ms, 2),
            span_ms=round(trailer.span_ms, 2),
        )
        return observed
