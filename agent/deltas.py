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

import functools
import itertools
import operator
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, Generic, TypeVar, cast

import numpy as np

Values = Sequence[float]
TableRow = Values | np.ndarray[Any, np.dtype[Any]]  # one source's values in a table add_all() takes
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
    """Monotonic sums per label set of the increases of every source carrying those labels, worked out
    for a whole table at once (`add_all`: numpy over its rows, where a refresh adds thousands). With
    `idle_seconds`, a label set no source carried for that long is dropped (short-lived processes
    would otherwise pile up series for ever); should it return, it counts from zero, which
    Prometheus reads as a counter reset."""

    def __init__(self, idle_seconds: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._sums: dict[int, _Sums[Labels]] = {}  # by width (one, but where a layout changes)
        self._last: dict[Hashable, Row] = {}  # each source's values at its last add
        self._sources_seen: set[Hashable] = set()
        self._idle = idle_seconds
        self._clock = clock
        self._seen: set[Labels] = set()
        self._seen_at: dict[Labels, float] = {}

    @property
    def sums(self) -> dict[Labels, list[float]]:
        """Each label set's sums, as they are now (new lists: later adds leave them be)."""
        return {labels: row for sums in self._sums.values() for labels, row in sums.items()}

    def labels(self) -> set[Labels]:
        return {labels for sums in self._sums.values() for labels in sums.index}

    def drop(self, labels: Iterable[Labels]) -> None:
        """Forget these label sets' sums (should one come back, it counts from zero)."""
        gone = set(labels)
        for width, sums in list(self._sums.items()):
            if not sums.drop(gone):
                del self._sums[width]

    def add(self, labels: Labels, source: Hashable, values: Values) -> bool:
        """Add the source's increase to its label set; returns whether all its values counted (a new or
        restarted source)."""
        return self.add_all([labels], [source], [values])[0]

    def add_all(self, labels: Sequence[Labels], sources: Sequence[Hashable],
                values: Sequence[TableRow] | Matrix) -> list[bool]:
        """add() for each (labels, source, values) in turn: whether each counted all its values (`values`: a
        row per source, or a matrix of them)."""
        whole = [False] * len(sources)
        for rows in _batches(sources, values) if sources else ():
            table = values[rows] if isinstance(values, np.ndarray) else _matrix([values[i] for i in rows])
            counted = self._add_batch([labels[i] for i in rows], [sources[i] for i in rows], table)
            for i, counts_all in zip(rows, counted, strict=True):
                whole[i] = counts_all
        return whole

    def _add_batch(self, labels: list[Labels], sources: list[Hashable], values: Matrix) -> list[bool]:
        """add() for sources that each come once, with values of one width."""
        width = values.shape[1]
        lasts = [last if last is not None and len(last) == width else None for last in map(self._last.get, sources)]
        new = np.fromiter((last is None for last in lasts), bool, len(lasts))
        missing = np.zeros(width)
        last = np.array([missing if row is None else row for row in lasts]).reshape(values.shape)
        whole = new | (values < last).any(axis=1)  # new, or restarted: all its values count
        added = np.where(whole[:, np.newaxis], values, values - last)
        self._last.update(zip(sources, values, strict=True))
        self._sources_seen.update(sources)
        self._sum(labels, added)
        return cast(list[bool], whole.tolist())

    def _sum(self, labels: list[Labels], added: Matrix) -> None:
        """Adds each row of `added` to the sums of its labels (a label set in a new layout starts over)."""
        index: dict[Labels, int] = {}
        rows = [index.setdefault(row_labels, len(index)) for row_labels in labels]
        if len(index) < len(rows):  # label sets several sources carry
            summed = np.zeros((len(index), added.shape[1]))
            np.add.at(summed, rows, added)
            added = summed
        width = added.shape[1]
        sums = self._sums.setdefault(width, _Sums(width))
        if len(self._sums) > 1:  # label sets of another layout start over in this one
            self.drop(row_labels for row_labels in index if row_labels not in sums.index)
            sums = self._sums.setdefault(width, sums)
        sums.add(list(index), added)
        self._seen.update(index)

    def forget(self, sources: Iterable[Hashable]) -> None:
        """Forget these sources now, not at the end of the round: they will not be added again (their
        last values were their last)."""
        for source in sources:
            self._last.pop(source, None)

    def end_round(self) -> None:
        """Forget sources not added since the previous call (a returning one then counts afresh); drop
        label sets idle for longer than asked."""
        _forget_unseen(self._last, self._sources_seen)
        self._sources_seen = set()
        if self._idle is None:
            return
        now = self._clock()
        self._seen_at.update(dict.fromkeys(self._seen, now))
        self._seen = set()
        idle = [labels for labels, at in self._seen_at.items() if now - at > self._idle]
        for labels in idle:
            del self._seen_at[labels]
        if idle:
            self.drop(idle)


Matrix = np.ndarray[Any, np.dtype[np.float64]]
Row = Matrix  # one source's values: a row of the matrix of its batch


class _Sums(Generic[Labels]):
    """Sums of one width, a row of a matrix per label set: a table's rows added in one numpy call."""

    __slots__ = ("index", "rows")

    def __init__(self, width: int) -> None:
        self.index: dict[Labels, int] = {}  # label set -> its row
        self.rows: Matrix = np.zeros((0, width))

    def add(self, labels: list[Labels], added: Matrix) -> None:
        """Adds each row of `added` to its label set's (each label set once)."""
        index = self.index
        if new := [row_labels for row_labels in labels if row_labels not in index]:
            index.update(zip(new, range(len(index), len(index) + len(new)), strict=True))
            if len(index) > len(self.rows):  # room for twice as many: a few copies as a table grows
                grown = np.zeros((2 * len(index), self.rows.shape[1]))
                grown[:len(self.rows)] = self.rows
                self.rows = grown
        self.rows[np.fromiter(map(index.__getitem__, labels), np.intp, len(labels))] += added

    def items(self) -> Iterable[tuple[Labels, list[float]]]:
        return zip(self.index, self.rows[list(self.index.values())].tolist(), strict=True)

    def drop(self, labels: set[Labels]) -> int:
        """Forgets these label sets' rows (the others move up); returns how many are left."""
        if gone := labels & self.index.keys():
            kept = [(row_labels, row) for row_labels, row in self.index.items() if row_labels not in gone]
            self.rows = self.rows[[row for _, row in kept]].reshape(len(kept), self.rows.shape[1])
            self.index = {row_labels: i for i, (row_labels, _) in enumerate(kept)}
        return len(self.index)


def _batches(sources: Sequence[Hashable], values: Sequence[TableRow] | Matrix) -> Sequence[Sequence[int]]:
    """The rows in runs that numpy takes at once, in their order: one width, each source at most once
    (a source's next row starts the next run, as add() would take it after)."""
    if len(set(sources)) == len(sources) and (isinstance(values, np.ndarray) or len(set(map(len, values))) <= 1):
        return [range(len(sources))]
    runs: list[list[int]] = []
    in_run: set[Hashable] = set()
    for i, (source, row) in enumerate(zip(sources, values, strict=True)):
        if not runs or source in in_run or len(row) != len(values[runs[-1][0]]):
            runs.append([])
            in_run = set()
        runs[-1].append(i)
        in_run.add(source)
    return runs


def _matrix(values: list[TableRow]) -> Matrix:
    """Rows of one width as a float matrix."""
    return np.array(values, dtype=np.float64).reshape(len(values), -1)


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


@functools.cache
def _zeros(width: int) -> tuple[float, ...]:
    """The baseline of a source new to its window: one per width, not a list of its own per source."""
    return (0.0,) * width


class _Since:
    """One source's cumulative values of the rounds in a window, and those of the round before them
    (its baseline: zeros for a source first seen in the window)."""

    __slots__ = ("baseline", "rounds")

    def __init__(self, width: int) -> None:
        self.baseline: Values = _zeros(width)
        self.rounds: list[tuple[float, Values]] = []  # a few: a list, a tenth of a deque's size


class Window:
    """Per source, the sum of its increases over the last `seconds` (its first values count as recent;
    a decrease is a restart, whose window starts afresh): its values less those of the round before
    the window, one subtraction per value however many rounds the window holds."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._sources: dict[Hashable, _Since] = {}
        self._seen: set[Hashable] = set()

    def recent(self, source: Hashable, values: Values, now: float) -> list[float]:
        since = self._sources.get(source)
        baseline = self._baseline(source, since, values, now, since is None or restarted(values, since.rounds[-1][1]))
        return list(map(operator.sub, values, baseline))

    def recent_all(self, sources: Sequence[Hashable], values: Matrix, now: float) -> Matrix:
        """recent() of each source, its values a row of `values` (one width): the restarts and the
        subtraction for all of them at once (thousands of processes a refresh)."""
        known = list(map(self._sources.get, sources))
        width = values.shape[1]
        lasts = [None if since is None else since.rounds[-1][1] for since in known]
        fresh = [last is None or len(last) != width for last in lasts]
        last = np.array([row if new else last for row, last, new in zip(values, lasts, fresh, strict=True)], np.float64)
        restarts = (np.array(fresh, bool) | (values < last.reshape(values.shape)).any(axis=1)).tolist()
        baselines = list(map(self._baseline, sources, known, values, itertools.repeat(now), restarts))
        return values - np.array(baselines, np.float64).reshape(values.shape)

    def _baseline(self, source: Hashable, since: _Since | None, values: Values, now: float, restart: bool) -> Values:
        """The source's values before the window, its `values` now kept for the rounds to come (a
        restarted source starts a window of its own)."""
        self._seen.add(source)
        if since is None or restart:
            since = self._sources[source] = _Since(len(values))
        rounds = since.rounds
        rounds.append((now, values))
        while now - rounds[0][0] >= self.seconds:
            since.baseline = rounds.pop(0)[1]
        return since.baseline

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
