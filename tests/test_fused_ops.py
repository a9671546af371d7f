"""The engine forward's fused elementwise ops (consumer.engine.fused_ops) against shared.model's eager
ones: float32 within float tolerance, bfloat16 within one unit in the last place (the reductions'
order differs) and almost everywhere equal; rows independent of the rows beside them; strided RoPE
input; NaN propagates; bad input refused by name. Run on the build for torch's CPU capability (the
AVX-512 one, or the AVX2 one as on an AVX2-only CPU and under `make test-lowered-isa`); skipped where
neither runs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from consumer.engine import fused_ops
from consumer.engine.kv_pool import KVPool
from consumer.engine.pool_forward import PoolRunner
from shared.model import EAGER
from shared.models import load_model

pytestmark = pytest.mark.numeric

fused = fused_ops.resolve(True, torch.device("cpu"), torch.float32)[0]
needs = pytest.mark.skipif(fused is EAGER, reason=f"fused ops not built here: {fused_ops.which()}")


def _rand(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(dtype)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
        return
    g, w = got.float(), want.float()
    ulp = w.abs().clamp_min(2**-126) * 2**-7  # one bfloat16 unit in the last place
    assert ((g - w).abs() <= ulp).all(), (g - w).abs().max()
    assert (g != w).float().mean().item() < 0.02  # a reduction-order tie, rarely


DTYPES = [torch.float32, torch.bfloat16]


@needs
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [576, 40, 7])  # whole vectors, a tail, less than one vector
def test_norms_equal_the_eager_ones(dtype, d):
    h, delta = _rand(33, d, dtype=dtype, seed=1, scale=3.0), _rand(33, d, dtype=dtype, seed=2)
    w = _rand(d, dtype=dtype, seed=3)
    _close(fused.rms_norm(h, w, 1e-5), EAGER.rms_norm(h, w, 1e-5))
    total, normed = fused.add_rms_norm(h, delta, w, 1e-5)
    want_total, want_normed = EAGER.add_rms_norm(h, delta, w, 1e-5)
    assert torch.equal(total, want_total)  # one add, one rounding: exact
    _close(normed, want_normed)


@needs
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1536, 24])
def test_silu_mul_equals_the_eager_one(dtype, n):
    gate_up = _rand(17, 2 * n, dtype=dtype, seed=4, scale=4.0)
    gate_up[0, :4] = torch.tensor([-120.0, 120.0, 0.0, -0.0])  # exp's clamp and overflow ends
    _close(fused.silu_mul(gate_up), EAGER.silu_mul(gate_up))


@needs
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hd", [64, 34])
def test_rope_equals_the_eager_one_on_a_strided_input(dtype, hd):
    T, heads = 19, 5
    qkv = _rand(T, heads + 2, hd, dtype=dtype, seed=5)
    x = qkv[:, :heads]  # as the fused projection's q | k slice: rows strided, heads contiguous
    pos = torch.arange(100, 100 + T).float()
    freq = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    emb = torch.cat([pos[:, None] * freq] * 2, dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    got = fused.rope(x, cos, sin)
    want = EAGER.rope(x, cos, sin)
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)  # elementwise only: every rounding where eager rounds
    else:
        _close(got, want)  # float32: the compiler may contract a product and a sum into one FMA


@needs
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_does_not_depend_on_the_rows_beside_it(dtype):
    h, delta, w = _rand(64, 576, dtype=dtype, seed=6), _rand(64, 576, dtype=dtype, seed=7), _rand(576, dtype=dtype, seed=8)
    gate_up = _rand(64, 3072, dtype=dtype, seed=9)
    together = (fused.add_rms_norm(h, delta, w, 1e-5)[1], fused.silu_mul(gate_up))
    for r in (0, 31, 63):
        alone = (fused.add_rms_norm(h[r : r + 1], delta[r : r + 1], w, 1e-5)[1], fused.silu_mul(gate_up[r : r + 1]))
        assert all(torch.equal(a[0], t[r]) for a, t in zip(alone, together))


@needs
def test_nan_propagates_and_bad_input_is_refused_by_name():
    h = _rand(3, 64, dtype=torch.bfloat16, seed=10)
    h[1, 5] = float("nan")
    w = torch.ones(64, dtype=torch.bfloat16)
    out = fused.rms_norm(h, w, 1e-5)
    assert out[1].isnan().all() and not out[[0, 2]].isnan().any()
    with pytest.raises(ValueError, match="weight: dtype"):
        fused.module.rms_norm(h, w.float(), 1e-5)
    # through the Ops a float32 norm weight on bfloat16 activations runs the eager op, promotion and all
    finite = h[[0, 2]]
    assert torch.equal(fused.rms_norm(finite, w.float(), 1e-5), EAGER.rms_norm(finite, w.float(), 1e-5))
    with pytest.raises(ValueError, match="fused ops: float32 or bfloat16"):
        fused.silu_mul(h.half())
    with pytest.raises(ValueError, match="silu_mul"):
        fused.silu_mul(h[:, :63])
    with pytest.raises(ValueError, match="rope: contiguous cos, sin"):
        fused.rope(h.view(3, 1, 64), torch.ones(2, 64, dtype=torch.bfloat16), torch.ones(2, 64, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_runner_says_what_its_elementwise_steps_run_and_both_pick_the_same_tokens(dtype):
    loaded = load_model("smollm2-135m", dtype, "cpu")
    from consumer.engine.rows import Row

    ids = list(range(2000, 2300))
    logits = {}
    for on in (True, False):
        pool = KVPool(loaded.info, loaded.device, 400 * loaded.info.kv_bytes(1) + (1 << 20), 16)
        runner = PoolRunner(loaded, pool, fused_ops=on)
        assert runner.fused_runs == (fused_ops.which() if on else "eager: --fused-ops false")
        assert (runner.ops is not EAGER) == runner.fused_runs.startswith("fused")
        seq = pool.allocate(301)
        row = Row(seq, ids, 0, tail_logits=len(ids))
        runner.forward([row])
        logits[on] = row.logits
    top2 = logits[False].topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > (0.5 if dtype == "bfloat16" else 1e-3)
    assert clear.sum() >= 20
    assert torch.equal(logits[True].argmax(-1)[clear], logits[False].argmax(-1)[clear])
    assert (logits[True] - logits[False]).abs().max() < (1.0 if dtype == "bfloat16" else 1e-3)


@pytest.mark.parametrize(("capability", "want"), [
    ("avx2", "fused avx2"),
    ("default", "eager: torch's CPU capability is DEFAULT, the fused ops need AVX512 or AVX2"),
])  # fmt: skip
def test_the_build_follows_torchs_cpu_capability(capability, want):
    """An AVX2-only CPU (as ATEN_CPU_CAPABILITY=avx2 makes of an AVX-512 one) runs the 8-lane build;
    below AVX2 the eager ops, saying why. Where the CPU itself lacks AVX2 torch ignores the request."""
    code = "import torch; from consumer.engine import fused_ops; print(torch.backends.cpu.get_cpu_capability()); print(fused_ops.which())"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    got_capability, which = out.stdout.splitlines()[-2:]
    if got_capability != capability.upper():
        pytest.skip(f"this CPU runs torch at {got_capability}, not {capability}")
    assert which == want
