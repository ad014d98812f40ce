"""gpu_contended: on one GPU (or MIG instance) a process's share fell while another's rose, and the first
one's token streams slowed in the same window (the p99 gap between their writes, or their p99 time to
first byte, grew): the contention as its users see it. Shares and stream figures are compared between the
last SIGNAL_WINDOW_SECONDS and the window before (`Refresh.trend`); the streams are the sendlat probe's
streams part's endpoints (none without it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...histogram import quantile
from ...model import Histogram
from ...refresh import SIGNAL_WINDOW_SECONDS, Refresh, target, trend_buckets
from ...rules import Signal
from ..sendlat.records import StreamEndpoint
from .records import GpuProcess
from .rules import MIN_SHARE_SHIFT


@dataclass(frozen=True)
class Change:
    """A figure over the window before the last and over the last."""

    before: float
    now: float


def _figure(name: str, change: Change | None, digits: int) -> dict[str, float | None]:
    """`name`_before and `name`_now (None where a window saw none)."""
    before, now = (None, None) if change is None else (round(change.before, digits), round(change.now, digits))
    return {f"{name}_before": before, f"{name}_now": now}


@dataclass(frozen=True)
class ShareChange:
    process: GpuProcess
    share: Change

    @property
    def moved(self) -> float:
        return self.share.now - self.share.before

    def evidence(self) -> dict[str, Any]:
        return {"pid": self.process.pid, "process": self.process.comm or str(self.process.pid),
                "container": self.process.container, **_figure("sm_utilization_ratio", self.share, 4)}


@dataclass(frozen=True)
class StreamChange:
    endpoint: StreamEndpoint
    gap_p99: Change | None
    ttfb_p99: Change | None

    @property
    def growth(self) -> float:
        """How many times its worse figure grew (0 when neither is known in both windows)."""
        return max((c.now / c.before for c in (self.gap_p99, self.ttfb_p99) if c is not None and c.before), default=0.0)

    def evidence(self) -> dict[str, Any]:
        return {"port": self.endpoint.port, "protocol": self.endpoint.protocol,
                **_figure("chunk_gap_p99_seconds", self.gap_p99, 6), **_figure("ttfb_p99_seconds", self.ttfb_p99, 6)}


def _p99_change(refresh: Refresh, kind: str, endpoint: StreamEndpoint, histogram: Histogram,
                now: float) -> Change | None:
    before, recent = trend_buckets(refresh, kind, endpoint.identity(), histogram, now)
    p99_before, p99_now = quantile(before, 0.99), quantile(recent, 0.99)
    return None if p99_before is None or p99_now is None else Change(p99_before, p99_now)


def _share_changes(processes: list[GpuProcess], refresh: Refresh, now: float) -> list[ShareChange]:
    changes = []
    for proc in processes:
        if proc.sm_utilization_ratio is None:
            continue
        before, recent = refresh.mean_trend(("gpu_share", proc.gpu_uuid, proc.pid, proc.comm),
                                            [proc.sm_utilization_ratio], now)
        if before is not None and recent is not None:
            changes.append(ShareChange(proc, Change(before[0], recent[0])))
    return changes


def _stream_changes(endpoints: list[StreamEndpoint], refresh: Refresh, now: float) -> dict[int, list[StreamChange]]:
    """pid -> how its endpoints' figures changed (every refresh, so the windows have a history)."""
    changes: dict[int, list[StreamChange]] = {}
    for endpoint in endpoints:
        changes.setdefault(endpoint.pid, []).append(StreamChange(
            endpoint, _p99_change(refresh, "contention_gaps", endpoint, endpoint.gap_histogram, now),
            _p99_change(refresh, "contention_ttfb", endpoint, endpoint.ttfb_histogram, now)))
    return changes


def _gpu_target(proc: GpuProcess) -> str:
    instance = "" if proc.gpu_instance_id is None else f" instance {proc.gpu_instance_id}"
    return f"{target(proc)} on gpu{proc.gpu_index}{instance}"


def contention_signals(processes: list[GpuProcess], endpoints: list[StreamEndpoint], refresh: Refresh,
                       now: float) -> list[Signal]:
    """Per process whose share fell while another's on its GPU rose: how many times its streams' worse
    figure grew, with both processes' shares and its stream's figures as evidence."""
    shares = _share_changes(processes, refresh, now)
    streams = _stream_changes([e for e in endpoints if e.pid in {s.process.pid for s in shares}], refresh, now)
    signals = []
    for victim in shares:
        rivals = [s for s in shares if s.process.gpu_uuid == victim.process.gpu_uuid and s.moved >= MIN_SHARE_SHIFT]
        slowed = max(streams.get(victim.process.pid, []), key=lambda change: change.growth, default=None)
        if victim.moved > -MIN_SHARE_SHIFT or not rivals or slowed is None or not slowed.growth:
            continue
        rival = max(rivals, key=lambda change: change.moved)
        signals.append(Signal("gpu_contended", _gpu_target(victim.process), slowed.growth, {
            "pid": victim.process.pid, "gpu": victim.process.gpu_index, "uuid": victim.process.gpu_uuid,
            "process": victim.evidence(),
            "rival": rival.evidence(), "stream": slowed.evidence(), "window_seconds": SIGNAL_WINDOW_SECONDS,
            "min_share_shift": MIN_SHARE_SHIFT}))
    return signals
