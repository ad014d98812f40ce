"""The consistency every histogram the agent exports owes its users, checked on what the Prometheus
exporter renders from a probe's records (each probe's tests feed it records of real traffic): counts
never fall as `le` grows, and the sum lies between the least and the most the buckets allow, each
observation at its bucket's lower or upper edge. An observation above the last finite bucket then
needs a sum that large, and no duration the kernel timed is longer than the time since boot (its clock,
CLOCK_MONOTONIC, is Python's time.monotonic()): a made-up value parked in +Inf (a negative duration read
as unsigned, a sum wrapped past 2^64 ns) fails."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from typing import Any

from aiprobe.config import from_dict
from aiprobe.exporters.prometheus import AgentCollector, exposition
from aiprobe.model import Readings
from prometheus_client.parser import text_string_to_metric_families

STREAM_HISTOGRAMS = [f"aiprobe_stream_{name}_seconds" for name in ("ttfb", "chunk_gap", "duration")]
# The kernel's sums are exact; its bucket of a value is, to a few ns (bpf/common.h): per observation.
SLACK_SECONDS = 1e-8

Series = tuple[list[tuple[float, float]], float]  # cumulative (le, count), ascending; sum


def rendered(records: Iterable[Any]) -> str:
    """/metrics as the agent's exporter renders it from these records."""
    readings = Readings(records={str(i): record for i, record in enumerate(records)})
    collector = AgentCollector(from_dict({}), build_info={}, source=lambda: readings)
    return exposition(collector, process_metrics=False)().decode()


def histograms_of(text: str) -> dict[str, list[Series]]:
    """Every histogram series of a Prometheus exposition, by family name."""
    found: dict[str, list[Series]] = {}
    for family in text_string_to_metric_families(text):
        if family.type != "histogram":
            continue
        buckets: dict[tuple[tuple[str, str], ...], list[tuple[float, float]]] = {}
        sums: dict[tuple[tuple[str, str], ...], float] = {}
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "le"))
            if sample.name.endswith("_bucket"):
                buckets.setdefault(labels, []).append((float(sample.labels["le"]), sample.value))
            elif sample.name.endswith("_sum"):
                sums[labels] = sample.value
        found[family.name] = [(sorted(series), sums[labels]) for labels, series in buckets.items()]
    return found


def check_series(name: str, buckets: list[tuple[float, float]], total: float) -> None:
    """`buckets`: cumulative (le, count), the last one +Inf; `total`: the series' sum."""
    counts = [count for _, count in buckets]
    assert counts == sorted(counts), f"{name}: counts fall as le grows: {buckets}"
    lower = [0.0, *(le for le, _ in buckets[:-1])]
    # A duration above the last bound is at most the machine's uptime; a size has no such bound.
    beyond = math.inf if name.endswith("_bytes") else time.monotonic()
    upper = [*(le for le, _ in buckets[:-1]), beyond]
    in_bucket = [count - below for below, count in zip([0.0, *counts], counts, strict=False)]
    least = sum(n * edge for n, edge in zip(in_bucket, lower, strict=True))
    most = sum(n * edge for n, edge in zip(in_bucket, upper, strict=True) if n)
    slack = counts[-1] * SLACK_SECONDS + 1e-9 * total
    assert least - slack <= total <= most + slack, \
        f"{name}: sum {total} outside [{least}, {most}] that its buckets allow: {[b for b in buckets if b[1]][:8]}"


def assert_exposition_consistent(text: str, observed: Iterable[str]) -> None:
    """Checks every histogram series of /metrics; those of the families in `observed` must hold
    observations (real traffic went through them)."""
    histograms = histograms_of(text)
    for name, series in histograms.items():
        for buckets, total in series:
            check_series(name, buckets, total)
    for name in observed:
        assert any(buckets[-1][1] for buckets, _ in histograms.get(name, [])), f"{name}: no observation exported"


def assert_histograms_consistent(records: Iterable[Any], observed: Iterable[str]) -> None:
    """assert_exposition_consistent() on what the exporter renders from a probe's records."""
    assert_exposition_consistent(rendered(records), observed)
