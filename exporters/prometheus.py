"""Prometheus exposition: the metric families that probes declare as tables over model records
(`SPEC.metrics`, aiprobe.metrics.Family), plus the agent's own, rebuilt once per refresh so a
scrape only serializes.

Labels stay bounded: processes are labelled by name and container (never pid), flows only for the
top K by rate with the rest summed per interface and direction into `remote_address="other"`.
Counters stay monotonic while their sources (processes, flows) come and go: the delta engine
(aiprobe.deltas) adds each record's increase, by record identity, to its label set.

`python -m aiprobe.exporters.prometheus` prints the tables of docs/metrics.md.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from aiprobe.config import Config
from aiprobe.deltas import Totals
from aiprobe.metrics import AgentFamily, Family, doc_rows, value_of
from aiprobe.model import Readings
from aiprobe.probes import specs
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

Samples = list[tuple[Sequence[str], float]]


def _build_info(build: dict[str, str], _r: Readings) -> Samples:
    return [(list(build.values()), 1)]


def _probe_up(_build: dict[str, str], r: Readings) -> Samples:
    return [([name, status.strategy or "none"], 1 if status.up else 0) for name, status in r.probes.items()]


def _map_usage(field: str) -> Callable[[dict[str, str], Readings], Samples]:
    return lambda _build, r: [([usage.map, probe], getattr(usage, field))
                              for probe, usages in r.map_usage.items() for usage in usages]


def _collectors(index: int) -> Callable[[dict[str, str], Readings], Samples]:
    return lambda _build, r: [([name], float(result[index])) for name, result in r.collectors.items()]


def _bottlenecks(_build: dict[str, str], r: Readings) -> Samples:
    return [([a.rule, a.severity, a.target], 1) for a in r.alerts if a.state == "firing"]


# The agent's own families: (description, samples from the build info and one refresh's readings).
AGENT_FAMILIES: tuple[tuple[AgentFamily, Callable[[dict[str, str], Readings], Samples]], ...] = (
    (AgentFamily("aiprobe_build_info", "gauge", "aiprobe version, kernel and libbpf; always 1.",
                 ("kernel", "libbpf", "version")), _build_info),
    (AgentFamily("aiprobe_probe_up", "gauge", "1 when the probe runs, with the strategy it runs.",
                 ("probe", "strategy"), doc_note="`strategy` is `none` when it cannot."), _probe_up),
    (AgentFamily("aiprobe_bpf_map_entries", "gauge", "Entries in a bounded BPF map.", ("map", "probe")),
     _map_usage("entries")),
    (AgentFamily("aiprobe_bpf_map_capacity", "gauge", "Capacity (max_entries) of a bounded BPF map.",
                 ("map", "probe")), _map_usage("capacity")),
    (AgentFamily("aiprobe_events_lost_total", "counter", "Events a probe could not deliver (ring buffer full).",
                 ("probe",)), lambda _build, r: [([probe], count) for probe, count in r.events_lost.items()]),
    (AgentFamily("aiprobe_collector_duration_seconds", "gauge", "Time the last refresh of a collector took.",
                 ("collector",)), _collectors(0)),
    (AgentFamily("aiprobe_collector_success", "gauge", "1 when the last refresh of a collector succeeded.",
                 ("collector",)), _collectors(1)),
)
RULE_FAMILIES = (
    (AgentFamily("aiprobe_bottleneck_active", "gauge", "1 while a bottleneck rule fires for a target.",
                 ("rule", "severity", "target"), doc_note="See docs/config.md for the rules."), _bottlenecks),
)


def _metric(name: str, kind: str, help_text: str, labels: list[str]) -> Metric:
    if kind == "histogram":
        return HistogramMetricFamily(name, help_text, labels=labels)
    if kind == "counter":
        return CounterMetricFamily(name.removesuffix("_total"), help_text, labels=labels)
    return GaugeMetricFamily(name, help_text, labels=labels)


def _getters(family: Family) -> list[Any]:
    return [getter for _, getter in family.expand] if family.expand else [family.value]


def _values(family: Family, record: Any) -> list[float] | None:
    """The numbers one record adds to its label set (histograms: sum, then bucket counts); None when
    the probe could not fill them."""
    if family.kind == "histogram":
        buckets = value_of(record, family.value)
        return [float(getattr(record, family.sum_field)), *(float(count) for _, count in buckets)]
    values = [value_of(record, getter) for getter in _getters(family)]
    if any(value is None for value in values):
        return None
    return [float(value) * family.scale for value in values]


def _prometheus_buckets(bounds: Sequence[float], counts: Sequence[float]) -> list[tuple[str, float]]:
    buckets = [("+Inf" if math.isinf(le) else repr(float(le)), count) for le, count in zip(bounds, counts, strict=True)]
    if not buckets or buckets[-1][0] != "+Inf":
        buckets.append(("+Inf", counts[-1] if counts else 0.0))
    return buckets


class _FamilyView:
    """One Family rendered from one refresh's records, keeping what its counters need across refreshes."""

    def __init__(self, family: Family) -> None:
        self.family = family
        self.totals = Totals()
        self.bounds: list[float] = []  # histogram bucket bounds (fixed per probe)

    def render(self, records: list[Any], top: int) -> Metric:
        family = self.family
        sums = self._per_identity(records, top) if family.per_identity or family.top_by or \
            family.kind == "histogram" else self._summed(records)
        metric = _metric(family.name, family.kind, family.help, family.label_names)
        for labels, values in sums:
            if family.kind == "histogram":
                metric.add_metric(list(labels), _prometheus_buckets(self.bounds, values[1:]), values[0])
            elif family.expand:
                for (extra, _), value in zip(family.expand, values, strict=True):
                    metric.add_metric([*labels, extra], value)
            else:
                metric.add_metric(list(labels), values[0])
        return metric

    def _summed(self, records: list[Any]) -> list[tuple[tuple[str, ...], list[float]]]:
        """Gauges (and counters the record keeps monotonic itself): values summed per label set."""
        sums: dict[tuple[str, ...], list[float]] = {}
        for record in records:
            values = _values(self.family, record)
            if values is None:
                continue
            current = sums.setdefault(self.family.label_values(record), [0.0] * len(values))
            for i, value in enumerate(values):
                current[i] += value
        return list(sums.items())

    def _per_identity(self, records: list[Any], top: int) -> list[tuple[tuple[str, ...], list[float]]]:
        """Counters and histograms through the delta engine; with `top_by`, the top records keep their
        own values and the rest go to their label set's `rest` series."""
        family = self.family
        own: list[tuple[tuple[str, ...], list[float]]] = []
        if family.top_by:
            records = sorted(records, key=lambda r: getattr(r, family.top_by), reverse=True)
        for rank, record in enumerate(records):
            values = _values(family, record)
            if values is None:
                continue
            if family.kind == "histogram":
                self.bounds = [le for le, _ in value_of(record, family.value)]
            if family.top_by and rank < top:
                self.totals.deltas.increase(record.identity(), values)  # known, should it leave the top
                own.append((family.label_values(record), values))
                continue
            self.totals.add(self._rest_labels(record), record.identity(), values)
        self.totals.end_round()
        return own + [(labels, values) for labels, values in self.totals.sums.items()]

    def _rest_labels(self, record: Any) -> tuple[str, ...]:
        if not self.family.top_by:
            return self.family.label_values(record)
        rest = dict(self.family.rest)
        return tuple(rest[label] if label in rest else str(value_of(record, getter))
                     for label, getter in self.family.labels)


class AgentCollector(Collector):
    """prometheus_client collector serving the families built by the last `update()`."""

    def __init__(self, config: Config, *, build_info: dict[str, str]) -> None:
        self._config = config
        self._build_info = build_info
        self._lock = threading.Lock()
        self._families: list[Metric] = []
        self._views = [_FamilyView(family) for spec in specs() for family in spec.metrics
                       if not family.option or getattr(config, family.option)]

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            return list(self._families)

    def update(self, readings: Readings) -> None:
        families = self._agent_families(AGENT_FAMILIES, readings)
        families += [view.render(readings.of(view.family.record), self._config.top_flows) for view in self._views]
        families += self._agent_families(RULE_FAMILIES, readings)
        with self._lock:
            self._families = families

    def _agent_families(self, table: Iterable[tuple[AgentFamily, Callable[[dict[str, str], Readings], Samples]]],
                        readings: Readings) -> list[Metric]:
        families = []
        for family, samples in table:
            metric = _metric(family.name, family.kind, family.help, list(family.labels))
            for labels, value in samples(self._build_info, readings):
                metric.add_metric(list(labels), value)
            families.append(metric)
        return families


def registry_for(collector: AgentCollector, *, process_metrics: bool = True) -> Any:
    """A registry holding the agent's collector (and the standard process_* self-metrics)."""
    from prometheus_client import CollectorRegistry, ProcessCollector

    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    if process_metrics:
        ProcessCollector(registry=registry)
    return registry


def doc_tables() -> dict[str, list[str]]:
    """The rows of docs/metrics.md's tables: the main one and the DCGM-compatible one."""
    main = doc_rows("agent", (family for family, _ in AGENT_FAMILIES))
    dcgm: list[str] = []
    for spec in specs():
        main += doc_rows(spec.name, (f for f in spec.metrics if not f.option))
        dcgm += doc_rows(spec.name, (f for f in spec.metrics if f.option))
    main += doc_rows("rules", (family for family, _ in RULE_FAMILIES))
    return {"main": main, "dcgm": dcgm}


if __name__ == "__main__":
    for name, rows in doc_tables().items():
        print(f"## {name}\n" + "\n".join(rows) + "\n")
