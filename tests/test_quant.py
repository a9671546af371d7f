"""KIVI-style quantization (shared.quantize) and the `quant` codec: stated error bound, payload
layout and bytes, codes bit-exact across the wire, option errors through the real services, and
end-to-end greedy decoding on the tiny models."""

from __future__ import annotations

import pytest
import torch

from shared import quantize, wire
from shared.models import load_model
from shared.pb import common_pb2
from tests.conftest import assert_refused_by_both, prompt, running_pair
from tests.greedy import context_cache
from tests.test_end_to_end import CONTEXT, QUESTION

SHAPES = [(2, 97, 16), (2, 64, 64), (1, 5, 7), (4, 1, 128), (3, 130, 24)]


def kv_like(shape, seed):
    """Keys with a few outlier channels (as real keys have) and values with a constant token."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(shape, generator=g) * (1 + 9 * (torch.rand(shape[-1], generator=g) > 0.8))
    values = torch.randn(shape, generator=g)
    values[:, 0] = 0.25  # one token whose value groups are constant: scale 0, exact
    return keys, values


def element_scales(payloads, shape, group_size):
    """Each element's stored scale, broadcast to [n_kv, T, hd] (keys, values)."""
    _, t, hd = shape
    k = payloads["k_scale"].float().repeat_interleave(group_size, dim=1)[:, :t]  # [n_kv, T, hd]
    v = payloads["v_scale"].float().repeat_interleave(group_size, dim=2)[..., :hd]
    return k, v


@pytest.mark.parametrize("bits", [8, 4])
def test_round_trip_error_within_half_a_scale_step(bits):
    worst = {}
    for i, shape in enumerate(SHAPES):
        for group_size in (8, 32, 128):
            keys, values = kv_like(shape, i)
            payloads = quantize.encode_kv(keys, values, bits, group_size)
            k_hat, v_hat = quantize.decode_kv(payloads, bits, group_size, shape)
            assert k_hat.dtype == v_hat.dtype == torch.float32 and k_hat.shape == v_hat.shape == shape
            k_scale, v_scale = element_scales(payloads, shape, group_size)
            for name, x, x_hat, scale in (("keys", keys, k_hat, k_scale), ("values", values, v_hat, v_scale)):
                err = (x - x_hat).abs()
                # |x - x̂| <= scale/2, up to float32 rounding of min + code * scale (~1e-7 of the group's range)
                rounding = 2.5e-7 * (x.abs() + scale * ((1 << bits) - 1))
                assert (err <= scale / 2 + rounding).all(), (name, shape, group_size)
                ratio = (err / (scale / 2).clamp_min(1e-30)).max().item()
                worst[name] = max(worst.get(name, 0.0), ratio)
                worst[name + "_abs"] = max(worst.get(name + "_abs", 0.0), err.max().item())
            assert torch.equal(v_hat[:, 0], values[:, 0])  # constant groups are exact
    print(f"int{bits}: max |x-x̂|/(scale/2) keys {worst['keys']:.4f} values {worst['values']:.4f};"
          f" max |x-x̂| keys {worst['keys_abs']:.4f} values {worst['values_abs']:.4f}")


def test_groups_are_per_channel_for_keys_and_per_token_for_values():
    n_kv, t, hd = 1, 40, 16
    keys = torch.zeros(n_kv, t, hd)
    keys[0, :, 3] = torch.linspace(0, 100, t)  # one wide channel must not coarsen the others
    keys[0, :, 5] = torch.linspace(0, 1, t)
    p = quantize.encode_kv(keys, keys.clone(), 8, 8)
    assert p["k_scale"].shape == (1, 5, 16) and p["v_scale"].shape == (1, 40, 2)
    k_hat, _ = quantize.decode_kv(p, 8, 8, (n_kv, t, hd))
    assert (keys[0, :, 5] - k_hat[0, :, 5]).abs().max() <= (7 / 39) / 255 / 2 * 1.01  # its own range per 8 tokens
    assert (p["k_scale"][0, :, 0] == 0).all()  # constant channels cost nothing


def test_payload_layout_and_bytes():
    for bits in (8, 4, 2):
        shape = (2, 97, 15)  # odd head_dim: int4 pads one nibble per row
        p = quantize.encode_kv(*kv_like(shape, 0), bits, 32)
        assert list(p) == list(quantize.PAYLOADS)
        want = quantize.payload_shapes(shape, bits, 32)
        for name, t in p.items():
            assert t.device.type == "cpu" and t.is_contiguous()
            assert t.dtype == (torch.uint8 if name.endswith("codes") else torch.float16), name
            assert tuple(t.shape) == want[name], name
        assert sum(t.numel() * t.element_size() for t in p.values()) == quantize.payload_bytes(shape, bits, 32)
    assert quantize.payload_shapes((2, 97, 15), 4, 32)["k_codes"] == (2, 97, 8)
    assert quantize.payload_shapes((2, 97, 15), 8, 32)["k_scale"] == (2, 4, 15)


def test_int4_packs_two_codes_per_byte_low_nibble_first():
    codes = torch.tensor([[1, 2, 3, 15, 7]], dtype=torch.uint8)
    packed = quantize.pack(codes, 4)
    assert packed.tolist() == [[0x21, 0xF3, 0x07]]
    assert torch.equal(quantize.unpack(packed, 4, 5), codes)


def test_decode_refuses_payloads_of_the_wrong_shape_or_dtype():
    shape = (2, 33, 16)
    p = quantize.encode_kv(*kv_like(shape, 1), 4, 32)
    with pytest.raises(ValueError, match="payload 'k_codes'"):
        quantize.decode_kv(p, 8, 32, shape)  # int4 codes read as int8
    with pytest.raises(ValueError, match="payload 'k_scale'"):
        quantize.decode_kv({**p, "k_scale": p["k_scale"].float()}, 4, 32, shape)
    with pytest.raises(KeyError, match="v_min"):
        quantize.decode_kv({k: v for k, v in p.items() if k != "v_min"}, 4, 32, shape)
    with pytest.raises(ValueError, match="bits"):
        quantize.encode_kv(*kv_like(shape, 1), 3, 32)


@pytest.mark.parametrize("bits", [8, 4])
def test_codes_survive_the_wire_bit_exactly(bits):
    shape = (2, 130, 24)
    keys, values = kv_like(shape, 2)
    payloads = quantize.encode_kv(keys.to(torch.bfloat16), values.to(torch.bfloat16), bits, 16)
    received = {}
    for name, t in payloads.items():
        chunks = wire.payload_to_pb(3, name, t, max_chunk_bytes=257)
        assert len(chunks) == -(-t.numel() * t.element_size() // 257)
        received[name] = wire.payload_from_pb(chunks)
        assert received[name].dtype == t.dtype and torch.equal(received[name], t), name
    local = quantize.decode_kv(payloads, bits, 16, shape)
    remote = quantize.decode_kv(received, bits, 16, shape)
    assert all(torch.equal(a, b) for a, b in zip(local, remote))


@pytest.mark.parametrize(
    "options, named",
    [
        ({"bits": "3"}, "transfer.options['bits']='3' for codec 'quant': must be '8', '4' or '2'"),
        ({"group_size": "48"},
         "transfer.options['group_size']='48' for codec 'quant': must be a power of two in 8..128"),
        ({"group_size": "256"}, "transfer.options['group_size']='256'"),
        ({"group_size": "x"}, "transfer.options['group_size']='x'"),
        ({"bits": "8", "scheme": "kivi"}, "transfer.options: unknown option(s) ['scheme']"),
    ],
)
async def test_invalid_options_are_refused_by_both_services(options, named, pair_llama):
    spec = common_pb2.CodecSpec(name="quant", options=options)
    await assert_refused_by_both(pair_llama, spec, named, context=prompt(CONTEXT), question=prompt(QUESTION))


@torch.inference_mode()
def question_logits(loaded, ctx_ids, q_ids, bits):
    """Teacher-forced logits over the question on a context cache whose K/V went through
    quantize (bits) or not (bits=None): [len(q), V]."""
    cache = context_cache(loaded, ctx_ids, bits)
    return loaded.model(input_ids=torch.tensor([q_ids]), cache=cache, use_cache=True).logits[0].float()


@pytest.mark.numeric
@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-qwen2"])
async def test_quant_end_to_end_bytes_and_greedy_tokens(arch):
    new = 16
    local = load_model(arch, "float32", "cpu")
    info, tok = local.info, local.tokenizer
    ctx_ids = tok(CONTEXT)["input_ids"]
    q_ids = tok(QUESTION, add_special_tokens=False)["input_ids"]
    shape = (info.num_kv_heads, len(ctx_ids), info.head_dim)

    # in-process: int8 logits stay within a small step of the exact ones, int4 further, same argmax for int8
    exact = question_logits(local, ctx_ids, q_ids, None)
    err8 = (question_logits(local, ctx_ids, q_ids, 8) - exact).abs().max().item()
    err4 = (question_logits(local, ctx_ids, q_ids, 4) - exact).abs().max().item()
    assert torch.equal(question_logits(local, ctx_ids, q_ids, 8).argmax(-1), exact.argmax(-1))
    assert err8 < err4 and err8 < 0.05 * exact.abs().max().item()

    async with running_pair(arch, producer_kw={"max_chunk_bytes": 1024}) as pair:
        answers = {}
        for name, options in (("raw", {}), ("quant", {}), ("quant", {"bits": "4"})):
            ids, _, stats = await pair.generate(context=prompt(CONTEXT), question=prompt(QUESTION), max_new_tokens=new,
                                                transfer=common_pb2.CodecSpec(name=name, options=options))
            bits = int(options.get("bits", 8)) if name == "quant" else None
            answers[bits] = ids
            assert stats.raw_kv_bytes == info.kv_bytes(len(ctx_ids))
            if bits:
                assert stats.transfer.options["bits"] == str(bits) and stats.transfer.options["group_size"] == "32"
                assert stats.bytes_received == info.num_layers * quantize.payload_bytes(shape, bits, 32)
                ratio = stats.bytes_received / stats.raw_kv_bytes
                # float32 raw: int8 = 1/4 + fp16 scales/mins, int4 = 1/8 + the same
                overhead = (4 / 32 + 4 / min(32, info.head_dim)) / 2 / 4  # fp16 scale+min per group, K and V
                assert ratio == pytest.approx(bits / 32 + overhead)
                print(f"{arch} int{bits}: bytes {stats.bytes_received} / raw {stats.raw_kv_bytes} = {ratio:.4f}")
    print(f"{arch}: max |logit err| int8 {err8:.4f} int4 {err4:.4f}; tokens raw {answers[None]}"
          f" int8 {answers[8]} int4 {answers[4]}")
    # int8 keeps raw's greedy path (identical for all 16 tokens here; assert the first 8), int4 its first token
    assert answers[8][:8] == answers[None][:8]
    assert answers[4][0] == answers[None][0]
