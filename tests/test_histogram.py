"""Histogram helpers and /proc parsers, without root."""

from __future__ import annotations

import math
import os
from pathlib import Path

import psutil
import pytest
from aiprobe.histogram import buckets_to_json, hist_slots, kernel_buckets, quantile
from aiprobe.procfs import StartTimes, start_ticks
from exported_histograms import check_series


def test_quantile_interpolates_inside_its_bucket() -> None:
    slots = [0] * hist_slots()
    slots[200] = 100  # 16 * 11 + 24: [24, 25) * 2^11 units of 2^-14 ms = [3.0, 3.125) ms
    buckets = kernel_buckets(slots)
    assert quantile(buckets, 0.5) == pytest.approx(3.0625e-3)
    assert quantile(buckets, 1.0) == pytest.approx(3.125e-3)


def test_quantile_without_observations_or_in_the_open_bucket() -> None:
    assert quantile(kernel_buckets([0] * hist_slots()), 0.99) is None
    assert quantile([], 0.5) is None
    open_ended = kernel_buckets([0] * (hist_slots() - 1) + [4])
    assert quantile(open_ended, 0.5) == 65.536  # the open bucket's lower bound


def test_documents_write_the_open_bound_as_text() -> None:
    assert buckets_to_json([(1e-9, 1), (math.inf, 2)]) == [{"le_seconds": 1e-9, "count": 1},
                                                             {"le_seconds": "+Inf", "count": 2}]


def test_start_ticks_from_a_stat_line_with_spaces_and_parens_in_comm(tmp_path: Path) -> None:
    (tmp_path / "42").mkdir()
    fields = ["S", *map(str, range(4, 22)), "123456", "0"]  # field 22 is the start time
    (tmp_path / "42" / "stat").write_text(f"42 (a (b) c) {' '.join(fields)}\n")
    assert start_ticks(42, tmp_path) == 123456
    assert start_ticks(43, tmp_path) is None
    # This process: psutil's start time is the same field over the clock tick, from boot.
    since_boot = psutil.Process().create_time() - psutil.boot_time()
    assert abs(start_ticks(os.getpid()) - since_boot * os.sysconf("SC_CLK_TCK")) < 1


def test_start_times_remember_an_exited_process(tmp_path: Path) -> None:
    (tmp_path / "42").mkdir()
    stat = tmp_path / "42" / "stat"
    stat.write_text("42 (x) S " + " ".join(["0"] * 18) + " 77 0\n")
    starts = StartTimes(tmp_path)
    assert starts.of(42) == 77
    stat.unlink()
    assert starts.of(42) == 77  # one read of the stat per round
    starts.keep_only({42})
    assert starts.of(42) == 77  # read once more after it exited: same identity
    starts.keep_only(set())
    assert starts.of(42) == 0


def test_exported_histogram_check_refuses_made_up_values_and_keeps_real_ones() -> None:
    # Issue 28 as /metrics showed it: 16 negative keep-alive durations in +Inf, the sum wrapped past 2^64 ns.
    for buckets, total in (([(0.2, 3.0), (32.768, 3.0), (math.inf, 19.0)], 2**64 / 1e9),
                           ([(0.2, 3.0), (32.768, 3.0), (math.inf, 19.0)], 0.139),
                           ([(0.2, 3.0), (32.768, 2.0), (math.inf, 3.0)], 0.3)):
        with pytest.raises(AssertionError):
            check_series("duration", buckets, total)
    check_series("duration", [(0.125, 1.0), (0.25, 19.0), (32.768, 19.0), (math.inf, 19.0)], 2.5)
    check_series("duration", [(32.768, 0.0), (math.inf, 1.0)], 40.0)  # really that long
