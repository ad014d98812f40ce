"""The send path's keys of the config file (docs/config.md): send latency's, the streams part's and the
requests part's."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...config import Settings, limits


@dataclass(frozen=True)
class SendLatencySettings(Settings):
    slow_send_threshold_ms: float = field(default=10.0, metadata=limits(0.001, 60_000.0))
    # Of one CPU, for sendlat's programs; past it, 1 send in N is timed.
    sendlat_cpu_budget: float = field(default=0.01, metadata=limits(0.0, 64.0))


@dataclass(frozen=True)
class StreamsSettings(Settings):
    stream_stall_threshold_ms: float = field(default=250.0, metadata=limits(1.0, 600_000.0))


@dataclass(frozen=True)
class RequestsSettings(Settings):
    # Off: no requests part, and none of its work on each send and receive (its cost, `make bench`).
    count_requests: bool = True
