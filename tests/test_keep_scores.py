"""Token selection's scores and keep sets (shared.keep): budgets, protected tokens, deterministic
ties, the attention statistics against transformers' own eager attention, and the scorers' math
on tensors whose answer is known. (Equality with NVIDIA kvpress' presses on the real pair's
tensors is bench/keep/kvpress_check.py: kvpress needs transformers < 5.3, a separate venv.)
"""

from __future__ import annotations

import pytest
import torch

from shared import kv
from shared import model as forward
from shared.keep import Budget, attention, parse_selection, scores
from shared.keep.select import keep_indices, protected
from shared.models import load_model


def test_budget_counts_as_kvpress_and_refuses_nonsense():
    assert Budget(fraction=0.25).kept(1023) == 255  # floor, as int(T * (1 - ratio)) in ScorerPress
    assert Budget(count=300).kept(100) == 100 and Budget(fraction=0.001).kept(100) == 1
    assert Budget.parse("256") == Budget(count=256) and Budget.parse("0.5") == Budget(fraction=0.5)
    assert Budget.parse("4294967295") == Budget(count=2**32 - 1)  # the wire's uint32
    for bad in ("0", "1.5", "-0.1", "x", "4294967296", "²"):
        with pytest.raises(ValueError, match="budget"):
            Budget.parse(bad)
    with pytest.raises(ValueError, match="keep policy"):
        parse_selection("nope:0.5")
    with pytest.raises(ValueError, match="keep option"):
        parse_selection("knorm:0.5:sinks=x")
    with pytest.raises(ValueError, match="above 4294967295"):
        parse_selection("knorm:0.5:window=4294967296")


def test_a_budgets_text_reads_back_as_itself_so_no_two_budgets_share_a_key():
    """The text is part of the stores' keys (KeepRequest.label): fraction 1.0 printed as the count
    "1" and 0.4999999 as "0.5", so requests keeping different counts shared a producer store entry
    (the second one failed DATA_LOSS on the first one's replayed stream)."""
    budgets = [Budget(fraction=1.0), Budget(count=1), Budget(fraction=0.5), Budget(fraction=0.4999999),
               Budget(fraction=0.1), Budget(fraction=1e-7), Budget(count=256)]
    assert [Budget.parse(str(b)) for b in budgets] == budgets
    assert len({str(b) for b in budgets}) == len(budgets)
    assert [str(b) for b in budgets[:3]] == ["1.0", "1", "0.5"]
    labels = {parse_selection(f"h2o:{b}").label for b in budgets}
    assert len(labels) == len(budgets)


def test_protected_tokens_come_first_then_the_best_scores():
    T = 20
    s = torch.arange(T, 0, -1, dtype=torch.float32)[None].repeat(2, 1)  # early tokens score highest
    s[1] = torch.arange(T, dtype=torch.float32)  # head 1: late tokens highest
    got = keep_indices(s, 8, sinks=2, window=3)
    assert got[0].tolist() == [0, 1, 2, 3, 4, 17, 18, 19]
    assert got[1].tolist() == [0, 1, 14, 15, 16, 17, 18, 19]
    # a budget below sinks + window: sinks, then the newest
    assert protected(T, 2, 3).tolist() == [0, 1, 19, 18, 17]
    assert keep_indices(s, 3, sinks=2, window=3)[0].tolist() == [0, 1, 19]
    # shared: one set from the heads' mean (equal everywhere here: ties go to the earlier)
    shared = keep_indices(s, 8, sinks=2, window=3, shared=True)
    assert torch.equal(shared[0], shared[1]) and shared[0].tolist() == [0, 1, 2, 3, 4, 17, 18, 19]


def test_ties_break_to_the_earlier_token_on_every_run():
    s = torch.zeros(3, 50)
    s[:, 10:20] = 1.0
    for _ in range(3):
        assert keep_indices(s, 8, sinks=0, window=0).tolist() == [list(range(10, 18))] * 3


def test_the_scorers_math():
    keys = torch.randn(2, 30, 8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(scores.key_norm(keys), -keys.norm(dim=-1))
    acc = torch.rand(4, 30, generator=torch.Generator().manual_seed(1))  # H = 4, n_kv = 2
    h = scores.h2o(acc, 2)
    assert torch.allclose(h[1, 7], (acc[2, 7] + acc[3, 7]) / 2 / (30 - 7))
    win = torch.softmax(torch.randn(4, 6, 30, generator=torch.Generator().manual_seed(2)), -1)
    s = scores.snapkv(win, 2, kernel_size=5)
    mean = win[..., :24].mean(1)  # [H, 24]
    t = 10  # an interior token: the mean of 5 neighbours, then of the group's heads
    assert torch.allclose(s[0, t], mean[0:2, t - 2 : t + 3].mean(), atol=1e-7)
    t = 0  # the edge: zero padding counted (torch avg_pool1d's default)
    assert torch.allclose(s[0, t], mean[0:2, 0:3].sum(1).mean() / 5, atol=1e-7)
    assert torch.all(s[:, 24:] == s[:, :24].max() + 1)
    assert scores.recency(5, 2).tolist() == [[0, 1, 2, 3, 4]] * 2


@pytest.fixture(scope="module")
def eager():
    loaded = load_model("tiny-llama", "float32", "cpu")
    loaded.model.set_attn_implementation("eager")
    return loaded


def test_attention_statistics_equal_transformers_eager_attention(eager):
    ids = torch.randint(3, 200, (90,), generator=torch.Generator().manual_seed(3)).tolist()
    states, _ = kv.capture_states(eager, ids, kv.Capture.KV | kv.Capture.NORMED)
    with torch.inference_mode():
        ref = eager.model(input_ids=torch.tensor([ids]), output_attentions=True).attentions  # [1, H, T, T] per layer
    model = forward.of(eager)
    for layer in range(len(states)):
        keys, _ = states[layer].kv()
        q = attention.queries(model, layer, states[layer].normed)
        assert torch.allclose(attention.window_attention(q, keys, 16), ref[layer][0, :, -16:], atol=1e-6)
        assert torch.allclose(attention.accumulated_attention(q, keys), ref[layer][0].sum(1), atol=1e-5)


def test_a_selection_reads_what_its_policy_needs(eager):
    ids = list(range(3, 83))
    states, _ = kv.capture_states(eager, ids, kv.Capture.KV)
    with pytest.raises(ValueError, match="capture NORMED"):
        parse_selection("h2o:0.5").keep(eager, states)
    keep = parse_selection("knorm:0.5").keep(eager, states)  # keys only
    assert len(keep) == 4 and all(k.shape == (2, 40) for k in keep)
