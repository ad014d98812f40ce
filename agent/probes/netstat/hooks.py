"""The netstat probe in the agent's refresh: the host's listen-queue and retransmit rules, and the
snapshot's `tcp`."""

from __future__ import annotations

from typing import Any

from ...model import Readings
from ...refresh import Hooks, Refresh, Section
from ...rules import Signal
from .records import TcpCounters, TcpSummary

MIN_SEGMENTS_FOR_RETRANSMIT_RATIO = 100


class NetstatHooks(Hooks):
    sections = {"tcp": Section(TcpSummary, many=False)}

    def signals(self, reading: TcpCounters, readings: Readings, refresh: Refresh, now: float) -> list[Signal]:
        counters = [reading.listen_drops, reading.retransmitted_segments, reading.sent_segments]
        drops, retransmitted, sent = refresh.rate(("tcp",), counters, now)
        if refresh.elapsed <= 0:
            return []
        # ListenDrops alone: the kernel counts every ListenOverflows in ListenDrops too.
        signals = [Signal("listen_queue_overflow", "host", drops, {
            "listen_overflows": reading.listen_overflows, "listen_drops": reading.listen_drops,
            "per_second": round(drops, 3)})]
        if sent * refresh.elapsed >= MIN_SEGMENTS_FOR_RETRANSMIT_RATIO:
            signals.append(Signal("tcp_retransmits_high", "host", retransmitted / sent, {
                "retransmit_ratio": round(retransmitted / sent, 4), "segments_sent": round(sent * refresh.elapsed)}))
        return signals

    def snapshot(self, reading: TcpCounters) -> dict[str, Any]:
        ratio = reading.retransmitted_segments / reading.sent_segments if reading.sent_segments else 0.0
        return {"tcp": TcpSummary(**vars(reading), retransmit_ratio=ratio)}
