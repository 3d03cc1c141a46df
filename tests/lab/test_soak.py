"""bench soak's arithmetic: which samples the slopes are fitted over, and the block means."""

import math

import pytest

from streamrl.lab.bench.faults import role_table, slope_per_100


def test_slope_is_per_100_iterations_and_zero_with_too_few_points():
    assert slope_per_100([0, 100, 200, 300], [10, 11, 12, 13]) == pytest.approx(1.0)
    assert slope_per_100([0, 1], [0, 50]) == 0.0


def test_soak_table_fits_the_loop_second_half_and_leaves_the_report_peak_out():
    samples = []
    for k in range(40):  # a sample every 10 iterations of a 400-iteration run
        it = 10 * k
        samples.append({"t": float(k), "iteration": it, "role": "driver", "rss_mb": 500.0 + it / 100, "open_files": 9})
        for pid in (1, 2):  # two instances share a role: their sum is the role's memory
            samples.append({"t": float(k), "iteration": it, "role": "inst", "rss_mb": 300.0, "open_files": 5})
    samples.append({"t": 40.0, "iteration": 400, "role": "driver", "rss_mb": 560.0, "open_files": 12})  # report
    by = {r["role"]: r for r in role_table(samples, iterations=400)}
    drv = by["driver"]
    assert drv["rss_mb_per_100_iter"] == pytest.approx(1.0)  # the report's +56 MB would make it ~4
    assert drv["rss_mb_last"] == pytest.approx(503.9) and drv["rss_mb_after_loop"] == 560.0
    assert drv["rss_mb_per_block"] == pytest.approx({0: 500.45, 100: 501.45, 200: 502.45, 300: 503.45})
    assert by["inst"]["rss_mb_last"] == 600.0 and by["inst"]["rss_mb_per_100_iter"] == pytest.approx(0.0)
    assert math.isnan(by["inst"]["rss_mb_after_loop"]) and by["inst"]["open_files_last"] == 10


def test_the_floor_of_each_block_ignores_step_peaks_and_follows_what_stays():
    samples = []
    for k in range(40):
        it = 10 * k
        peak = 30.0 if k % 3 == 0 else 0.0  # a sample that lands inside a step sees its tensors
        samples.append({"t": float(k), "iteration": it, "role": "trainer", "rss_mb": 500.0 + it / 200 + peak,
                        "open_files": 9})
    row = role_table(samples, iterations=400)[0]
    assert row["rss_mb_floor_per_block"] == pytest.approx({0: 500.05, 100: 500.5, 200: 501.0, 300: 501.55})
    assert row["rss_mb_floor_per_100_iter"] == pytest.approx(0.5, abs=0.03)  # the real creep, without the peaks
