"""The rule the GPU tests compare greedy sequences under (tests/greedy.py), checked here on CPU:
its edge cases, and the GPU tests' own comparison run with the services on CPU, where it must
hold exactly (same kernels as the reference)."""

from __future__ import annotations

import pytest

from tests.greedy import NEAR_TIE, NEAR_TIE_BF16, agree_until_a_near_tie_divergence, agree_up_to_near_tie, near_tie_for


def test_identical_sequences_agree_over_their_whole_length():
    assert agree_up_to_near_tie([1, 2, 3], [1, 2, 3], [1.0, 1.0, 1.0]) == (True, 3)
    assert agree_up_to_near_tie([1, 2], [1, 2, 3], [1.0, 1.0, 1.0]) == (False, 3)  # stopped early
    assert agree_up_to_near_tie([1, 2, 3, 4], [1, 2, 3], [1.0, 1.0, 1.0]) == (False, 3)  # missed the stop


def test_a_near_tie_ends_the_comparison_there():
    margins = [1.0, 0.5, NEAR_TIE / 2, 1.0]
    assert agree_up_to_near_tie([1, 2, 9, 9], [1, 2, 3, 4], margins) == (True, 2)  # the tie may flip position 2
    assert agree_up_to_near_tie([1, 7, 3, 4], [1, 2, 3, 4], margins) == (False, 2)  # but not position 1
    assert agree_up_to_near_tie([1], [1, 2, 3, 4], margins) == (False, 2)


def test_the_same_device_rule_allows_a_difference_only_at_a_near_tie():
    margins = [1.0, NEAR_TIE / 2, 1.0, NEAR_TIE / 2, 1.0]
    assert agree_until_a_near_tie_divergence([1, 2, 3, 4, 5], [1, 2, 3, 4, 5], margins) == (True, 5)
    assert agree_until_a_near_tie_divergence([1, 2, 3, 9, 9], [1, 2, 3, 4, 5], margins) == (True, 3)  # split at a tie
    assert agree_until_a_near_tie_divergence([1, 9, 9, 9, 9], [1, 2, 3, 4, 5], margins) == (True, 1)
    # stricter than agree_up_to_near_tie: a tie both sides resolved alike does not end the comparison
    assert agree_until_a_near_tie_divergence([1, 2, 7, 4, 5], [1, 2, 3, 4, 5], margins) == (False, 2)
    assert agree_up_to_near_tie([1, 2, 7, 4, 5], [1, 2, 3, 4, 5], margins) == (True, 1)
    assert agree_until_a_near_tie_divergence([1, 2, 3], [1, 2, 3, 4, 5], margins) == (False, 3)  # stopped early
    assert agree_until_a_near_tie_divergence([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5], margins) == (False, 5)  # missed the stop


def test_bfloat16_gets_its_own_bound():
    assert near_tie_for("float32") == NEAR_TIE < NEAR_TIE_BF16 == near_tie_for("bfloat16")
    assert agree_until_a_near_tie_divergence([1, 9], [1, 2], [1.0, 2**-6], NEAR_TIE_BF16) == (True, 1)  # one bf16 ulp
    assert agree_until_a_near_tie_divergence([1, 9], [1, 2], [1.0, 0.25], NEAR_TIE_BF16) == (False, 1)


@pytest.mark.numeric
@pytest.mark.parametrize("mode", ["quant", "scd"])  # raw and oracle: tests/test_end_to_end.py
async def test_the_gpu_comparison_holds_with_the_services_on_cpu(mode, tmp_path):
    from tests.test_gpu import serve_and_compare

    await serve_and_compare(mode, "cpu", tmp_path)


@pytest.mark.numeric
async def test_the_gpu_predictor_comparison_holds_with_the_services_on_cpu(tmp_path):
    from tests.test_gpu import train_serve_and_compare

    await train_serve_and_compare("cpu", tmp_path)
