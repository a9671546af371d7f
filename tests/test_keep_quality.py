"""real.quality's token-selection dimension: a mode's `@POLICY:BUDGET` suffix parsed, and its
bytes per context token scaled by the kept share plus the keep sets' own bytes (on the real
pair's artifact; the answers themselves are the kept cache's, tests/test_keep_cache.py)."""

from __future__ import annotations

import pytest

from real import quality
from shared.models import load_model
from shared.scd.artifact import Artifact

ARTIFACT = "artifacts/qa-base-to-tuned.safetensors"  # committed: a fresh clone has it (the real pair's is built)


def test_a_mode_suffix_is_a_selection():
    label, codec, options, sel = quality.parse_mode("scd:s11@h2o:0.5")  # one keep set per layer, as the services send scd
    assert (label, codec, options) == ("scd:s11@h2o:0.5:heads=shared", "scd", {"schedule": "s11"})
    assert sel is not None and sel.shared and sel.label == "h2o:0.5:heads=shared" and sel.policy.name == "h2o"
    with pytest.raises(SystemExit, match="heads=shared only"):
        quality.parse_mode("scd:s11@h2o:0.5:heads=each")
    label, _, _, sel = quality.parse_mode("naive@h2o:0.5")  # raw: each KV head its own, as the services' default
    assert label == "naive@h2o:0.5" and sel is not None and not sel.shared
    assert quality.parse_mode("oracle@snapkv:0.25")[:2] == ("oracle@snapkv:0.25", "")
    assert quality.parse_mode("naive")[3] is None
    with pytest.raises(SystemExit, match="keep policy"):
        quality.parse_mode("oracle@lru:0.5")
    with pytest.raises(SystemExit, match="budget"):
        quality.parse_mode("oracle@knorm:2.5")


def test_keep_set_bytes_are_a_bitmap_or_positions_whichever_is_smaller():
    sel = quality.parse_mode("naive@knorm:0.25")[3]
    assert quality.index_bytes_per_token(sel, 0.25, 30, 3) == 30 * 3 / 8  # bitmap: 1 bit per context token
    assert quality.index_bytes_per_token(sel, 0.01, 30, 3) == pytest.approx(30 * 3 * 2 * 0.01)  # 2-byte positions
    shared = quality.parse_mode("naive@knorm:0.25:heads=shared")[3]
    assert quality.index_bytes_per_token(shared, 0.25, 30, 3) == 30 / 8


def test_bytes_per_token_scale_with_the_kept_share():
    art = Artifact.load(ARTIFACT)
    producer = load_model(art.meta["producer"]["model_id"], "float32", "cpu")
    modes = quality.Modes(art, producer, producer, ["oracle", "naive", "naive@knorm:0.25", "oracle@knorm:0.25"])
    rows = [
        {
            "kind": "task",
            "family": "qa",
            "seed": s,
            "context_tokens": 1000,
            "kept_tokens": kept,
            "mode": mode,
            "em": 1.0,
            "f1": 1.0,
            "recall": 1.0,
            "identical_to_oracle": True,
        }
        for s in (1, 2)
        for mode, kept in (("oracle", 1000), ("naive", 1000), ("naive@knorm:0.25", 250), ("oracle@knorm:0.25", 250))
    ]
    out = {s["mode"]: s for s in quality.summaries(rows, modes)}
    raw = out["naive"]["bytes_per_token"]
    layers, kv_heads = art.num_layers, producer.info.num_kv_heads
    assert raw == layers * 2 * kv_heads * producer.info.head_dim * 2  # bf16 K/V (the artifact's dtype)
    assert out["naive@knorm:0.25"]["bytes_per_token"] == round(raw * 0.25 + layers * kv_heads / 8, 2)
    assert out["naive@knorm:0.25"]["keep"] == {"selection": "knorm:0.25", "kept_share": 0.25, "scored_by": "P"}
    assert out["oracle@knorm:0.25"]["bytes_per_token"] is None  # the oracle's cache is its own: nothing sent
    assert out["oracle@knorm:0.25"]["keep"]["scored_by"] == "C"
    assert out["oracle"]["keep"] is None
