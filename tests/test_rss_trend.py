"""bench.harness.rss_trend's verdict on RSS series (a leak fails, a plateau and a bounded sawtooth pass, a
short run gets none), on the consumer's series as the load test recorded them before and after
the oneDNN kernel caches were bounded (issue 43); and shared.heap_trace's dumps, diffed, naming the
container that grew."""

from __future__ import annotations

import random
import tracemalloc

from bench.harness import rss_trend
from shared import heap_trace

MIB = 1024
# the consumer's RSS (MiB) after each round of `python -m bench.serving.load_test --limits defaults --rounds 12`
# on 2cf1243 (oneDNN's and ideep's caches at their defaults of 1024 kernels each) ...
BEFORE = [512.5, 530.2, 541.3, 552.0, 559.4, 554.1, 571.6, 585.7, 595.4, 597.8, 602.6, 584.0]
# ... and with --onednn-cache-entries 128 (16 rounds): the gather buffers' bounded sawtooth
AFTER = [509.2, 519.4, 529.6, 541.1, 541.1, 503.1, 517.5, 521.4, 524.5, 529.7, 532.9, 533.6, 503.6, 507.9, 516.3, 520.2]


def kib(series: list[float]) -> list[int]:
    return [int(v * MIB) for v in series]


def test_the_recorded_growth_fails_and_the_bounded_consumer_passes():
    before, after = rss_trend.trend(kib(BEFORE)), rss_trend.trend(kib(AFTER))
    assert before["levels_off"] is False and before["peak_rise_pct_per_round"] > 1.0
    assert after["levels_off"] is True and after["peak_rise_pct_per_round"] == 0


def test_a_steady_leak_under_noise_fails_and_a_noisy_plateau_passes():
    rng = random.Random(0)
    base = 500 * MIB
    leak = [base + 1024 * r + rng.randint(-3000, 3000) for r in range(40)]  # +1 MiB a round (0.2%), +-3 MiB noise
    plateau = [base + rng.randint(-3000, 3000) for _ in range(40)]
    sawtooth = [base + 6000 * (r % 7) for r in range(40)]  # 36 MiB teeth, every 7 rounds
    assert rss_trend.trend(leak)["levels_off"] is False
    assert rss_trend.trend(plateau)["levels_off"] is True
    saw = rss_trend.trend(sawtooth)
    assert saw["levels_off"] is True and saw["peak_rise_pct_per_round"] == 0


def test_too_few_rounds_give_no_verdict():
    assert rss_trend.trend(kib(BEFORE[:6]))["levels_off"] is None  # 3 rounds in the second half
    assert rss_trend.trend(kib(BEFORE[:10]))["levels_off"] is False


def test_theil_sen_ignores_one_outlier():
    assert rss_trend.theil_sen([10, 11, 12, 13, 100, 15, 16]) == 1


class Holder:
    def __init__(self):
        self.items: list[int] = list(range(heap_trace.CONTAINER_MIN_LEN))


def test_heap_dumps_diff_names_the_container_that_grew(tmp_path):
    holder = Holder()
    tracemalloc.start(4)
    try:
        first = heap_trace.dump(tmp_path, "test", 0)
        holder.items += list(range(1000, 1500))
        last = heap_trace.dump(tmp_path, "test", 1)
    finally:
        tracemalloc.stop()
    diff = rss_trend.diff_dumps(first, last)
    grew = [c for c in diff["containers"] if c["owner"] == "Holder.items"]
    assert grew and grew[0]["grew"] == 500 and not grew[0]["new"]
    assert diff["sites"] and {"rss_kib", "malloc_kib", "objects"} <= diff.keys()
