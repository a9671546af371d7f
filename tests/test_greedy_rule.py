"""The rule the GPU tests compare greedy sequences under (tests/greedy.py), checked here on CPU:
its edge cases, and the GPU tests' own comparison run with the services on CPU, where it must
hold exactly (same kernels as the reference)."""

from __future__ import annotations

import pytest

from tests.greedy import NEAR_TIE, agree_up_to_near_tie


def test_identical_sequences_agree_over_their_whole_length():
    assert agree_up_to_near_tie([1, 2, 3], [1, 2, 3], [1.0, 1.0, 1.0]) == (True, 3)
    assert agree_up_to_near_tie([1, 2], [1, 2, 3], [1.0, 1.0, 1.0]) == (False, 3)  # stopped early
    assert agree_up_to_near_tie([1, 2, 3, 4], [1, 2, 3], [1.0, 1.0, 1.0]) == (False, 3)  # missed the stop


def test_a_near_tie_ends_the_comparison_there():
    margins = [1.0, 0.5, NEAR_TIE / 2, 1.0]
    assert agree_up_to_near_tie([1, 2, 9, 9], [1, 2, 3, 4], margins) == (True, 2)  # the tie may flip position 2
    assert agree_up_to_near_tie([1, 7, 3, 4], [1, 2, 3, 4], margins) == (False, 2)  # but not position 1
    assert agree_up_to_near_tie([1], [1, 2, 3, 4], margins) == (False, 2)


@pytest.mark.parametrize("mode", ["quant", "scd"])  # raw and oracle: tests/test_end_to_end.py
async def test_the_gpu_comparison_holds_with_the_services_on_cpu(mode, tmp_path):
    from tests.test_gpu import serve_and_compare

    await serve_and_compare(mode, "cpu", tmp_path)


async def test_the_gpu_predictor_comparison_holds_with_the_services_on_cpu(tmp_path):
    from tests.test_gpu import train_serve_and_compare

    await train_serve_and_compare("cpu", tmp_path)
