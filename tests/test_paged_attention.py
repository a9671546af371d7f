"""The paged decode-attention kernel (consumer/engine/kernels/decode_attention.cpp) against float32
SDPA over the same keys: random pools, block tables fragmented and out of order and padded with the
null block, ragged lengths, GQA, three dtypes; hostile tables and lengths raise before anything is
read; the engine's greedy tokens with the kernel equal per-row SDPA's on the QA pair.

Tests that need the kernel skip only where no C++ compiler is found; with one, a kernel that does
not build fails them. Under `make test-lowered-isa` (ATEN_CPU_CAPABILITY=avx2) the AVX2 build runs.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from consumer.engine import paged_attention
from consumer.engine.batch import BatchEngine
from consumer.engine.pool_forward import PoolRunner
from shared.models import load_model
from tests.test_batch_engine import ids, pool_for, run_tasks

BT = 16  # tokens per block
# the kernel against float32 SDPA on the same (rounded) inputs: scores, softmax and sums in float32
# in another order (float32: ~1e-6 seen), then one rounding to the output dtype (half an ulp:
# 2**-9 relative for bfloat16, 2**-11 for float16); the bounds give 2-4x slack
TOLERANCE = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 1e-5, "rtol": 2**-8},
    torch.float16: {"atol": 1e-5, "rtol": 2**-10},
}


class Variant:
    """One entry of the kernel: `plain` (every build), `amx` (bfloat16 rows on AMX-BF16 tiles, where
    the CPU has them), called as paged_attention.decode_attention calls the chosen one."""

    def __init__(self, name: str, fn):
        self.name, self.fn = name, fn

    def __call__(self, q, k, v, tables, lengths, block_tokens):
        return self.fn(q.contiguous(), k, v, tables, lengths, block_tokens, q.shape[-1] ** -0.5)

    def tolerance(self, dtype: torch.dtype, v: torch.Tensor) -> dict:
        """TOLERANCE; the AMX items round the probabilities to bfloat16 for P by V (as SDPA's bfloat16
        flash kernel does): up to 2**-9 of each weight, so of the output's scale, beside the output's rounding."""
        if self.name == "amx" and dtype == torch.bfloat16:
            return {"atol": 2**-8 * float(v.float().nan_to_num(0).abs().max()), "rtol": 2**-8}
        return TOLERANCE[dtype]


@pytest.fixture(scope="module", params=["plain", "amx"])
def decode(request):
    """The built kernel's entries: skipped without a C++ compiler; with one, a failed build fails the test."""
    if paged_attention.compiler() is None:
        pytest.skip("no C++ compiler ($CXX or c++ on PATH): the engine runs per-row SDPA, the kernel cannot be built")
    fn = paged_attention.kernel()
    assert fn is not None, f"a C++ compiler is here but the kernel did not build: {paged_attention.which()}"
    variants = paged_attention.variants()
    if request.param not in variants:
        pytest.skip(f"the {request.param} entry does not run here: {paged_attention.amx_off()}")
    return Variant(request.param, variants[request.param])


def random_case(batch: int, groups: int, hd: int, dtype: torch.dtype, seed: int):
    """A pool of one layer (k, v [n_kv, slots, hd]) and `batch` decode rows over it: lengths ragged
    (1, exact block multiples, one past them, the longest), each row's blocks a random,
    non-ascending draw from the pool, tables padded with the null block 0. Every slot no row may
    read (block 0, the tail of a row's last block) holds NaN: a read past a length shows."""
    g = torch.Generator().manual_seed(seed)
    n_kv, max_blocks = 2, 6
    lengths = [[1, BT, 2 * BT, BT + 1, max_blocks * BT, 3 * BT - 1][i % 6] for i in range(batch)]
    if batch > 1:
        lengths[-1] = int(torch.randint(1, max_blocks * BT + 1, (1,), generator=g))
    used = [-(-n // BT) for n in lengths]
    blocks = 1 + torch.randperm(sum(used) + 3, generator=g)  # 0 is the null block; a few spare blocks
    slots = (sum(used) + 4) * BT
    k = torch.randn(n_kv, slots, hd, generator=g).to(dtype)
    v = torch.randn(n_kv, slots, hd, generator=g).to(dtype)
    k[:, :BT] = v[:, :BT] = float("nan")
    tables = torch.zeros(batch, max_blocks, dtype=torch.long)
    at = 0
    for b, (n, u) in enumerate(zip(lengths, used)):
        tables[b, :u] = blocks[at : at + u]
        at += u
        tail = tables[b, u - 1] * BT + (n - (u - 1) * BT)  # the first slot past the row's last key
        k[:, tail : (tables[b, u - 1] + 1) * BT] = float("nan")
        v[:, tail : (tables[b, u - 1] + 1) * BT] = float("nan")
    q = torch.randn(batch, n_kv * groups, hd, generator=g).to(dtype)
    return q, k, v, tables, torch.tensor(lengths, dtype=torch.long)


def sdpa_reference(q, k, v, tables, lengths) -> torch.Tensor:
    """Per row: its keys gathered through its table, float32 SDPA with the GQA groups folded into
    the query dimension -> [B, H, hd] float32."""
    n_kv, hd = k.shape[0], k.shape[-1]
    out = []
    for b in range(q.shape[0]):
        n = int(lengths[b])
        flat = (tables[b, : -(-n // BT)][:, None] * BT + torch.arange(BT)).reshape(-1)[:n]  # [n] slots
        keys, values = k[:, flat].float()[None], v[:, flat].float()[None]  # [1, n_kv, n, hd]
        folded = q[b].float().view(1, n_kv, -1, hd)  # [1, n_kv, g, hd]
        out.append(F.scaled_dot_product_attention(folded, keys, values).reshape(-1, hd))
    return torch.stack(out)


@pytest.mark.numeric
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("hd", [32, 64, 128])
@pytest.mark.parametrize("groups", [1, 3, 4, 8])  # 8: past the vectorized paths (the portable loop)
@pytest.mark.parametrize("batch", [1, 33])
def test_the_kernel_equals_float32_sdpa_over_the_same_keys(decode, batch, groups, hd, dtype):
    q, k, v, tables, lengths = random_case(batch, groups, hd, dtype, seed=batch * 100 + groups * 10 + hd)
    got = decode(q, k, v, tables, lengths, BT)
    assert got.dtype == dtype and got.shape == q.shape
    assert torch.isfinite(got).all(), "a NaN slot was read: past a row's length or through the null block"
    torch.testing.assert_close(got.float(), sdpa_reference(q, k, v, tables, lengths), **decode.tolerance(dtype, v))


@pytest.mark.numeric
def test_the_build_matches_the_cpus_instruction_set(decode):
    """The variant loaded is the one torch's capability names (avx2 under make test-lowered-isa)."""
    capability = torch.backends.cpu.get_cpu_capability()
    want = {"AVX512": "avx512", "AVX2": "avx2"}.get(capability, "base")
    amx = "" if paged_attention.amx_off() else " amx"  # the AVX-512 build's AMX items, where the CPU has AMX-BF16
    assert paged_attention.which() == f"kernel {want}{amx}"


def test_table_entries_past_a_rows_length_are_never_read(decode):
    """Padding past the blocks a row uses may hold anything (here: blocks far outside the pool)."""
    q, k, v, tables, lengths = random_case(4, 2, 64, torch.float32, seed=5)
    used = (lengths + BT - 1) // BT
    padded = tables.clone()
    for b in range(4):
        padded[b, used[b] :] = 10**12
    torch.testing.assert_close(decode(q, k, v, padded, lengths, BT), decode(q, k, v, tables, lengths, BT), atol=0, rtol=0)


def test_a_builder_killed_mid_build_blocks_no_later_load(decode, tmp_path):
    """cpp_extension's own lock file, left behind by a builder killed mid-build, made every later
    load wait forever; two processes loading at once over it both get the kernel (they take turns
    on build.flock, which the OS releases with its holder)."""
    name = paged_attention._flags()[0]
    shutil.copytree(paged_attention.build_dir(name), tmp_path / name)  # the build, up to date
    (tmp_path / name / "lock").touch()  # what a killed builder leaves
    env = {**os.environ, "SCD_KERNEL_DIR": str(tmp_path)}
    loads = [
        subprocess.Popen([sys.executable, "-m", "consumer.engine.paged_attention"], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120)[0] for p in loads]
    assert [p.returncode for p in loads] == [0, 0]
    assert all(f"decode attention: {paged_attention.which()}" in out for out in outs), outs


def hostile_cases():
    """(name, change to the good inputs, error type, words of the message)."""
    huge = 2**62
    return [
        ("block past the pool", lambda a: a["tables"].__setitem__((1, 0), a["k"].shape[1] // BT), ValueError, "outside the pool"),
        ("block far past the pool", lambda a: a["tables"].__setitem__((2, 1), huge), ValueError, "outside the pool"),
        ("negative block", lambda a: a["tables"].__setitem__((0, 0), -1), ValueError, "outside the pool"),
        ("length past the table", lambda a: a["lengths"].__setitem__(3, 6 * BT + 1), ValueError, "length"),
        ("huge length", lambda a: a["lengths"].__setitem__(3, huge), ValueError, "length"),
        ("length 0", lambda a: a["lengths"].__setitem__(0, 0), ValueError, "length 0"),
        ("negative length", lambda a: a["lengths"].__setitem__(0, -5), ValueError, "length -5"),
        ("tables int32", lambda a: a.update(tables=a["tables"].int()), TypeError, "int64"),
        ("lengths float", lambda a: a.update(lengths=a["lengths"].float()), TypeError, "int64"),
        ("q float16 over float32 keys", lambda a: a.update(q=a["q"].half()), TypeError, "one dtype"),
        ("integer q, k, v", lambda a: a.update(q=a["q"].long(), k=a["k"].long(), v=a["v"].long()), TypeError, "one dtype"),
        ("q without a head axis", lambda a: a.update(q=a["q"][:, 0]), ValueError, "[B, H, hd]"),
        ("head_dim differs", lambda a: a.update(q=a["q"][..., :32].contiguous()), ValueError, "head_dim"),
        ("heads not a multiple", lambda a: a.update(q=a["q"][:, :3].contiguous()), ValueError, "multiple"),
        ("k and v differ", lambda a: a.update(v=a["v"][:, :-BT].contiguous()), ValueError, "differ"),
        ("fewer table rows", lambda a: a.update(tables=a["tables"][:3]), ValueError, "tables"),
        ("fewer lengths", lambda a: a.update(lengths=a["lengths"][:3]), ValueError, "lengths"),
        ("strided lengths", lambda a: a.update(lengths=a["lengths"].repeat_interleave(2)[::2]), ValueError, "contiguous"),
        ("non-contiguous k", lambda a: a.update(k=a["k"].transpose(0, 1).contiguous().transpose(0, 1)), ValueError, "contiguous"),
        ("block_tokens 0", lambda a: a.update(block_tokens=0), ValueError, "block_tokens"),
    ]


@pytest.mark.parametrize("name,change,error,words", hostile_cases(), ids=[c[0] for c in hostile_cases()])
def test_hostile_inputs_raise_a_clear_error(decode, name, change, error, words):
    q, k, v, tables, lengths = random_case(4, 2, 64, torch.float32, seed=9)
    args = {"q": q, "k": k, "v": v, "tables": tables, "lengths": lengths, "block_tokens": BT}
    change(args)
    fn = paged_attention.kernel()
    with pytest.raises(error, match=None) as raised:
        fn(args["q"], args["k"], args["v"], args["tables"], args["lengths"], args["block_tokens"], 0.125)
    assert words in str(raised.value) and "decode_attention" in str(raised.value), str(raised.value)


@pytest.mark.numeric
@pytest.mark.parametrize("name", ["checkpoints/qa-base", "checkpoints/qa-tuned"])
def test_the_engine_answers_with_the_kernel_as_with_sdpa(decode, name):
    """The engine's greedy tokens, chunked prefill and batched decode, with decode rows through the
    kernel and through per-row SDPA: the same tokens (float32, the QA pair)."""
    model = load_model(name, "float32", "cpu")
    vocab = model.info.vocab_size
    specs = [(ids(n, seed, vocab), new) for seed, (n, new) in enumerate([(70, 12), (9, 20), (130, 6), (33, 16), (64, 10)])]
    answers = {}
    for mode in ("kernel", "sdpa"):
        pool = pool_for(model)
        engine = BatchEngine(
            model,
            pool,
            max_batch=8,
            prefill_chunk=32,
            max_batch_tokens=64,
            runner=functools.partial(PoolRunner, decode_attention=mode),
        )
        try:
            assert (engine.runner.decode_kernel is not None) == (mode == "kernel")
            assert paged_attention.runs(engine.runner) == (
                paged_attention.which() if mode == "kernel" else "sdpa: decode_attention='sdpa'"
            )
            answers[mode] = run_tasks(engine, specs, pool)
        finally:
            engine.shutdown()
    assert answers["kernel"] == answers["sdpa"]
    assert [len(a) for a in answers["kernel"]] == [new for _, new in specs]  # type: ignore[arg-type]


def test_auto_keeps_per_row_sdpa_where_it_measured_faster():
    """auto: float32 pools with head_dim < 64 keep per-row SDPA where the kernel runs its portable
    loop (the QA pair's rows: it was 0.97-1.13x the per-row step there), saying so and that the
    kernel is built; the AVX-512 and AVX2 builds' vectorized paths take them; bfloat16 on the same model and
    an explicit "kernel" take the kernel."""
    from consumer.engine.kv_pool import KVPool
    from consumer.engine.pool_forward import PoolRunner
    from shared.models import load_model

    if paged_attention.kernel() is None:
        pytest.skip(f"no kernel here: {paged_attention.which()}")
    vector = paged_attention.which().startswith(("kernel avx512", "kernel avx2"))  # head_dim 32, one query head per KV head: vectorized
    for dtype, mode, takes in (("float32", "auto", vector), ("bfloat16", "auto", True), ("float32", "kernel", True)):
        loaded = load_model("checkpoints/qa-tuned", dtype, "cpu")
        assert loaded.info.head_dim == 32
        pool = KVPool(loaded.info, loaded.device, 64 * loaded.info.kv_bytes(1) + (1 << 20), 16)
        runner = PoolRunner(loaded, pool, decode_attention=mode)
        assert (runner.decode_kernel is not None) == takes, (dtype, mode)
        status = paged_attention.runs(runner)
        if takes:
            assert status == paged_attention.which()
        else:
            assert status.startswith("sdpa: auto: float32 with head_dim 32 < 64") and status.endswith(" built"), status


@pytest.mark.numeric
@pytest.mark.parametrize("bt", [1, 5, 48])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_any_block_size_reads_the_same_keys(decode, bt, dtype):
    """Blocks of 1, 5 and 48 tokens (the vectorized paths' 16- and 8-key tiles straddle them), rows' blocks
    out of order: the same answer as float32 SDPA over the keys gathered."""
    g = torch.Generator().manual_seed(bt)
    n_kv, hd, groups, lengths = 2, 64, 3, [1, 17, 70, 33]
    used = [-(-n // bt) for n in lengths]
    blocks = 1 + torch.randperm(sum(used) + 2, generator=g)
    k = torch.randn(n_kv, (sum(used) + 3) * bt, hd, generator=g).to(dtype)
    v = torch.randn(n_kv, (sum(used) + 3) * bt, hd, generator=g).to(dtype)
    tables = torch.zeros(len(lengths), max(used), dtype=torch.long)
    at = 0
    for b, u in enumerate(used):
        tables[b, :u] = blocks[at : at + u]
        at += u
    q = torch.randn(len(lengths), n_kv * groups, hd, generator=g).to(dtype)
    got = decode(q, k, v, tables, torch.tensor(lengths), bt)
    want = []
    for b, n in enumerate(lengths):
        flat = (tables[b, : used[b]][:, None] * bt + torch.arange(bt)).reshape(-1)[:n]
        folded = q[b].float().view(1, n_kv, groups, hd)
        want.append(F.scaled_dot_product_attention(folded, k[:, flat].float()[None], v[:, flat].float()[None]).reshape(-1, hd))
    torch.testing.assert_close(got.float(), torch.stack(want), **decode.tolerance(dtype, v))
