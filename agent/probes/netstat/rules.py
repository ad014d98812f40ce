"""The host TCP counters' bottleneck rules: what each means, its PromQL and its default thresholds
(`[rules.<name>]` overrides them)."""

from __future__ import annotations

from ...config import RuleConfig
from ...rules import RuleSpec

LISTEN_QUEUE_OVERFLOW = RuleSpec(
    False, "{value:.3g} connections/s overflow or drop at listen queues: accept backlog too small "
    "or the server accepts too slowly",
    # ListenDrops alone: the kernel counts every ListenOverflows in ListenDrops too.
    "rate(aiprobe_tcp_listen_drops_total[1m])",
    "Connections overflow or drop at listen queues",
    "Accept backlog too small, or the server accepts too slowly.",
    name="listen_queue_overflow",
    # listen-queue drops per second (TcpExt ListenDrops, which counts every overflow too)
    default=RuleConfig(threshold=1.0, clear=0.0, for_seconds=0, severity="critical"),
)


TCP_RETRANSMITS_HIGH = RuleSpec(
    False, "{value:.1%} of TCP segments are retransmitted: network loss",
    "rate(aiprobe_tcp_retransmitted_segments_total[5m]) / rate(aiprobe_tcp_sent_segments_total[5m])",
    "More than %(threshold_percent)s of TCP segments are retransmitted",
    "Network loss between this host and its peers.",
    guard="and rate(aiprobe_tcp_sent_segments_total[5m]) > 1",
    name="tcp_retransmits_high",
    # retransmitted / sent TCP segments
    default=RuleConfig(threshold=0.02, clear=0.01, for_seconds=30, severity="warning"),
)
