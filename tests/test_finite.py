"""shared.finite against torch.isfinite: the same answer for every tensor, whatever the dtype,
the length (BLAS tails) and where the one bad value sits; huge finite values never read as
infinite (every term of the product is 0, so nothing overflows)."""

from __future__ import annotations

import pytest
import torch

from shared.finite import all_finite, finite_each, peaks, rows_finite

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_finite_agrees_with_isfinite_for_every_position_of_a_bad_value(dtype):
    g = torch.Generator().manual_seed(0)
    big = torch.finfo(dtype).max
    for n in (1, 2, 7, 8, 15, 16, 17, 31, 64, 127, 1000, 4099):
        base = torch.randn(n, generator=g).to(dtype)
        base[torch.randint(0, n, (max(1, n // 5),), generator=g)] = big  # huge but finite
        base[0] = -big
        assert all_finite([base]) and all_finite([base.view(1, n), base[: n // 2]])
        for pos in {0, n // 2, n - 1, int(torch.randint(0, n, (1,), generator=g))}:
            for bad in (float("inf"), float("-inf"), float("nan")):
                x = base.clone()
                x[pos] = bad
                assert not all_finite([x]), (n, pos, bad)
                assert not all_finite([base, x, base]), (n, pos, bad)


def test_all_finite_reads_shapes_views_and_non_floating_tensors():
    x = torch.randn(4, 512, 32)
    y = x.transpose(0, 1)  # not contiguous
    assert all_finite([x, y]) and all_finite([]) and all_finite([torch.arange(5)])
    y[3, 2, 1] = float("nan")
    assert not all_finite([x]) and not all_finite([torch.arange(5), y])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_finite_agrees_with_isfinite_row_by_row(dtype):
    g = torch.Generator().manual_seed(1)
    for rows, cols in ((1, 1), (3, 679), (32, 1003), (5, 4096)):
        x = torch.randn(rows, cols, generator=g).to(dtype)
        x[:, 0] = torch.finfo(dtype).max
        for r in range(0, rows, 2):  # every other row gets one bad value somewhere
            x[r, int(torch.randint(0, cols, (1,), generator=g))] = (float("inf"), float("nan"), float("-inf"))[r % 3]
        assert rows_finite(x).tolist() == torch.isfinite(x).all(dim=1).tolist()


def test_finite_each_names_every_bad_tensor_in_order():
    good, bad = torch.randn(37), torch.randn(5, 9).to(torch.bfloat16)
    bad[4, 8] = float("inf")
    assert finite_each([good, bad, torch.arange(3), good.double(), bad.t()]) == [True, False, True, True, False]
    assert finite_each([]) == []


@pytest.mark.parametrize("dtype", DTYPES)
def test_peaks_is_the_largest_magnitude_and_sees_every_bad_value(dtype):
    """peaks agrees with |x|.max() wherever the largest value sits (vector tails), reads a huge
    finite value as itself (3e38 is not an overflow to it), and gives NaN for a NaN and inf for
    an infinity at any position, so `peak <= limit` fails for both."""
    g = torch.Generator().manual_seed(2)
    big = torch.finfo(dtype).max
    for n in (1, 2, 7, 16, 17, 31, 64, 127, 1000, 4099):
        base = torch.randn(n, generator=g).to(dtype)
        for pos in {0, n // 2, n - 1}:
            for extreme in (-big, big, -3.5, 1e4 if dtype == torch.float16 else 1e30):
                x = base.clone()
                x[pos] = extreme
                assert peaks([x]) == [float(x.double().abs().max())], (n, pos, extreme)
            for bad, want in ((float("nan"), "nan"), (float("inf"), "inf"), (float("-inf"), "inf")):
                x = base.clone()
                x[pos] = bad
                got = peaks([base, x, base.view(1, n)])
                assert str(got[1]) == want and got[0] == got[2] == float(base.double().abs().max()), (n, pos, bad)


def test_peaks_reads_shapes_views_and_empty_tensors():
    x = torch.randn(2, 300, 16)
    y = x.transpose(0, 1)  # not contiguous
    y[4, 1, 3] = -77.0
    assert peaks([x, y, torch.empty(0), torch.arange(-9, 5)]) == [77.0, 77.0, 0.0, 9.0]
    assert peaks([]) == []
