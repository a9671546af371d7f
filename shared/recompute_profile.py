"""Choosing the `recompute` codec's span by profiling on calibration data (DroidSpeak's
"critical layers"): for every contiguous span of `width` layers, how far the consumer's answer
distribution moves from its oracle when the span is recomputed by the consumer from the
producer's hidden state and every other layer reuses the producer's K/V.

Loss = mean over answer tokens (teacher forcing, pooled over all examples) of
KL(oracle next-token distribution || reconstructed one), the same loss the SCD schedules use.
Owns nothing but this measurement; knows nothing about the wire or the services.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shared import kv, layers
from shared.models import LoadedModel


def _answer_logprobs(consumer: LoadedModel, cache, question: list[int], answer: list[int]) -> torch.Tensor:
    """Teacher-forced log-probs of the next token at each answer position, float32 [len(answer), V].

    question + answer[:-1] is fed on top of the context cache; the last question token predicts
    answer[0], answer[i] predicts answer[i+1]."""
    ids = torch.tensor([question + answer[:-1]], device=consumer.device)
    logits = consumer.model(input_ids=ids, cache=cache, use_cache=True).logits[0, -len(answer):]
    return F.log_softmax(logits.float(), dim=-1)


def _kl_sum(log_p: torch.Tensor, log_q: torch.Tensor) -> float:
    """Sum over positions of KL(p || q), both [N, V] log-probs."""
    return float((log_p.exp() * (log_p - log_q)).sum())


@torch.inference_mode()
def profile_span(producer: LoadedModel, consumer: LoadedModel, contexts: list[list[int]], questions: list[list[int]],
                 answers: list[list[int]], width: int) -> list[dict]:
    """Rows {"start", "end", "width", "kl", "kl_reuse", "answer_tokens"}, one per span
    [start, start + width), best (lowest kl) first. `kl_reuse` is the same loss with no span
    recomputed (naive reuse of the producer's K/V on every layer), for reference."""
    num_layers = consumer.info.num_layers
    if producer.info.num_layers != num_layers:
        raise ValueError(f"producer has {producer.info.num_layers} layers, consumer {num_layers}")
    if not 1 <= width <= num_layers:
        raise ValueError(f"width {width} not in 1..{num_layers}")
    if not len(contexts) == len(questions) == len(answers):
        raise ValueError(f"{len(contexts)} contexts, {len(questions)} questions, {len(answers)} answers")
    starts = range(num_layers - width + 1)
    kl = {s: 0.0 for s in starts}
    kl_reuse = 0.0
    tokens = 0
    device, dtype = consumer.device, consumer.dtype
    for context, question, answer in zip(contexts, questions, answers):
        if not answer:
            continue
        if not question:
            raise ValueError("every question needs at least one token (it predicts the first answer token)")
        states: dict[int, kv.LayerState] = {}
        producer_cache = kv.empty_cache(producer)
        with kv.layer_capture(producer, producer_cache, kv.Capture.KV | kv.Capture.HIDDEN,
                              lambda s: states.__setitem__(s.index, s)):
            kv.prefill_context(producer, torch.tensor([context], device=producer.device), producer_cache)
        reuse = [(states[i].keys.to(device, dtype), states[i].values.to(device, dtype)) for i in range(num_layers)]

        def answer_logprobs(replaced: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
            cache = kv.empty_cache(consumer)
            for i in range(num_layers):
                keys, values = replaced.get(i, reuse[i])  # [n_kv, T, hd] each
                kv.put_layer(cache, i, keys.to(device, dtype), values.to(device, dtype))
            return _answer_logprobs(consumer, cache, question, answer)

        oracle_cache = kv.prefill_context(consumer, torch.tensor([context], device=device))
        log_p = _answer_logprobs(consumer, oracle_cache, question, answer)  # [A, V]
        kl_reuse += _kl_sum(log_p, answer_logprobs({}))
        for s in starts:
            span_kv = layers.run_layers(consumer, states[s].hidden.to(device), s, s + width)
            kl[s] += _kl_sum(log_p, answer_logprobs({s + j: pair for j, pair in enumerate(span_kv)}))
        tokens += len(answer)
    if tokens == 0:
        raise ValueError("no answer tokens to profile on")
    rows = [
        {"start": s, "end": s + width, "width": width, "kl": kl[s] / tokens, "kl_reuse": kl_reuse / tokens,
         "answer_tokens": tokens}
        for s in starts
    ]
    return sorted(rows, key=lambda r: (r["kl"], r["start"]))
