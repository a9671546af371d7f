"""The Generate stream's and Describe's messages from the pipeline's items: token deltas, commits,
the final GenerateStats (with auto's trail), and the prefix cache's counters; and generate.done's
log fields of an auto choice. Conversions only: no state, no gRPC calls."""

from __future__ import annotations

from consumer.auto.chooser import AutoChoice, Budget
from consumer.engine.prefix_cache import PrefixCache
from consumer.request.job import Commit, GenerateResult, TokenOut
from shared.pb import common_pb2, consumer_pb2

FINISH = {"length": consumer_pb2.FINISH_REASON_LENGTH, "stop": consumer_pb2.FINISH_REASON_STOP}


def item_to_pb(item: TokenOut | Commit | GenerateResult) -> consumer_pb2.GenerateResponse:
    """One pipeline item as the Generate stream's message."""
    if isinstance(item, TokenOut):
        return consumer_pb2.GenerateResponse(token=consumer_pb2.TokenDelta(ids=item.ids, text=item.text))
    if isinstance(item, Commit):
        return consumer_pb2.GenerateResponse(
            commit=consumer_pb2.VerifyCommit(accepted_tokens=item.accepted, ids=item.ids, text=item.text)
        )
    return consumer_pb2.GenerateResponse(stats=result_to_pb(item))


def prefix_stats(prefix: PrefixCache | None) -> dict[str, int]:
    if prefix is None:
        return {}
    return dict(
        prefix_cache_bytes=prefix.nbytes,
        prefix_cache_chunks=len(prefix.entries),
        prefix_hits=prefix.hits,
        prefix_partial_hits=prefix.partial_hits,
        prefix_misses=prefix.misses,
        prefix_evictions=prefix.evictions,
        prefix_kept_shared=prefix.kept_shared,
    )


def result_to_pb(r: GenerateResult) -> consumer_pb2.GenerateStats:
    return consumer_pb2.GenerateStats(
        request_id=r.request_id,
        transfer=common_pb2.CodecSpec(name=r.codec, options=r.options),
        context_tokens=r.context_tokens,
        question_tokens=r.question_tokens,
        generated_tokens=r.generated_tokens,
        ttft_ms=r.ttft_ms,
        transfer_ms=r.transfer_ms,
        rebuild_ms=r.rebuild_ms,
        local_prefill_ms=r.local_prefill_ms,
        question_prefill_ms=r.question_prefill_ms,
        decode_ms=r.decode_ms,
        total_ms=r.total_ms,
        bytes_received=r.bytes_received,
        raw_kv_bytes=r.raw_kv_bytes,
        finish_reason=FINISH[r.finish_reason],
        producer_prefill_ms=r.producer_prefill_ms,
        producer_encode_ms=r.producer_encode_ms,
        producer_store_hit=r.producer_store_hit,
        transfer_failure=r.transfer_failure,
        audit_layer_errors=r.audit_layer_errors,
        audit_layer_thresholds=r.audit_thresholds,
        audit_decision=r.audit_decision,
        audit_ms=r.audit_ms,
        queue_wait_ms=r.queue_wait_ms,
        prefix_reused_tokens=r.prefix_reused_tokens,
        auto=auto_to_pb(r.auto) if r.auto is not None else None,
        transfer_abandoned=r.transfer_abandoned,
        drafted_tokens=r.drafted_tokens,
        accepted_draft_tokens=r.accepted_tokens,
        time_to_verified_ms=r.time_to_verified_ms,
        verify_decision=r.verify_decision,
        verify_ms=r.verify_ms,
        repair_tokens=r.repair_tokens,
        repair_ms=r.repair_ms,
        repair_choice=r.repair_choice,
    )


def auto_to_pb(a: AutoChoice) -> consumer_pb2.AutoChoice:
    """The candidates within reach with their estimates; the others counted by why."""
    excluded: dict[str, list[str]] = {}
    for s in a.scored:
        if not s.within:
            excluded.setdefault(s.excluded or "not within the budget", []).append(s.key or s.candidate.key)
    return consumer_pb2.AutoChoice(
        max_loss=a.budget.max_loss if a.budget.max_loss != float("inf") else 0.0,
        exact=a.budget.exact,
        budget_source=a.budget.source,
        reason=a.reason,
        candidates=[
            consumer_pb2.CandidateEstimate(
                mode=s.candidate.mode,
                options={k: v for k, v in s.candidate.options.items() if v != ""},
                calibrated_loss=s.candidate.loss,
                how=s.candidate.how,
                within_budget=s.within,
                estimated_ms=s.estimate.ms if s.estimate.ms is not None else -1.0,
                detail=s.estimate.detail,
                chosen=s.chosen,
                confident=s.estimate.confident and s.estimate.ms is not None,
                key=s.key or s.candidate.key,
            )
            for s in a.scored
            if s.within
        ],
        excluded=[
            consumer_pb2.ExcludedCandidates(reason=why, count=len(keys), candidates=keys) for why, keys in excluded.items()
        ],
        probe=a.reason.startswith("probe"),
    )


def budget_to_pb(b: Budget) -> consumer_pb2.AutoBudget:
    return consumer_pb2.AutoBudget(max_loss=b.max_loss, exact=b.exact, source=b.source)


def auto_trail(a: AutoChoice | None) -> dict:
    """generate.done's fields of an auto choice: what it chose, why, and the estimate (the
    measured TTFT is the line's own ttft_ms)."""
    if a is None:
        return {}
    chosen = a.picked
    estimate = chosen.estimate.ms if chosen is not None else None
    return {
        "auto_choice": a.key,
        "auto_reason": a.reason[:400],
        "auto_estimate_ms": round(estimate, 2) if estimate is not None else None,
        "auto_confident": chosen.estimate.confident if chosen is not None else None,
        "auto_probe": a.reason.startswith("probe") or None,
    }
