"""In-process answer predictors: prefill a context, prefill a question on top, greedy-decode.

Owns the `Predictor` signature every evaluation path plugs into,
`predict(context, question, max_new_tokens) -> answer text`, and the in-process ones:

- `own_prefill(model, tok)`: the model prefills the context itself (the reference).
- `cross_cache(producer, consumer, tok, producer_layers)`: the producer prefills the context; the
  consumer prefills the question on the producer's KV and decodes (naive reuse, "raw"). With
  `producer_layers` only those layers take the producer's KV, the rest the consumer's own.

Tokenization follows the services: context with the tokenizer's default special tokens (BOS),
question with add_special_tokens=False, ids concatenated. Positions after a cache continue at
the cache's logical length (shared.keep.next_positions: its stored length, plus the tokens a kept
cache dropped). Decoding stops at the
answer terminator '.' (not returned) or after `max_new_tokens`. Knows nothing about metrics
or grpc.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from transformers import DynamicCache

from qa.tokenizer import end_token_id
from shared.keep import next_positions

Predictor = Callable[[str, str, int], str]


def encode_prompt(tokenizer, context: str, question: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(context ids [1, n_ctx] with BOS, question ids [1, n_q] without special tokens)."""
    ctx = tokenizer(context, return_tensors="pt")["input_ids"]
    q = tokenizer(question, add_special_tokens=False, return_tensors="pt")["input_ids"]
    return ctx, q


@torch.no_grad()
def prefill(model, ids: torch.Tensor, cache: DynamicCache | None = None) -> tuple[torch.Tensor, DynamicCache]:
    """Run `ids` [1, n] on top of `cache` (new if None); returns (last logits [1, vocab], cache).
    Positions continue at the cache's logical length (shared.keep: a kept cache stores fewer)."""
    if cache is None:
        cache = DynamicCache(config=model.config)
    pos = next_positions(cache, ids.shape[1], ids.device)
    out = model(input_ids=ids, cache=cache, position_ids=pos, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1], cache  # logits: [1, 1, vocab] -> [1, vocab]


@torch.no_grad()
def greedy_decode(model, cache: DynamicCache, logits: torch.Tensor, end_id: int, max_new_tokens: int) -> list[int]:
    """Greedy tokens after `logits` [1, vocab], extending `cache`; stops at `end_id` (excluded)."""
    out: list[int] = []
    for step in range(max_new_tokens):
        nxt = int(logits.argmax(-1))
        if nxt == end_id:
            break
        out.append(nxt)
        if step + 1 < max_new_tokens:
            logits, cache = prefill(model, torch.tensor([[nxt]]), cache)
    return out


def mix_caches(sources: Iterable[DynamicCache], config) -> DynamicCache:
    """A new cache whose layer i holds the KV of the i-th source cache (copied by reference)."""
    mixed = DynamicCache(config=config)
    for i, src in enumerate(sources):
        layer = src.layers[i]
        mixed.update(layer.keys, layer.values, i)  # keys/values: [1, n_kv_heads, seq, head_dim]
    return mixed


def own_prefill(model, tokenizer) -> Predictor:
    end_id = end_token_id(tokenizer)

    def predict(context: str, question: str, max_new_tokens: int) -> str:
        ctx, q = encode_prompt(tokenizer, context, question)
        _, cache = prefill(model, ctx)
        logits, cache = prefill(model, q, cache)
        return tokenizer.decode(greedy_decode(model, cache, logits, end_id, max_new_tokens))

    return predict


def cross_cache(producer, consumer, tokenizer, producer_layers: Iterable[int] | None = None) -> Predictor:
    """Consumer answers on the producer's context KV (all layers, or only `producer_layers`)."""
    end_id = end_token_id(tokenizer)
    n_layers = consumer.config.num_hidden_layers
    from_producer = set(range(n_layers) if producer_layers is None else producer_layers)

    def predict(context: str, question: str, max_new_tokens: int) -> str:
        ctx, q = encode_prompt(tokenizer, context, question)
        _, p_cache = prefill(producer, ctx)
        if len(from_producer) == n_layers:
            cache = p_cache
        else:
            _, c_cache = prefill(consumer, ctx)
            sources = [p_cache if i in from_producer else c_cache for i in range(n_layers)]
            cache = mix_caches(sources, consumer.config)
        logits, cache = prefill(consumer, q, cache)
        return tokenizer.decode(greedy_decode(consumer, cache, logits, end_id, max_new_tokens))

    return predict
