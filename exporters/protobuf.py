"""Prometheus' protobuf exposition (io.prometheus.client.MetricFamily, each family prefixed by its
length), written by hand: prometheus_client writes no protobuf, and the few fields /metrics needs
do not call for the `protobuf` package. Field numbers are those of client_model's metrics.proto.

Its point is native histograms: each histogram goes out with its classic buckets and, in the same
message, as a native histogram of schema 3 (8 buckets per doubling, each 9% wide), as client_golang
writes both, so Prometheus keeps whichever it is set to keep.
"""

from __future__ import annotations

import functools
import itertools
import math
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

CONTENT_TYPE = "application/vnd.google.protobuf; proto=io.prometheus.client.MetricFamily; encoding=delimited"
SCHEMA = 3
_TYPES = {"counter": 0, "gauge": 1, "untyped": 3, "histogram": 4}  # MetricType
_VALUE_FIELDS = {"counter": 3, "gauge": 2, "untyped": 5}  # Metric's field holding a value of that type
_VARINT, _FIXED64, _BYTES = 0, 1, 2  # wire types


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _zigzag(n: int) -> int:
    return n << 1 if n >= 0 else (-n << 1) - 1


def _key(field: int, wire: int) -> bytes:
    return _varint(field << 3 | wire)


def _message(field: int, payload: bytes) -> bytes:
    return _key(field, _BYTES) + _varint(len(payload)) + payload


def _double(field: int, value: float) -> bytes:
    return _key(field, _FIXED64) + struct.pack("<d", value)


def _uint(field: int, value: int) -> bytes:
    return _key(field, _VARINT) + _varint(value)


def _text(field: int, value: str) -> bytes:
    return _message(field, value.encode())


def family(name: str, help_text: str, kind: str, metrics: Iterable[bytes]) -> bytes:
    """One MetricFamily, length-prefixed; `metrics`: its Metric messages (metric() or histogram())."""
    body = _text(1, name) + _text(2, help_text) + _uint(3, _TYPES[kind]) + b"".join(_message(4, m) for m in metrics)
    return _varint(len(body)) + body


def _labels(pairs: Iterable[tuple[str, str]]) -> bytes:
    return b"".join(_message(1, _text(1, name) + _text(2, value)) for name, value in pairs)


def metric(labels: Iterable[tuple[str, str]], kind: str, value: float) -> bytes:
    """A counter's, gauge's or untyped metric's Metric message."""
    return _labels(labels) + _message(_VALUE_FIELDS[kind], _double(1, value))


def histogram(labels: Iterable[tuple[str, str]], total: float, buckets: Iterable[tuple[float, float]],
              count: float, native: bytes = b"") -> bytes:
    """A histogram's Metric message: its sum, its classic buckets (cumulative (le, count), finite
    ones: Prometheus adds +Inf from the count, as client_golang leaves it out) and `native` fields."""
    classic = b"".join(_message(3, _uint(1, int(n)) + _double(2, le)) for le, n in buckets)
    return _labels(labels) + _message(7, _uint(1, int(count)) + _double(2, total) + classic + native)


@dataclass(frozen=True)
class NativeLayout:
    """Where the buckets of one layout of cumulative counts go among the native buckets: the first
    bucket (from 0) is the zero bucket, each later run of them (`ends`: the index of its last) one
    native bucket (`indices`)."""

    zero_threshold: float
    ends: tuple[int, ...]
    indices: tuple[int, ...]


def _native_index(seconds: float) -> int:
    """The schema-3 bucket holding `seconds`: bucket i is (2^((i-1)/8), 2^(i/8)]."""
    return math.ceil(math.log2(seconds) * (1 << SCHEMA))


@functools.cache
def native_layout(bounds: tuple[float, ...]) -> NativeLayout:
    """The native buckets of cumulative counts whose upper bounds are `bounds` (ascending, +Inf last):
    each bucket goes whole into the native bucket of its geometric mid-point, the one from 0 into the
    zero bucket. The last bucket (+Inf: 32.8 s and up, the kernel's overflow) has no mid-point: it goes
    into the native bucket of its lower edge, as histogram_quantile reads +Inf as its lower edge too."""
    edges = [*(math.sqrt(low * high) for low, high in itertools.pairwise(bounds[:-1])), bounds[-2]]
    ends: list[int] = []
    indices: list[int] = []
    for end, index in enumerate(map(_native_index, edges), start=1):
        if indices and indices[-1] == index:  # finer buckets than the schema's share one
            ends[-1] = end
        else:
            ends.append(end)
            indices.append(index)
    return NativeLayout(bounds[0], tuple(ends), tuple(indices))


def native(layout: NativeLayout, cumulative: Sequence[float]) -> bytes:
    """The native histogram fields of cumulative counts in `layout`: schema, zero bucket, and only
    the buckets that hold something (spans of consecutive ones, each count as a delta to the last)."""
    spans: list[list[int]] = []
    deltas: list[int] = []
    below = cumulative[0]
    last_index, last_count = 0, 0
    for index, end in zip(layout.indices, layout.ends, strict=True):
        count = int(cumulative[end] - below)
        below = cumulative[end]
        if not count:
            continue
        if spans and index == last_index + 1:
            spans[-1][1] += 1
        else:
            spans.append([index - last_index - 1 if spans else index, 1])
        deltas.append(count - last_count)
        last_index, last_count = index, count
    packed = b"".join(_varint(_zigzag(delta)) for delta in deltas)
    return (_uint(5, _zigzag(SCHEMA)) + _double(6, layout.zero_threshold) + _uint(7, int(cumulative[0]))
            + b"".join(_message(12, _uint(1, _zigzag(offset)) + _uint(2, length)) for offset, length in spans)
            + (_message(13, packed) if packed else b""))
