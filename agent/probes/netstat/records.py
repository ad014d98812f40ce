"""The netstat probe's records: host-wide TCP counters."""

from __future__ import annotations

from dataclasses import dataclass

from ...model import Record


@dataclass
class TcpCounters(Record):
    """Host-wide kernel TCP counters (/proc/net/netstat, /proc/net/snmp), monotonic."""

    listen_overflows: int
    listen_drops: int
    retransmitted_segments: int
    sent_segments: int


@dataclass
class TcpSummary(TcpCounters):
    """The snapshot's `tcp`: the counters and the ratio since boot."""

    retransmit_ratio: float = 0.0
