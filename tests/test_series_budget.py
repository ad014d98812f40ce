"""The series budget (max_series): past it, the least active label sets fold into `other`, totals still
add up, `other` never falls, and what was folded is counted; a scrape under it shows every label set.
The exporter renders real records (no mock): many request keys of one server, as a busy gateway has."""

from __future__ import annotations

from typing import Any

from aiprobe.config import from_dict
from aiprobe.exporters.prometheus import AgentCollector
from aiprobe.exporters.series_budget import Folding, most_kept
from aiprobe.histogram import exported_buckets, hist_slots, kernel_buckets
from aiprobe.model import Readings
from aiprobe.probes.sendlat.records import HttpRequests, RequestsSnapshot
from aiprobe.registry import catalog
from prometheus_client.parser import text_string_to_metric_families

DURATION = "http_server_request_duration_seconds"


def test_most_kept_fills_the_room_from_the_largest_family_down() -> None:
    families = [(1000, 10, False), (5, 10, False)]  # 10,050 series whole
    assert most_kept(families, 20_000) is None
    kept = most_kept(families, 1_000)
    assert kept is not None and 10 * (kept + 1) + 50 <= 1_000 < 10 * (kept + 2) + 50
    assert most_kept(families, 0) == 0  # nothing fits: each family keeps only its `other` row


def test_folding_keeps_the_active_and_other_only_grows() -> None:
    folding = Folding()
    rows = [((f"k{i}",), [float(i), float(i)]) for i in range(10)]
    assert folding.apply(rows, keep=None) == rows
    # k0..k4 grew least since the last call: they fold; the sum of all rows is unchanged
    grown = [(labels, [v + 10 * (i >= 5) for v in values]) for i, (labels, values) in enumerate(rows)]
    shown = folding.apply(grown, keep=5)
    assert [labels for labels, _ in shown] == [(f"k{i}",) for i in range(5, 10)] + [("other",)]
    assert [sum(column) for column in zip(*(v for _, v in shown), strict=True)] == \
        [sum(column) for column in zip(*(v for _, v in grown), strict=True)]
    # a folded label set leaves /metrics (idle): what it counted stays in `other`
    other = shown[-1][1]
    later = folding.apply([row for row in grown if row[0] != ("k4",)], keep=5)
    assert later[-1] == (("other",), other) and folding.folded_total == 5


def _requests(statuses: int, count: int) -> list[HttpRequests]:
    slots = [0] * hist_slots()
    slots[200] = count
    histogram = exported_buckets(kernel_buckets(slots))
    return [HttpRequests(pid=1, comm="gateway", cgroup_id=0, port=8000, protocol="http1", method="GET",
                         status_code=status, count=count, duration_sum_seconds=0.01 * count,
                         duration_histogram=histogram, p50_seconds=None, p99_seconds=None, durations_unknown=0,
                         request_bytes=10 * count, response_bytes=20 * count, start_ticks=1)
            for status in range(200, 200 + statuses)]


def _scraped(collector: AgentCollector) -> dict[str, Any]:
    return {family.name: family for family in text_string_to_metric_families(collector.text().decode())}


def test_past_max_series_the_quiet_request_keys_fold_and_totals_add_up() -> None:
    readings = [Readings(records={"requests": RequestsSnapshot("kprobe", "", http=_requests(300, 3))})]
    collector = AgentCollector(from_dict({"max_series": 2_000}, catalog()), build_info={},
                               source=lambda: readings[0])
    families = _scraped(collector)
    total = sum(int(v) for v in collector.series.values())
    assert total <= 2_000 < 300 * 24  # 24 series a request key whole
    counts = [s for s in families[DURATION].samples if s.name == DURATION + "_count"]
    assert sum(s.value for s in counts) == 900  # every request, in its own row or in `other`
    assert any(s.labels["http_response_status_code"] == "other" for s in counts)
    folded = {s.labels["family"]: s.value for s in families["aiprobe_label_sets_folded"].samples}
    assert folded[DURATION] == 300 - (len(counts) - 1)
    other = next(s.value for s in counts if s.labels["http_response_status_code"] == "other")
    readings[0] = Readings(records={"requests": RequestsSnapshot("kprobe", "", http=_requests(300, 4))})
    later = [s for s in _scraped(collector)[DURATION].samples if s.name == DURATION + "_count"]
    assert sum(s.value for s in later) == 1200
    assert next(s.value for s in later if s.labels["http_response_status_code"] == "other") > other


def test_under_max_series_every_label_set_shows() -> None:
    readings = Readings(records={"requests": RequestsSnapshot("kprobe", "", http=_requests(5, 3))})
    collector = AgentCollector(from_dict({}, catalog()), build_info={}, source=lambda: readings)
    counts = [s for s in _scraped(collector)[DURATION].samples if s.name == DURATION + "_count"]
    assert sorted(s.labels["http_response_status_code"] for s in counts) == [str(s) for s in range(200, 205)]
