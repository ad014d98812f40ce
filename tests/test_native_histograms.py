"""Native histograms: /metrics in protobuf for a scraper that asks for it (Prometheus with
native histograms on), each histogram both classic and native in one message, the text format for
everyone else; checked by a decoder of the tests' own (exported_histograms), through the delta engine's
churn, and by a real Prometheus 2.42 scraping a real agent under the sendlat truth tests' traffic."""

from __future__ import annotations

import math
import urllib.request
from pathlib import Path

import pytest
from aiprobe.config import from_dict
from aiprobe.exporters.http import wants_protobuf
from aiprobe.exporters.prometheus import AgentCollector, exposition
from aiprobe.exporters.protobuf import CONTENT_TYPE
from aiprobe.histogram import exported_buckets, hist_slots, kernel_buckets, no_observations
from aiprobe.histogram import quantile as quantile_of
from aiprobe.model import Readings
from aiprobe.probes.sendlat.records import ProcessSendLatency, SendLatencySnapshot
from aiprobe.registry import catalog
from exported_histograms import (
    HISTOGRAM,
    assert_histograms_consistent,
    assert_protobuf_consistent,
    histograms_of,
    protobuf_families,
)
from fixtures.sendlat_peer import build, mix, paced_sink
from helpers import CLOCK_TOLERANCE, wait_until
from prometheus_client.parser import text_string_to_metric_families
from servers import Agent, Prometheus, http_get
from test_sendlat import INFLATED_SENDS, sender_quantile

SENDS = "aiprobe_tcp_sendmsg_duration_seconds"
# What Prometheus 2.42 sends: with native histograms on, and without.
NATIVE_ACCEPT = ("application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited;q=0.7,"
                 "text/plain;version=0.0.4;q=0.3,*/*;q=0.2")
TEXT_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
               "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
NATIVE_BUCKET = 2 ** (1 / 8)  # the width of a schema-3 bucket, as a ratio


def seconds(slots: list[int]) -> float:
    """A sum the slots allow: each observation at its slot's upper edge (the last slot's: its lower)."""
    edges = [le for le, _ in kernel_buckets(slots)]
    return sum(n * (edges[i] if i < len(slots) - 1 else edges[-2]) for i, n in enumerate(slots))


def sender(pid: int, comm: str, slots: list[int], start: int = 1, waits: list[int] | None = None) -> ProcessSendLatency:
    count = sum(slots)
    return ProcessSendLatency(pid, comm, 0, count, count, seconds(slots), None, None,
                              exported_buckets(kernel_buckets(slots)), start_ticks=start,
                              unwritable_count=sum(waits or []),
                              unwritable_sum_seconds=seconds(waits) if waits else 0.0,
                              unwritable_histogram=exported_buckets(kernel_buckets(waits)) if waits
                              else no_observations())


def slots_with(*filled: tuple[int, int]) -> list[int]:
    slots = [0] * hist_slots()
    for slot, count in filled:
        slots[slot] += count
    return slots


@pytest.mark.host_only
def test_protobuf_has_the_texts_histograms_classic_and_native_and_its_counters() -> None:
    # From the zero bucket's slots to the overflow slot (32.8 s and up).
    records = [sender(1, "a", slots_with((0, 2), (40, 1), (150, 5), (151, 3), (300, 7), (hist_slots() - 1, 1)),
                      waits=slots_with((200, 4))),
               sender(2, "b", slots_with((120, 1)))]
    assert_histograms_consistent(records, observed=[SENDS, "aiprobe_tcp_socket_unwritable_seconds"])
    readings = Readings(records={"sendlat": SendLatencySnapshot("tracepoint", "", records)})
    metrics = exposition(AgentCollector(from_dict({}, catalog()), build_info={}, source=lambda: readings))
    families = protobuf_families(metrics(True))
    kind, [(_, histogram)] = families[SENDS][0], [m for m in families[SENDS][1] if m[0]["process"] == "a"]
    assert kind == HISTOGRAM and histogram.schema == 3
    assert histogram.zero_count == 3, "below 7.8 us: the records' first bucket"
    assert max(histogram.native) == 41, "the overflow slot goes into the native bucket of 32.8 s"
    _, sends = families["aiprobe_tcp_sends_total"]
    assert sorted(value for _, value in sends) == [1.0, 19.0]
    assert families["process_cpu_seconds_total"][0] == 0, "the process_* self-metrics, as counters"
    assert b"process_cpu_seconds_total " in metrics(False), "the text is the text"


@pytest.mark.host_only
def test_native_counts_follow_the_classic_ones_through_churn_restarts_and_relabelling() -> None:
    """Refreshes that no scrape sees (a source that sends, then leaves, changes its name or restarts
    between two scrapes) count in the native buckets as in the classic ones."""
    rounds = [
        [sender(1, "a", slots_with((150, 1))), sender(2, "b", slots_with((200, 1)))],
        [sender(1, "a", slots_with((150, 1), (160, 2))), sender(2, "b", slots_with((200, 3)))],
        [sender(1, "renamed", slots_with((150, 1), (160, 4))), sender(3, "a", slots_with((250, 1)))],  # 2 left
        [sender(1, "renamed", slots_with((170, 1))), sender(3, "a", slots_with((250, 2)))],  # 1 restarted
        [sender(1, "renamed", slots_with((170, 1), (171, 1))), sender(2, "b", slots_with((200, 9)))],  # 2 is back
    ]
    readings = [Readings()]
    collector = AgentCollector(from_dict({}, catalog()), build_info={}, source=lambda: readings[0])
    metrics = exposition(collector, process_metrics=False)
    for number, records in enumerate(rounds):
        readings[0] = Readings(records={"sendlat": SendLatencySnapshot("tracepoint", "", records)})
        collector.absorb(readings[0])
        if number in (0, 4):  # scraped at the first refresh and the last only
            assert_protobuf_consistent(metrics(True), metrics(False).decode())
    sends = protobuf_families(metrics(True))[SENDS][1]
    assert {labels["process"]: h.count for labels, h in sends} == {"a": 3 + 2, "b": 3 + 9, "renamed": 2 + 2}
    assert all(h.schema is not None for _, h in sends), "a label set whose native buckets fell behind"


@pytest.mark.host_only
@pytest.mark.parametrize(("accept", "protobuf"), [
    (NATIVE_ACCEPT, True),
    (TEXT_ACCEPT, False),
    ("", False),
    ("*/*", False),
    ("application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited", True),
    ("text/plain;q=0.9, application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited",
     True),
    ("text/plain, application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited", False),
    ("application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited;q=0", False),
    ("application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=text", False),
    ("application/vnd.google.protobuf;proto=io.prometheus.client.Other;encoding=delimited", False),
    ("application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited;q=x", False),
])
def test_protobuf_only_where_the_scraper_prefers_it(accept: str, protobuf: bool) -> None:
    assert wants_protobuf(accept) is protobuf


@pytest.fixture(scope="module")
def peer(cbuild) -> str:
    return build(cbuild)


def sends_counted(agent: Agent) -> float:
    """The agent's count of the peer's sends (exact, where its histogram may sample)."""
    return sum(sample.value for family in text_string_to_metric_families(agent.metrics())
               if family.name == "aiprobe_tcp_sends" for sample in family.samples
               if sample.labels.get("process") == "sendlat_peer")


def quantile(prometheus: Prometheus, expr: str) -> float | None:
    result = prometheus.query(expr)
    value = float(result[0]["value"][1]) if result else math.nan
    return None if math.isnan(value) else value


@pytest.mark.bpf
@pytest.mark.slow_truth
def test_prometheus_with_native_histograms_gets_every_histogram_native_at_the_senders_p99(
        tmp_path: Path, peer: str) -> None:
    """Sends of about 17 ms (test_sendlat's constant-latency truth): Prometheus 2.42 with native
    histograms on keeps every histogram the agent exports as one native histogram, whose p99 over the
    test's sends lies in the classic bucket holding the agent's own p99 of them (give or take a native
    bucket, 9%: the native ones are finer) and within 10% of the sender's clock;
    another Prometheus, without them, scrapes the text format with its classic buckets. The window's
    sends are exactly the test's: the first samples hold the sends before them, which the agent had
    counted before Prometheus started (p99 of 24 sends is their slowest: one send slowed by a loaded
    machine outside the window would move it)."""
    config = 'probes = ["sendlat"]\n'
    with Agent(tmp_path, config) as agent, paced_sink(peer, "127.0.0.1", 17, 1 << 20) as slow:
        status, body = http_get(agent.url + "/metrics", headers={"Accept": TEXT_ACCEPT})
        assert status == 200 and body.startswith(b"# HELP")
        mix(peer, "0" * 4, [(slow, 1 << 20)])  # the series is there before the window's sends
        assert wait_until(lambda: sends_counted(agent) == 4, timeout=60, interval=0.5)
        (tmp_path / "native").mkdir()
        (tmp_path / "classic").mkdir()
        with Prometheus(tmp_path / "native", [agent.target], flags=["--enable-feature=native-histograms"]) as native, \
                Prometheus(tmp_path / "classic", [agent.target]) as classic:
            selector = f'{SENDS}{{process="sendlat_peer"}}'
            native.wait_for_series(selector, timeout=60)
            before = own_buckets(agent)
            _, durations = mix(peer, "0" * 24, [(slow, 1 << 20)])
            assert wait_until(lambda: sends_counted(agent) == 4 + 24, timeout=60, interval=0.5)
            after = own_buckets(agent)
            assert wait_until(lambda: [float(s["histogram"][1]["count"]) for s in native.query(selector)]
                              == [after[-1][1]], timeout=60, interval=0.5), native.query(selector)
            exported = [name for name, (kind, metrics) in protobuf_families(
                http_get(agent.url + "/metrics", headers={"Accept": NATIVE_ACCEPT})[1]).items()
                if kind == HISTOGRAM and any(h.schema is not None and h.count for _, h in metrics)]
            assert SENDS in exported
            for name in exported:  # each arrives native: a `histogram`, no `value`, no classic series
                series = native.wait_for_series(name)
                assert series and all("histogram" in s and "value" not in s for s in series), (name, series[:1])
                assert not native.query(f"{name}_bucket") and not native.query(f"{name}_count")
            p99 = quantile(native, f"histogram_quantile(0.99, sum(rate({selector}[10m])))")
            assert classic.wait_for_series(f'{SENDS}_bucket{{process="sendlat_peer",le="0.02"}}', timeout=60)
    window = [(le, count - below) for (le, count), (_, below) in zip(after, before, strict=True)]
    own = quantile_of(window, 0.99)  # the agent's own, of the window's sends, from its classic buckets
    edges = [0.0, *(le for le, _ in window)]  # within the classic bucket holding it
    upper = next(le for le in edges if own is not None and le >= own)
    lower = edges[edges.index(upper) - 1]
    assert p99 is not None and lower / NATIVE_BUCKET <= p99 <= upper * NATIVE_BUCKET, (p99, own, lower, upper)
    truth_upper = sender_quantile(durations, 0.99) * (1 + CLOCK_TOLERANCE)
    truth_lower = sender_quantile(durations, 0.99 - INFLATED_SENDS / len(durations)) * (1 - CLOCK_TOLERANCE)
    assert truth_lower <= p99 <= truth_upper, (p99, sorted(durations))


def own_buckets(agent: Agent) -> list[tuple[float, float]]:
    """The agent's classic buckets of the peer's sends (what it timed: all, or sampled)."""
    sends = histograms_of(agent.metrics(), by_labels=True)[SENDS]
    [(buckets, _)] = [series for labels, series in sends.items() if ("process", "sendlat_peer") in labels]
    return buckets


@pytest.mark.bpf
def test_metrics_answers_protobuf_to_whom_asks_and_text_to_others(tmp_path: Path) -> None:
    with Agent(tmp_path, 'probes = ["sendlat"]\n') as agent:
        for accept, content_type in ((NATIVE_ACCEPT, CONTENT_TYPE), (TEXT_ACCEPT, "text/plain;")):
            request = urllib.request.Request(agent.url + "/metrics", headers={"Accept": accept})
            with urllib.request.urlopen(request, timeout=10) as response:
                assert response.headers["Content-Type"].startswith(content_type)
                body = response.read()
        assert body.startswith(b"# HELP")
        families = protobuf_families(http_get(agent.url + "/metrics", headers={"Accept": NATIVE_ACCEPT})[1])
        assert {"aiprobe_build_info", "process_resident_memory_bytes", "aiprobe_probe_up"} <= families.keys()
