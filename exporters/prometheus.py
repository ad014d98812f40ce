"""Prometheus exposition: the metric families that probes declare as tables over model records
(`SPEC.metrics`, aiprobe.metrics.Family), plus the agent's own, rendered at each scrape from the
readings the agent gives then (Agent.scrape_readings: the last refresh's, flows read again).

The exporter only reads the model: whatever it needs across scrapes (the delta engine's totals, the
top K flows, which process names have a label) it keeps itself.

Labels stay bounded: processes are labelled by name and container (never pid), flows only for the
top K by rate with the rest summed per interface and direction into `remote_address="other"`
(aiprobe.probes.flows.probe.TopFlows).
Counters stay monotonic while their sources (processes, flows) come and go: the delta engine
(aiprobe.deltas) adds each record's increase, by record identity, to its label set.
In protobuf (aiprobe.exporters.protobuf, for a scraper that asks for it) a histogram is native too:
its records' buckets go through the delta engine as well (NativeTotals).
The probes' series stay within `max_series` (aiprobe.exporters.series_budget), and a histogram shows its
family's bucket set (Family.buckets, or the config's `histogram_buckets`), never a label set that holds nothing.

`python -m aiprobe.exporters.prometheus` prints the tables of docs/metrics.md.
"""

from __future__ import annotations

import functools
import math
import operator
import re
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import numpy as np
from aiprobe.config import Config
from aiprobe.deltas import Matrix, Totals
from aiprobe.exporters import protobuf
from aiprobe.exporters.series_budget import Folding, Row, most_kept
from aiprobe.histogram import (
    NATIVE_BOUNDS,
    CumulativeBuckets,
    NativeCounts,
    bucket_indices,
    counts_table,
    nearest_exported,
)
from aiprobe.metrics import AgentFamily, Family, doc_rows, reader, value_of
from aiprobe.model import Readings
from aiprobe.registry import faces
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

Samples = list[tuple[Sequence[str], float]]
# An agent family's samples, from the collector (its build info, its own counts) and one reading.
AgentSamples = Callable[["AgentCollector", Readings], Samples]
OTHER_PROCESS = "other"
MAX_FOLDED_REMEMBERED = 10_000


BUILD_LABELS = ("kernel", "libbpf", "version")


def _build_info(collector: AgentCollector, _r: Readings) -> Samples:
    return [([collector.build_info.get(label, "") for label in BUILD_LABELS], 1)]


def _probe_up(_collector: AgentCollector, r: Readings) -> Samples:
    return [([name, status.strategy or "none"], 1 if status.up else 0) for name, status in r.probes.items()]


def _map_usage(field: str) -> AgentSamples:
    return lambda _collector, r: [([usage.map, probe], getattr(usage, field))
                                  for probe, usages in r.map_usage.items() for usage in usages]


def _collectors(index: int) -> AgentSamples:
    return lambda _collector, r: [([name], float(result[index])) for name, result in r.collectors.items()]


def _bottlenecks(_collector: AgentCollector, r: Readings) -> Samples:
    return [([a.rule, a.severity, a.target], 1) for a in r.alerts if a.state == "firing"]


# The agent's own families: (description, samples).
AGENT_FAMILIES: tuple[tuple[AgentFamily, AgentSamples], ...] = (
    (AgentFamily("aiprobe_build_info", "gauge", "aiprobe version, kernel and libbpf; always 1.",
                 BUILD_LABELS), _build_info),
    (AgentFamily("aiprobe_probe_up", "gauge", "1 when the probe runs, with the strategy it runs.",
                 ("probe", "strategy"), doc_note="`strategy` is `none` when it cannot."), _probe_up),
    (AgentFamily("aiprobe_bpf_map_entries", "gauge", "Entries in a bounded BPF map.", ("map", "probe")),
     _map_usage("entries")),
    (AgentFamily("aiprobe_bpf_map_capacity", "gauge", "Capacity (max_entries) of a bounded BPF map.",
                 ("map", "probe")), _map_usage("capacity")),
    (AgentFamily("aiprobe_bpf_map_overflows_total", "counter",
                 "Entries a bounded BPF map could not hold: failed inserts and evictions (what was lost).",
                 ("map", "probe")), _map_usage("overflows")),
    (AgentFamily("aiprobe_events_lost_total", "counter", "Events a probe could not deliver (ring buffer full).",
                 ("probe",)), lambda _collector, r: [([probe], count) for probe, count in r.events_lost.items()]),
    (AgentFamily("aiprobe_collector_duration_seconds", "gauge", "Time the last refresh of a collector took.",
                 ("collector",)), _collectors(0)),
    (AgentFamily("aiprobe_collector_success", "gauge", "1 when the last refresh of a collector succeeded.",
                 ("collector",)), _collectors(1)),
    (AgentFamily("aiprobe_collector_errors_total", "counter", "Refreshes in which a collector failed.",
                 ("collector",)), lambda _collector, r: [([name], n) for name, n in r.collector_errors.items()]),
    (AgentFamily("aiprobe_thread_restarts_total", "counter",
                 "Times a background thread (cuda_scan, nvml_events, link_watcher, alertmanager, http) was run "
                 "again after it failed.", ("thread",)),
     lambda _collector, r: [([name], n) for name, n in r.thread_restarts.items()]),
    (AgentFamily("aiprobe_attach_errors_total", "counter",
                 "Failed attempts to attach a probe to a target (an interface, a library); each is retried "
                 "with back-off.", ("probe", "reason", "target"),
                 doc_note="`reason`: busy (another program holds the hook), unsupported, permission, gone, "
                 "resources, other."),
     lambda _collector, r: [([probe, reason, target], n) for (probe, target, reason), n in r.attach_errors.items()]),
    (AgentFamily("aiprobe_alertmanager_notifications_total", "counter",
                 "Pushes of the current alerts to Alertmanager, by result (success, failure).", ("result",)),
     lambda _collector, r: [([result], n) for result, n in r.notifications.items()]),
    (AgentFamily("aiprobe_alert_log_errors_total", "counter",
                 "Alert transitions that could not be written to alert_log (a full disk, a vanished file).", ()),
     lambda _collector, r: [([], r.alert_log_errors)]),
    (AgentFamily("aiprobe_exported_series", "gauge",
                 "Series of the probes' families in the last scrape, by the probe (or part) they come from.",
                 ("probe",)), lambda collector, _r: [([probe], n) for probe, n in collector.series.items()]),
    (AgentFamily("aiprobe_label_sets_folded_total", "counter",
                 "Label sets of a family folded into its row whose labels all read \"other\", the probes' series "
                 "having reached max_series.", ("family",)),
     lambda collector, _r: [([view.family.name], view.folding.folded_total) for view in collector.views
                            if view.folding.folded_total]),
    (AgentFamily("aiprobe_process_labels_folded_total", "counter",
                 "Process names summed into process=\"other\" because max_process_labels names were in use.", ()),
     lambda collector, _r: [([], collector.processes.folded_total)]),
)

RULE_FAMILIES = (
    (AgentFamily("aiprobe_bottleneck_active", "gauge", "1 while a bottleneck rule fires for a target.",
                 ("rule", "severity", "target"), doc_note="See docs/config.md for the rules."), _bottlenecks),
)


def _metric(name: str, kind: str, help_text: str, labels: list[str]) -> Any:
    """A Counter-, Gauge- or HistogramMetricFamily (each with its own add_metric)."""
    if kind == "histogram":
        return HistogramMetricFamily(name, help_text, labels=labels)
    if kind == "counter":
        return CounterMetricFamily(name.removesuffix("_total"), help_text, labels=labels)
    return GaugeMetricFamily(name, help_text, labels=labels)


def _getters(family: Family) -> list[Callable[[Any], Any]]:
    getters = [getter for _, getter in family.expand] if family.expand else [family.value]
    return [reader(getter) for getter in getters]


# A table of records -> the values each adds, a row each of a float matrix, and which records have a row
# (None: all of them; the others, the probe filled none of the family's values in).
TableReader = Callable[[list[Any]], tuple[Matrix, list[int] | None]]


def table_reader(family: Family, shown: Sequence[int] = ()) -> TableReader:
    """Reads the numbers each record adds to its label set (histograms: sum, then the counts of the buckets
    at `shown` and +Inf, or of all its buckets where the family has no bucket set), a column at a time:
    a refresh reads thousands of records per family. Built once per family."""
    if family.kind == "histogram":
        return _histogram_reader(family, shown)
    getters, scale = _getters(family), family.scale

    def read(records: list[Any]) -> tuple[Matrix, list[int] | None]:
        columns = [list(map(getter, records)) for getter in getters]
        kept = None
        if any(None in column for column in columns):
            kept = [i for i, values in enumerate(zip(*columns, strict=True)) if None not in values]
            columns = [_rows(column, kept) for column in columns]
        return np.array(columns, np.float64).reshape(len(columns), -1).T * scale, kept
    return read


def _histogram_reader(family: Family, shown: Sequence[int]) -> TableReader:
    buckets_of, sum_of = _getters(family)[0], operator.attrgetter(family.sum_field)
    picked = [*shown, -1] if family.buckets else slice(None)

    def read(records: list[Any]) -> tuple[Matrix, list[int] | None]:
        histograms = list(map(buckets_of, records))
        kept = None
        if not all(histograms):  # none filled in some (processes whose sockets never filled)
            kept = [i for i, buckets in enumerate(histograms) if buckets]
            records, histograms = _rows(records, kept), _rows(histograms, kept)
        if not records:
            return np.zeros((0, 0)), kept
        sums = np.fromiter(map(sum_of, records), np.float64, len(records))
        return np.hstack((sums[:, np.newaxis], counts_table(histograms)[:, picked])), kept
    return read


def _le_labels(bounds: Sequence[float]) -> list[str]:
    """Each bucket's `le` label, +Inf last (added where the bounds end before it)."""
    les = ["+Inf" if math.isinf(le) else repr(float(le)) for le in bounds]
    return les if les and les[-1] == "+Inf" else [*les, "+Inf"]


def _buckets(les: Sequence[str], counts: Sequence[float]) -> Iterable[tuple[str, float]]:
    """(le, cumulative count) of each bucket: an added +Inf counts what the last bound does."""
    return zip(les, [*counts, counts[-1] if counts else 0.0], strict=False)


def _label_text(pairs: Iterable[tuple[str, str]]) -> str:
    return ",".join(f'{name}="{_escape(value)}"' for name, value in pairs)


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')


_go_float: Callable[[float], str] = floatToGoString


def _number(value: float) -> str:
    """A sample's value as Go (and generate_latest) writes it: below a million (every bucket count of a
    quiet node), as Python's repr, which floatToGoString returns there after its checks."""
    return repr(float(value)) if 0.0 <= value < 1e6 else _go_float(value)


@dataclass
class Table:
    """One family as a scrape renders it: rows of label values and numbers (a histogram's: its sum,
    then its buckets' counts over `bounds`), given to prometheus_client as a Metric (`metric()`) or
    written as text (`text()`): as generate_latest writes that Metric, without the sample and label
    dict it makes per bucket (1,000 stream endpoints have 400k bucket lines). In protobuf
    (`protobuf()`), a histogram's row that has `cumulative` counts in the `native` layout is also a
    native histogram: counted only then (a text scrape pays nothing for them)."""

    name: str
    kind: str
    help: str
    labels: Sequence[str]
    rows: list[tuple[Sequence[str], Sequence[float]]]
    bounds: Sequence[float] = ()
    native: protobuf.NativeLayout | None = None
    cumulative: Callable[[], list[Sequence[float] | None]] | None = None  # by row; None: classic only

    @property
    def series(self) -> int:
        """The series it writes: a histogram's rows each have their bounds, +Inf, _count and _sum."""
        return len(self.rows) * (len(_le_labels(self.bounds)) + 2 if self.kind == "histogram" else 1)

    def metric(self) -> Metric:
        metric = _metric(self.name, self.kind, self.help, list(self.labels))
        les = _le_labels(self.bounds)
        for labels, values in self.rows:
            if self.kind == "histogram":
                metric.add_metric(list(labels), list(_buckets(les, values[1:])), values[0])
            else:
                metric.add_metric(list(labels), values[0])
        built: Metric = metric
        return built

    @property
    def _exposed_name(self) -> str:
        return self.name.removesuffix("_total") + "_total" if self.kind == "counter" else self.name

    def text(self) -> str:
        name = self._exposed_name
        help_text = self.help.replace("\\", r"\\").replace("\n", r"\n")
        lines = [f"# HELP {name} {help_text}\n# TYPE {name} {self.kind}\n"]
        order = sorted(range(len(self.labels)), key=self.labels.__getitem__)  # as generate_latest sorts them
        les = _le_labels(self.bounds)
        for labels, values in self.rows:
            pairs = [(self.labels[i], labels[i]) for i in order]
            if self.kind != "histogram":
                lines.append(f"{name}{_braced(_label_text(pairs))} {_number(values[0])}\n")
                continue
            before = _label_text(p for p in pairs if p[0] < "le")
            after = _label_text(p for p in pairs if p[0] > "le")
            lines.extend(f"{name}_bucket{{{before}{',' * bool(before)}le=\"{le}\"{',' * bool(after)}{after}}} "
                         f"{_number(count)}\n" for le, count in _buckets(les, values[1:]))
            labelled = _braced(_label_text(pairs))
            lines.append(f"{name}_count{labelled} {_number(values[-1] if len(values) > 1 else 0.0)}\n"
                         f"{name}_sum{labelled} {_number(values[0])}\n")
        return "".join(lines)

    def protobuf(self) -> bytes:
        """The family as a protobuf MetricFamily (a counter's name with its `_total`, as client_golang
        writes it and Prometheus reads it)."""
        if self.kind != "histogram":
            metrics = [protobuf.metric(zip(self.labels, labels, strict=True), self.kind, values[0])
                       for labels, values in self.rows]
            return protobuf.family(self._exposed_name, self.help, self.kind, metrics)
        finite = [le for le in self.bounds if not math.isinf(le)]
        cumulative = self.cumulative() if self.cumulative else [None] * len(self.rows)
        return protobuf.family(self.name, self.help, self.kind, [
            protobuf.histogram(zip(self.labels, labels, strict=True), values[0], zip(finite, values[1:], strict=False),
                               values[-1] if len(values) > 1 else 0.0, self._native(counts))
            for (labels, values), counts in zip(self.rows, cumulative, strict=True)])

    def _native(self, cumulative: Sequence[float] | None) -> bytes:
        return protobuf.native(self.native, cumulative) if self.native and cumulative is not None else b""


def _braced(labels: str) -> str:
    return f"{{{labels}}}" if labels else ""


class ProcessLabels:
    """At most `limit` distinct `process` label values at a time, first come first served; names
    beyond are folded into process="other" (each counted once while it keeps coming). A name not
    seen for `idle_seconds` frees its place, as its series leave /metrics then too."""

    def __init__(self, limit: int, idle_seconds: float) -> None:
        self._limit = limit
        self._idle = idle_seconds
        self._admitted: dict[str, float] = {}  # name -> last seen (monotonic)
        self._folded: dict[str, float] = {}
        self.folded_total: int = 0
        self._now = time.monotonic()

    def label(self, name: str) -> str:
        if name in self._admitted or len(self._admitted) < self._limit:
            self._admitted[name] = self._now
            return name
        if name not in self._folded:
            self.folded_total += 1
        self._folded[name] = self._now
        return OTHER_PROCESS

    def end_round(self) -> None:
        self._now = time.monotonic()
        for seen in (self._admitted, self._folded):
            for name in [name for name, at in seen.items() if self._now - at > self._idle]:
                del seen[name]
        while len(self._folded) > MAX_FOLDED_REMEMBERED:  # under endless churn: forget the oldest
            del self._folded[next(iter(self._folded))]


def native_layout() -> protobuf.NativeLayout:
    """The native buckets of the records' histograms: their counts at NATIVE_BOUNDS (CumulativeBuckets.native)."""
    return protobuf.native_layout(NATIVE_BOUNDS)


def shown_bounds(family: Family, config: Config) -> tuple[float, ...]:
    """A histogram family's finite `le` bounds on /metrics: the config's `histogram_buckets`, each
    moved to the nearest edge the agent keeps (its count stays exact), else the family's own."""
    configured = config.histogram_buckets.get(family.name)
    if configured is None:
        return family.buckets
    return tuple(sorted({nearest_exported(bound) for bound in configured}))


NATIVE_ROUND_SECONDS = 60.0  # the longest a source's native counts wait for the delta engine, unscraped


class _Source(NamedTuple):
    """A histogram's source as its last refresh saw it: its key in the native totals (its identity
    and the refresh it began or restarted in), labels and its native counts (None: it has none, and its
    label set goes out classic only)."""

    key: tuple[Hashable, int]
    labels: tuple[str, ...]
    native: NativeCounts | None


class NativeTotals:
    """A histogram family's native buckets per label set: its records' cumulative counts at the native
    edges (CumulativeBuckets.native: 177, where /metrics shows 17 buckets), summed by the delta engine (a
    Totals of their own) as the shown ones are, but fed when a protobuf scrape renders (`catch_up`, at least every
    NATIVE_ROUND_SECONDS), not at every refresh: a refresh keeps a reference to each source's counts, and
    feeds at once only what the shown totals would count apart, the last counts of a source that left,
    changed labels or restarted. So each label set's native counts add up to its count, at a few dict
    operations per record and refresh."""

    def __init__(self, idle_seconds: float) -> None:
        self.totals: Totals[tuple[str, ...]] = Totals(idle_seconds)
        self._latest: dict[Hashable, _Source] = {}
        self._done: list[_Source] = []  # this refresh's sources that restarted or changed labels: last counts
        self._refresh = 0
        self._caught_up = time.monotonic()

    def source(self, identity: Hashable, labels: tuple[str, ...], buckets: Sequence[tuple[float, float]],
               started: bool) -> _Source:
        """A source of this refresh; `started`: the shown totals' delta engine took all its values, as
        those of a new or restarted source (then a new source here too, from this refresh)."""
        native = buckets.native if isinstance(buckets, CumulativeBuckets) else None
        last = self._latest.get(identity)
        if last is not None and (started or labels != last.labels):
            self._done.append(last)
        if last is None or started:
            return _Source((identity, self._refresh), labels, native)
        return _Source(last.key, labels, native)

    def end_refresh(self, seen: dict[Hashable, _Source], shown: set[tuple[str, ...]]) -> None:
        """After a refresh's sources (`seen`): feeds those that left, and drops the label sets the
        shown totals dropped (idle: both count from zero should they return)."""
        ended = [*self._done, *(self._latest[identity] for identity in self._latest.keys() - seen.keys())]
        self._feed(ended)
        # Those that left or restarted are fed for the last time (a source that changed labels goes on).
        self.totals.forget({source.key for source in ended} - {source.key for source in seen.values()})
        self._done, self._latest = [], seen
        self._refresh += 1
        self.totals.drop(self.totals.labels() - shown)
        if time.monotonic() - self._caught_up > NATIVE_ROUND_SECONDS:
            self.catch_up()

    def catch_up(self) -> None:
        """Feeds every source's last buckets: the totals then count all that the refreshes saw."""
        self._feed(self._latest.values())
        self.totals.end_round()
        self._caught_up = time.monotonic()

    def _feed(self, sources: Iterable[_Source]) -> None:
        fed = [(source, source.native) for source in sources if source.native is not None]
        self.totals.add_all([source.labels for source, _ in fed], [source.key for source, _ in fed],
                            [native for _, native in fed])

    def cumulative(self, rows: list[Row], shown: list[Row]) -> list[Sequence[float] | None]:
        """Caught up, each shown row's cumulative counts of all its buckets; None where they do not add
        up to the row's count (the row of folded label sets, whose members' buckets are not summed; a
        source two records share; a refresh fed since the rows were rendered), which goes out classic only."""
        self.catch_up()
        own, sums = dict(rows), self.totals.sums
        return [counts if own.get(labels) is values and (counts := sums.get(labels, []))
                and counts[-1] == values[-1] else None for labels, values in shown]


class _FamilyView:
    """One Family rendered from one refresh's records, keeping what its counters need across refreshes."""

    def __init__(self, source: str, family: Family, processes: ProcessLabels, config: Config) -> None:
        self.source = source
        self.family: Family = family
        self.totals: Totals[tuple[str, ...]] = Totals(config.idle_series_seconds)
        self.bounds = shown_bounds(family, config)  # a histogram's finite `le` bounds
        self._shown = bucket_indices(self.bounds) if family.buckets else ()
        self._read = table_reader(family, self._shown)
        self.series = family.series(config) if family.series is not None else None
        # A histogram with a bucket set is native too, in protobuf.
        self.native = NativeTotals(config.idle_series_seconds) if family.buckets and self.by_identity else None
        self.folding: Folding = Folding()
        self._absorbed: list[Any] = []  # the records absorb() fed last
        self._processes = processes
        self._process_index = next((i for i, (label, _) in enumerate(family.labels) if label == "process"), None)

    def label_values(self, record: Any) -> tuple[str, ...]:
        values = self.family.label_values(record)
        if self._process_index is None:
            return values
        i = self._process_index
        return (*values[:i], self._processes.label(values[i]), *values[i + 1:])

    @property
    def by_identity(self) -> bool:
        """Whether the delta engine sums it per label set (counters and histograms; flows choose their
        own series): only those fold under the series budget, as a sum of gauges would mean nothing."""
        return self.series is None and (self.family.per_identity or self.family.kind == "histogram")

    @property
    def series_per_row(self) -> int:
        return series_of(self.family, self.bounds)

    def rows(self, records: list[Any], keys: RecordKeys) -> list[Row]:
        """The family's label sets and their values from this refresh's records."""
        family = self.family
        if self.series is not None:
            return self.series(records)
        if not self.by_identity:
            return self._summed(records)
        sums = self._per_identity(records, keys)
        if family.kind == "histogram":  # a label set nothing was observed in shows no histogram
            return [(labels, values) for labels, values in sums if values[-1]]
        return sums

    def table(self, rows: list[Row], keep: int | None) -> Table:
        """The family's table of `rows`, label sets folded as the budget's `keep` says (None: none)."""
        family = self.family
        shown = self.folding.apply(rows, keep) if self.by_identity else rows
        if family.expand:
            shown = [((*labels, extra), [value]) for labels, values in shown
                     for (extra, _), value in zip(family.expand, values, strict=True)]
        native = self.native
        return Table(family.name, family.kind, family.help, family.label_names, list(shown), self.bounds,
                     native_layout() if native else None,
                     functools.partial(native.cumulative, rows, shown) if native else None)

    def _summed(self, records: list[Any]) -> list[Row]:
        """Gauges (and counters the record keeps monotonic itself): values summed per label set."""
        sums: dict[tuple[str, ...], list[float]] = {}
        table, kept = self._read(records)
        for record, values in zip(records if kept is None else _rows(records, kept), table.tolist(), strict=True):
            current = sums.setdefault(self.label_values(record), [0.0] * len(values))
            for i, value in enumerate(values):
                current[i] += value
        return list(sums.items())

    def _per_identity(self, records: list[Any], keys: RecordKeys) -> list[Row]:
        """Counters and histograms through the delta engine: the records' increases, unless they are the
        very records the refresh fed it (a scrape rendering the refresh's readings: not walked again)."""
        if not _same(records, self._absorbed):
            self.absorb(records, keys)
        return list(self.totals.sums.items())

    def absorb(self, records: list[Any], keys: RecordKeys) -> None:
        """Adds the records' increases to the delta engine's totals (counters and histograms; a
        record fed twice adds nothing the second time)."""
        if not self.by_identity:
            return
        self._absorbed = records
        values, kept = self._read(records)
        labels, identities = keys.of(self, records)
        if kept is not None:  # records the probe filled none of this family's values in
            records, labels, identities = _rows(records, kept), _rows(labels, kept), _rows(identities, kept)
        started = self.totals.add_all(labels, identities, values)
        self.totals.end_round()
        if (native := self.native) is not None:
            seen = {identity: native.source(identity, record_labels, value_of(record, self.family.value), whole)
                    for record, record_labels, identity, whole in zip(records, labels, identities, started,
                                                                      strict=True)}
            native.end_refresh(seen, self.totals.labels())


T = TypeVar("T")


def _rows(column: list[T], kept: list[int]) -> list[T]:
    return [column[i] for i in kept]


class RecordKeys:
    """One pass's records of each kind, with their label values and identities: the families over one
    kind of record (six for a process) share its records and label declaration, so those are worked
    out once per pass."""

    def __init__(self, readings: Readings) -> None:
        self._readings = readings
        self._records: dict[type, list[Any]] = {}
        self._known: dict[tuple[int, int], tuple[list[tuple[str, ...]], list[Hashable]]] = {}

    def records(self, kind: type) -> list[Any]:
        if kind not in self._records:
            self._records[kind] = self._readings.of(kind)
        return self._records[kind]

    def of(self, view: _FamilyView, records: list[Any]) -> tuple[list[tuple[str, ...]], list[Hashable]]:
        """The label values and identity of each of `records` (one of records()' lists)."""
        key = (id(view.family.labels), id(records))
        known = self._known.get(key)
        if known is None:
            known = self._known[key] = ([view.label_values(record) for record in records],
                                        [record.identity() for record in records])
        return known


def _same(records: list[Any], last: list[Any]) -> bool:
    """Whether `records` are the very objects of `last`, in order (a list of thousands: one C loop);
    never when there are none, whose absorb() still ends the delta engine's round."""
    return bool(records) and len(records) == len(last) and all(map(operator.is_, records, last))


class AgentCollector(Collector):
    """prometheus_client collector, pulled: each scrape renders what `source` returns then, as
    node_exporter reads at scrape time, so a counter is never a refresh behind the scrape (a 1 s
    scrape never sees a flat step from refresh/scrape aliasing). A reading that comes back again
    (the same object) is served as rendered.

    `absorb` counts a refresh no scrape may see: a process that exited is reported by the one
    refresh after its exit, so its last increase must reach the delta engine then. It renders
    nothing and keeps no reading (full-resolution histograms, thousands of them under churn): the
    delta engine keeps what it needs, as numbers per source."""

    def __init__(self, config: Config, *, build_info: dict[str, str], source: Callable[[], Readings]) -> None:
        self.build_info = build_info
        self._source = source
        self._lock = threading.Lock()  # one render at a time, in the order of the readings
        self._families: list[Table] = []
        self._text: bytes | None = None  # the families' text, written at the first text() after a render
        self._protobuf: bytes | None = None  # as _text, in protobuf
        self._rendered: Readings | None = None
        self.processes: ProcessLabels = ProcessLabels(config.max_process_labels, config.idle_series_seconds)
        self.series: dict[str, int] = {}  # series rendered last, by the probe (or part) they come from
        self._max_series = config.max_series
        self.views: list[_FamilyView] = [_FamilyView(face.name, family, self.processes, config)
                       for face in faces() for family in face.metrics
                       if family.option is None or family.option(config)]

    def collect(self) -> Iterable[Metric]:
        return [table.metric() for table in self.tables()]

    def text(self) -> bytes:
        """/metrics' text (format 0.0.4), as generate_latest writes collect()'s families; written once
        per rendered reading (two Prometheus servers scraping one agent get the same bytes)."""
        with self._lock:
            families = self._current()
            if self._text is None:
                self._text = "".join(table.text() for table in families).encode()
            return self._text

    def protobuf(self) -> bytes:
        """/metrics in protobuf (histograms native too), written once per rendered reading as text()."""
        with self._lock:
            families = self._current()
            if self._protobuf is None:
                self._protobuf = b"".join(table.protobuf() for table in families)
            return self._protobuf

    def tables(self) -> list[Table]:
        with self._lock:
            return list(self._current())

    def _current(self) -> list[Table]:
        """The families of the source's reading now, rendered if it is a new one (under the lock)."""
        readings = self._source()
        if readings is not self._rendered:
            self._families, self._rendered = self._render(readings), readings
            self._text = self._protobuf = None
        return self._families

    def absorb(self, readings: Readings) -> None:
        """Adds one refresh's counters to the delta engine, scraped or not (feeding the same
        readings again, as the scrape that renders them does, adds nothing)."""
        with self._lock:
            keys = RecordKeys(readings)
            for view in self.views:
                view.absorb(keys.records(view.family.record), keys)
            self.processes.end_round()

    def _render(self, readings: Readings) -> list[Table]:
        keys = RecordKeys(readings)
        rows = [view.rows(keys.records(view.family.record), keys) for view in self.views]
        self.processes.end_round()
        keep = self._most_kept(rows)
        families = [view.table(view_rows, keep) for view, view_rows in zip(self.views, rows, strict=True)]
        self.series = dict.fromkeys((view.source for view in self.views), 0)
        for view, table in zip(self.views, families, strict=True):
            self.series[view.source] += table.series
        families = self._agent_families(AGENT_FAMILIES, readings) + families
        return families + self._agent_families(RULE_FAMILIES, readings)

    def _most_kept(self, rows: list[list[Row]]) -> int | None:
        """The most label sets a foldable family keeps within `max_series` (None: all of them)."""
        fixed = sum(view.series_per_row * len(r) for view, r in zip(self.views, rows, strict=True)
                    if not view.by_identity)
        return most_kept([(view.folding.unfolded(r), view.series_per_row, view.folding.folds)
                          for view, r in zip(self.views, rows, strict=True) if view.by_identity],
                         self._max_series - fixed)

    def _agent_families(self, table: Iterable[tuple[AgentFamily, AgentSamples]], readings: Readings) -> list[Table]:
        return [Table(family.name, family.kind, family.help, family.labels,
                      [(labels, [value]) for labels, value in samples(self, readings)])
                for family, samples in table]


def exposition(collector: AgentCollector, *, process_metrics: bool = True) -> Callable[[bool], bytes]:
    """What /metrics serves: the collector's families, then the standard process_* self-metrics; as
    text, or in protobuf where the argument says so."""
    from prometheus_client import ProcessCollector, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    if process_metrics:
        ProcessCollector(registry=registry)

    def metrics(in_protobuf: bool) -> bytes:
        if in_protobuf:
            return collector.protobuf() + b"".join(map(_client_family, registry.collect()))
        return collector.text() + generate_latest(registry)

    return metrics


def _client_family(metric: Metric) -> bytes:
    """A prometheus_client family (the process_* self-metrics: gauges and counters) in protobuf."""
    name = metric.name + "_total" if metric.type == "counter" else metric.name
    return protobuf.family(name, metric.documentation, metric.type,
                           [protobuf.metric(sorted(sample.labels.items()), metric.type, sample.value)
                            for sample in metric.samples if sample.name == name])


def series_of(family: Family, bounds: Sequence[float]) -> int:
    """The most series one label set of a family can have (a histogram: its `bounds`, +Inf, _count
    and _sum)."""
    if family.kind == "histogram":
        return len(bounds) + 3
    return len(family.expand) if family.expand else 1


def series_rows() -> list[str]:
    """docs/metrics.md's series per entry: | source | entry (its record) | families | series |, from
    the families a record feeds (flows, which choose their own series, apart)."""
    rows = []
    for face in faces():
        by_record: dict[type, list[Family]] = {}
        for family in face.metrics:
            if family.option is None and family.series is None:
                by_record.setdefault(family.record, []).append(family)
        for record, families in by_record.items():
            rows.append(f"| `{face.name}` | {_entry(record)} | {len(families)} | "
                        f"{sum(series_of(family, family.buckets) for family in families)} |")
    return rows


def _entry(record: type) -> str:
    """What a record is: its docstring's first words (to a period, a colon or a parenthesis), and its name."""
    words = " ".join((record.__doc__ or "").split())
    what = re.split(r"\. |:| \(", words)[0].rstrip(".")
    return f"`{record.__name__}`" if what.startswith(record.__name__) else f"{what} (`{record.__name__}`)"


def doc_tables() -> dict[str, list[str]]:
    """The rows of docs/metrics.md's tables: the main one, the DCGM-compatible one and the series
    per entry."""
    main = doc_rows("agent", (family for family, _ in AGENT_FAMILIES))
    dcgm: list[str] = []
    for face in faces():
        main += doc_rows(face.name, (f for f in face.metrics if f.option is None))
        dcgm += doc_rows(face.name, (f for f in face.metrics if f.option is not None))
    main += doc_rows("rules", (family for family, _ in RULE_FAMILIES))
    return {"main": main, "dcgm": dcgm, "series": series_rows()}


if __name__ == "__main__":
    for name, rows in doc_tables().items():
        print(f"## {name}\n" + "\n".join(rows) + "\n")
