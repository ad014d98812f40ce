"""CPU budgets for work that cannot be made cheaper, only rarer.

- `CpuBudget`, for kernel-side work: the estimated CPU time of a probe's programs (event rate times a
  calibrated cost per event, an estimate that costs nothing to make) is kept within a fraction of one
  CPU by doing the costly part for 1 event, or 1 period, in N (N a power of two). Used by sendlat
  (timing 1 send in N) and cuda (launch uprobes attached 1/N of the time).
- `RefreshPacer`, for the agent's own refresh: its measured CPU time paces the next one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterator, Mapping
from contextlib import contextmanager

# N falls again (finer sampling) only once that would use at most this share of the budget.
BUDGET_HYSTERESIS = 0.7


class CpuBudget:
    """`cost(rate, every)`: the estimated CPU (fraction of one CPU) at `rate` events per second
    when the costly part runs for 1 in `every`. N is at most `max_every`."""

    def __init__(self, cpu_budget: float, max_every: int, cost: Callable[[float, int], float]) -> None:
        if cpu_budget <= 0:
            raise ValueError("cpu_budget must be positive")
        self.cpu_budget = cpu_budget
        self.max_every = max_every
        self._cost = cost
        self._last: dict[Hashable, float] = {}  # key -> its cumulative count at the last call
        self._last_time: float | None = None

    def rate(self, totals: Mapping[Hashable, float], now: float) -> float:
        """Events per second since the previous call, from cumulative counts per key (a key that
        appears counts all of its events, one that went counts none)."""
        new = sum(max(0.0, total - self._last.get(key, 0)) for key, total in totals.items())
        elapsed = now - self._last_time if self._last_time is not None else 0.0
        self._last, self._last_time = dict(totals), now
        return new / elapsed if elapsed > 0 else 0.0

    def every(self, rate: float, current: int, fixed: float = 0.0) -> int:
        """1-in-N for the coming interval: the finest N within budget (the coarsest there is when
        none is); coarser at once, finer only with room to spare. `fixed`: CPU the budget also pays
        for that no 1-in-N makes cheaper."""
        wanted = 1
        while wanted < self.max_every and self._cost(rate, wanted) + fixed > self.cpu_budget:
            wanted *= 2
        if wanted >= current or self._cost(rate, wanted) + fixed <= BUDGET_HYSTERESIS * self.cpu_budget:
            return wanted
        return current


# A paced refresh comes this many seconds after the last at most: half the rules' window
# (aiprobe.refresh.SIGNAL_WINDOW_SECONDS), which so still holds two reads.
MAX_PACED_SECONDS = 5.0


class RefreshPacer:
    """Keeps the agent's refreshes (reading every probe, joins, rules, the delta engine) within
    `budget` of one CPU, as the flow table paces its whole reads: the next refresh comes once the
    budget has paid for the CPU time the last one took, `interval` after it at least and
    MAX_PACED_SECONDS at most. A node with thousands of processes or endpoints is read less often,
    not at a higher cost; a budget of 0 refreshes every interval."""

    def __init__(self, interval: float, budget: float) -> None:
        self.interval = interval
        self._budget = budget
        self.wait = interval  # before the next refresh

    @property
    def longest(self) -> float:
        """The longest wait there can be between two refreshes."""
        return max(self.interval, MAX_PACED_SECONDS) if self._budget else self.interval

    @contextmanager
    def timed(self) -> Iterator[None]:
        """Around one refresh: its CPU time sets the wait before the next."""
        started = time.thread_time()
        yield
        if self._budget:
            self.wait = min(max(self.interval, (time.thread_time() - started) / self._budget), self.longest)
