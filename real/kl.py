"""The task-free measure: how far the consumer's next-token distributions over real text move when
it reads a context from a given cache (rebuilt by a codec, or the producer's own: naive reuse)
instead of its own exact cache. KL(exact || given) at each of the text's following tokens
(teacher-forced: the real next tokens are fed), averaged. Knows nothing about codecs."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from calibration.kl import kl_sum
from shared.keep import next_positions
from shared.models import LoadedModel


def crop_to(cache: DynamicCache, length: int) -> None:
    """Drop what was appended to `cache` after its first `length` tokens (transformers 5 crops by a
    negative count of tokens to remove)."""
    cache.crop(length - cache.get_seq_length())


@torch.inference_mode()
def following_logprobs(consumer: LoadedModel, cache: DynamicCache, following_ids: list[int]) -> torch.Tensor:
    """float32 log-probs [len(following_ids), vocab] of the consumer reading `following_ids` on top
    of `cache` (which holds the context); the cache is cropped back to the context afterwards."""
    length = cache.get_seq_length()
    ids = torch.tensor([following_ids], device=consumer.device)
    pos = next_positions(cache, len(following_ids), consumer.device)  # a kept cache stores fewer
    logits = consumer.model(input_ids=ids, cache=cache, position_ids=pos, use_cache=True).logits[0]
    crop_to(cache, length)
    return torch.log_softmax(logits.float(), -1)


def mean_kl(consumer: LoadedModel, exact: DynamicCache, given: DynamicCache, following_ids: list[int]) -> float:
    """Mean over the following tokens of KL(consumer on `exact` || consumer on `given`), in nats."""
    ref = following_logprobs(consumer, exact, following_ids)
    return float(kl_sum(ref, following_logprobs(consumer, given, following_ids))) / len(following_ids)
