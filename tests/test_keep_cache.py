"""The kept cache (shared.keep.cache): only the kept tokens stored, at their original positions,
and tokens read on top of it continue at the context's logical length.

- Keeping every token is the full cache: the question's and the decode steps' logits are equal
  bit for bit (same tensors, same positions, same kernels).
- Keeping a subset (per layer, per KV head) equals an independent reference: our own forward
  (shared.model) over the question with attention on the FULL context's K/V where the dropped
  tokens of that layer and KV head are masked out, at positions T.. (float32, max abs logit
  difference within 1e-4: the two sum softmax terms in a different order).
- Restarting the question's positions at the stored length (what transformers does by itself
  with a shorter cache) is caught: the logits move by far more than that tolerance.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qa.predict import greedy_decode, prefill
from shared import kv
from shared import model as forward
from shared.keep import kept_cache, next_positions, parse_selection
from shared.models import load_model

pytestmark = pytest.mark.numeric  # logits against a reference within a tolerance: run under lowered ISAs too

TOL = 1e-4


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen2"])
def loaded(request):
    return load_model(request.param, "float32", "cpu")


def context(loaded, T=160):
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, loaded.model.config.vocab_size, (T,), generator=g).tolist()
    states, _ = kv.capture_states(loaded, ids, kv.Capture.KV | kv.Capture.NORMED)
    return ids, states, [states[i].kv() for i in range(len(states))]


QUESTION = torch.tensor([[5, 9, 13, 17, 21, 25]])


def full_cache(loaded, layer_kv):
    cache = kv.empty_cache(loaded)
    for i, (k, v) in enumerate(layer_kv):
        kv.put_layer(cache, i, k, v)
    return cache


def masked_reference(loaded, layer_kv, keep, question):
    """Logits [n, vocab] of `question` after the context through our own forward, attending to the
    full context's K/V with every token outside `keep` masked out, per layer and KV head."""
    model = forward.of(loaded)
    T = layer_kv[0][0].shape[1]
    n = question.shape[1]

    def attend(layer, q, k, v):  # q [n, H, hd], k/v [n, n_kv, hd]
        ck, cv = layer_kv[layer]  # [n_kv, T, hd]
        keys = torch.cat([ck, k.transpose(0, 1)], dim=1)  # [n_kv, T + n, hd]
        values = torch.cat([cv, v.transpose(0, 1)], dim=1)
        allowed = torch.zeros(ck.shape[0], n, T + n, dtype=torch.bool)
        allowed[:, :, T:] = torch.ones(n, n, dtype=torch.bool).tril()
        kept = torch.zeros(ck.shape[0], T, dtype=torch.bool).scatter_(1, keep[layer], True)  # [n_kv, T]
        allowed[:, :, :T] = kept[:, None, :]
        groups = q.shape[1] // ck.shape[0]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            keys.repeat_interleave(groups, 0)[None],
            values.repeat_interleave(groups, 0)[None],
            attn_mask=allowed.repeat_interleave(groups, 0)[None],
        )
        return out[0].transpose(0, 1)

    with torch.inference_mode():
        h = model.hidden(question[0], torch.arange(T, T + n), attend)
        return model.logits(h)


def test_keeping_every_token_is_the_full_cache_exactly(loaded):
    _, states, layer_kv = context(loaded)
    sel = parse_selection("snapkv:1.0")
    keep = sel.keep(loaded, states)
    assert all(k.shape[-1] == 160 for k in keep)
    full, kept = full_cache(loaded, layer_kv), kept_cache(loaded, layer_kv, keep)
    a, _ = prefill(loaded.model, QUESTION, full)
    b, _ = prefill(loaded.model, QUESTION, kept)
    assert torch.equal(a, b)
    assert greedy_decode(loaded.model, full, a, -1, 6) == greedy_decode(loaded.model, kept, b, -1, 6)


@pytest.mark.parametrize(
    "spec", ["knorm:0.4:window=16", "h2o:0.3:sinks=2,window=8", "snapkv:0.6", "snapkv:0.5:heads=shared", "streaming:40"]
)
def test_a_kept_subset_equals_masking_the_dropped_tokens(loaded, spec):
    _, states, layer_kv = context(loaded)
    keep = parse_selection(spec).keep(loaded, states)
    cache = kept_cache(loaded, layer_kv, keep)
    assert cache.get_seq_length() == keep[0].shape[-1] < 160 and cache.logical_length == 160
    pos = next_positions(cache, QUESTION.shape[1])
    assert pos.tolist() == [list(range(160, 166))]
    got = loaded.model(input_ids=QUESTION, cache=cache, position_ids=pos, use_cache=True).logits[0]
    want = masked_reference(loaded, layer_kv, keep, QUESTION)
    assert (got - want).abs().max().item() < TOL
    # and the dropped tokens matter here: the full cache's logits are far from these
    full = loaded.model(input_ids=QUESTION, cache=full_cache(loaded, layer_kv), use_cache=True).logits[0]
    assert (full - want).abs().max().item() > 100 * TOL
    # decode continues at the logical length: after the question, the next token is at 166
    assert next_positions(cache, 1).tolist() == [[166]]


def test_positions_restarting_at_the_stored_length_are_caught(loaded):
    _, states, layer_kv = context(loaded)
    keep = parse_selection("knorm:0.4").keep(loaded, states)
    cache = kept_cache(loaded, layer_kv, keep)
    stored = cache.get_seq_length()
    wrong = loaded.model(input_ids=QUESTION, cache=cache, use_cache=True).logits[0]  # transformers' own positions
    want = masked_reference(loaded, layer_kv, keep, QUESTION)
    assert (wrong - want).abs().max().item() > 100 * TOL
    assert stored < 160


def test_counts_must_agree_across_layers(loaded):
    _, states, layer_kv = context(loaded)
    keep = parse_selection("knorm:0.4").keep(loaded, states)
    keep[1] = keep[1][:, :-1]
    with pytest.raises(ValueError, match="differ across layers"):
        kept_cache(loaded, layer_kv, keep)
