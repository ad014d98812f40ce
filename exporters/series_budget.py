"""The series budget (`max_series`): past it, the least active label sets of the largest counter and
histogram families fold into one row whose every label is "other", so a family's totals still add up.

Folding is sticky: a folded label set stays in `other` until it leaves /metrics (idle_series_seconds),
and `other` keeps what its members counted after they leave, so it only grows, as a counter must.
Which families fold, and how far: each keeps at most K label sets of its own, K the largest that fits
the budget (water-filling: the families with the most label sets give them up first). Gauges never
fold: a sum of ratios or queue lengths would mean nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

OTHER = "other"

Labels = tuple[str, ...]
Row = tuple[Labels, list[float]]


def most_kept(families: Sequence[tuple[int, int, bool]], room: int) -> int | None:
    """K, the most label sets any foldable family keeps so that their series fit `room`. Each family:
    (its label sets not folded, the series of one, whether it has an `other` row already); it shows
    min(n, K) of its own label sets and an `other` row where it folds any. None where all fit whole."""
    def series(kept: int) -> int:
        return sum(cost * (min(n, kept) + (n > kept or folded)) for n, cost, folded in families)

    most = max((n for n, _, _ in families), default=0)
    if series(most) <= room:
        return None
    low, high = 0, most  # series(0) is the least there is: the largest K that fits, or 0
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if series(middle) <= room else (low, middle - 1)
    return low


class Folding:
    """One family's folded label sets and its `other` row."""

    def __init__(self) -> None:
        self.members: dict[Labels, list[float]] = {}  # folded label set -> its values when last seen
        self._left: list[float] = []  # what members that left /metrics had counted
        self._last_totals: dict[Labels, float] = {}
        self._width = 0  # labels per label set
        self.folded_total = 0  # label sets folded since start

    def _own(self, rows: list[Row]) -> list[Row]:
        """`rows` less the folded (all of them, as they are, where nothing is: every scrape's case
        under the budget)."""
        return [row for row in rows if row[0] not in self.members] if self.members else rows

    @property
    def folds(self) -> bool:
        """Whether it shows an `other` row."""
        return bool(self.members or self._left)

    def unfolded(self, rows: list[Row]) -> int:
        """How many of `rows` are not folded (and so count against the budget)."""
        return len(self._own(rows))

    def apply(self, rows: list[Row], keep: int | None) -> list[Row]:
        """`rows` with the members' and, where more than `keep` remain, the least active ones folded
        into one `other` row. Activity: the growth of the sum of a row's values (a histogram's counts,
        a counter) since the budget last bound (nothing is kept while it does not)."""
        own = self._own(rows)
        if keep is not None and len(own) > keep:
            totals = {labels: sum(values) for labels, values in own}
            growth = {labels: total - self._last_totals.get(labels, 0.0) for labels, total in totals.items()}
            self._last_totals = totals
            quiet = sorted(own, key=lambda row: growth[row[0]])[:len(own) - keep]
            self.members.update((labels, values) for labels, values in quiet)
            self.folded_total += len(quiet)
            self._width = len(quiet[0][0])
        if not self.members:
            return rows
        present = {labels: values for labels, values in rows if labels in self.members}
        for labels in [labels for labels in self.members if labels not in present]:  # it left /metrics
            self._left = _added(self._left, self.members.pop(labels))
        self.members.update(present)
        other = _added(self._left, *present.values())
        kept = [row for row in rows if row[0] not in self.members]
        return [*kept, ((OTHER,) * self._width, other)] if other else kept


def _added(*rows: Sequence[float]) -> list[float]:
    """The rows' values summed column by column, in order (an empty row adds nothing): hundreds of
    folded rows in one pass per column."""
    return [sum(column) for column in zip(*(row for row in rows if row), strict=True)]
