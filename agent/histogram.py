"""Cumulative histograms as (le_seconds, count) buckets: quantiles and windows of recent changes."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

Buckets = Sequence[tuple[float, float]]  # cumulative (upper bound in seconds, count), ascending
NS_PER_SECOND = 1e9


# The kernel's log-linear histogram (`struct hist`, bpf/common.h): durations in units of 2^-14 ms;
# slot i < 32 holds units [i, i + 1), slot 16 * s + m (16 <= m < 32) holds [m * 2^s, (m + 1) * 2^s),
# the last slot everything above. Every m * 2^k ms with m < 32 is an edge.
HIST_SUB = 16
HIST_SLOTS = 433
UNITS_PER_MS = 2 ** 14


def _slot_upper_units(index: int) -> int:
    if index < 2 * HIST_SUB:
        return index + 1
    shift, mantissa = divmod(index, HIST_SUB)
    return (mantissa + HIST_SUB + 1) << (shift - 1)


def _units_to_seconds(units: int) -> float:
    return units / UNITS_PER_MS / 1000  # two exact-as-possible divisions: 50 ms reads 0.05


# The `le` bounds exported (Prometheus, JSON): 3 per power of two, 7.8 us to 32.8 s. Each is a kernel
# edge (so its count is exact), among them the shipped rules' thresholds 2, 5, 20 and 50 ms.
_EXPORTED_UNITS = tuple(sorted({m << s for s in range(3, 25) for m in (16, 20, 25)} | {16 << 25}))
_SLOT_BY_UPPER = {_slot_upper_units(i): i for i in range(HIST_SLOTS - 1)}
EXPORTED_BOUNDS = tuple(_units_to_seconds(u) for u in _EXPORTED_UNITS)


def kernel_buckets(slots: Sequence[int]) -> list[tuple[float, int]]:
    """Cumulative (le_seconds, count) of every slot of a `struct hist`, the last one +Inf: full
    resolution, for quantiles."""
    buckets, total = [], 0
    for index, count in enumerate(slots):
        total += count
        upper = math.inf if index == len(slots) - 1 else _units_to_seconds(_slot_upper_units(index))
        buckets.append((upper, total))
    return buckets


def exported_buckets(fine: Sequence[tuple[float, int]]) -> list[tuple[float, int]]:
    """The bounded set of buckets shown to users (EXPORTED_BOUNDS and +Inf) from kernel_buckets():
    exact counts, since each bound is a kernel edge."""
    picked = [(le, fine[_SLOT_BY_UPPER[units]][1]) for le, units in zip(EXPORTED_BOUNDS, _EXPORTED_UNITS, strict=True)]
    return [*picked, (math.inf, fine[-1][1])]


def buckets_to_json(buckets: Buckets) -> list[dict]:
    """[{"le_seconds", "count"}], with the open bucket's bound written "+Inf" as Prometheus does."""
    return [{"le_seconds": "+Inf" if math.isinf(le) else le, "count": count} for le, count in buckets]


def buckets_from_json(histogram: Iterable[Any]) -> list[tuple[float, float]]:
    """The inverse of buckets_to_json; also takes (le, count) pairs."""
    out = []
    for bucket in histogram or ():
        le, count = (bucket["le_seconds"], bucket["count"]) if isinstance(bucket, dict) else bucket
        out.append((math.inf if le is None else float(le), float(count)))
    return out


def quantile(buckets: Buckets, q: float) -> float | None:
    """The q-quantile, interpolated linearly inside its bucket as Prometheus' histogram_quantile
    does (the first bucket starts at 0). None without observations."""
    total = buckets[-1][1] if buckets else 0
    if total <= 0:
        return None
    rank = q * total
    previous_le, previous_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return previous_le
            lower = previous_le
            in_bucket = count - previous_count
            fraction = (rank - previous_count) / in_bucket if in_bucket else 1.0
            return lower + (le - lower) * fraction
        previous_le, previous_count = le, count
    return previous_le


class WindowedHistograms:
    """Per-source change of cumulative histograms over the last `window_seconds`, so alert rules
    judge recent behaviour rather than everything since start."""

    def __init__(self, window_seconds: float) -> None:
        self._window = window_seconds
        self._history: dict[Hashable, deque[tuple[float, tuple[float, ...]]]] = {}
        self._bounds: dict[Hashable, tuple[float, ...]] = {}

    def observe(self, source: Hashable, buckets: Buckets, now: float) -> list[tuple[float, float]]:
        """Record the current cumulative buckets; return the buckets of what changed in the window."""
        bounds = tuple(le for le, _ in buckets)
        counts = tuple(count for _, count in buckets)
        history = self._history.get(source)
        if history is None or self._bounds.get(source) != bounds or any(
                c < p for c, p in zip(counts, history[-1][1], strict=True)):
            # New source, new layout or a reset: everything counted so far is recent.
            history = self._history[source] = deque([(now, tuple(0.0 for _ in counts))])
        self._bounds[source] = bounds
        history.append((now, counts))
        while len(history) > 1 and now - history[1][0] >= self._window:
            history.popleft()
        oldest = history[0][1]
        return [(le, c - o) for le, c, o in zip(bounds, counts, oldest, strict=True)]

    def forget(self, keep: set[Hashable]) -> None:
        for source in set(self._history) - keep:
            del self._history[source]
            self._bounds.pop(source, None)


class Rates:
    """Per-second rate of cumulative counters, per source, between consecutive observations."""

    def __init__(self) -> None:
        self._last: dict[Hashable, tuple[float, float]] = {}

    def rate(self, source: Hashable, value: float, now: float) -> float:
        last = self._last.get(source)
        self._last[source] = (now, value)
        if last is None or now <= last[0] or value < last[1]:
            return 0.0
        return (value - last[1]) / (now - last[0])

    def forget(self, keep: set[Hashable]) -> None:
        self._last = {k: v for k, v in self._last.items() if k in keep}
