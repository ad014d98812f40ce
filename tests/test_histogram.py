"""Histogram helpers and /proc parsers, without root."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import psutil
import pytest
from aiprobe import histogram
from aiprobe.config import from_dict
from aiprobe.exporters.prometheus import shown_bounds
from aiprobe.histogram import (
    EXPORTED_BOUNDS,
    FAST_BOUNDS,
    REQUEST_BOUNDS,
    STREAM_BOUNDS,
    Histograms,
    buckets_to_json,
    exported_buckets,
    hist_slots,
    kernel_buckets,
    quantile,
    summaries_of,
)
from aiprobe.procfs import StartTimes, start_ticks
from aiprobe.registry import catalog, faces
from exported_histograms import check_series


def test_quantile_interpolates_inside_its_bucket() -> None:
    slots = [0] * hist_slots()
    slots[200] = 100  # 16 * 11 + 24: [24, 25) * 2^11 units of 2^-14 ms = [3.0, 3.125) ms
    buckets = kernel_buckets(slots)
    assert quantile(buckets, 0.5) == pytest.approx(3.0625e-3)
    assert quantile(buckets, 1.0) == pytest.approx(3.125e-3)


def test_histograms_at_once_are_the_ones_worked_out_one_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Histograms (1k endpoints' histograms in a few numpy calls) gives exported_buckets() and quantile() of each,
    to the bit: empty ones, one observation, the first slot, the open bucket, counts spread wide."""
    rng = np.random.default_rng(7)
    rows = np.zeros((400, hist_slots()), dtype=np.uint64)
    for row in rows[1:]:
        spread = rng.integers(0, hist_slots(), size=rng.integers(1, 40))
        row[spread] = rng.integers(0, 5000, size=len(spread))
    rows[2, :] = 0
    rows[2, 0] = 3
    rows[3, :] = 0
    rows[3, -1] = 4
    rows[4, :] = 0
    rows[4, 300] = 1
    summaries = Histograms.of(list(rows)).summaries()
    for row, summary in zip(rows, summaries, strict=True):
        fine = kernel_buckets(row)
        alone = exported_buckets(fine)
        assert summary.buckets.counts == alone.counts
        assert np.array_equal(summary.buckets.native, alone.native)  # both None for an empty one
        assert (summary.p50, summary.p99) == (quantile(fine, 0.5), quantile(fine, 0.99))
    monkeypatch.setattr(histogram, "SUMMARIES_AT_ONCE", 7)  # chunks, the last one short
    assert summaries_of(list(rows)) == summaries
    groups = [list(range(len(rows)))[group::3] for group in range(3)]
    summed = Histograms.of(list(rows)).summed(groups).cumulative
    for group in range(3):
        assert summed[group].tolist() == rows[group::3].sum(axis=0).cumsum().tolist()


def test_quantile_without_observations_or_in_the_open_bucket() -> None:
    assert quantile(kernel_buckets([0] * hist_slots()), 0.99) is None
    assert quantile([], 0.5) is None
    open_ended = kernel_buckets([0] * (hist_slots() - 1) + [4])
    assert quantile(open_ended, 0.5) == 65.536  # the open bucket's lower bound


@pytest.mark.parametrize("bounds", [FAST_BOUNDS, REQUEST_BOUNDS, STREAM_BOUNDS])
def test_a_bucket_set_is_kernel_edges_and_at_most_20_series(bounds: tuple[float, ...]) -> None:
    assert set(bounds) <= set(EXPORTED_BOUNDS) and list(bounds) == sorted(bounds)
    assert len(bounds) + 3 <= 20  # the finite bounds, +Inf, _count and _sum


def test_every_histogram_of_kernel_slots_has_a_bucket_set() -> None:
    """What /metrics shows of each family (a histogram of one bucket counts and sums, as sizes do)."""
    timed = exported_buckets(kernel_buckets([1] * hist_slots()))
    for family in (f for face in faces() for f in face.metrics if f.kind == "histogram"):
        assert family.buckets or family.name.endswith("_bytes"), family.name
    assert len(timed) == len(EXPORTED_BOUNDS) + 1


def test_configured_buckets_move_to_the_nearest_kept_edge() -> None:
    """0.25 s is no kernel edge: 0.256 s is (2^8 ms), so its count is exact; 0.1 s is one (1.5625 * 64 ms)."""
    config = from_dict({"histogram_buckets": {"http_server_request_duration_seconds": [0.1, 0.25, 0.26, 1]}},
                       catalog())
    family = next(f for face in faces() for f in face.metrics if f.name == "http_server_request_duration_seconds")
    assert shown_bounds(family, config) == (0.1, 0.256, 1.024)
    assert shown_bounds(family, from_dict({}, catalog())) == REQUEST_BOUNDS


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
