"""bench.micro.engine_step --compare and bench.micro.pool_attention on a tiny model: the rows have
their fields, the three steps start from one state (the pool step's logits equal the runner's),
and every attention variant computes the gather's answer."""

from __future__ import annotations

import torch

from bench.micro import engine_step, pool_attention
from shared.models import load_model


def test_compare_times_three_steps_from_one_state():
    loaded = load_model("tiny-llama", "float32", "cpu")
    row = engine_step.compare(loaded, batch=3, ctx=40, steps=2)
    assert {"pool_step_ms", "runner_step_ms", "bare_step_ms", "pool_vs_runner", "pool_vs_bare"} <= set(row)
    assert row["gathered_rows"] == 0  # fresh pool: every row is one run of blocks, read in place
    assert row["logits_max_diff"] <= 1e-4 < row["logits_max_abs"]


def test_every_attention_variant_gives_the_gathers_answer():
    row = pool_attention.measure(9, 3, 64, 2, 40, torch.float32, steps=1, flex=False)
    assert row["max_err"] <= 1e-5
    assert {"gather_sdpa_ms", "row_token_major_ms", "row_head_major_ms", "row_gqa_ms"} <= set(row)


def test_compare_prefill_times_ours_and_the_runners_forward():
    loaded = load_model("tiny-llama", "float32", "cpu")
    row = engine_step.compare_prefill(loaded, [(20, 12), (0, 1)], reps=1)
    assert row["pool_prefill_ms"] > 0 and row["runner_prefill_ms"] > 0
