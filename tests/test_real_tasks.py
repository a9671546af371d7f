"""The real pair's benchmark set: RULER-style tasks over real prose (real.tasks, real.prose), their
scoring (real.score) and the task-free KL measure (real.kl). Generation needs only SmolLM2's
tokenizer; the KL check runs on the builtin tiny model."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import AutoTokenizer

from qa.predict import prefill
from real import kl, prose, score, tasks
from shared import pretrained
from shared.models import load_model


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(pretrained.ensure("smollm2-135m"))


def test_the_splits_share_no_text_and_no_seed():
    texts = {s: set(prose.load(s).paragraphs) for s in prose.SPLITS}
    assert all(len(texts[s]) > 200 for s in prose.SPLITS)
    assert not texts["train"] & texts["validation"] and not texts["train"] & texts["test"]
    assert not texts["validation"] & texts["test"]
    assert len({prose.load(s).digest for s in prose.SPLITS}) == 3
    bases = sorted(tasks.SEED_BASE.values())
    assert all(b - a == tasks.SEED_BASE["validation"] for a, b in zip(bases, bases[1:]))
    with pytest.raises(ValueError, match="index"):
        tasks.make(None, "qa", "train", tasks.SEED_BASE["validation"], 1024)


@pytest.mark.parametrize("family", tasks.FAMILIES)
@pytest.mark.parametrize("length", [1024, 4096])
def test_an_example_is_its_length_in_the_chat_format_with_every_answer_placed(tok, family, length):
    ex = tasks.make(tok, family, "test", 7, length)
    assert abs(len(ex.context_ids) - length) <= 8, len(ex.context_ids)
    full = tok.apply_chat_template(
        [{"role": "user", "content": f"{ex.context}\n\n{ex.question}"}], add_generation_prompt=True, tokenize=False
    )
    assert tok.decode(ex.context_ids + ex.question_ids) == full
    assert tok.decode(ex.question_ids).endswith("<|im_start|>assistant\n") and ex.question in tok.decode(ex.question_ids)
    positions = [ex.context.index(a) for a in ex.answers]
    assert positions == sorted(positions)  # gold in the order of the context
    assert ex == tasks.make(tok, family, "test", 7, length)  # seeded
    assert ex.context != tasks.make(tok, family, "test", 8, length).context
    assert ex.prose_digest == prose.load("test").digest


def test_variable_tracking_gold_is_what_the_assignments_compute(tok):
    for index in range(6):
        ex = tasks.make(tok, "variable_tracking", "validation", index, 1024)
        values: dict[str, str] = {}
        for name, source in re.findall(r"VAR (\w+) = (VAR \w+|\d+)\.", ex.context):
            values[name] = values[source[4:]] if source.startswith("VAR ") else source  # KeyError: read before set
        wanted = re.search(r"assigned the value (\d+)", ex.question).group(1)
        assert tuple(n for n in values if values[n] == wanted) == ex.answers
        assert len(values) == 8


def test_scores_of_a_sentence_a_bare_value_and_a_wrong_value(tok):
    ex = tasks.make(tok, "niah_multivalue", "test", 0, 1024)
    bare = ex.answer
    assert score.score(bare, ex, oracle=bare) == {"em": 1.0, "f1": 1.0, "recall": 1.0, "identical_to_oracle": True}
    sentence = f"The special magic numbers are {ex.answers[0]} and {ex.answers[1]}."
    got = score.score(sentence, ex, oracle=bare)
    assert got["em"] == 0.0 and got["recall"] == 0.5 and not got["identical_to_oracle"]
    assert got["f1"] == pytest.approx(2 * (2 / 7) * (2 / 4) / (2 / 7 + 2 / 4))  # 2 of 7 words right, 2 of 4 found
    assert score.score(ex.answers[0][:-1], ex)["recall"] == 0.0  # a prefix of a number is not the number


def test_text_windows_are_the_real_continuation(tok):
    w = tasks.text_window(tok, "test", 3, 1024)
    assert (len(w.context_ids), len(w.following_ids)) == (1024, 64)
    text = tok.decode(w.context_ids + w.following_ids)
    assert any(p[:40] in text for p in prose.load("test").paragraphs)


def test_kl_is_zero_on_the_exact_cache_and_grows_with_a_perturbed_one():
    model = load_model("tiny-llama", dtype="float32", device="cpu")
    ids = torch.arange(3, 40)[None]
    _, exact = prefill(model.model, ids)
    _, other = prefill(model.model, ids)
    with torch.inference_mode():
        noise = torch.Generator().manual_seed(0)
        for layer in other.layers:
            layer.values.add_(0.5 * torch.randn(layer.values.shape, generator=noise))
    following = list(range(50, 66))
    assert kl.mean_kl(model, exact, exact, following) == pytest.approx(0.0, abs=1e-6)
    assert kl.mean_kl(model, exact, other, following) > 1e-3
    assert exact.get_seq_length() == other.get_seq_length() == ids.shape[1]  # cropped back after each read


def test_the_reuse_gap_summary_pairs_examples_by_seed():
    from real.reuse_gap import MODES, summary

    f1 = {
        (1, "producer"): 0.2,
        (1, "oracle"): 1.0,
        (1, "naive_reuse"): 0.5,
        (2, "producer"): 0.0,
        (2, "oracle"): 0.5,
        (2, "naive_reuse"): 0.5,
    }
    rows = [
        {"kind": "task", "seed": s, "mode": m, "f1": f1[(s, m)], "em": 0.0, "recall": 1.0, "identical_to_oracle": m == "oracle"}
        for s in (1, 2)
        for m in MODES
    ]
    got = summary([*rows, {"kind": "kl", "mean_kl": 0.25}])
    assert got["n"] == 2 and got["producer"]["f1"] == 0.1 and got["oracle"]["identical_to_oracle"] == 1.0
    assert got["naive_reuse_f1_gap"] == 0.25  # (1.0 - 0.5 + 0.5 - 0.5) / 2
    assert got["naive_reuse_mean_kl"] == 0.25
