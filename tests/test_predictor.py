"""The learned SCD predictor (shared.scd.predictor) on a tiny heterogeneous pair: training lowers
the consumer-K/V error, the artifact round-trips it, the producer's encoder reads through it,
and the real services serve a predictor artifact with the tokens of the in-process codec path."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from calibration import predictor_training
from calibration.distill import distill
from shared.models import load_model
from shared.pb import common_pb2, consumer_pb2
from shared.scd import ops, predictor
from shared.scd.artifact import Artifact
from shared.scd.schedule import Schedule
from tests.conftest import perturbed_model, prompt, running_pair
from tests.greedy import assert_greedy_agrees, greedy_with_margins, scd_cache
from tests.test_end_to_end import CONTEXT, QUESTION
from tests.test_scd import heldout, random_corpus, states_of

TRAIN = predictor_training.TrainConfig(mse_steps=100, kl_steps=6, batch=2, lr=1e-2, kl_lr=1e-3)
LAYER = 1


def train_examples() -> list[predictor_training.TrainExample]:
    """Random contexts, each with three scored continuations (two of one length: one batch)."""
    seqs = random_corpus(12, 100, 7)
    return [predictor_training.TrainExample(s[:80], ((s[80:90], 4), (s[90:100], 0), (s[85:92], 2))) for s in seqs]


def hetero_artifact(consumer_path, directory, device: str, train: predictor_training.TrainConfig, schedules: list[str]):
    """Producer tiny-llama, a perturbed consumer saved at consumer_path (both loaded on device),
    and their artifact with a layer-LAYER predictor, saved in directory: (producer, consumer, art)."""
    perturbed_model("tiny-llama", seed=1, scale=0.05, save_to=consumer_path)
    producer = load_model("tiny-llama", "float32", device)
    consumer = load_model(str(consumer_path), "float32", device)
    art = distill(producer, consumer, random_corpus(12, 96, 0), heldout(3, 1), corpus_name="random", generations=1,
                  predictor_layers=str(LAYER), predictor_examples=itertools.cycle(train_examples()),
                  predictor_train=train, schedules=schedules, log=lambda m: None)
    art.save(directory / "tiny-hetero.safetensors")
    return producer, consumer, art


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(producer, consumer, artifact saved under a directory, that directory, consumer path)."""
    consumer_path, directory = tmp_path_factory.mktemp("consumer"), tmp_path_factory.mktemp("artifacts")
    producer, consumer, art = hetero_artifact(consumer_path, directory, "cpu", TRAIN, ["R8.P.R8.R8", "W.P.W.W"])
    return producer, consumer, art, directory, consumer_path


def test_training_lowers_the_consumer_kv_error(pair):
    _, _, art, _, _ = pair
    curve = art.meta["predictor"]["layers"][str(LAYER)]["curve"]
    kv_stage = [c["kv_error"] for c in curve if c["stage"] == "kv"]
    assert kv_stage[-1] < 0.6 * kv_stage[0]
    assert [c for c in curve if c["stage"] == "kl"][-1]["kl"] >= 0
    assert art.predictor_layers == [LAYER] and art.predictor(0) is None


def test_artifact_round_trips_the_predictor_and_the_encoder_reads_through_it(pair):
    producer, _, art, directory, _ = pair
    back = Artifact.load(directory / "tiny-hetero.safetensors")
    assert back.predictor_layers == [LAYER]
    ids = random_corpus(1, 70, 11)[0]
    state = states_of(producer, ids)[LAYER]
    with torch.no_grad():
        expected_x = predictor.predict(art.predictor(LAYER), state.normed)
        assert torch.equal(predictor.predict(back.predictor(LAYER), state.normed), expected_x)
    x = expected_x - back.tensor(LAYER, "mu_x")
    patch = ops.encode_layer(back, LAYER, Schedule.parse("W.P.W.W", 4).actions[LAYER], state)["x"]
    assert f"layer.{LAYER}.patch" not in back.tensors  # the predictor's output is the patch
    assert torch.equal(patch, expected_x.to(torch.float16))
    reuse = ops.encode_layer(back, LAYER, Schedule.parse("R8.R8.R8.R8", 4).actions[LAYER], state)
    codes, scale = ops.int8_rows(x @ back.tensor(LAYER, "encoder")[:, :8])
    assert torch.equal(reuse["z"], codes) and torch.equal(reuse["z_scale"], scale)


def test_a_frozen_predictor_runs_our_forward_bit_for_bit(pair):
    """An artifact's predictor (frozen) runs on shared.model, never its Hugging Face modules, with
    the modules' values bit for bit; a trainable one still runs the modules (gradients)."""
    from tests.test_no_hf_forward import forbidden

    back = Artifact.load(pair[3] / "tiny-hetero.safetensors")
    model = back.predictor(LAYER)
    for T in (1, 70):
        x = torch.randn(T, model.config.hidden_size, generator=torch.Generator().manual_seed(T))
        with torch.inference_mode():
            with forbidden(model) as calls:
                got = predictor.predict(model, x)
            ref = model(inputs_embeds=x[None]).last_hidden_state[0]  # the modules: the reference
        assert calls == [] and torch.equal(got, ref), T
    trainable = predictor.build(back.meta["predictor"]["config"])
    assert predictor.predict(trainable, x).requires_grad


@torch.inference_mode()
def codec_reference(producer, consumer, art, schedule: str, ctx_ids, q_ids, n: int) -> tuple[list[int], list[float]]:
    """The scd codec path in-process: encode every layer from P's states, decode into C's cache,
    greedy; the tokens and their top-2 margins."""
    cache = scd_cache(producer, consumer, art, schedule, ctx_ids, states_of)
    return greedy_with_margins(consumer, cache, q_ids, n)


@pytest.mark.numeric
@pytest.mark.parametrize("schedule", ["R8.P.R8.R8", "R8.P8.R8.R8"])  # the predictor's input fp16, int8
async def test_services_serve_a_predictor_artifact_like_the_in_process_codec(pair, schedule):
    producer, consumer, art, directory, consumer_path = pair
    tok = consumer.tokenizer
    ctx_ids, q_ids = tok(CONTEXT)["input_ids"], tok(QUESTION, add_special_tokens=False)["input_ids"]
    expected, margins = codec_reference(producer, consumer, art, schedule, ctx_ids, q_ids, 12)
    async with running_pair("tiny-llama", consumer_model=str(consumer_path), producer_kw={"artifacts": str(directory)},
                            consumer_kw={"artifacts": str(directory)}) as services:
        ids, _, stats = await services.generate(context=prompt(CONTEXT), question=prompt(QUESTION), max_new_tokens=12,
                                                transfer=common_pb2.CodecSpec(name="scd", options={"schedule": schedule}))
        assert_greedy_agrees(ids, expected, margins, what=schedule)  # the services' kernels vs in-process: near-tie rule
        assert stats.transfer.options["schedule"] == schedule
        (listed,) = (await services.stub.Describe(consumer_pb2.ConsumerServiceDescribeRequest())).artifacts
        assert list(listed.predictor_layers) == [LAYER]


@torch.no_grad()
def test_kl_is_zero_for_the_true_input_and_batching_does_not_change_it(pair):
    _, consumer, _, _, _ = pair
    ex = train_examples()[0]
    true_x, own_kv = predictor_training.consumer_pass(consumer, ex.context_ids, LAYER)
    assert float(predictor_training._kl(consumer, LAYER, true_x, ex, own_kv)) == pytest.approx(0.0, abs=1e-5)
    noisy = true_x + 0.3 * torch.randn(true_x.shape, generator=torch.Generator().manual_seed(0))
    together = float(predictor_training._kl(consumer, LAYER, noisy, ex, own_kv))
    singles = [(float(predictor_training._kl(consumer, LAYER, noisy, predictor_training.TrainExample(ex.context_ids, (c,)), own_kv)),
                len(c[0]) - 1 - max(c[1] - 1, 0)) for c in ex.continuations]
    assert together > 1e-3
    assert together == pytest.approx(sum(k * n for k, n in singles) / sum(n for _, n in singles), rel=1e-4)


def test_homogeneous_pairs_get_no_predictor_and_auto_follows_the_linear_patch_loss(pair):
    producer, consumer, art, _, _ = pair
    same = distill(producer, producer, random_corpus(6, 64, 0), heldout(2, 1), corpus_name="r", predictor_layers="all",
                   schedules=["R8.R8.R8.R8"], log=lambda m: None)
    assert same.predictor_layers == [] and "predictor" not in same.meta
    auto = distill(producer, consumer, random_corpus(6, 64, 0), heldout(2, 1), corpus_name="r", predictor_layers="auto",
                   predictor_examples=itertools.cycle(train_examples()), schedules=["R8.R8.R8.R8"], loss_target=0.0,
                   predictor_train=predictor_training.TrainConfig(mse_steps=2, kl_steps=1, batch=1), log=lambda m: None)
    linear = auto.meta["predictor"]["patch_loss_linear"]
    assert auto.predictor_layers == [int(l) for l, loss in linear.items() if loss > 0.0] != []
    worst = distill(producer, consumer, random_corpus(6, 64, 0), heldout(2, 1), corpus_name="r", predictor_layers="auto:1",
                    predictor_examples=itertools.cycle(train_examples()), schedules=["R8.R8.R8.R8"], loss_target=0.0,
                    predictor_train=predictor_training.TrainConfig(mse_steps=2, kl_steps=1, batch=1), log=lambda m: None)
    assert worst.predictor_layers == [int(max(linear, key=linear.get))]  # "auto:K": the K worst layers only


def test_predictor_training_is_deterministic_for_a_seed(pair):
    producer, consumer, _, _, _ = pair
    cfg = predictor_training.TrainConfig(mse_steps=5, kl_steps=3, batch=2)
    a, report_a = predictor_training.train(producer, consumer, LAYER, itertools.cycle(train_examples()), cfg, log=lambda m: None)
    b, report_b = predictor_training.train(producer, consumer, LAYER, itertools.cycle(train_examples()), cfg, log=lambda m: None)
    assert report_a["curve"] == report_b["curve"]
    sa, sb = predictor.to_tensors(LAYER, a), predictor.to_tensors(LAYER, b)
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_a_pool_reads_each_example_once_keeps_copies_and_trains_like_the_stream(pair):
    """A Pool (the 30-layer pairs' way: two forwards per example once, not per step) takes exactly
    `size` examples from the stream, holds tensors with storage of their own (a view of a larger
    capture buffer would hold all of it for the whole training), gives the KL stage only the
    examples whose cache it kept, and trains the predictor as the stream does."""
    from calibration import moments

    producer, consumer, _, _, _ = pair
    examples = train_examples()
    stream = iter(examples)
    pool = predictor_training.Pool(producer, consumer, stream, [LAYER], size=6, kl_size=2, seed=0)
    assert next(stream) is examples[6]
    assert [own is not None for *_, own in pool.items] == [True, True, False, False, False, False]
    for ex, xps, xcs, own in pool.items:
        assert torch.equal(xps[LAYER], moments.normed_inputs(producer, ex.context_ids)[LAYER])
        kept = [xps[LAYER], xcs[LAYER]] + [t for pair_kv in own or [] for t in pair_kv]
        assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in kept)
    assert {id(pool.draw(LAYER, "kl").example) for _ in range(40)} == {id(e) for e in examples[:2]}
    assert {id(pool.draw(LAYER, "kv").example) for _ in range(200)} == {id(e) for e in examples[:6]}
    clipped = dataclasses.replace(TRAIN, clip=1.0)  # the real pair's setting: bounded steps
    _, report = predictor_training.train(producer, consumer, LAYER, pool, clipped, log=lambda m: None)
    kv_stage = [c["kv_error"] for c in report["curve"] if c["stage"] == "kv"]
    assert kv_stage[-1] < 0.6 * kv_stage[0] and report["pool"] == {"examples": 6, "kl_examples": 2}
    with pytest.raises(ValueError, match="pool"):
        predictor_training.Pool(producer, consumer, stream, [LAYER], size=0)
