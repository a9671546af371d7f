"""The bfloat16 prefill-attention kernel (consumer/engine/kernels/prefill_attention.cpp) against float32
SDPA over the same keys: rows from position 0 and after a prefix, 1 to 300 new tokens, GQA 1/3/4,
head sizes 32/64/128, block tables out of order, every slot the row may not read poisoned with NaN;
no worse than bfloat16 SDPA itself. Hostile inputs raise before anything is read. On the real pair
(bf16, a chunked prefill of English text) the engine's logits with the kernel are as close to the
float32 forward as with SDPA. Where the CPU cannot run it (no AVX-512 BF16, or a lowered
ATEN_CPU_CAPABILITY) the engine keeps SDPA and says why.

Tests that need the kernel skip where this CPU cannot run it; on one that can, with a C++ compiler,
a kernel that does not build fails them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from consumer.engine import paged_attention, prefill_attention
from consumer.engine.kv_pool import KVPool
from consumer.engine.pool_forward import PoolRunner
from consumer.engine.rows import Row
from shared.models import load_model

BT = 16


VARIANTS = ("avx512bf16", "amx")


@pytest.fixture(scope="module", params=VARIANTS)
def prefill(request):
    """Each variant of the kernel this CPU runs (the AMX one where it has AMX-BF16), called as
    prefill_attention.prefill_attention calls the chosen one."""
    reason = prefill_attention.cpu_reason()
    if reason:
        pytest.skip(f"the prefill kernel does not run here: {reason}")
    if paged_attention.compiler() is None:
        pytest.skip("no C++ compiler ($CXX or c++ on PATH): the engine runs per-row SDPA")
    assert prefill_attention.kernel() is not None, f"the CPU runs it and a compiler is here, yet: {prefill_attention.which()}"
    variants = prefill_attention.variants()
    if request.param not in variants:
        pytest.skip(f"the {request.param} variant does not run here: {prefill_attention.amx_off()}")
    fn = variants[request.param]
    return lambda q, k, v, table, start, bt: fn(q.contiguous(), k, v, table, start, bt, q.shape[-1] ** -0.5)


def random_case(n: int, start: int, groups: int, hd: int, seed: int, bt: int = BT):
    """One layer of a pool (k, v [n_kv, slots, hd] bf16) and one row of n new tokens after `start`:
    its blocks a random non-ascending draw (block 0 never among them), every slot it may not read
    (block 0, spare blocks, its last block past start + n) NaN."""
    g = torch.Generator().manual_seed(seed)
    n_kv, L = 2, start + n
    used = -(-L // bt)
    table = 1 + torch.randperm(used + 3, generator=g)[:used]
    slots = (used + 4) * bt
    k = torch.full((n_kv, slots, hd), float("nan"))
    v = torch.full((n_kv, slots, hd), float("nan"))
    flat = (table[:, None] * bt + torch.arange(bt)).reshape(-1)[:L]
    k[:, flat] = 2 * torch.randn(n_kv, L, hd, generator=g)  # scores of a few units: a peaked softmax
    v[:, flat] = torch.randn(n_kv, L, hd, generator=g)
    q = (2 * torch.randn(n, n_kv * groups, hd, generator=g)).bfloat16()
    return q, k.bfloat16(), v.bfloat16(), table, flat


def sdpa(q, k, v, flat, start, dtype) -> torch.Tensor:
    """SDPA in `dtype` over the row's keys gathered, causal from `start` -> [n, H, hd] float32."""
    n, H, hd = q.shape
    n_kv, L = k.shape[0], start + n
    keys = k[:, flat].to(dtype).repeat_interleave(H // n_kv, 0)[None]
    values = v[:, flat].to(dtype).repeat_interleave(H // n_kv, 0)[None]
    mask = torch.arange(L)[None] <= start + torch.arange(n)[:, None]
    out = F.scaled_dot_product_attention(q.to(dtype).transpose(0, 1)[None], keys, values, attn_mask=mask)
    return out[0].transpose(0, 1).float()


CASES = [  # (n, start, groups, hd)
    (1, 0, 1, 64),
    (2, 0, 3, 64),
    (33, 0, 3, 64),
    (37, 100, 3, 64),
    (300, 0, 3, 64),
    (64, 448, 4, 32),
    (17, 15, 1, 128),
    (130, 70, 4, 128),
    (5, 3, 3, 32),
]


@pytest.mark.numeric
@pytest.mark.parametrize("n,start,groups,hd", CASES)
def test_the_kernel_equals_float32_sdpa_as_closely_as_bf16_sdpa(prefill, n, start, groups, hd):
    """Within bfloat16 rounding of float32 SDPA over the same (rounded) inputs: at most half an ulp
    of the output's scale beyond twice bf16 SDPA's own error (the probabilities rounded to bf16 for
    the weighted sum, as SDPA's flash kernel does)."""
    q, k, v, table, flat = random_case(n, start, groups, hd, seed=n * 1000 + start + hd)
    got = prefill(q, k, v, table, start, BT)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    assert torch.isfinite(got).all(), "a NaN slot was read: past the row's keys or outside its table"
    ref = sdpa(q, k, v, flat, start, torch.float32)
    own = (sdpa(q, k, v, flat, start, torch.bfloat16) - ref).abs().max().item()
    err = (got.float() - ref).abs().max().item()
    assert err <= 2 * own + 2**-9 * ref.abs().max().item(), (err, own)


@pytest.mark.numeric
@pytest.mark.parametrize("bt", [1, 7, 32, 48])
def test_any_block_size_reads_the_same_keys(prefill, bt):
    """Blocks of 1, 7, 32, 48 tokens (tiles of 32 keys straddle them): the same answer as SDPA."""
    q, k, v, table, flat = random_case(45, 61, 3, 64, seed=bt, bt=bt)
    got = prefill(q, k, v, table, 61, bt)
    assert torch.isfinite(got).all()
    ref = sdpa(q, k, v, flat, 61, torch.float32)
    own = (sdpa(q, k, v, flat, 61, torch.bfloat16) - ref).abs().max().item()
    assert (got.float() - ref).abs().max().item() <= 2 * own + 2**-9 * ref.abs().max().item()


def test_table_entries_past_the_rows_keys_are_never_read(prefill):
    q, k, v, table, _ = random_case(40, 20, 3, 64, seed=3)
    padded = torch.cat([table, torch.tensor([10**12, -1])])
    assert torch.equal(prefill(q, k, v, padded, 20, BT), prefill(q, k, v, table, 20, BT))


def hostile_cases():
    """(name, change to the good inputs, error type, words of the message)."""
    huge = 2**62
    return [
        ("block past the pool", lambda a: a["table"].__setitem__(0, a["k"].shape[1] // BT), ValueError, "outside the pool"),
        ("block far past the pool", lambda a: a["table"].__setitem__(1, huge), ValueError, "outside the pool"),
        ("negative block", lambda a: a["table"].__setitem__(2, -1), ValueError, "outside the pool"),
        ("table too short", lambda a: a.update(table=a["table"][:-1].contiguous()), ValueError, "blocks"),
        ("start past the table", lambda a: a.update(start=1000), ValueError, "blocks"),
        ("start near overflow", lambda a: a.update(start=2**63 - 10), ValueError, "start"),
        ("negative start", lambda a: a.update(start=-1), ValueError, "start -1"),
        ("float32 q, k, v", lambda a: a.update(q=a["q"].float(), k=a["k"].float(), v=a["v"].float()), TypeError, "bfloat16"),
        ("float16 q", lambda a: a.update(q=a["q"].half()), TypeError, "bfloat16"),
        (
            "head_dim 48",
            lambda a: a.update(q=a["q"][..., :48].contiguous(), k=a["k"][..., :48].contiguous(), v=a["v"][..., :48].contiguous()),
            ValueError,
            "head_dim 48",
        ),
        ("head_dim differs", lambda a: a.update(q=a["q"][..., :32].contiguous()), ValueError, "head_dim"),
        ("heads not a multiple", lambda a: a.update(q=a["q"][:, :5].contiguous()), ValueError, "multiple"),
        ("no query", lambda a: a.update(q=a["q"][:0]), ValueError, "no query"),
        ("k and v differ", lambda a: a.update(v=a["v"][:, :-BT].contiguous()), ValueError, "differ"),
        ("non-contiguous k", lambda a: a.update(k=a["k"].transpose(0, 1).contiguous().transpose(0, 1)), ValueError, "contiguous"),
        ("table int32", lambda a: a.update(table=a["table"].int()), TypeError, "int64"),
        ("table 2-D", lambda a: a.update(table=a["table"][None]), ValueError, "table"),
        ("block_tokens 0", lambda a: a.update(block_tokens=0), ValueError, "block_tokens"),
        ("block_tokens past the pool", lambda a: a.update(block_tokens=2**40), ValueError, "block_tokens"),
    ]


@pytest.mark.parametrize("name,change,error,words", hostile_cases(), ids=[c[0] for c in hostile_cases()])
def test_hostile_inputs_raise_a_clear_error(prefill, name, change, error, words):
    q, k, v, table, _ = random_case(40, 20, 3, 64, seed=9)
    args = {"q": q, "k": k, "v": v, "table": table, "start": 20, "block_tokens": BT}
    change(args)
    with pytest.raises(error) as raised:
        prefill(args["q"], args["k"], args["v"], args["table"], args["start"], args["block_tokens"])
    assert words in str(raised.value) and "prefill_attention" in str(raised.value), str(raised.value)


def english_ids(loaded, n: int) -> list[int]:
    text = " ".join(p.read_text() for p in sorted(Path(__file__).resolve().parents[1].glob("docs/*.md")))
    ids = loaded.tokenizer(text)["input_ids"][:n]
    assert len(ids) == n
    return ids


def chunked_logits(loaded, ids: list[int], chunk: int, mode: str) -> torch.Tensor:
    """Every position's logits of a prefill of `ids` in chunks through PoolRunner, float32."""
    pool = KVPool(loaded.info, loaded.device, (len(ids) + 64) * loaded.info.kv_bytes(1) + (1 << 20), BT)
    runner = PoolRunner(loaded, pool, prefill_attention=mode)
    seq = pool.allocate(len(ids))
    out = []
    with torch.inference_mode():
        for at in range(0, len(ids), chunk):
            row = Row(seq, ids[at : at + chunk], at)
            row.tail_logits = len(row.ids)
            runner.forward([row])
            out.append(row.logits.float())
    return torch.cat(out)


@pytest.mark.numeric
def test_the_real_pairs_prefill_with_the_kernel_is_as_close_to_float32_as_with_sdpa(prefill):
    """SmolLM2-135M in bfloat16, 1100 tokens of English in chunks of 300 (a chunk from 0, chunks
    after a prefix, a short last one): against the same weights in float32, the kernel's logits
    are as close as bf16 SDPA's (mean |error| within 5 %, argmax agreement within 1 point)."""
    bf16 = load_model("smollm2-135m", "bfloat16", "cpu")
    fp32 = load_model("smollm2-135m", "float32", "cpu")
    ids = english_ids(bf16, 1100)
    ref = chunked_logits(fp32, ids, 300, "sdpa")
    got = {mode: chunked_logits(bf16, ids, 300, mode) for mode in ("kernel", "sdpa")}
    err = {mode: (x - ref).abs().mean().item() for mode, x in got.items()}
    agree = {mode: (x.argmax(-1) == ref.argmax(-1)).float().mean().item() for mode, x in got.items()}
    assert err["kernel"] <= 1.05 * err["sdpa"], err
    assert agree["kernel"] >= agree["sdpa"] - 0.01, agree
    assert agree["kernel"] > 0.9, agree


def test_the_runner_says_what_its_prefill_rows_run(prefill):
    """auto: the kernel on a bfloat16 pool (SDPA where the CPU has AMX-BF16, saying so); SDPA on
    float32 saying why; "kernel" where it cannot serve the pool fails at construction; "sdpa" asked for."""
    amx = prefill_attention.amx_reason()
    chosen = "kernel amx" if not prefill_attention.amx_off() else "kernel avx512bf16"
    assert prefill_attention.which() == chosen
    for dtype, mode, runs in (
        ("bfloat16", "auto", f"sdpa: {amx}" if amx else chosen),
        ("bfloat16", "kernel", chosen),
        ("float32", "auto", "sdpa: the kernel is bfloat16-only, the pool is float32"),
        ("bfloat16", "sdpa", "sdpa: prefill_attention='sdpa'"),
    ):
        loaded = load_model("checkpoints/qa-tuned", dtype, "cpu")
        pool = KVPool(loaded.info, loaded.device, 64 * loaded.info.kv_bytes(1) + (1 << 20), BT)
        runner = PoolRunner(loaded, pool, prefill_attention=mode)
        assert runner.prefill_runs == runs and (runner.prefill_kernel is not None) == runs.startswith("kernel")
    loaded = load_model("checkpoints/qa-tuned", "float32", "cpu")
    pool = KVPool(loaded.info, loaded.device, 64 * loaded.info.kv_bytes(1) + (1 << 20), BT)
    with pytest.raises(ValueError, match="prefill_attention='kernel': the kernel is bfloat16-only"):
        PoolRunner(loaded, pool, prefill_attention="kernel")
    with pytest.raises(ValueError, match="prefill_attention: 'flash' is not one of"):
        PoolRunner(loaded, pool, prefill_attention="flash")


def test_without_amx_the_kernel_runs_its_avx512_bf16_path_and_auto_says_why():
    """SCD_PREFILL_AMX=0, or ONEDNN_MAX_CPU_ISA below AMX (as an operator lowers oneDNN): the kernel
    runs its VDPBF16PS path. With AMX turned off for the kernel alone, on a CPU with AMX-BF16, auto
    keeps SDPA (on AMX tiles, faster than that path), saying why; with oneDNN lowered, SDPA is off
    AMX too and auto takes the kernel."""
    if prefill_attention.cpu_reason():
        pytest.skip(f"the prefill kernel does not run here: {prefill_attention.cpu_reason()}")
    code = (
        "import torch; from consumer.engine import prefill_attention as p; print(p.which()); "
        "print(p.resolve('auto', torch.device('cpu'), torch.bfloat16, 64)[1])"
    )
    amx_cpu = "amx_bf16" in (prefill_attention.compute_dtype.cpu_flags() or ())
    for env in ({"SCD_PREFILL_AMX": "0"}, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}):
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        which, auto = out.stdout.splitlines()[-2:]
        assert which == "kernel avx512bf16", (env, which)
        if amx_cpu and "SCD_PREFILL_AMX" in env:
            assert auto.startswith("sdpa: auto: the CPU has AMX-BF16"), (env, auto)
        else:
            assert auto == "kernel avx512bf16", (env, auto)


def test_a_lowered_cpu_capability_keeps_sdpa_and_says_why():
    """Under ATEN_CPU_CAPABILITY=avx2 (an AVX2-only CPU, as make test-lowered-isa runs) nothing is
    built or loaded and `which()` says why."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    code = "from consumer.engine import prefill_attention as p; print(p.which()); print(p.kernel())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["sdpa: torch's CPU capability is AVX2, the kernel needs AVX512", "None"]


def test_the_benchmark_writes_a_row_per_chunk_and_a_total(prefill, tmp_path):
    """`python -m bench.micro.prefill_attention` on a small prefill: one row per chunk and a total."""
    import json

    from bench.micro import prefill_attention as bench

    out = tmp_path / "rows.jsonl"
    assert bench.main(["--tokens", "96", "--chunk", "32", "--reps", "1", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["chunk"] * 3 + ["total"]
    assert [r["start"] for r in rows[:3]] == [0, 32, 64]
    assert all(r["sdpa_ms"] > 0 and r["kernel_ms"] > 0 for r in rows)
    assert rows[-1]["layers"] == 30 and rows[-1]["head_dim"] == 64
