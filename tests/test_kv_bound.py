"""shared.kv_bound: the limits hold for every K/V a model's own layers make, however hostile the
hidden state (the worst case of the proof is reached, so the bound cannot be tighter, and the
margin is above it), and for the codecs' rebuilds of them (quant, SCD Reuse projections); and the
codecs' store refuses, naming the layer and the limit, finite values past it: 3e38, 1e30 and just
past the limit, in float32 and bfloat16, alone and in a batch of requests."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Qwen3Config

from shared import kv_bound, layers, quantize, tiny
from shared.codecs.base import LayerJob, StreamInfo, add_layers, create_codecs
from shared.errors import DataLoss
from shared.models import load_model
from shared.scd.ops import from_int8_rows, int8_rows


def qwen3_tiny(root) -> str:
    """A Qwen3 (k_norm) model of the builtin tiny size, random weights, k_norm weights spread out."""
    config = Qwen3Config(vocab_size=len(tiny.build_tokenizer()), **{**tiny._COMMON, "head_dim": 16})
    path = tiny.save_random(root / "tiny-qwen3", config, tiny.build_tokenizer())
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    qwen3 = qwen3_tiny(tmp_path_factory.mktemp("qwen3"))
    out = {}
    for name in ("tiny-llama", "tiny-qwen2", qwen3):
        for dtype in ("float32", "bfloat16"):
            loaded = load_model(name, dtype, "cpu")
            with torch.no_grad():  # spread the norm weights, so the worst case is not every channel alike
                g = torch.Generator().manual_seed(3)
                for layer in loaded.layers:
                    for norm in (layer.input_layernorm, getattr(layer.self_attn, "k_norm", None)):
                        if norm is not None:
                            norm.weight.mul_((0.5 + 2 * torch.rand(norm.weight.shape, generator=g)).to(norm.weight.dtype))
            out[(name.split("/")[-1], dtype)] = loaded
    return out


def hostile_hidden(loaded, layer: int) -> torch.Tensor:
    """Hidden states [N, d] aimed at the bound: for every K and V row j, h = ±(w ⊙ W_j) (the
    Cauchy-Schwarz maximizer), plus one-hot outliers at 1e4, near-zero states and noise."""
    attn = loaded.layers[layer].self_attn
    w = loaded.layers[layer].input_layernorm.weight.detach().float()
    rows = torch.cat([attn.k_proj.weight.detach().float(), attn.v_proj.weight.detach().float()]) * w  # [D, d]
    d = w.shape[0]
    g = torch.Generator().manual_seed(layer)
    parts = [rows, -rows, torch.eye(d) * 1e4, torch.full((4, d), 1e-6), torch.randn(64, d, generator=g) * 30]
    return torch.cat(parts).to(loaded.dtype)


def own_kv(loaded, layer: int, hidden: torch.Tensor, start: int = 0):
    """The post-RoPE keys and values the layer stores for hidden states [N, d] at positions start.."""
    normed = loaded.layers[layer].input_layernorm(hidden)
    pos = layers.positions(loaded, hidden.shape[0], start)
    return layers.kv_from_normed(loaded, layer, normed, pos)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_layers_own_kv_never_pass_the_limit_and_reach_the_bound(models, name, dtype):
    """The worst hidden state reaches the values' bound (limit / MARGIN) to rounding: the bound
    is the least that holds. Nothing a layer makes, at any position, passes its limit."""
    loaded = models[(name, dtype)]
    for layer, bound in enumerate(loaded.kv_bounds):
        assert math.isfinite(bound.keys) and math.isfinite(bound.values)
        hidden = hostile_hidden(loaded, layer)
        with torch.inference_mode():
            for start in (0, 1, 1000, 7777):  # RoPE turns the pairs
                keys, values = own_kv(loaded, layer, hidden, start)
                assert float(keys.float().abs().max()) <= bound.keys, (layer, start)
                assert float(values.float().abs().max()) <= bound.values, (layer, start)
        reached = float(values.float().abs().max()) / (bound.values / kv_bound.MARGIN)
        assert 0.97 < reached <= 1.01, (layer, reached)  # bf16 rounding on either side of 1


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_codec_rebuilds_of_the_layers_own_kv_stay_inside(models, name):
    """Quant (8 and 4 bits) of the worst K/V stays inside the K/V limits; an SCD Reuse rebuild (PCA
    basis of any rank, mean, int8 codes) inside `projected`, which a projection can need: it may
    gather a token's norm into one element, past the per-element limits."""
    loaded = models[(name, "float32")]
    info = loaded.info
    for layer, bound in enumerate(loaded.kv_bounds):
        hidden = hostile_hidden(loaded, layer)
        with torch.inference_mode():
            keys, values = own_kv(loaded, layer, hidden, 5)
            for bits in (8, 4, 2):
                k, v = quantize.decode_kv(quantize.encode_kv(keys, values, bits, 16), bits, 16, tuple(keys.shape))
                assert float(k.abs().max()) <= bound.keys and float(v.abs().max()) <= bound.values, (layer, bits)
            k_pre, v_pre = layers.kv_pre_rope(loaded, layer, loaded.layers[layer].input_layernorm(hidden))
            T = hidden.shape[0]
            y = torch.cat([k_pre.transpose(0, 1).reshape(T, -1), v_pre.transpose(0, 1).reshape(T, -1)], dim=1).float()
            mu = y.mean(0)
            basis = torch.linalg.svd(y - mu, full_matrices=False).Vh.T  # [D, D] orthonormal, by variance
            for rank in (1, 4, basis.shape[1]):
                z = from_int8_rows(*int8_rows((y - mu) @ basis[:, :rank]))
                rebuilt = z @ basis[:, :rank].T + mu
                half = rebuilt.shape[1] // 2
                k_re = rebuilt[:, :half].reshape(T, info.num_kv_heads, info.head_dim).transpose(0, 1)
                k_re = layers.rope(loaded, layer, k_re, layers.positions(loaded, T, 5))
                assert float(k_re.abs().max()) <= bound.projected and float(rebuilt.abs().max()) <= bound.projected


def test_a_normalization_it_cannot_read_gives_no_limit():
    """A norm that is not w ⊙ h / rms(h) (here: an offset weight, as Gemma's) leaves the layer
    held only to finite values, never to a wrong limit."""
    loaded = load_model("tiny-llama", "float32", "cpu")
    norm = loaded.layers[1].input_layernorm
    forward = norm.forward
    norm.forward = lambda h: forward(h) + 0.5 * h  # type: ignore[method-assign]
    info = loaded.info
    bounds = kv_bound.layer_bounds(loaded.model, info.hidden_size, info.num_kv_heads, info.head_dim)
    assert bounds[1].keys == bounds[1].values == math.inf and math.isfinite(bounds[0].keys)


def raw_jobs(loaded, lengths, mutate):
    """Raw layer-1 payloads of several requests (noise well inside the limits), mutate(i, k, v)."""
    info = loaded.info
    codec = create_codecs(loaded, ["raw"])["raw"]
    jobs = []
    for i, T in enumerate(lengths):
        g = torch.Generator().manual_seed(i)
        keys, values = (torch.randn(info.num_kv_heads, T, info.head_dim, generator=g) for _ in range(2))
        mutate(i, keys, values)
        decoder = codec.decoder(StreamInfo(info.num_layers, T, "float32", {}))
        jobs.append(LayerJob(decoder, 1, {"k": keys, "v": values}))
    return jobs


VALUES = [3e38, 1e30, "past"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["keys", "values"])
@pytest.mark.parametrize("value", VALUES, ids=["3e38", "1e30", "just_past"])
def test_store_refuses_finite_values_past_the_limit_alone_and_in_a_batch(models, dtype, kind, value):
    """Layer 1 of request 1 carries the value (every element of 3e38 or 1e30; one element 2% past
    the limit): that request alone fails DataLoss naming the layer, the tensor and the limit,
    stored alone or with three others; the others are stored. One element 2% under the limit
    is stored."""
    loaded = models[("tiny-llama", dtype)]
    limit = loaded.kv_bounds[1].keys if kind == "keys" else loaded.kv_bounds[1].values
    index = 0 if kind == "keys" else 1

    def mutate(i, keys, values):
        t = (keys, values)[index]
        if i == 1 and value == "past":
            t[1, 3, 2] = -limit * 1.02
        elif i == 1:
            t.fill_(value)
        if i == 2:
            t[0, 0, 0] = limit * 0.98

    expected = f"layer 1: rebuilt {kind} reach |"
    for together in (False, True):
        jobs = raw_jobs(loaded, [16, 24, 8, 32], mutate)
        errors = add_layers(jobs)[0] if together else [add_layers([job])[0][0] for job in jobs]
        assert [e is None for e in errors] == [True, False, True, True], errors
        assert isinstance(errors[1], DataLoss)
        text = str(errors[1])
        assert text.startswith(expected) and f"past {limit:.4g}" in text, text
        assert all(1 in job.decoder.received for i, job in enumerate(jobs) if i != 1)


def test_non_finite_values_are_still_named_as_such(models):
    loaded = models[("tiny-llama", "bfloat16")]
    for bad in (float("nan"), float("inf"), float("-inf")):
        jobs = raw_jobs(loaded, [8, 8], lambda i, k, v, bad=bad: v.__setitem__((0, 7, 15), bad) if i == 0 else None)
        errors, _ = add_layers(jobs)
        assert "layer 1: rebuilt values hold non-finite values" in str(errors[0]) and errors[1] is None


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_the_residual_stream_never_passes_its_limit(models, name):
    """Every layer's input in a forward from token embeddings, and from embeddings aimed at the
    bound (every element +-max|E|, or one-hot at it), stays within hidden_bounds."""
    loaded = models[(name, "float32")]
    bounds = loaded.hidden_bounds
    assert len(bounds) == loaded.info.num_layers and all(math.isfinite(b) for b in bounds)
    top = float(loaded.model.model.embed_tokens.weight.detach().abs().max())
    g = torch.Generator().manual_seed(0)
    d = loaded.info.hidden_size
    embeds = [
        loaded.model.model.embed_tokens(torch.randint(0, 100, (1, 48), generator=g)),
        top * torch.sign(torch.randn(1, 48, d, generator=g)),
        top * torch.eye(d)[None, :48],
    ]
    with torch.inference_mode():
        for x in embeds:
            states = loaded.model(inputs_embeds=x, output_hidden_states=True).hidden_states[:-1]  # each layer's input
            for layer, (h, limit) in enumerate(zip(states, bounds)):
                assert float(h.abs().max()) <= limit, (layer, float(h.abs().max()), limit)


@pytest.mark.parametrize("value", [1e30, 3e38, "past", "nan"])
def test_a_recompute_hidden_state_past_its_limit_fails_naming_the_payload(models, value):
    """A recompute stream's `hidden` at 1e30 (its square overflows the RMSNorm into zero K/V, which
    pass every K/V limit) or 3e38 or 2% past the limit is DataLoss naming the layer, the payload and
    the limit; NaN is named as non-finite; the true hidden state of a forward is accepted."""
    loaded = models[("tiny-llama", "float32")]
    info = loaded.info
    codec = create_codecs(loaded, ["recompute"])["recompute"]
    ids = torch.randint(0, 100, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        true = loaded.model(ids, output_hidden_states=True).hidden_states[1][0]  # entering layer 1
    limit = loaded.hidden_bounds[1]
    bad = true.clone()
    if value == "past":
        bad[3, 5] = -limit * 1.02
    elif value == "nan":
        bad[0, 0] = math.nan
    else:
        bad.fill_(value)
    for hidden, ok in ((true, True), (bad, False)):
        decoder = codec.decoder(StreamInfo(info.num_layers, 12, "float32", {"start": "1", "end": "2"}))
        (error,), _ = add_layers([LayerJob(decoder, 1, {"hidden": hidden})])
        if ok:
            assert error is None and {1} <= decoder.received
            continue
        assert isinstance(error, DataLoss) and str(error).startswith("layer 1: payload 'hidden' values"), error
        assert ("non-finite" in str(error)) if value == "nan" else (f"past {limit:.4g}" in str(error)), error


def test_a_family_that_scales_its_embeddings_gets_no_hidden_limit():
    """Gemma multiplies the embedding by sqrt(d): the plain rows' bound would refuse valid streams,
    so a family not known to start from the plain row is held to finite values only."""
    loaded = load_model("tiny-llama", "float32", "cpu")
    loaded.model.config.model_type = "gemma"
    assert all(b == math.inf for b in kv_bound.hidden_bounds(loaded.model, loaded.info.hidden_size))
