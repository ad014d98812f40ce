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
- `Window`: the increases of the last `seconds`, so alert rules judge recent behaviour;
- `Trend`: the last `seconds` and the `seconds` before them, so a rule can judge a change.
"""

from __future__ import annotations

import operator
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, Generic, TypeVar

Values = Sequence[float]
Labels = TypeVar("Labels", bound=Hashable)


def restarted(values: Values, last: Values) -> bool:
    """Whether cumulative `values` restarted since `last`: a new layout, or any of them fell."""
    return len(values) != len(last) or any(map(operator.lt, values, last))


def _forget_unseen(table: dict[Hashable, Any], seen: set[Hashable]) -> set[Hashable]:
    """Deletes the entries of `table` not in `seen`, and returns their keys: where most were seen (every
    round of a steady table), a few deletions, not a copy of the table."""
    unseen = table.keys() - seen
    for key in unseen:
        del table[key]
    return unseen


class Deltas:
    """Increase of each source's cumulative values since the previous round."""

    def __init__(self) -> None:
        self._last: dict[Hashable, Values] = {}
        self._seen: set[Hashable] = set()

    def increase(self, source: Hashable, values: Values) -> list[float]:
        added = self.added(source, values)
        return [0.0] * len(values) if added is None else list(added)

    def added(self, source: Hashable, values: Values) -> Iterable[float] | None:
        """What the source added since the previous round, as increase() says, or None where its values
        are those of the previous round: one comparison, where most sources of a large table did nothing."""
        self._seen.add(source)
        last = self._last.get(source)
        self._last[source] = values
        if last == values:
            return None
        if last is None or restarted(values, last):
            return values
        return map(operator.sub, values, last)

    def end_round(self) -> set[Hashable]:
        """Forget sources not seen since the previous call (a returning key then counts afresh); returns them."""
        forgotten = _forget_unseen(self._last, self._seen)
        self._seen = set()
        return forgotten


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

    def add(self, labels: Labels, source: Hashable, values: Values) -> bool:
        """Add the source's increase to its label set; returns whether all its values counted (a new or
        restarted source)."""
        self._seen.add(labels)
        current = self.sums.get(labels)
        if current is None or len(current) != len(values):  # a new label set, or a new layout: start over
            current = self.sums[labels] = [0.0] * len(values)
        added = self.deltas.added(source, values)
        if added is not None:
            current[:] = map(operator.add, current, added)
        return added is values

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
        for source in self._deltas.end_round():
            del self._times[source]


class _Since:
    """One source's cumulative values of the rounds in a window, and those of the round before them
    (its baseline: zeros for a source first seen in the window)."""

    __slots__ = ("baseline", "rounds")

    def __init__(self, width: int) -> None:
        self.baseline: Values = [0.0] * width
        self.rounds: deque[tuple[float, Values]] = deque()


class Window:
    """Per source, the sum of its increases over the last `seconds` (its first values count as recent;
    a decrease is a restart, whose window starts afresh): its values less those of the round before
    the window, one subtraction per value however many rounds the window holds."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._sources: dict[Hashable, _Since] = {}
        self._seen: set[Hashable] = set()

    def recent(self, source: Hashable, values: Values, now: float) -> list[float]:
        self._seen.add(source)
        since = self._sources.get(source)
        if since is None or restarted(values, since.rounds[-1][1]):
            since = self._sources[source] = _Since(len(values))
        since.rounds.append((now, values))
        while now - since.rounds[0][0] >= self.seconds:
            since.baseline = since.rounds.popleft()[1]
        return list(map(operator.sub, values, since.baseline))

    def end_round(self) -> None:
        """Forget sources not seen this round."""
        _forget_unseen(self._sources, self._seen)
        self._seen = set()


History = deque[tuple[float, list[float]]]


def _kept(history: History, now: float, added: list[float], seconds: float) -> History:
    """`history` with this round's values, less what is `seconds` old (all of it when their layout changed)."""
    if history and len(history[-1][1]) != len(added):
        history.clear()
    history.append((now, added))
    while now - history[0][0] >= seconds:
        history.popleft()
    return history


def _sums(rows: list[list[float]], width: int) -> list[float]:
    return [sum(column) for column in zip(*rows, strict=True)] if rows else [0.0] * width


def _means(sums: list[float]) -> list[float] | None:
    """Sums whose last column counts the rows -> the means of the others; None without a row."""
    return [value / sums[-1] for value in sums[:-1]] if sums[-1] else None


class Trend:
    """Per source, what the last `seconds` and the `seconds` before them saw, so a rule can judge a
    change (a share that fell, gaps that grew): `counts` sums the increases of cumulative values (the
    first values count as recent), `means` averages readings."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._deltas = Deltas()
        self._history: dict[Hashable, History] = {}
        self._seen: set[Hashable] = set()

    def _halves(self, source: Hashable, added: list[float], now: float) -> tuple[list[float], list[float]]:
        self._seen.add(source)
        history = _kept(self._history.setdefault(source, deque()), now, added, 2 * self.seconds)
        before = [values for at, values in history if now - at >= self.seconds]
        recent = [values for at, values in history if now - at < self.seconds]
        return _sums(before, len(added)), _sums(recent, len(added))

    def counts(self, source: Hashable, values: Values, now: float) -> tuple[list[float], list[float]]:
        """What cumulative `values` added in the window before the last and in the last."""
        return self._halves(source, self._deltas.increase(source, values), now)

    def means(self, source: Hashable, values: Values, now: float) -> tuple[list[float] | None, list[float] | None]:
        """The mean of the readings in the window before the last and in the last (None: no reading there)."""
        before, recent = self._halves(source, [*values, 1.0], now)
        return _means(before), _means(recent)

    def end_round(self) -> None:
        """Forget sources not seen this round."""
        self._deltas.end_round()
        _forget_unseen(self._history, self._seen)
        self._seen = set()
