"""KIVI-style asymmetric integer quantization of one layer's K/V, pure torch.

Keys are quantized per channel: each (kv head, channel) gets its own min and scale over every
group of `group_size` consecutive tokens (key outliers live in fixed channels). Values are
quantized per token: each token gets a min and scale per group of `group_size` consecutive
channels. A last partial group (T or head_dim not a multiple of `group_size`) is its own group.

Per group: `min` is the group minimum rounded down to fp16, `scale` is
(max - min) / (2**bits - 1) rounded up to fp16, `code = round((x - min) / scale)` in
[0, 2**bits - 1], and `x̂ = min + code * scale`. Rounding min down and scale up keeps every
element inside the representable range, so the error bound is

    |x - x̂| <= scale / 2        per element, with `scale` the stored fp16 scale of its group

up to the float32 rounding of the decode arithmetic (a few float32 ulp of the group's magnitude,
~1e-7 relative). Inputs must lie within
the fp16 range (|x| < 65504), as every model's K/V here does.

Wire layout (names -> CPU tensors), for keys/values [n_kv, T, hd]:
  k_codes  uint8 [n_kv, T, hd] (bits=8), [n_kv, T, ceil(hd/2)] (bits=4, low nibble first) or
           [n_kv, T, ceil(hd/4)] (bits=2, low bits first)
  k_scale, k_min  float16 [n_kv, ceil(T/group_size), hd]
  v_codes  like k_codes
  v_scale, v_min  float16 [n_kv, T, ceil(hd/group_size)]

Knows nothing about models, codecs or the wire.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BITS = (8, 4, 2)
PAYLOADS = ("k_codes", "k_scale", "k_min", "v_codes", "v_scale", "v_min")


def _check(bits: int, group_size: int) -> None:
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")


def _groups(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """Split the last dim into groups: x [..., n] -> [..., ceil(n/g), g], padding the last group
    by repeating its final element (so padding never changes a group's min or max)."""
    n = x.shape[-1]
    pad = -n % group_size
    if pad:
        x = torch.cat([x, x[..., -1:].expand(*x.shape[:-1], pad)], dim=-1)
    return x.reshape(*x.shape[:-1], -1, group_size)


def _ungroup(x: torch.Tensor, n: int) -> torch.Tensor:
    """[..., groups, g] -> [..., n], dropping the padding of the last group."""
    return x.reshape(*x.shape[:-2], -1)[..., :n]


def _quantize(grouped: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """grouped float32 [..., G, g] -> (codes uint8 [..., G, g], scale fp16 [..., G], min fp16 [..., G])."""
    levels = (1 << bits) - 1
    lo = grouped.amin(dim=-1)  # [..., G]
    hi = grouped.amax(dim=-1)
    lo16 = lo.to(torch.float16)
    lo16 = torch.where(lo16.float() > lo, torch.nextafter(lo16, torch.full_like(lo16, -torch.inf)), lo16)  # round down
    span = (hi - lo16.float()) / levels  # >= 0
    scale16 = span.to(torch.float16)
    up = torch.nextafter(scale16, torch.full_like(scale16, torch.inf))
    scale16 = torch.where(scale16.float() < span, up, scale16)  # round up
    # scale 0 only when every element equals min exactly: any divisor gives code 0
    safe = torch.where(scale16 == 0, 1.0, scale16.float())[..., None]
    codes = torch.round((grouped - lo16.float()[..., None]) / safe).clamp_(0, levels).to(torch.uint8)
    return codes, scale16, lo16


def _dequantize(codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """codes [..., G, g], scale/min [..., G] -> float32 [..., G, g]."""
    return lo.float()[..., None] + codes.float() * scale.float()[..., None]


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., n] -> bytes: unchanged for 8 bits; for 4 and 2 bits 8 // bits codes per
    byte along the last dim, element (8 // bits) i + j in bits [j bits, (j + 1) bits) of byte i
    (low bits first) -> [..., ceil(n / (8 // bits))]."""
    if bits == 8:
        return codes.contiguous()
    per = 8 // bits
    if codes.shape[-1] % per:
        codes = F.pad(codes, (0, per - codes.shape[-1] % per))
    out = codes[..., 0::per].clone()
    for j in range(1, per):
        out |= codes[..., j::per] << (j * bits)
    return out.contiguous()


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of pack: [..., ceil(n / (8 // bits))] -> uint8 codes [..., n]."""
    if bits == 8:
        return packed
    per, mask = 8 // bits, (1 << bits) - 1
    parts = torch.stack([(packed >> (j * bits)) & mask for j in range(per)], dim=-1)  # [..., m, per]
    return parts.reshape(*packed.shape[:-1], -1)[..., :n]


def codes_width(bits: int, n: int) -> int:
    return -(-n // (8 // bits))


def payload_shapes(shape: tuple[int, int, int], bits: int, group_size: int) -> dict[str, tuple[int, ...]]:
    """Expected shape of every payload for keys/values of `shape` [n_kv, T, hd]."""
    n_kv, t, hd = shape
    codes = (n_kv, t, codes_width(bits, hd))
    return {
        "k_codes": codes,
        "k_scale": (n_kv, -(-t // group_size), hd),
        "k_min": (n_kv, -(-t // group_size), hd),
        "v_codes": codes,
        "v_scale": (n_kv, t, -(-hd // group_size)),
        "v_min": (n_kv, t, -(-hd // group_size)),
    }


def payload_bytes(shape: tuple[int, int, int], bits: int, group_size: int) -> int:
    """Bytes of all payloads of one layer (codes 1 byte per element, scales and mins 2)."""
    total = 0
    for name, s in payload_shapes(shape, bits, group_size).items():
        count = 1
        for d in s:
            count *= d
        total += count * (1 if name.endswith("codes") else 2)
    return total


@torch.inference_mode()
def encode_keys(keys: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """keys [n_kv, T, hd], per channel over token groups -> (codes, scale [n_kv, T/g, hd], min)."""
    n_kv, t, hd = keys.shape
    grouped = _groups(keys.float().transpose(1, 2), group_size)  # [n_kv, hd, Tg, g]
    codes, scale, lo = _quantize(grouped, bits)
    codes = _ungroup(codes, t).transpose(1, 2)  # [n_kv, T, hd]
    return pack(codes, bits), scale.transpose(1, 2).contiguous(), lo.transpose(1, 2).contiguous()


@torch.inference_mode()
def encode_values(values: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """values [n_kv, T, hd], per token over channel groups -> (codes, scale [n_kv, T, hd/g], min)."""
    hd = values.shape[-1]
    grouped = _groups(values.float(), group_size)  # [n_kv, T, Cg, g]
    codes, scale, lo = _quantize(grouped, bits)
    return pack(_ungroup(codes, hd), bits), scale, lo


@torch.inference_mode()
def decode_keys(
    codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, bits: int, group_size: int, shape: tuple[int, int, int]
) -> torch.Tensor:
    n_kv, t, hd = shape
    full = unpack(codes, bits, hd).transpose(1, 2)  # [n_kv, hd, T]
    grouped = _groups(full, group_size)  # [n_kv, hd, Tg, g]
    out = _dequantize(grouped, scale.transpose(1, 2), lo.transpose(1, 2))
    return _ungroup(out, t).transpose(1, 2)  # [n_kv, T, hd]


@torch.inference_mode()
def decode_values(
    codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, bits: int, group_size: int, shape: tuple[int, int, int]
) -> torch.Tensor:
    hd = shape[-1]
    grouped = _groups(unpack(codes, bits, hd), group_size)  # [n_kv, T, Cg, g]
    return _ungroup(_dequantize(grouped, scale, lo), hd)


def encode_kv(keys: torch.Tensor, values: torch.Tensor, bits: int, group_size: int) -> dict[str, torch.Tensor]:
    """One layer's keys and values [n_kv, T, hd] each -> payloads (name -> CPU tensor, see module doc)."""
    _check(bits, group_size)
    if keys.dim() != 3 or keys.shape != values.shape:
        raise ValueError(f"keys {list(keys.shape)} and values {list(values.shape)} must both be [n_kv, T, hd]")
    k_codes, k_scale, k_min = encode_keys(keys, bits, group_size)
    v_codes, v_scale, v_min = encode_values(values, bits, group_size)
    out = dict(k_codes=k_codes, k_scale=k_scale, k_min=k_min, v_codes=v_codes, v_scale=v_scale, v_min=v_min)
    return {name: t.to("cpu") for name, t in out.items()}


def decode_kv(
    payloads: dict[str, torch.Tensor], bits: int, group_size: int, shape: tuple[int, int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Payloads from encode_kv -> (keys, values), float32 [n_kv, T, hd] each, on the payloads' device.

    Raises KeyError naming a missing payload and ValueError naming one whose shape or dtype is not
    what `shape`, `bits` and `group_size` imply."""
    _check(bits, group_size)
    n_kv, t, hd = shape
    shape = (int(n_kv), int(t), int(hd))
    for name, want in payload_shapes(shape, bits, group_size).items():
        if name not in payloads:
            raise KeyError(f"payload '{name}' missing")
        got = payloads[name]
        dtype = torch.uint8 if name.endswith("codes") else torch.float16
        if tuple(got.shape) != want or got.dtype != dtype:
            raise ValueError(
                f"payload '{name}' is {got.dtype} {list(got.shape)}, expected {dtype} {list(want)}"
                f" for K/V {list(shape)} at {bits} bits, group_size {group_size}"
            )
    p = payloads
    keys = decode_keys(p["k_codes"], p["k_scale"], p["k_min"], bits, group_size, shape)
    values = decode_values(p["v_codes"], p["v_scale"], p["v_min"], bits, group_size, shape)
    return keys, values
