"""What a probe adds to the agent's refresh, beyond its own read: its `Hooks`.

Each refresh, the agent reads every running probe, then calls each one's hooks in registry order:
`join` (who is behind its records), `rates` (per-second rates of its counters), `signals` (the rule
inputs it owns), `process_rows` (its columns of the snapshot's process table) and `snapshot` (its
sections of the snapshot document). A hook gets its own probe's reading; where a rule needs another
probe's figures (a GPU idle while the network is busy), it finds them in `Readings.of`, by the other
probe's record type: the probe depends on that probe, never the agent.

The agent offers hooks what they share through `Refresh`: the cgroup and socket joins, the rates,
the rules' recent window and, for rules that judge a change, the window before it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from .histogram import CumulativeBuckets, Histograms, bounds_of, counts_of, counts_table, with_counts
from .model import ProcessRow, Readings

if TYPE_CHECKING:
    from .config import Config, RuleConfig
    from .containers import Workload
    from .deltas import Matrix
    from .model import Histogram, Identity
    from .rules import Signal

# Alert rules judge latency histograms over this recent window rather than since start.
SIGNAL_WINDOW_SECONDS = 10.0


class Refresh(Protocol):
    """The agent's side of one refresh, as hooks see it."""

    config: Config
    elapsed: float  # seconds since the last refresh (0 at the first)

    def workload(self, cgroup_id: int, pid: int | None) -> Workload:
        """A record's cgroup when the kernel gave one, else its process's current cgroup."""

    def workload_of_pid(self, pid: int) -> Workload: ...

    def socket_owner(self, local_address: str, local_port: int, remote_address: str, remote_port: int) -> int | None:
        """The pid holding that socket, where the host's namespace holds it."""

    def comm(self, pid: int) -> str:
        """The kernel's comm of pid (its pid when gone), as probes' records carry it."""

    def rule(self, name: str) -> RuleConfig:
        """A rule's thresholds in force (for the evidence)."""

    def rate(self, source: tuple[Any, ...], counters: list[float] | list[int], now: float) -> list[float]:
        """Per-second rates of cumulative counters since the last refresh, by the source's identity."""

    def recent(self, source: tuple[Any, ...], counts: Sequence[float], now: float) -> list[float]:
        """What the last SIGNAL_WINDOW_SECONDS added to cumulative counts, by the source's identity."""

    def recent_all(self, sources: Sequence[tuple[Any, ...]], counts: Matrix, now: float) -> Matrix:
        """recent() of many sources at once, each one's counts a row of `counts`."""

    def trend(self, source: tuple[Any, ...], counts: Sequence[float],
              now: float) -> tuple[list[float], list[float]]:
        """What the SIGNAL_WINDOW_SECONDS before the last and the last added to cumulative counts."""

    def mean_trend(self, source: tuple[Any, ...], values: list[float],
                   now: float) -> tuple[list[float] | None, list[float] | None]:
        """The means of a reading over the SIGNAL_WINDOW_SECONDS before the last and over the last
        (None: no reading there)."""


def recent_buckets(refresh: Refresh, kind: str, identity: Identity, buckets: Histogram,
                   now: float) -> CumulativeBuckets:
    """The cumulative buckets of what the window saw of a source's histogram."""
    return with_counts(buckets, refresh.recent((kind, identity), counts_of(buckets), now))


def recent_p99s(refresh: Refresh, kind: str, records: Sequence[Any], histogram_of: Callable[[Any], Histogram],
                now: float) -> tuple[list[float | None], list[float]]:
    """Of each record's histogram (one layout for all), the p99 of what the window saw, and how many it saw:
    the windows and quantiles of all of them at once (thousands of processes a refresh)."""
    if not records:
        return [], []
    histograms = list(map(histogram_of, records))
    recent = refresh.recent_all([(kind, record.identity()) for record in records], counts_table(histograms), now)
    return Histograms(recent).quantiles(0.99, bounds_of(histograms[0])), recent[:, -1].tolist()


def trend_buckets(refresh: Refresh, kind: str, identity: Identity, buckets: Histogram,
                  now: float) -> tuple[CumulativeBuckets, CumulativeBuckets]:
    """The cumulative buckets of what the window before the last and the last saw of a source's histogram."""
    before, recent = refresh.trend((kind, identity), counts_of(buckets), now)
    return with_counts(buckets, before), with_counts(buckets, recent)


@dataclass
class ProcessRows:
    """The snapshot's process table being built: one row per pid, whichever probes saw it."""

    comm: Callable[[int], str]  # the kernel's comm of a pid, for rows whose record has none
    rows: dict[int, ProcessRow] = field(default_factory=dict)

    def row(self, record: Any) -> ProcessRow:
        """The row of a record's process (a record with pid, comm and the joined workload fields)."""
        return self.rows.setdefault(record.pid, ProcessRow(record.pid, record.comm or self.comm(record.pid),
                                                           record.container, record.namespace, record.pod,
                                                           record.pod_uid))


@dataclass(frozen=True)
class Section:
    """A section of the snapshot document a probe fills: a list of its records, or one record."""

    record: type
    many: bool = True

    @property
    def empty(self) -> list[Any] | dict[str, Any]:
        """How it reads while its probe is not running."""
        return [] if self.many else {}


class Hooks:
    """A probe's part in the refresh; every hook is optional. `reading` is what its probe's read()
    returned this refresh."""

    # The snapshot's sections this probe fills (`snapshot`), by name.
    sections: dict[str, Section] = {}

    def join(self, reading: Any, readings: Readings, refresh: Refresh) -> Iterable[int]:
        """Fill the joined fields (container, pod, socket owner); returns the pids it saw."""
        return ()

    def rates(self, reading: Any, refresh: Refresh, now: float) -> None:
        """Fill the per-second rates of its counters."""

    def signals(self, reading: Any, readings: Readings, refresh: Refresh, now: float) -> list[Signal]:
        """The rules' inputs it owns."""
        return []

    def process_rows(self, reading: Any, rows: ProcessRows) -> None:
        """Its columns of the process table."""

    def snapshot(self, reading: Any) -> dict[str, Any]:
        """Its sections of the snapshot document (keys of `sections`)."""
        return {}


NO_HOOKS = Hooks()


def target(record: Any) -> str:
    """A rule's target for a process's record: its comm (or pid) at its container."""
    return f"{record.comm or record.pid}@{record.container}"
