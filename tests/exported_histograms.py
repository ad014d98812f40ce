"""The consistency every histogram the agent exports owes its users, checked on what the Prometheus
exporter renders from a probe's records (each probe's tests feed it records of real traffic): counts
never fall as `le` grows, and the sum lies between the least and the most the buckets allow, each
observation at its bucket's lower or upper edge. An observation above the last finite bucket then
needs a sum that large, and no duration the kernel timed is longer than the time since boot (its clock,
CLOCK_MONOTONIC, is Python's time.monotonic()): a made-up value parked in +Inf (a negative duration read
as unsigned, a sum wrapped past 2^64 ns) fails.

The same holds in protobuf, read here by a decoder of its own (a varint and length-delimited walk), where
each histogram is also native: its native buckets add up to its count, and hold at each classic bound
about what the classic bucket there counts (a native bucket's edges are the kernel's nearest its bounds,
within 3%)."""

from __future__ import annotations

import itertools
import math
import struct
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from aiprobe.config import from_dict
from aiprobe.exporters.prometheus import AgentCollector, exposition
from aiprobe.model import Readings
from prometheus_client.parser import text_string_to_metric_families

STREAM_HISTOGRAMS = [f"aiprobe_stream_{name}_seconds" for name in ("ttfb", "chunk_gap", "duration")]
# The kernel's sums are exact; its bucket of a value is, to a few ns (bpf/common.h): per observation.
SLACK_SECONDS = 1e-8

Series = tuple[list[tuple[float, float]], float]  # cumulative (le, count), ascending; sum


def renderings(records: Iterable[Any]) -> tuple[str, bytes]:
    """/metrics as the agent's exporter renders it from these records: as text, and in protobuf."""
    readings = Readings(records={str(i): record for i, record in enumerate(records)})
    metrics = exposition(AgentCollector(from_dict({}), build_info={}, source=lambda: readings), process_metrics=False)
    return metrics(False).decode(), metrics(True)


def rendered(records: Iterable[Any]) -> str:
    """/metrics as the agent's exporter renders it from these records, as text."""
    return renderings(records)[0]


def histograms_of(text: str, by_labels: bool = False) -> dict[str, Any]:
    """Every histogram series of a Prometheus exposition, by family name (and by sorted label pairs)."""
    found: dict[str, Any] = {}
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
        found[family.name] = {labels: (sorted(series), sums[labels]) for labels, series in buckets.items()} \
            if by_labels else [(sorted(series), sums[labels]) for labels, series in buckets.items()]
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
    """assert_exposition_consistent() and assert_protobuf_consistent() on what the exporter renders
    from a probe's records."""
    text, protobuf = renderings(records)
    assert_exposition_consistent(text, observed)
    assert_protobuf_consistent(protobuf, text)


# --- protobuf, decoded by hand (io.prometheus.client's metrics.proto) ---

HISTOGRAM = 4  # MetricType

def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at, shift = at + 1, shift + 7
        if byte < 0x80:
            return value, at


def _signed(zigzag: int) -> int:
    return (zigzag >> 1) ^ -(zigzag & 1)


def fields(message: bytes) -> Iterator[tuple[int, Any]]:
    """(field number, value): a varint as an int, a fixed64 as a double, length-delimited as bytes."""
    at = 0
    while at < len(message):
        key, at = _varint(message, at)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, at = _varint(message, at)
        elif wire == 1:
            value, at = struct.unpack_from("<d", message, at)[0], at + 8
        elif wire == 2:
            length, at = _varint(message, at)
            value, at = message[at:at + length], at + length
        else:
            raise AssertionError(f"wire type {wire} in {message!r}")
        yield number, value


def delimited(data: bytes) -> Iterator[bytes]:
    """The messages of a stream of varint-length-prefixed ones."""
    at = 0
    while at < len(data):
        length, at = _varint(data, at)
        yield data[at:at + length]
        at += length


@dataclass
class Histogram:
    count: int = 0
    sum: float = 0.0
    buckets: list[tuple[float, int]] = field(default_factory=list)  # classic: cumulative (le, count)
    schema: int | None = None
    zero_threshold: float = 0.0
    zero_count: int = 0
    native: dict[int, int] = field(default_factory=dict)  # native bucket index -> count

    def native_below(self, le: float) -> int:
        """What the zero bucket and the native buckets wholly at or below `le` hold."""
        assert self.schema is not None
        below = sum(n for index, n in self.native.items() if 2 ** (index / 2 ** self.schema) <= le * (1 + 1e-12))
        return below + (self.zero_count if self.zero_threshold <= le else 0)


_SCALARS = {1: "count", 2: "sum", 6: "zero_threshold", 7: "zero_count"}  # Histogram's, as they come


def _histogram(message: bytes) -> Histogram:
    histogram, spans, deltas = Histogram(), [], []
    for number, value in fields(message):
        if number in _SCALARS:
            setattr(histogram, _SCALARS[number], value)
        elif number == 3:
            bucket = dict(fields(value))
            histogram.buckets.append((bucket[2], bucket.get(1, 0)))
        elif number == 5:
            histogram.schema = _signed(value)
        elif number == 12:
            span = dict(fields(value))
            spans.append((_signed(span.get(1, 0)), span.get(2, 0)))
        elif number == 13:
            at = 0
            while at < len(value):
                delta, at = _varint(value, at)
                deltas.append(_signed(delta))
    counts = itertools.accumulate(deltas)
    index = 0
    for number, (offset, length) in enumerate(spans):
        index += offset if number == 0 else offset + 1
        for _ in range(length):
            histogram.native[index] = next(counts)
            index += 1
        index -= 1
    return histogram


def protobuf_families(data: bytes) -> dict[str, tuple[int, list[tuple[dict[str, str], Any]]]]:
    """Every MetricFamily: name -> (type, [(labels, its value or Histogram)])."""
    found = {}
    for message in delimited(data):
        family = dict(fields(message))
        metrics = []
        for number, metric in fields(message):
            if number != 4:
                continue
            labels: dict[str, str] = {}
            value: Any = None
            for part, content in fields(metric):
                if part == 1:
                    pair = dict(fields(content))
                    labels[pair[1].decode()] = pair.get(2, b"").decode()
                elif part in (2, 3, 5):
                    value = dict(fields(content)).get(1, 0.0)
                elif part == 7:
                    value = _histogram(content)
            metrics.append((labels, value))
        found[family[1].decode()] = (family.get(3, 0), metrics)
    return found


def assert_protobuf_consistent(data: bytes, text: str) -> None:
    """Every histogram of the protobuf exposition: its count and sum those of the text's same series,
    its classic buckets as consistent as the text's, and (where it has native buckets) those holding
    something, adding up to its count and agreeing with its classic buckets at each bound."""
    in_text = histograms_of(text, by_labels=True)
    for name, (kind, metrics) in protobuf_families(data).items():
        if kind != HISTOGRAM:
            continue
        assert len(metrics) == len(in_text[name]), name
        for labels, histogram in metrics:
            text_buckets, text_sum = in_text[name][tuple(sorted(labels.items()))]
            assert (histogram.count, histogram.sum) == (text_buckets[-1][1], text_sum), (name, labels)
            check_series(name, [*histogram.buckets, (math.inf, histogram.count)], histogram.sum)
            if histogram.schema is None:
                continue
            assert all(n > 0 for n in histogram.native.values()), f"{name}: an empty native bucket sent"
            assert histogram.zero_count + sum(histogram.native.values()) == histogram.count, (name, labels)
            width = 2 ** (2 / 2 ** histogram.schema)  # two native buckets: a bound, and the 3% of its edge
            for le, count in histogram.buckets:
                assert histogram.native_below(le / width) <= count <= histogram.native_below(le * width), \
                    f"{name} {labels}: native buckets about {le}"
