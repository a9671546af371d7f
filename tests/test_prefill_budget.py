"""The engine's prefill budget per device (consumer.engine.prefill_budget): 0 takes the device's
default, an explicit value stays, a chunk never exceeds the iteration's budget, and the config
refuses negative values naming the field; the budget bench's settings parse."""

from __future__ import annotations

import pytest

from bench.peer.prefill_budget import parse_settings
from consumer.engine import prefill_budget
from shared.config import ConsumerConfig


def test_zero_takes_the_devices_default_and_explicit_values_stay():
    assert prefill_budget.resolve(0, 0, "cpu") == prefill_budget.DEFAULTS["cpu"]
    assert prefill_budget.resolve(0, 0, "cuda") == prefill_budget.DEFAULTS["cuda"]
    assert prefill_budget.resolve(0, 0, "mps") == prefill_budget.FALLBACK
    assert prefill_budget.resolve(512, 0, "cpu") == (512, prefill_budget.DEFAULTS["cpu"][1])
    assert prefill_budget.resolve(300, 700, "cuda") == (300, 700)
    # an operator's smaller budget also bounds the default chunk
    assert prefill_budget.resolve(0, 256, "cpu") == (256, 256)


@pytest.mark.parametrize("name", ["prefill_chunk", "max_batch_tokens"])
def test_a_negative_budget_is_refused_naming_the_field(name):
    with pytest.raises(ValueError, match=name):
        ConsumerConfig(**{name: -1}).validate()
    ConsumerConfig(**{name: 0}).validate()  # 0: the device's default


def test_settings_parse():
    assert parse_settings("512:2048,2048") == [(512, 2048), (2048, 2048)]
