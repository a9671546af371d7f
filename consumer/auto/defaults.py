"""The consumer's default transfer mode: what a request that names no mode gets.

`--default-mode` names it; left empty, it is `auto` (consumer.auto.chooser): the fastest candidate whose
calibrated loss meets the budget of the pair's artifact default schedule (lossless candidates
only without an artifact), so a caller who knows nothing about transfer modes gets the fastest
answer that stays close to the consumer's own.

`safest` names the safest fixed mode the loaded artifacts allow, given what the consumer knows of
its producer's weights (shown in auto's reason):
- `scd` (the artifact's default schedule) when an SCD artifact calibrated for this consumer's
  weights, and for the producer's as far as they are known, is loaded;
- `raw` only when the producer's weights are known to equal the consumer's (raw K/V is then
  exact);
- otherwise `oracle` (the consumer prefills the context itself: right by construction).
Naive reuse of another model's K/V (`raw`, `quant` or `recompute` across different weights) is
served only when a request names it: a `--default-mode` that is naive reuse for these weights is a
start-up error unless `--allow-naive-reuse-default` is set (`naive_reuse`; the producer's weights
come from the link, else from the loaded artifacts calibrated for this consumer). Readiness
(consumer.link.readiness.not_ready): a fixed transfer default needs the producer, `auto` and `oracle`
do not. Recomputed whenever the producer link learns the producer's weight digest. Knows nothing
about grpc.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from shared import codecs as codec_lib
from shared.codecs.scd import ScdCodec
from shared.config import AUTO_MODE, ORACLE_MODE

NAIVE_MODES = ("raw", "quant", "recompute")  # modes that reuse the producer's own K/V


@dataclass(frozen=True)
class Choice:
    mode: str
    why: str


def safest(
    codecs: Mapping[str, codec_lib.Codec],
    consumer_digest: str,
    producer_digest: str = "",
    producer_artifacts: tuple[str, ...] | None = None,
) -> Choice:
    """The safest mode for this consumer and its codecs' artifacts, given the producer's digest
    ("" unknown) and the artifact ids the producer loaded (None unknown)."""
    scd = codecs.get("scd")
    for art in scd.artifacts if isinstance(scd, ScdCodec) else []:
        mine = art.meta["consumer"]["weight_digest"] == consumer_digest
        theirs = art.meta["producer"]["weight_digest"]
        loaded_there = producer_artifacts is None or art.artifact_id in producer_artifacts
        if mine and loaded_there and (not producer_digest or theirs == producer_digest):
            return Choice("scd", f"artifact {art.artifact_id} is calibrated for this pair")
    if producer_digest and producer_digest == consumer_digest:
        return Choice("raw", "the producer's weights equal the consumer's")
    if producer_digest:
        return Choice(ORACLE_MODE, "the producer's weights differ from the consumer's and no SCD artifact covers the pair")
    return Choice(ORACLE_MODE, "the producer's weights are not known yet and no SCD artifact covers this consumer")


class DefaultMode:
    """The default mode now: the configured one, else auto; `choice` is the safest fixed mode for
    what is known (auto's reason names it)."""

    def __init__(self, configured: str, codecs: Mapping[str, codec_lib.Codec], consumer_digest: str):
        self.configured, self.codecs, self.consumer_digest = configured, codecs, consumer_digest
        self.choice = Choice(configured, "--default-mode") if configured else safest(codecs, consumer_digest)

    @property
    def mode(self) -> str:
        return self.configured or AUTO_MODE

    @property
    def why(self) -> str:
        if self.configured:
            return "--default-mode"
        return (
            "auto: the fastest candidate within the budget of the pair's artifact default schedule (lossless"
            f" candidates without one); the safest fixed mode now: {self.choice.mode} ({self.choice.why})"
        )

    def producer_known(self, producer_digest: str, producer_artifacts: tuple[str, ...] | None = None) -> bool:
        """Learn the producer's weights and artifacts; True when the default changed."""
        if self.configured:
            return False
        before = self.choice
        self.choice = safest(self.codecs, self.consumer_digest, producer_digest, producer_artifacts)
        return before != self.choice

    @property
    def needs_producer(self) -> bool:
        """Whether the default cannot be served without the producer: a fixed transfer mode (auto
        falls back to the consumer's own prefill; oracle never calls it)."""
        return self.mode not in (ORACLE_MODE, AUTO_MODE)

    def naive_reuse(self, producer_digest: str, allowed: bool = False) -> str:
        """Why the configured default is naive reuse of another model's K/V ("" when it is not, the
        producer's weights are unknown, or `allowed`)."""
        if allowed or self.configured not in NAIVE_MODES or not producer_digest or producer_digest == self.consumer_digest:
            return ""
        return (
            f"--default-mode {self.configured}: naive reuse: the producer's weights ({producer_digest[:16]}...) differ from"
            f" this consumer's ({self.consumer_digest[:16]}...), so its K/V do not fit this model; use --default-mode auto"
            " (or scd with an artifact for the pair, or oracle), or set --allow-naive-reuse-default to serve it anyway"
        )


def producer_digest_known(codecs: Mapping[str, codec_lib.Codec], consumer_digest: str, linked: str) -> str:
    """The producer's weight digest as far as it is known: the link's, else that of the loaded
    artifacts calibrated for this consumer (they name the producer they were calibrated with)."""
    if linked:
        return linked
    scd = codecs.get("scd")
    theirs = {
        a.meta["producer"]["weight_digest"]
        for a in (scd.artifacts if isinstance(scd, ScdCodec) else [])
        if a.meta["consumer"]["weight_digest"] == consumer_digest
    }
    return theirs.pop() if len(theirs) == 1 else ""
