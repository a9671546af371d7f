"""Choosing the `recompute` codec's span by profiling on calibration data (DroidSpeak's
"critical layers"): for every contiguous span of `width` layers, how far the consumer's answer
distribution moves from its oracle when the span is recomputed by the consumer from the
producer's hidden state and every other layer reuses the producer's K/V.

Loss = mean over answer tokens (teacher forcing, pooled over all examples) of
KL(oracle next-token distribution || reconstructed one), the same loss the SCD schedules use.
Owns nothing but this measurement; knows nothing about the wire or the services.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from calibration.kl import kl_sum, scored_logprobs
from shared import kv, layers
from shared.models import LoadedModel


@torch.inference_mode()
def profile_span(
    producer: LoadedModel,
    consumer: LoadedModel,
    contexts: list[list[int]],
    questions: list[list[int]],
    answers: list[list[int]],
    width: int | Sequence[int],
) -> list[dict]:
    """Rows {"start", "end", "width", "kl", "kl_reuse", "answer_tokens"}, one per span
    [start, start + width) of each width asked for (one pass over the examples for all of them),
    by width, best (lowest kl) first within a width. `kl_reuse` is the same loss with no span
    recomputed (naive reuse of the producer's K/V on every layer), for reference."""
    num_layers = consumer.info.num_layers
    if producer.info.num_layers != num_layers:
        raise ValueError(f"producer has {producer.info.num_layers} layers, consumer {num_layers}")
    widths = [width] if isinstance(width, int) else list(width)
    for w in widths:
        if not 1 <= w <= num_layers:
            raise ValueError(f"width {w} not in 1..{num_layers}")
    if not len(contexts) == len(questions) == len(answers):
        raise ValueError(f"{len(contexts)} contexts, {len(questions)} questions, {len(answers)} answers")
    spans = [(s, s + w) for w in widths for s in range(num_layers - w + 1)]
    kl = dict.fromkeys(spans, 0.0)
    kl_reuse = 0.0
    tokens = 0
    device, dtype = consumer.device, consumer.dtype
    for context, question, answer in zip(contexts, questions, answers):
        if not answer:
            continue
        if not question:
            raise ValueError("every question needs at least one token (it predicts the first answer token)")
        states, _ = kv.capture_states(producer, context, kv.Capture.KV | kv.Capture.HIDDEN)
        reuse = [(k.to(device, dtype), v.to(device, dtype)) for k, v in (states[i].kv() for i in range(num_layers))]
        scored = [(question + answer, len(question))]

        def answer_logprobs(replaced: dict[int, tuple[torch.Tensor, torch.Tensor]], reuse=reuse, scored=scored) -> torch.Tensor:
            layer_kv = [replaced.get(i, reuse[i]) for i in range(num_layers)]  # [n_kv, T, hd] each
            return scored_logprobs(consumer, layer_kv, scored)[0]

        own, _ = kv.capture_states(consumer, context, kv.Capture.KV)
        log_p = answer_logprobs({i: own[i].kv() for i in range(num_layers)})  # [A, V]
        kl_reuse += float(kl_sum(log_p, answer_logprobs({})))
        for s, e in spans:
            hidden = states[s].hidden
            assert hidden is not None  # captured above (Capture.HIDDEN)
            span_kv = layers.run_layers(consumer, hidden.to(device), s, e)
            kl[s, e] += float(kl_sum(log_p, answer_logprobs({s + j: pair for j, pair in enumerate(span_kv)})))
        tokens += len(answer)
    if tokens == 0:
        raise ValueError("no answer tokens to profile on")
    rows = [
        {
            "start": s,
            "end": e,
            "width": e - s,
            "kl": kl[s, e] / tokens,
            "kl_reuse": kl_reuse / tokens,
            "answer_tokens": tokens,
        }
        for s, e in spans
    ]
    return sorted(rows, key=lambda r: (r["width"], r["kl"], r["start"]))
