"""The `recompute` codec (DroidSpeak-style span recompute) and its span profiler: default span
rule, option errors through the real services, exactness with C == P, a heterogeneous pair
against an in-process reference, and profile_span."""

from __future__ import annotations

import math

import pytest
import torch

from shared import layers
from shared.codecs import EncodeRequest, StreamInfo
from shared.codecs.recompute import RecomputeCodec, default_span, span
from shared.errors import InvalidArgument
from shared.models import load_model
from shared.pb import common_pb2
from calibration.recompute_profile import profile_span
from tests.conftest import assert_refused_by_both, perturbed_model, prompt, running_pair
from tests.greedy import assert_greedy_agrees
from tests.test_end_to_end import CONTEXT, QUESTION, greedy_on, local_greedy

NEW = 16


def test_default_span_is_the_middle_quarter():
    assert [default_span(n) for n in (1, 2, 4, 6, 24, 28, 32)] == [
        (0, 1), (0, 1), (1, 2), (2, 4), (9, 15), (10, 17), (12, 20)]
    assert span({}, 4, "m") == (1, 2)
    assert span({"start": "3", "end": "auto"}, 4, "m") == (3, 4)
    assert span({"start": "auto", "end": "1"}, 4, "m") == (0, 1)
    assert span({"start": "0", "end": "4"}, 4, "m") == (0, 4)


def test_decoder_checks_the_span_against_the_consumers_layers():
    codec = RecomputeCodec(load_model("tiny-llama", "float32", "cpu"))
    with pytest.raises(InvalidArgument, match=r"transfer.options\['end'\]='6' .*num_layers=4: must be in 2..4"):
        codec.decoder(StreamInfo(4, 10, "float32", {"start": "1", "end": "6"}))
    with pytest.raises(InvalidArgument, match=r"transfer.options\['start'\]='4' .*must be in 0..3"):
        codec.encoder({"start": "4", "end": "auto"}, EncodeRequest(10))


@pytest.mark.parametrize(
    "options, named",
    [
        ({"start": "4"},
         "transfer.options['start']='4' for codec 'recompute' on model tiny-llama with num_layers=4: must be in 0..3"),
        ({"start": "2", "end": "2"},
         "transfer.options['end']='2' for codec 'recompute' on model tiny-llama with num_layers=4: must be in 3..4"),
        ({"end": "9"}, "transfer.options['end']='9'"),
        ({"start": "-1"}, "transfer.options['start']='-1' for codec 'recompute': must be >= 0"),
        ({"start": "one"}, "transfer.options['start']='one' for codec 'recompute': must be a layer index or 'auto'"),
        ({"width": "2"}, "transfer.options: unknown option(s) ['width']"),
    ],
)
async def test_invalid_options_are_refused_by_both_services(options, named, pair_llama):
    spec = common_pb2.CodecSpec(name="recompute", options=options)
    await assert_refused_by_both(pair_llama, spec, named, context=prompt(CONTEXT), question=prompt(QUESTION))


@pytest.mark.numeric
@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-qwen2"])
async def test_recompute_with_the_same_model_equals_oracle(arch):
    local = load_model(arch, "float32", "cpu")
    info, tok = local.info, local.tokenizer
    ctx_ids = tok(CONTEXT)["input_ids"]
    t = len(ctx_ids)
    q_ids = tok(QUESTION, add_special_tokens=False)["input_ids"]
    expected, margins = local_greedy(local.model, ctx_ids, q_ids, NEW, tok.eos_token_id)
    layer_kv = info.kv_bytes(t) // info.num_layers
    async with running_pair(arch, producer_kw={"max_chunk_bytes": 1024}) as pair:
        cases = (({}, (1, 2)), ({"start": "0", "end": "4"}, (0, 4)), ({"start": "2", "end": "4"}, (2, 4)))
        for options, (start, end) in cases:
            ids, _, stats = await pair.generate(context=prompt(CONTEXT), question=prompt(QUESTION), max_new_tokens=NEW,
                                                transfer=common_pb2.CodecSpec(name="recompute", options=options))
            # the services' kernels vs the in-process reference's: tests/greedy.py's near-tie rule
            assert_greedy_agrees(ids, expected, margins, what=str(options))
            assert (stats.transfer.options["start"], stats.transfer.options["end"]) == (str(start), str(end))
            # raw K/V outside the span, one hidden state [T, d] float32 for it
            assert stats.bytes_received == (info.num_layers - (end - start)) * layer_kv + t * info.hidden_size * 4
            print(f"{arch} recompute [{start},{end}): bytes {stats.bytes_received} / raw {stats.raw_kv_bytes}"
                  f" = {stats.bytes_received / stats.raw_kv_bytes:.4f}")


@pytest.fixture(scope="module")
def different_consumer(tmp_path_factory):
    """tiny-llama with perturbed weights, saved where a server can load it (a fine-tuned C)."""
    path = tmp_path_factory.mktemp("consumer")
    return path, perturbed_model("tiny-llama", seed=1, scale=0.05, save_to=path)


@torch.inference_mode()
def reference_recompute(local_p, local_c, ctx_ids, q_ids, start, end, n):
    """P's K/V outside [start, end); C's layers start..end-1 run over P's hidden state entering
    `start` (taken from P's output_hidden_states); then C decodes greedily."""
    out = local_p.model(input_ids=torch.tensor([ctx_ids]), use_cache=True, output_hidden_states=True)
    cache_p = out.cache
    span_kv = layers.run_layers(local_c, out.hidden_states[start][0], start, end)
    for offset, (keys, values) in enumerate(span_kv):
        cache_p.layers[start + offset].keys = keys[None].clone()
        cache_p.layers[start + offset].values = values[None].clone()
    return greedy_on(local_c.model, cache_p, q_ids, n, local_c.tokenizer.eos_token_id)  # tokens and top-2 margins


@pytest.mark.numeric
async def test_recompute_across_different_models_matches_in_process_reference(different_consumer):
    path, local_c = different_consumer
    local_p = load_model("tiny-llama", "float32", "cpu")
    tok = local_c.tokenizer
    ctx_ids = tok(CONTEXT)["input_ids"]
    q_ids = tok(QUESTION, add_special_tokens=False)["input_ids"]
    spans = [(1, 2), (0, 4), (1, 3)]
    expected = {s: reference_recompute(local_p, local_c, ctx_ids, q_ids, *s, NEW) for s in spans}
    async with running_pair("tiny-llama", consumer_model=str(path)) as pair:
        for start, end in spans:
            spec = common_pb2.CodecSpec(name="recompute", options={"start": str(start), "end": str(end)})
            ids, _, _ = await pair.generate(context=prompt(CONTEXT), question=prompt(QUESTION), max_new_tokens=NEW,
                                            transfer=spec)
            assert_greedy_agrees(ids, *expected[(start, end)], what=f"span {(start, end)}")
        raw, _, _ = await pair.generate(context=prompt(CONTEXT), question=prompt(QUESTION), max_new_tokens=NEW,
                                        transfer=common_pb2.CodecSpec(name="raw"))
        oracle, _, _ = await pair.generate(context=prompt(CONTEXT), question=prompt(QUESTION), max_new_tokens=NEW,
                                           transfer=common_pb2.CodecSpec(name="oracle"))
    print(f"heterogeneous: oracle {oracle}\n raw {raw}\n" + "\n".join(f" recompute {s} {expected[s][0]}" for s in spans))


def calibration(tok):
    texts = [CONTEXT, "Semantic cache distillation sends compact codes. " * 6]
    contexts = [tok(t)["input_ids"] for t in texts]
    questions = [tok(" Which layers are patched?", add_special_tokens=False)["input_ids"]] * 2
    answers = [tok(" most layers are rebuilt from low rank subspaces", add_special_tokens=False)["input_ids"],
               tok(" a few layers are patched", add_special_tokens=False)["input_ids"]]
    return contexts, questions, answers


def test_profile_span_ranks_every_span(different_consumer):
    _, local_c = different_consumer
    local_p = load_model("tiny-llama", "float32", "cpu")
    data = calibration(local_c.tokenizer)
    tokens = sum(len(a) for a in data[2])

    same = profile_span(local_p, local_p, *data, width=2)
    assert [(r["start"], r["end"]) for r in same] == [(0, 2), (1, 3), (2, 4)]  # all ~0: ties keep layer order
    assert all(abs(r["kl"]) < 1e-5 and abs(r["kl_reuse"]) < 1e-5 and r["answer_tokens"] == tokens for r in same)

    rows = profile_span(local_p, local_c, *data, width=1)
    print("profile width=1:", [(r["start"], round(r["kl"], 4)) for r in rows], "reuse", round(rows[0]["kl_reuse"], 4))
    assert sorted((r["start"], r["end"], r["width"]) for r in rows) == [(i, i + 1, 1) for i in range(4)]
    assert [r["kl"] for r in rows] == sorted(r["kl"] for r in rows)
    assert all(math.isfinite(r["kl"]) and r["kl"] >= 0 for r in rows)
    assert rows[0]["kl"] < rows[0]["kl_reuse"]  # the best span beats naive reuse of every layer
    full = profile_span(local_p, local_c, *data, width=4)
    assert len(full) == 1 and full[0]["kl"] < rows[-1]["kl"]  # C recomputing all layers from P's embeddings
    both = profile_span(local_p, local_c, *data, width=[1, 4])  # one pass over the examples, by width
    assert [(r["start"], r["end"]) for r in both] == [(r["start"], r["end"]) for r in rows + full]
    assert all(math.isclose(a["kl"], b["kl"], rel_tol=1e-5, abs_tol=1e-7) for a, b in zip(both, rows + full, strict=True))
