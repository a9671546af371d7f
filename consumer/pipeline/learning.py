"""What a finished request teaches (consumer.api.servicer calls `learn` once per answered Generate): its
measurements into the transfer planner's fits (consumer.auto.planner), the overhead the planner's
model left out (the measured TTFT against the estimate made before the request ran: auto's
choice's, or a named mode's), and what its transfer left in the producer's store into the
producer memory (consumer.auto.producer_memory). A keep transfer teaches under its own key (the
codec's options and the keep set: auto's keep point), per context token. Knows nothing about gRPC."""

from __future__ import annotations

import dataclasses

from consumer.auto.planner import Observation, TransferPlanner
from consumer.auto.producer_memory import ProducerMemory
from consumer.request.job import ORACLE_MODE, GenerateJob, GenerateResult


def learn(planner: TransferPlanner, memory: ProducerMemory, job: GenerateJob, item: GenerateResult) -> None:
    """A finished request's measurements into the planner, and what its transfer left in the
    producer's store into the memory, both under the key the job carries (GenerateJob.candidate_key);
    a flagged cache re-transferred or replaced is no clean sample."""
    if item.audit_decision.startswith("diverged:"):
        return
    if item.abandoned_span is not None:
        planner.observe_abandoned(*item.abandoned_span)
    _overhead(planner, job, item)
    planner.observe(_observation(job, item))
    # a kept transfer is stored whole (producer.sources: one entry, replayed only for the same whole
    # context and selection), not per chunk as the memory models it: not remembered, so auto prices
    # a repeat of it as a fresh forward (an overestimate of its time, never an underestimate)
    if item.trailer is not None and item.codec != ORACLE_MODE and job.codec is not None and job.keep is None:
        if item.stream_producer is not None:  # what the stream's header said, not the link check
            identity, dtype = item.stream_producer
            producer = f"{identity}|{job.tenant}" if identity else ""  # the tenant's own state there (Chooser._estimate)
            memory.remember(producer, dtype, job.candidate_key, job.context_ids, item.chunk_tokens)


def _overhead(planner: TransferPlanner, job: GenerateJob, item: GenerateResult) -> None:
    """The measured time to the KV (TTFT minus the question prefill) against what the model said
    before the request ran: auto's choice's estimate, or a named mode's (GenerateJob.estimate)."""
    chosen = job.auto.picked if job.auto is not None else None
    remote, base_ms = (chosen.candidate.remote, chosen.estimate.base_ms) if chosen else (job.codec is not None, None)
    if job.auto is None and job.estimate is not None:
        base_ms = job.estimate.base_ms
    if item.verify_decision.startswith("verified"):
        return  # its first token waited for the exact cache: no sample of the transfer's overhead
    if base_ms is not None and not item.transfer_failure and item.generated_tokens:
        planner.observe_overhead(remote, item.ttft_ms - item.question_prefill_ms, base_ms)


def _observation(job: GenerateJob, item: GenerateResult) -> Observation:
    observed = Observation(
        item.codec,
        item.options if item.transfer_failure else job.options,
        item.context_tokens,
        item.bytes_received,
        item.rebuild_ms,
        local_tokens=item.local_tokens,
        local_prefill_ms=item.local_prefill_ms,
        producer_prefill_ms=item.producer_prefill_ms,
        producer_encode_ms=item.producer_encode_ms,
        producer_store_hit=item.producer_store_hit,
        question_tokens=item.question_tokens,
        question_prefill_ms=item.question_prefill_ms,
        key=job.candidate_key if item.codec == job.mode else "",
    )
    t = item.trailer if item.codec != ORACLE_MODE else None  # the stream the KV came from
    if t is None:
        return observed
    return dataclasses.replace(
        observed,
        # a kept transfer's payloads cover the whole context (its candidate's costs are per context
        # token, as auto estimates them: the kept share is in its key and its bytes per token)
        sent_tokens=item.sent_tokens if job.keep is None else item.context_tokens,
        computed_tokens=t.computed_tokens,
        queue_ms=t.queue_ms,
        header_ms=t.header_ms,
        span_ms=t.span_ms,
        span_bytes=t.span_bytes,
    )
