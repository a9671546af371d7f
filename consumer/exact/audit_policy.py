"""The cache audit's policies over a rebuilt cache (shared.audit spot-checks it): report answers
from it anyway; fallback prefills locally when it is flagged; upgrade transfers once more with the
codec's richer options and audits that, prefilling locally when that is flagged too, no richer
option exists or the second transfer fails; repair recomputes anchor tokens of a flagged cache
(consumer.exact.repair, through the pipeline's `repair` step) and audits it again, prefilling locally
when it is still flagged. Knows nothing about gRPC or the prefix cache.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable

from consumer.engine.kv_pool import SequenceKV
from consumer.request.job import AUDIT_REPAIR, AUDIT_REPORT, AUDIT_UPGRADE, GenerateJob, GenerateResult, left
from consumer.request.transfer import Transfer
from shared import audit, logs
from shared.codecs import CacheDecoder
from shared.errors import Cancelled, ServiceError
from shared.models import LoadedModel

log = logs.get("consumer.exact.audit_policy")


class AuditPolicy:
    def __init__(
        self,
        loaded: LoadedModel,
        transfer: Transfer,
        local_prefill: Callable[[GenerateJob, GenerateResult, SequenceKV], Awaitable[None]],
        repair: Callable[[GenerateJob, GenerateResult, SequenceKV], Awaitable[None]],
    ):
        self.loaded, self.transfer, self.local_prefill, self.repair = loaded, transfer, local_prefill, repair

    async def apply(self, job: GenerateJob, result: GenerateResult, seq: SequenceKV, decoder: CacheDecoder) -> None:
        """Spot-check the rebuilt cache (shared.audit). Policy report: answer from it anyway;
        fallback: prefill locally when it is flagged; upgrade: when flagged, transfer once more
        with the codec's richer options and audit that, prefilling locally if it is flagged too,
        no richer option exists or the second transfer fails; repair: when flagged, repair anchor
        tokens and audit again, prefilling locally if it is flagged again."""
        if not await self.check(job, result, seq, decoder):
            if job.audit == AUDIT_REPAIR:
                result.repair_choice = "skipped: the audit did not flag the cache"
            return
        if job.audit == AUDIT_REPORT:
            return
        if job.audit == AUDIT_REPAIR:
            first = result.audit_decision
            await self.repair(job, result, seq)
            flagged = await self.check(job, result, seq, decoder)
            result.audit_decision = f"{first}: repaired {result.repair_tokens} tokens: {result.audit_decision}"
            if not flagged:
                return
        if job.audit == AUDIT_UPGRADE:
            richer = decoder.richer_options()
            if richer is None:
                result.audit_decision += ": no richer options"
            else:
                assert job.codec is not None
                label = richer.get("schedule") or ",".join(f"{k}={v}" for k, v in sorted(richer.items()))
                first = result.audit_decision
                try:
                    upgraded = dataclasses.replace(job, options=job.codec.resolve(richer))
                    decoder = await self.transfer.pull(upgraded, result, seq)  # the whole context again
                except ServiceError as exc:
                    if isinstance(exc, Cancelled) or job.deadline - time.monotonic() <= 0:
                        raise
                    result.audit_decision = f"{first}: upgrade to {label} failed ({exc.code})"
                    log.warning("generate.upgrade_failed", mode=job.mode, code=exc.code, reason=str(exc)[:300])
                else:
                    flagged = await self.check(upgraded, result, seq, decoder)
                    result.audit_decision = f"{first}: upgraded to {label}: {result.audit_decision}"
                    if not flagged:
                        return
        result.audit_decision += ": prefilled locally"
        await self.local_prefill(job, result, seq)

    async def check(self, job: GenerateJob, result: GenerateResult, seq: SequenceKV, decoder: CacheDecoder) -> bool:
        """Audit the rebuilt cache in seq into `result` (errors, thresholds, decision "ok" |
        "diverged", time added); True when it diverged."""
        left(job, "cache audit")
        thresholds = decoder.audit_thresholds() or (job.audit_threshold,) * self.loaded.info.num_layers
        T = len(job.context_ids)
        checked = audit.positions(T, job.audit_positions, seed=T)
        report, _ = await self.transfer._timed(lambda: audit.audit(self.loaded, job.context_ids, seq.to_dynamic(T), checked))
        result.audit_layer_errors, result.audit_thresholds = report.layer_errors, thresholds
        result.audit_ms += report.ms
        diverged = any(e > t for e, t in zip(report.layer_errors, thresholds))
        result.audit_decision = "diverged" if diverged else "ok"
        if diverged:
            log.warning(
                "generate.audit_diverged",
                mode=job.mode,
                options=job.options,
                thresholds=[round(t, 4) for t in thresholds],
                layer_errors=[round(e, 4) for e in report.layer_errors],
                policy=job.audit,
            )
        return diverged
