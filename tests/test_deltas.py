"""The delta/rate engine (agent/deltas.py) and the exporter's counters over it, without root: counters
stay monotonic per label set through pid reuse, cgroup moves and evicted entries."""

from __future__ import annotations

import copy
import dataclasses
import math
import random

import numpy as np
import pytest
from aiprobe.config import Config
from aiprobe.deltas import Deltas, Rates, Totals, Trend, Window
from aiprobe.exporters.prometheus import AgentCollector
from aiprobe.histogram import Histograms, quantile
from aiprobe.model import Readings
from aiprobe.probes.sendlat.records import ProcessSendLatency, SendLatencySnapshot


def test_increase_counts_a_new_source_whole_and_a_decrease_as_a_restart() -> None:
    deltas = Deltas()
    assert deltas.increase("a", [5.0]) == [5.0]
    assert deltas.increase("a", [7.0]) == [2.0]
    assert deltas.increase("a", [1.0]) == [1.0]  # restarted
    deltas.end_round()
    deltas.end_round()  # "a" not seen in this round: forgotten
    assert deltas.increase("a", [3.0]) == [3.0]


def test_totals_stay_monotonic_while_sources_come_and_go() -> None:
    totals = Totals()
    totals.add("app", ("pid", 1), [10.0])
    totals.add("app", ("pid", 2), [4.0])
    totals.end_round()
    totals.add("app", ("pid", 1), [12.0])  # pid 2 evicted
    totals.end_round()
    totals.add("app", ("pid", 2), [1.0])  # a new process on a reused key
    totals.end_round()
    assert totals.sums["app"] == [10 + 4 + 2 + 1]


def test_totals_drop_label_sets_idle_longer_than_asked() -> None:
    now = [0.0]
    totals = Totals(idle_seconds=10, clock=lambda: now[0])
    totals.add("short-lived", ("pid", 1), [3.0])
    totals.add("daemon", ("pid", 2), [5.0])
    totals.end_round()
    for now[0] in (5.0, 10.0, 11.0):
        totals.add("daemon", ("pid", 2), [6.0])
        totals.end_round()
    assert set(totals.sums) == {"daemon"}
    assert totals.sums["daemon"] == [6.0]


def test_a_table_added_at_once_sums_what_its_rows_one_at_a_time_would() -> None:
    """add_all (numpy over a table) against the rules worked out row by row: a new source counts
    whole, one whose values fell restarts, a source unseen for a round is forgotten, a label set in
    another layout starts over; tables with a source twice, layouts changing within one table."""
    rng = random.Random(7)
    totals: Totals[str] = Totals()
    last: dict[int, list[float]] = {}
    expected: dict[str, list[float]] = {}
    for _ in range(200):
        rows = [(f"labels {rng.randrange(4)}", rng.randrange(8),
                 [float(rng.randrange(40)) for _ in range(rng.choice((3, 3, 3, 2)))]) for _ in range(rng.randrange(10))]
        assert totals.add_all([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]) == [
            _add_one(expected, last, *row) for row in rows]
        last = {source: values for source, values in last.items() if source in {r[1] for r in rows}}
        totals.end_round()
        assert totals.sums == expected


def _add_one(sums: dict[str, list[float]], last: dict[int, list[float]], labels: str, source: int,
             values: list[float]) -> bool:
    """Totals.add's rules for one row, written out: whether all its values counted."""
    previous = last.get(source)
    whole = previous is None or len(previous) != len(values) or any(map(float.__lt__, values, previous))
    added = values if whole else [value - before for value, before in zip(values, previous or [], strict=True)]
    last[source] = values
    current = sums.get(labels)
    if current is None or len(current) != len(values):
        current = [0.0] * len(values)
    sums[labels] = [total + value for total, value in zip(current, added, strict=True)]
    return whole


def test_windows_taken_at_once_are_those_taken_one_at_a_time() -> None:
    """Window.recent_all (numpy over a table) against recent() source by source, to the bit, and the p99s
    of the windows' buckets against quantile(): sources new, gone, restarting, changing layout, rounds
    leaving the window."""
    rng = random.Random(11)
    at_once, one_by_one = Window(10.0), Window(10.0)
    bounds = (0.001, 0.01, 0.1, 1.0, math.inf)
    totals: dict[int, list[float]] = {}
    for now in range(0, 120, 3):
        sources = [source for source in range(12) if rng.random() < 0.9]  # most stay for several windows
        width = 5 if now < 60 or now > 90 else 3  # a layout change for all, then back
        for source in sources:
            old = totals.get(source, [])
            counts = sorted(rng.randrange(5) for _ in range(width))
            restart = len(old) != width or rng.random() < 0.1
            totals[source] = counts if restart else [o + c for o, c in zip(old, counts, strict=True)]
        table = np.array([totals[source] for source in sources], np.float64)
        recent = at_once.recent_all(sources, table, float(now))
        expected = [one_by_one.recent(source, totals[source], float(now)) for source in sources]
        assert recent.tolist() == expected
        assert Histograms(recent).quantiles(0.99, bounds[-width:]) == [
            quantile(list(zip(bounds[-width:], row, strict=True)), 0.99) for row in expected]
        at_once.end_round()
        one_by_one.end_round()


def test_rates_per_second_between_rounds() -> None:
    rates = Rates()
    assert rates.rate("a", [100.0], now=10.0) == [0.0]
    rates.end_round()
    assert rates.rate("a", [300.0], now=12.0) == [100.0]


def test_window_sums_only_recent_increases() -> None:
    window = Window(10.0)
    assert window.recent("a", [1.0, 2.0], now=0.0) == [1.0, 2.0]
    assert window.recent("a", [1.0, 5.0], now=5.0) == [1.0, 5.0]
    assert window.recent("a", [1.0, 6.0], now=12.0) == [0.0, 4.0]  # the first observation left the window


def test_trend_splits_what_the_last_window_and_the_one_before_saw() -> None:
    trend = Trend(10.0)
    assert trend.counts("gaps", [3.0], now=0.0) == ([0.0], [3.0])  # the first values count as recent
    assert trend.means("share", [0.8], now=0.0) == (None, [0.8])
    trend.end_round()
    assert trend.counts("gaps", [5.0], now=12.0) == ([3.0], [2.0])
    assert trend.means("share", [0.2], now=12.0) == ([0.8], [0.2])
    trend.end_round()
    assert trend.counts("gaps", [9.0], now=15.0) == ([3.0], [6.0])
    assert trend.means("share", [0.5], now=15.0) == ([0.8], [0.35])
    trend.end_round()
    assert trend.counts("gaps", [9.0], now=21.0) == ([0.0], [6.0])  # 0 s left both windows; 12 s is 9 s old
    assert trend.means("share", [0.5], now=21.0) == (None, [pytest.approx(0.4)])
    trend.end_round()
    trend.end_round()  # neither seen in this round: forgotten
    assert trend.means("share", [0.1], now=22.0) == (None, [0.1])


def sends(*records: ProcessSendLatency) -> Readings:
    return Readings(records={"sendlat": SendLatencySnapshot("tracepoint", "", list(records))})


def sender(pid: int, comm: str, sent: int) -> ProcessSendLatency:
    return ProcessSendLatency(pid, comm, 100, 1, sent, 0.0, None, None, [], start_ticks=5)


class Scraped:
    """An exporter pulling from a stand-in for the agent: `refresh()` makes new readings the latest,
    as Agent.refresh() does, and counts them (as `aiprobe agent` does after each refresh)."""

    def __init__(self, config: Config | None = None) -> None:
        self.latest = Readings()
        self.collector = AgentCollector(config or Config(), build_info={}, source=lambda: self.latest)

    def refresh(self, readings: Readings, *, counted: bool = True) -> None:
        self.latest = readings
        if counted:
            self.collector.absorb(readings)

    def samples(self, name: str) -> dict[str, float]:
        """The family's samples by `process` label."""
        (family,) = [f for f in self.collector.collect() if f.name == name]
        return {sample.labels.get("process", ""): sample.value for sample in family.samples}


def send_bytes_total(scraped: Scraped) -> float:
    return scraped.samples("aiprobe_tcp_send_bytes")["app"]


def test_send_bytes_total_through_a_cgroup_move_and_pid_reuse() -> None:
    """One process with entries under two cgroups (it moved) is two sources of one label set: the
    counter grows by what each sent, however the entries' order changes between refreshes."""
    scraped = Scraped()
    before = sender(7, "app", 1000)
    after = dataclasses.replace(before, cgroup_id=200, bytes=300)
    scraped.refresh(sends(before), counted=False)  # scraped before it was counted: counted once all the same
    assert send_bytes_total(scraped) == 1000
    scraped.refresh(sends(before, after))
    assert send_bytes_total(scraped) == 1300
    scraped.refresh(sends(dataclasses.replace(after, bytes=500), before))
    assert send_bytes_total(scraped) == 1500
    reused = dataclasses.replace(after, start_ticks=9, bytes=50)  # pid 7 again, a new process
    scraped.refresh(sends(reused))
    assert send_bytes_total(scraped) == 1550


def test_a_process_seen_by_one_unscraped_refresh_still_counts_at_the_next_scrape() -> None:
    """A short-lived process's counts are read once, by the refresh after it exited; /metrics renders
    at scrape time, so that refresh must reach the delta engine even when no scrape follows it."""
    scraped = Scraped()
    for readings in (sends(sender(7, "app", 1000)), sends()):  # two refreshes, the process gone by the second
        scraped.refresh(readings)
    assert send_bytes_total(scraped) == 1000
    assert send_bytes_total(scraped) == 1000  # scraped again: nothing counted twice


def test_process_names_beyond_the_limit_are_folded_and_counted_without_touching_the_readings() -> None:
    """The exporter keeps its label folding to itself: the readings it renders come out as they went in."""
    scraped = Scraped(Config(max_process_labels=1))
    readings = sends(sender(1, "first", 10), sender(2, "second", 20), sender(3, "third", 30))
    unchanged = copy.deepcopy(readings)
    scraped.refresh(readings)
    assert scraped.samples("aiprobe_tcp_send_bytes") == {"first": 10, "other": 50}
    assert scraped.samples("aiprobe_process_labels_folded") == {"": 2}
    scraped.refresh(sends(sender(1, "first", 15), sender(2, "second", 25), sender(3, "third", 30)))
    assert scraped.samples("aiprobe_tcp_send_bytes") == {"first": 15, "other": 55}
    assert scraped.samples("aiprobe_process_labels_folded") == {"": 2}  # each name counted once while it comes
    assert readings == unchanged
