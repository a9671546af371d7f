"""The analytic FLOP counts behind the benchmarks' cost ratios (bench.harness.flops, bench.serving.quality):
they add up layer by layer, SCD's consumer side and predictors count only where a schedule uses
them, and a recompute span costs its share of the consumer's prefill."""

from __future__ import annotations

import json

import pytest

from bench.harness import flops
from bench.harness.services import ROOT
from bench.serving.quality import compute_costs
from shared.scd.artifact import Artifact

CONFIG = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 512, "num_hidden_layers": 6}


def test_prefill_adds_up_per_layer_and_grows_quadratically_only_in_attention():
    one = flops.prefill(CONFIG, 100, layers=1)
    assert flops.prefill(CONFIG, 100) == pytest.approx(6 * one)
    weights = 2 * 100 * flops.layer_weight_macs(CONFIG)
    assert one - weights == pytest.approx(2 * 100 * 100 * 128)  # QK^T + AV over a causal half
    assert flops.layer_weight_macs(CONFIG) == 128 * 128 + 2 * 128 * 64 + 128 * 128 + 3 * 128 * 512


def test_audit_costs_about_k_over_t_of_the_prefill():
    ratio = flops.audit(CONFIG, 1000, 8) / flops.prefill(CONFIG, 1000)
    assert 8 / 1000 < ratio < 3 * 8 / 1000


def test_scd_rebuild_counts_reuse_and_patch_layers_only():
    t, kv = 50, 64
    assert flops.scd_rebuild(CONFIG, t, ["R8", "P", "Q8", "W"]) == 2 * t * 8 * 2 * kv + 2 * t * 128 * 2 * kv
    assert [flops.uses_predictor(a) for a in ("R2", "P", "Q8", "W")] == [True, True, False, False]


def test_costs_of_each_mode_on_the_shipped_two_layer_artifact():
    art = Artifact.load(ROOT / "artifacts/qa-base-to-tuned.safetensors")
    config = json.loads((ROOT / "checkpoints/qa-tuned/config.json").read_text())
    assert compute_costs("oracle", {}, art, config, 500) == {"predictor_flops_ratio": 0.0, "consumer_flops_ratio": 1.0}
    assert compute_costs("recompute", {"start": "0", "end": "1"}, art, config, 500)["consumer_flops_ratio"] == 0.5
    assert compute_costs("raw", {}, art, config, 500) == {"predictor_flops_ratio": 0.0, "consumer_flops_ratio": 0.0}
    scd = compute_costs("scd", {"schedule": "R2.R64"}, art, config, 500)
    assert art.predictor_layers == [1] and 0.3 < scd["predictor_flops_ratio"] < 1.0 and 0 < scd["consumer_flops_ratio"] < 0.05
    assert compute_costs("scd", {"schedule": "R2.Q8"}, art, config, 500)["predictor_flops_ratio"] == 0.0
