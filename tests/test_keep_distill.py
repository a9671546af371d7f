"""DistillCache (shared.keep.distill) and its training (calibration.distill_keep) on the committed QA
pair (a fresh clone has it; the real pair's 84 MB artifact is built): score shapes, a seeded
training is reproducible, REINFORCE raises the reward of a tiny fixed problem, the committed weights
load through POLICIES and beat SnapKV's KL (the training's own reward) on QA validation examples, and a clear error names the
weights file when it is absent."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from calibration import keep_attention
from calibration.distill_keep import reinforce_step
from calibration.keep_reinforce import Prepared, greedy_keep, plackett_luce_logp, prepare, reward, sample_keep
from qa.corpus import heldout_example
from qa.task import examples
from shared import kv
from shared.keep import POLICIES, distill, features, parse_selection
from shared.keep.distill import DistillCache, DistillNet
from shared.keep.policy import Needs, layer_scores, layer_views
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


def _needle_problem(seed: int = 0):
    """A tiny fixed problem: 2 layers x 2 KV heads x 200 tokens of random features, where 20
    "needle" tokens stand out in one feature the initial network does not read (value_norm); the
    reward of a keep set is the share of needle tokens each layer's KV head holds (mean)."""
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(2, 2, 200, len(features.NAMES), generator=g)
    needles = 20 + torch.randperm(160, generator=g)[:20]  # outside the protected sinks and window
    feats[..., needles, features.NAMES.index("value_norm")] += 3.0
    share = lambda keep: float(torch.stack([torch.isin(needles, k[h]) for k in keep for h in range(k.shape[0])]).float().mean())
    return feats, share


def _inputs(feats) -> Prepared:
    """A Prepared with only what the network reads (the tiny problem scores keep sets itself)."""
    return Prepared(layer_kv=[], feats=feats, normed=None, continuations=[], reference=[], heuristic={})


def _train(feats, score_keep, seed: int, steps: int = 30) -> DistillNet:
    torch.manual_seed(seed)
    net = DistillNet(2)
    opt = torch.optim.Adam(net.parameters(), lr=5e-2)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        reinforce_step(net, opt, _inputs(feats), score_keep, 0.25, 4, SINKS, WINDOW, gen)
    return net


def _greedy_share(net: DistillNet, feats, score_keep) -> float:
    with torch.no_grad():
        s = _inputs(feats).scores(net)
    return score_keep(greedy_keep(list(s.unbind(0)), Budget(fraction=0.25).kept(feats.shape[2]), SINKS, WINDOW))


def test_reinforce_steps_raise_the_reward_of_a_tiny_fixed_problem_and_repeat_with_the_seed():
    """From the SnapKV-like start (which does not read the needles' feature) 30 REINFORCE steps at
    25 % make the deterministic keep set hold most needles; fails with the update's sign flipped
    (the share then falls) or a wrong log-probability. The same seed gives the same weights."""
    feats, share = _needle_problem()
    torch.manual_seed(0)
    before = _greedy_share(DistillNet(2), feats, share)
    first, again = _train(feats, share, 0), _train(feats, share, 0)
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), again.state_dict().values()))
    after = _greedy_share(first, feats, share)
    assert before < 0.35 and after > 0.7, (before, after)


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

    learned = mean_kl(lambda ex: [sel.policy.net(torch.tensor(i), ex.feats[i]).detach() for i in range(ex.feats.shape[0])])
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


def test_the_weights_file_is_a_sidecar_artifact_discovery_skips():
    """A folder of artifacts holds DistillCache's weights beside them: the services' artifact
    discovery must not read them as SCD artifacts (it failed start-up on the shipped folder)."""
    from pathlib import Path

    from shared.keep import distill
    from shared.scd.artifact import SIDECAR_SUFFIXES, discover

    assert distill.SUFFIX in SIDECAR_SUFFIXES
    folder = Path(__file__).resolve().parents[1] / "artifacts"
    assert any(folder.glob("*" + distill.SUFFIX)), "the shipped folder has a keep sidecar"
    assert all(not a.path.name.endswith(distill.SUFFIX) for a in discover([folder]))


# --- the probe over normed inputs (DistillNet(inputs=("normed",)), calibration.keep_attention) ---


def _probe(consumer, seed: int = 0) -> DistillNet:
    net = DistillNet(
        consumer.info.num_layers, inputs=("normed",), d_model=consumer.info.hidden_size, num_kv_heads=consumer.info.num_kv_heads
    )
    with torch.no_grad():
        net.probe.copy_(torch.randn(net.probe.shape, generator=torch.Generator().manual_seed(seed)))
    return net


def test_a_probe_reads_only_the_normed_input_and_names_it_when_missing(consumer):
    h = _held(consumer, "validation", 1)[0]
    states = kv.capture_states(consumer, h.context_ids, kv.Capture.KV | kv.Capture.NORMED)[0]
    policy = DistillCache(_probe(consumer))
    assert policy.needs == Needs.NORMED  # no T x T attention pass: a producer scores each layer as it comes
    views = list(layer_views(consumer, states, policy.needs, policy.observation))
    assert views[0].window_attention is None and views[0].accumulated_attention is None
    scores = layer_scores(policy, consumer, states)
    T, n_kv = len(h.context_ids), consumer.info.num_kv_heads
    assert [s.shape for s in scores] == [(n_kv, T)] * consumer.info.num_layers
    with torch.no_grad():
        expected = (states[1].normed.float() @ policy.net.probe[1]).T + policy.net.probe_bias[1][:, None]
    torch.testing.assert_close(scores[1], expected)
    bare = layer_views(consumer, states, Needs.NONE, 0)
    with pytest.raises(ValueError, match=rf"normed input \[T, {consumer.info.hidden_size}\], got None"):
        policy.score(next(bare))


def test_a_probe_saves_and_loads_to_the_same_scores_and_a_foreign_file_is_named(consumer, tmp_path):
    net = _probe(consumer, 3)
    path = tmp_path / "pair.keep.safetensors"
    distill.save(net, path, {"pair": "test"})
    loaded = distill.load(path)
    assert loaded.net.inputs == ("normed",) and distill.meta_of(path)["trained"] == {"pair": "test"}
    normed = torch.randn(2, 10, consumer.info.hidden_size)
    layers = torch.tensor([0, 1])
    torch.testing.assert_close(loaded.net(layers, None, normed), net(layers, None, normed))
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(tmp_path / "other.keep.safetensors"), metadata={"distill": '{"format": "v0"}'})
    with pytest.raises(ValueError, match="other.keep.safetensors"):
        distill.load(tmp_path / "other.keep.safetensors")


def _attention_problem(seed: int = 0, n: int = 8):
    """Tiny fixed targets: 2 layers x 2 KV heads x 200 tokens of random 16-dim "normed inputs";
    20 needle tokens per example carry one direction and get the answers' attention."""
    g = torch.Generator().manual_seed(seed)
    direction = torch.randn(16, generator=g)
    out = []
    for _ in range(n):
        normed = torch.randn(2, 200, 16, generator=g)
        needles = 8 + torch.randperm(150, generator=g)[:20]
        normed[:, needles] += direction
        att = torch.rand(2, 2, 200, generator=g) * 0.01
        att[..., needles] += 0.5
        out.append(keep_attention.Target(normed.half(), att))
    return out


def test_the_attention_fit_learns_what_answers_read_and_repeats_with_the_seed():
    """From zero (every token ties) the fit puts the needles' attention in the top 25 %: fails with
    the loss's sign flipped or a target read from the wrong tokens."""
    train, held = _attention_problem(0), _attention_problem(1, 2)

    def fitted(seed: int) -> DistillNet:
        torch.manual_seed(seed)
        net = DistillNet(2, inputs=("normed",), d_model=16, num_kv_heads=2)
        keep_attention.fit(net, train, held, 5, 5e-2, SINKS, WINDOW, seed, lambda row: None)
        return net

    def held_recall(net: DistillNet) -> float:
        with torch.no_grad():
            return (
                sum(
                    keep_attention.recall(net(torch.arange(2), None, t.normed.float()), t.attention, 0.25, SINKS, WINDOW)
                    for t in held
                )
                / 2
            )

    start = DistillNet(2, inputs=("normed",), d_model=16, num_kv_heads=2)
    first, again = fitted(0), fitted(0)
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), again.state_dict().values()))
    assert held_recall(start) < 0.4 and held_recall(first) > 0.7, (held_recall(start), held_recall(first))


def test_the_attention_target_is_the_answers_largest_attention_per_kv_head(consumer):
    h = _held(consumer, "validation", 1)[0]
    t = keep_attention.target(consumer, h.context_ids, h.qa_ids, h.answer_start)
    L, n_kv, T = consumer.info.num_layers, consumer.info.num_kv_heads, len(h.context_ids)
    assert t.normed.shape == (L, T, consumer.info.hidden_size) and t.attention.shape == (L, n_kv, T)
    assert bool((t.attention >= 0).all() and (t.attention <= 1).all())
    # the answer is copied from the context: where its tokens occur, the answers' queries look hardest
    answer = set(h.qa_ids[h.answer_start : -1])  # the gold value, not the end-of-answer token
    at = [i for i, x in enumerate(h.context_ids) if x in answer]
    rest = [i for i in range(T) if i not in at]
    strongest = t.attention.amax((0, 1))  # [T]: over layers and KV heads
    assert at and float(strongest[at].mean()) > 3 * float(strongest[rest].mean())
    with pytest.raises(ValueError, match="answer_start"):
        keep_attention.target(consumer, h.context_ids, h.qa_ids, 0)


def _occurrences(tokenizer, ids: list[int], values) -> list[int]:
    """Positions of every token of each value where it occurs in ids (as " value" or "value")."""
    out = set()
    for value in values:
        for text in (" " + value, value):
            v = tokenizer(text, add_special_tokens=False)["input_ids"]
            for i in range(len(ids) - len(v) + 1):
                if ids[i : i + len(v)] == v:
                    out.update(range(i, i + len(v)))
    return sorted(out)


def test_the_real_pairs_committed_probe_keeps_more_of_the_answers_than_streaming():
    """The real pair's committed weights (a probe over normed inputs, fitted to answer-time
    attention on train examples) load through POLICIES and, on validation examples of every
    family, hold more of the gold value's tokens in their 25 % keep sets (over layers and KV
    heads) than StreamingLLM's: fails for weights that learned nothing (they tie, keeping the
    earliest tokens) or that read another model's inputs."""
    from real import tasks

    path = distill.register(ROOT / "artifacts" / "smollm2-pc.safetensors")
    try:
        sel = parse_selection("distill:0.25")
        assert isinstance(sel.policy, DistillCache) and sel.policy.needs == Needs.NORMED
        assert distill.meta_of(path)["trained"]["pair"] == "real"
        real = load_model("smollm2-135m-tuned", "float32", "cpu")
        streaming = parse_selection("streaming:0.25")
        held = {"distill": [], "streaming": []}
        for ex in tasks.examples(real.tokenizer, "validation", 5, 1024):
            at = torch.tensor(_occurrences(real.tokenizer, ex.context_ids, ex.answers))
            assert len(at), ex.family
            states = kv.capture_states(real, ex.context_ids, kv.Capture.KV | kv.Capture.NORMED)[0]
            for name, s in (("distill", sel), ("streaming", streaming)):
                keep = s.keep(real, states)
                held[name].append(float(torch.stack([torch.isin(at, k).float().mean() for k in keep]).mean()))
    finally:
        distill.register(ARTIFACT)
    assert sum(held["distill"]) > sum(held["streaming"]) + 1.0, held
