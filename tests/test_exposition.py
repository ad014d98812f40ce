"""/metrics' text is written by the exporter itself (Table.text), not by prometheus_client's
generate_latest, which makes a sample and a label dict per histogram bucket: it must be the same text,
byte for byte, as generate_latest writes from the same families (Table.metric)."""

from __future__ import annotations

import math

import pytest
from aiprobe.config import from_dict
from aiprobe.exporters.prometheus import AgentCollector, Table
from aiprobe.model import Readings
from prometheus_client import generate_latest
from prometheus_client.registry import CollectorRegistry

HOSTILE = 'a "quoted" \\ back\nline ünï'
TABLES = [
    Table("aiprobe_stream_ttfb_seconds", "histogram", "Time to first byte.\nSecond \\ line.",
          ("process", "port", "container"),
          [(("nginx", "8080", "host"), [0.5, 1.0, 2.0, 2.0, 5.0]), ((HOSTILE, "1", ""), [0.0, 0.0, 0.0, 0.0, 0.0])],
          (0.001, 0.01, 2.5e-05, math.inf)),
    Table("aiprobe_rtt_seconds", "histogram", "No +Inf bound, labels after le.", ("zone", "a"),
          [(("z", "x"), [3.25, 1.0, 3.0])], (1e-05, 0.5)),
    Table("aiprobe_empty_seconds", "histogram", "No bounds.", (), [((), [0.0])]),
    Table("aiprobe_streams_total", "counter", "Counted.", ("process",), [(("x",), [3.0]), ((HOSTILE,), [1e21])]),
    Table("aiprobe_build_info", "gauge", "Info.", ("kernel", "version"), [(("6.1", "0.3"), [1])]),
    Table("aiprobe_alert_log_errors_total", "counter", "No labels.", (), [((), [0])]),
    Table("aiprobe_gauge", "gauge", "Odd values.", ("k",),
          [(("nan",), [math.nan]), (("inf",), [math.inf]), (("neg",), [-2.5]), (("big",), [123456789.0])]),
    Table("aiprobe_nothing", "gauge", "No rows.", ("k",), []),
]


@pytest.mark.parametrize("table", TABLES, ids=lambda table: table.name)
def test_a_table_writes_what_generate_latest_writes_of_its_metric(table: Table) -> None:
    class One:
        def collect(self):  # type: ignore[no-untyped-def]
            return [table.metric()]

    registry = CollectorRegistry(auto_describe=False)
    registry.register(One())  # type: ignore[arg-type]
    assert table.text() == generate_latest(registry).decode()


def test_the_collector_writes_a_reading_once_and_a_new_reading_again() -> None:
    readings = [Readings()]
    collector = AgentCollector(from_dict({}), build_info={"version": "1"}, source=lambda: readings[0])
    first = collector.text()
    assert collector.text() is first  # a second scrape of the same reading: the same bytes
    readings[0] = Readings()
    assert collector.text() is not first and collector.text() == first
