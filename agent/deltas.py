"""The one delta/rate engine: increases of cumulative values per record identity.

Every "previous value" the agent keeps lives here, keyed by what a record *is* (a process is
(pid, start time, cgroup id), a flow its key; `model.*.identity()`), never by a pid alone. So a
process with entries under two cgroups is two sources, a reused pid is a new source, and a source
that vanishes (exit, eviction) is forgotten at the end of the round in which it was not seen.

- `Deltas.increase()`: what a source added since the previous round (a decrease is a restart:
  everything counts as new);
- `Totals`: those increases summed per label set, so exported counters stay monotonic while
  their sources come and go;
- `Rates`: increases per second over the time between rounds;
- `Window`: the increases of the last `seconds`, so alert rules judge recent behaviour.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, TypeVar

Values = Sequence[float]
Labels = TypeVar("Labels", bound=Hashable)


def _added(values: Values, last: Values | None) -> list[float]:
    if last is None or len(last) != len(values):
        return list(values)
    increase = [v - p for v, p in zip(values, last, strict=True)]
    return list(values) if min(increase, default=0.0) < 0 else increase


class Deltas:
    """Increase of each source's cumulative values since the previous round."""

    def __init__(self) -> None:
        self._last: dict[Hashable, Values] = {}
        self._seen: set[Hashable] = set()

    def increase(self, source: Hashable, values: Values) -> list[float]:
        self._seen.add(source)
        added = _added(values, self._last.get(source))
        self._last[source] = values
        return added

    def end_round(self) -> None:
        """Forget sources not seen since the previous call (a returning key then counts afresh)."""
        self._last = {k: v for k, v in self._last.items() if k in self._seen}
        self._seen = set()

    def known(self, source: Hashable) -> bool:
        return source in self._last


class Totals(Generic[Labels]):
    """Monotonic sums per label set of the increases of every source carrying those labels. With
    `idle_seconds`, a label set no source carried for that long is dropped (short-lived processes
    would otherwise pile up series for ever); should it return, it counts from zero, which
    Prometheus reads as a counter reset."""

    def __init__(self, idle_seconds: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.deltas = Deltas()
        self.sums: dict[Labels, list[float]] = {}
        self._idle = idle_seconds
        self._clock = clock
        self._seen: set[Labels] = set()
        self._seen_at: dict[Labels, float] = {}

    def add(self, labels: Labels, source: Hashable, values: Values) -> list[float]:
        """Add the source's increase to its label set; returns the increase."""
        self._seen.add(labels)
        added = self.deltas.increase(source, values)
        current = self.sums.get(labels)
        if current is None or len(current) != len(added):  # a new label set, or a new layout: start over
            current = self.sums[labels] = [0.0] * len(added)
        for i, value in enumerate(added):
            current[i] += value
        return added

    def end_round(self) -> None:
        self.deltas.end_round()
        if self._idle is None:
            return
        now = self._clock()
        self._seen_at.update(dict.fromkeys(self._seen, now))
        self._seen = set()
        for labels in [labels for labels, at in self._seen_at.items() if now - at > self._idle]:
            del self._seen_at[labels]
            self.sums.pop(labels, None)


class Rates:
    """Per-second increase of each source's values between consecutive rounds (0 the first time)."""

    def __init__(self) -> None:
        self._deltas = Deltas()
        self._times: dict[Hashable, float] = {}

    def rate(self, source: Hashable, values: Values, now: float) -> list[float]:
        last = self._times.get(source)
        self._times[source] = now
        added = self._deltas.increase(source, values)
        if last is None or now <= last:
            return [0.0] * len(values)
        return [value / (now - last) for value in added]

    def end_round(self) -> None:
        self._deltas.end_round()
        self._times = {k: v for k, v in self._times.items() if self._deltas.known(k)}


class Window:
    """Per source, the sum of its increases over the last `seconds` (its first values count as recent)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._deltas = Deltas()
        self._history: dict[Hashable, deque[tuple[float, list[float]]]] = {}

    def recent(self, source: Hashable, values: Values, now: float) -> list[float]:
        added = self._deltas.increase(source, values)
        history = self._history.setdefault(source, deque())
        if history and len(history[-1][1]) != len(added):
            history.clear()
        history.append((now, added))
        while history and now - history[0][0] >= self.seconds:
            history.popleft()
        return [sum(column) for column in zip(*(values for _, values in history), strict=True)]

    def end_round(self) -> None:
        self._deltas.end_round()
        self._history = {k: v for k, v in self._history.items() if self._deltas.known(k)}
