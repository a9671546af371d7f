"""The per-layer math in shared.layers reproduces the model's own cache exactly."""

import pytest
import torch

from shared import kv, layers
from shared.models import load_model


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-qwen2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_patch_from_true_normed_input_gives_the_models_kv(arch, dtype):
    loaded = load_model(arch, dtype, "cpu")
    ids = torch.randint(3, 380, (1, 97), generator=torch.Generator().manual_seed(0))
    cache = kv.empty_cache(loaded)
    states = {}
    with kv.layer_capture(loaded, cache, kv.Capture.KV | kv.Capture.NORMED | kv.Capture.HIDDEN,
                          lambda s: states.__setitem__(s.index, s)):
        kv.prefill_context(loaded, ids, cache)
    pos = layers.positions(loaded, ids.shape[1])
    for i, s in states.items():
        keys, values = layers.kv_from_normed(loaded, i, s.normed, pos)
        assert torch.equal(keys, s.keys) and torch.equal(values, s.values), i
    # recomputing a span from the hidden state entering it gives the same K/V too
    for start, end in [(0, 4), (1, 3), (2, 4)]:
        for offset, (k, v) in enumerate(layers.run_layers(loaded, states[start].hidden, start, end)):
            torch.testing.assert_close(k, states[start + offset].keys, rtol=0, atol=0 if dtype == "float32" else 1e-2)
            torch.testing.assert_close(v, states[start + offset].values, rtol=0, atol=0 if dtype == "float32" else 1e-2)
