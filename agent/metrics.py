"""Metric families described as tables over model records (in the way of ebpf_exporter's decoders).

A probe lists its families in its `SPEC.metrics`; `aiprobe.exporters.prometheus` renders them and
docs/metrics.md is generated from them (`python -m aiprobe.metrics`; tests/test_metrics_doc.py
fails when the two differ). This module only describes: it imports no Prometheus client.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import Config

Getter = str | Callable[[Any], Any]  # a record field, or a function of the record
Series = tuple[tuple[str, ...], list[float]]  # label values, sample values


def value_of(record: Any, getter: Getter) -> Any:
    return getter(record) if callable(getter) else getattr(record, getter)


def reader(getter: Getter) -> Callable[[Any], Any]:
    """The getter as a function of the record (for getters run over thousands of records)."""
    return getter if callable(getter) else operator.attrgetter(getter)


@dataclass(frozen=True)
class Family:
    """One metric family over one kind of record.

    gauge: one sample per label set, the sum of `value` over its records.
    counter with `per_identity`: each record's increase since the last refresh (the delta engine,
      by record identity) summed per label set, so the series stays monotonic while records come
      and go; without it: the record's own (monotonic) value.
    histogram: `value` holds cumulative buckets and `sum_field` their sum; always per identity.
      `buckets`: the `le` bounds /metrics shows of exported_buckets()' (aiprobe.histogram; the config's
      `histogram_buckets` may set others); empty: the record's own buckets as they are.
    `expand` turns one record into one sample per (label value, getter) under label `expand_label`.
    `series`, given the config, makes a stateful function from the records to the family's series,
    for a family the rules above cannot say (flows: the top K and `other`).
    """

    name: str
    kind: str  # "gauge" | "counter" | "histogram"
    help: str
    record: type
    value: Getter = ""
    labels: tuple[tuple[str, Getter], ...] = ()  # (label, getter)
    scale: float = 1.0
    sum_field: str = ""
    buckets: tuple[float, ...] = ()
    per_identity: bool = False
    expand_label: str = ""
    expand: Sequence[tuple[str, Getter]] = ()  # a loader.Lazy where the label values come from BTF
    series: Callable[[Config], Callable[[list[Any]], list[Series]]] | None = None
    option: Callable[[Config], bool] | None = None  # whether the config wants it (DCGM names)
    doc_note: str = ""  # extra words in docs/metrics.md only

    @property
    def label_names(self) -> list[str]:
        names = [label for label, _ in self.labels]
        return [*names, self.expand_label] if self.expand_label else names

    def label_values(self, record: Any) -> tuple[str, ...]:
        return tuple([str(read(record)) for read in self._label_readers])

    @functools.cached_property
    def _label_readers(self) -> list[Callable[[Any], Any]]:
        """The labels' getters as functions (a refresh reads thousands of records' labels)."""
        return [reader(getter) for _, getter in self.labels]


@dataclass(frozen=True)
class AgentFamily:
    """A family about the agent itself, built by the exporter from the agent's own records."""

    name: str
    kind: str
    help: str
    labels: tuple[str, ...] = ()
    doc_note: str = ""

    @property
    def label_names(self) -> list[str]:
        return list(self.labels)


def doc_rows(source: str, families: Iterable[Family | AgentFamily]) -> list[str]:
    """docs/metrics.md table rows: | metric | type | labels | source | description |"""
    rows = []
    for family in families:
        labels = ", ".join(sorted(family.label_names))
        description = family.help + (f" {family.doc_note}" if family.doc_note else "")
        rows.append(f"| `{family.name}` | {family.kind} | {labels} | {source} | {description} |")
    return rows


# Processes are labelled by name and workload, never by pid (bounded label sets). In Kubernetes, as
# dcgm-exporter's Kubernetes mode: `namespace`, `pod` and `container` (its name); empty `namespace` and
# `pod` (no label, to Prometheus) elsewhere.
PROCESS_LABELS: tuple[tuple[str, Getter], ...] = (("process", "comm"), ("container", "container"),
                                                  ("namespace", "namespace"), ("pod", "pod"))
