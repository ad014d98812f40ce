"""/metrics' text is written by the exporter itself (Table.text), not by prometheus_client's
generate_latest, which makes a sample and a label dict per histogram bucket: it must be the same text,
byte for byte, as generate_latest writes from the same families (Table.metric)."""

from __future__ import annotations

import math
from typing import Any

import pytest
from aiprobe.config import from_dict
from aiprobe.exporters.prometheus import AgentCollector, Table
from aiprobe.histogram import exported_buckets, hist_slots, kernel_buckets, no_observations
from aiprobe.model import Readings
from aiprobe.probes.sendlat.records import ProcessSendLatency, SendLatencySnapshot
from aiprobe.registry import catalog, faces
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


def test_histograms_show_their_bucket_set_and_nothing_where_nothing_was_observed() -> None:
    """19 series for a process's sends (16 bounds, +Inf, _count, _sum), whatever the kernel's 433 slots;
    the config's bounds in place of them; no unwritable histogram for a process whose sockets never
    filled, none at all for one that timed nothing."""
    slots = [0] * hist_slots()
    slots[100] = 3
    sent = ProcessSendLatency(1, "sender", 0, 3, 30, 0.1, None, None, exported_buckets(kernel_buckets(slots)))
    idle = ProcessSendLatency(2, "idle", 0, 0, 0, 0.0, None, None, no_observations(),
                              unwritable_histogram=no_observations())
    readings = Readings(records={"sendlat": SendLatencySnapshot("tracepoint", "", [sent, idle])})

    def lines(config: dict[str, Any]) -> list[str]:
        text = AgentCollector(from_dict(config, catalog()), build_info={}, source=lambda: readings).text().decode()
        assert 'aiprobe_exported_series{probe="sendlat"}' in text
        return [line for line in text.splitlines() if line.startswith("aiprobe_tcp_s") and "seconds" in line]

    shown = lines({})
    collector = AgentCollector(from_dict({}, catalog()), build_info={}, source=lambda: readings)
    names = tuple(f.name.removesuffix("_total") for face in faces() if face.name == "sendlat" for f in face.metrics)
    samples = [line for line in collector.text().decode().splitlines() if line.startswith(names)]
    assert collector.series["sendlat"] == len(samples) > 19
    assert len(shown) == 19 and all('process="sender"' in line for line in shown)
    labels = '{container="host",namespace="",pod="",process="sender"}'
    assert shown[-2:] == [f"aiprobe_tcp_sendmsg_duration_seconds_count{labels} 3.0",
                          f"aiprobe_tcp_sendmsg_duration_seconds_sum{labels} 0.1"]
    configured = lines({"histogram_buckets": {"aiprobe_tcp_sendmsg_duration_seconds": [0.001, 1]}})
    assert [line.split('le="')[1].split('"')[0] for line in configured if "_bucket" in line] == \
        ["0.001", "1.024", "+Inf"]
