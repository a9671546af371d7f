"""DistillCache (shared.keep.distill) and its training (calibration.distill_keep) on the committed QA
pair (a fresh clone has it; the real pair's 84 MB artifact is built): score shapes, a seeded
training is reproducible, REINFORCE raises the reward on one fixed example, the committed weights
load through POLICIES and beat SnapKV's KL on validation examples, and a clear error names the
weights file when it is absent."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from calibration.distill_keep import reinforce_step
from calibration.keep_reinforce import greedy_keep, plackett_luce_logp, prepare, reward, sample_keep
from qa.corpus import heldout_example
from qa.task import examples
from shared import kv
from shared.keep import POLICIES, distill, features, parse_selection
from shared.keep.distill import DistillCache, DistillNet
from shared.keep.policy import layer_scores, layer_views
from shared.keep.select import Budget
from shared.models import load_model

ROOT = Path(__file__).resolve().parents[1]
ARTIFACT = ROOT / "artifacts" / "qa-base-to-tuned.safetensors"
SINKS, WINDOW = 4, 16  # the QA pair's training: 256-token contexts


@pytest.fixture(scope="module")
def consumer():
    return load_model(str(ROOT / "checkpoints" / "qa-tuned"), "float32", "cpu")


def _held(consumer, split: str, n: int):
    return [heldout_example(e, consumer.tokenizer) for e in examples(split, n, 256, "tuned")]  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def val(consumer):
    return [prepare(consumer, h.context_ids, [(h.qa_ids, h.answer_start)]) for h in _held(consumer, "validation", 6)]


def test_features_and_scores_have_one_value_per_token_and_kv_head(consumer):
    h = _held(consumer, "validation", 1)[0]
    states = kv.capture_states(consumer, h.context_ids, kv.Capture.KV | kv.Capture.NORMED)[0]
    policy = DistillCache(DistillNet(consumer.info.num_layers))
    views = list(layer_views(consumer, states, policy.needs, policy.observation))
    n_kv, T = consumer.info.num_kv_heads, len(h.context_ids)
    assert features.token_features(views[0]).shape == (n_kv, T, len(features.NAMES))
    scores = layer_scores(policy, consumer, states)
    assert [s.shape for s in scores] == [(n_kv, T)] * consumer.info.num_layers
    assert all(torch.isfinite(s).all() for s in scores)


def test_sampled_keep_sets_hold_the_protected_tokens_and_repeat_with_the_seed():
    scores = torch.randn(2, 3, 100)
    a, logp = sample_keep(scores, 30, SINKS, WINDOW, torch.Generator().manual_seed(5))
    b, _ = sample_keep(scores, 30, SINKS, WINDOW, torch.Generator().manual_seed(5))
    c, _ = sample_keep(scores, 30, SINKS, WINDOW, torch.Generator().manual_seed(6))
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and not all(torch.equal(x, y) for x, y in zip(a, c))
    protected = torch.tensor(list(range(SINKS)) + list(range(100 - WINDOW, 100)))
    assert all(k.shape == (3, 30) and torch.isin(protected, k).all(dim=-1).all() for k in a)
    assert logp.shape == (2, 3) and (logp < 0).all()


def test_plackett_luce_probabilities_of_every_ordered_draw_sum_to_one():
    s = torch.tensor([0.3, -1.0, 2.0, 0.5])
    draws = torch.tensor([[i, j] for i in range(4) for j in range(4) if i != j])
    assert float(plackett_luce_logp(s.expand(len(draws), -1), draws).exp().sum()) == pytest.approx(1.0, abs=1e-9)


def test_a_seeded_training_is_reproducible_and_raises_the_reward_on_a_fixed_example(consumer):
    """REINFORCE on one example at 25 %: the greedy keep set's reward after 40 steps is higher than
    at the SnapKV-like start, and the same seed gives the same weights (fails if the update's sign
    or the log-probability is wrong: the reward then stays or falls)."""
    h = _held(consumer, "train", 1)[0]
    ex = prepare(consumer, h.context_ids, [(h.qa_ids, h.answer_start)])
    kept = Budget(fraction=0.25).kept(ex.num_tokens)

    def greedy(net):
        with torch.no_grad():
            s = net(ex.feats, torch.arange(ex.feats.shape[0]))
        return reward(consumer, ex, greedy_keep(list(s.unbind(0)), kept, SINKS, WINDOW))

    def train(seed: int) -> DistillNet:
        torch.manual_seed(seed)
        net = DistillNet(consumer.info.num_layers)
        opt = torch.optim.Adam(net.parameters(), lr=2e-2)
        gen = torch.Generator().manual_seed(seed)
        for _ in range(40):
            reinforce_step(net, opt, consumer, ex, 0.25, 4, SINKS, WINDOW, gen)
        return net

    torch.manual_seed(0)
    before = greedy(DistillNet(consumer.info.num_layers))
    first, again = train(0), train(0)
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), again.state_dict().values()))
    after = greedy(first)
    assert after > before + 0.5, (before, after)  # nats per answer token


def test_the_committed_weights_load_through_policies_and_beat_snapkv_on_validation(consumer, val):
    path = distill.register(ARTIFACT)
    assert path.name == "qa-base-to-tuned.keep.safetensors" and path.exists()
    sel = parse_selection("distill:0.25:sinks=4,window=16")
    assert isinstance(sel.policy, DistillCache)
    meta = distill.meta_of(path)
    assert meta["trained"]["pair"] == "qa" and meta["num_layers"] == consumer.info.num_layers

    def mean_kl(score) -> float:
        kls = []
        for ex in val:
            keep = greedy_keep(score(ex), Budget(fraction=0.25).kept(ex.num_tokens), SINKS, WINDOW)
            kls.append(-reward(consumer, ex, keep))
        return sum(kls) / len(kls)

    learned = mean_kl(lambda ex: [sel.policy.net(ex.feats[i], torch.tensor(i)).detach() for i in range(ex.feats.shape[0])])
    snapkv = mean_kl(lambda ex: ex.heuristic["snapkv"])
    assert learned < snapkv - 1.0, (learned, snapkv)


def test_asking_for_distill_without_its_weights_names_the_file(tmp_path):
    art = tmp_path / "pair.safetensors"
    distill.register(art)
    try:
        with pytest.raises(ValueError, match="pair.keep.safetensors"):
            parse_selection("distill:0.25")
    finally:
        distill.register(ARTIFACT)
    assert "distill" in POLICIES
