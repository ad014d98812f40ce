"""Bottleneck rules: thresholds with a `for` duration and hysteresis; pending -> firing -> resolved.

The agent turns each refresh into `Signal`s (one number per rule and target, with the evidence that
explains it); the engine keeps per-(rule, target) state and returns the transitions, which the alert
outputs (JSON lines, Alertmanager) and `aiprobe_bottleneck_active` consume.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from .config import RuleConfig
from .model import Alert

RESOLVED_RETENTION_SECONDS = 15 * 60


@dataclass(frozen=True)
class RuleSpec:
    """What a rule means: which way its value crosses the threshold, a sentence for humans, and the
    same rule in PromQL for deploy/prometheus/aiprobe-rules.yml (generated from these definitions and
    the thresholds of config.DEFAULT_RULES: `python -m aiprobe.rules`).

    `query` is what the agent's value is in PromQL; the rule file compares it with the threshold the
    same way the engine does, then adds `guard`. In the Prometheus texts, %(threshold)s,
    %(threshold_percent)s and %(traffic_floor)s stand for the configured values."""

    fires_below: bool
    summary: str
    query: str
    prometheus_summary: str
    description: str
    guard: str = ""


def _p99(histogram: str) -> str:
    return (f"histogram_quantile(0.99,\n  sum by (instance, process, container, le) "
            f"(rate({histogram}_bucket[1m]))\n)")


RULES: dict[str, RuleSpec] = {
    # Blocking senders wait in the send; asynchronous servers (uvicorn, vLLM's API server) never do:
    # their sockets stay unwritable instead. The agent takes the larger of the two p99s.
    "network_send_stall": RuleSpec(
        False, "sends block or sockets stay unwritable {value:.3g}s (p99) in {target}: full socket buffers "
        "(slow clients, backpressure or congestion)",
        _p99("aiprobe_tcp_sendmsg_duration_seconds"),
        "sends of {{ $labels.process }} in {{ $labels.container }} block or stay unwritable",
        "Full socket buffers: slow clients, backpressure or congestion.",
        guard="or\n" + _p99("aiprobe_tcp_socket_unwritable_seconds") + " > %(threshold)s"),
    "gpu_saturated": RuleSpec(
        False, "{target} is {value:.0%} busy: the GPU is the bottleneck",
        "aiprobe_gpu_utilization_ratio", "GPU {{ $labels.gpu }} is saturated", "The GPU is the bottleneck."),
    "gpu_idle_with_traffic": RuleSpec(
        True, "{target} is only {value:.0%} busy while the endpoint receives traffic: "
        "the bottleneck is on the host side (CPU, scheduling, batching, network)",
        "aiprobe_gpu_utilization_ratio", "GPU {{ $labels.gpu }} is idle while the endpoint receives traffic",
        "The bottleneck is on the host side: CPU, scheduling, batching or network.",
        guard="and on (instance) (sum by (instance) (rate(aiprobe_interface_bytes_total{direction=\"ingress\"}[1m]))"
              " > %(traffic_floor)s)"),
    "gpu_threads_starved": RuleSpec(
        False, "GPU-driving threads of {target} wait {value:.3g}s (p99) for a CPU: the GPU is starved by the host",
        _p99("aiprobe_gpu_thread_runqueue_delay_seconds"),
        "GPU-driving threads of {{ $labels.process }} wait for a CPU",
        "Run-queue delay p99 of GPU-driving threads is high: the GPU is starved by the host."),
    "cuda_context_switch_storm": RuleSpec(
        False, "{target} switches CUDA contexts {value:.0f} times/s: context-switch overhead",
        "sum by (instance, process, container) (rate(aiprobe_cuda_context_switches_total[1m]))",
        "{{ $labels.process }} switches CUDA contexts more than %(threshold)s times/s",
        "CUDA context-switch overhead."),
    "gpu_time_sliced": RuleSpec(
        False, "{target} is time-sliced between {value:.0f} busy CUDA contexts: each switch saves and restores "
        "the GPU's state (merge the work into one context or process, or use MPS)",
        "aiprobe_gpu_active_contexts",
        "GPU {{ $labels.gpu }} is time-sliced between {{ $value }} busy CUDA contexts",
        "Each switch between contexts saves and restores the GPU's state: merge the work into one context or "
        "process, or use MPS."),
    "gpu_context_switch_overhead": RuleSpec(
        False, "{target} spends {value:.0%} of its time switching contexts (its busiest graphics engine): "
        "time-slicing overhead (fewer contexts per GPU, merge the work into one process, or use MPS)",
        "max by (instance, gpu, uuid) (aiprobe_gpu_context_switching_ratio)",
        "GPU {{ $labels.gpu }} spends more than %(threshold_percent)s of its time switching contexts",
        "The GPU saves and restores contexts' state instead of running kernels: fewer contexts per GPU, "
        "merge the work into one context or process, or use MPS."),
    "listen_queue_overflow": RuleSpec(
        False, "{value:.3g} connections/s overflow or drop at listen queues: accept backlog too small "
        "or the server accepts too slowly",
        # ListenDrops alone: the kernel counts every ListenOverflows in ListenDrops too.
        "rate(aiprobe_tcp_listen_drops_total[1m])",
        "Connections overflow or drop at listen queues",
        "Accept backlog too small, or the server accepts too slowly."),
    "tcp_retransmits_high": RuleSpec(
        False, "{value:.1%} of TCP segments are retransmitted: network loss",
        "rate(aiprobe_tcp_retransmitted_segments_total[5m]) / rate(aiprobe_tcp_sent_segments_total[5m])",
        "More than %(threshold_percent)s of TCP segments are retransmitted",
        "Network loss between this host and its peers.",
        guard="and rate(aiprobe_tcp_sent_segments_total[5m]) > 1"),
    "token_streams_stalling": RuleSpec(
        False, "token streams of {target} stalled {value:.0f} times in the last 10 s (the evidence names the "
        "cause: network, cpu, gpu or server)",
        "sum by (instance, process, container, cause) (increase(aiprobe_stream_stalls_total[1m]))",
        "token streams of {{ $labels.process }} stall (cause: {{ $labels.cause }})",
        "Gaps between writes of streamed responses above stream_stall_threshold_ms. The cause label says "
        "why: network (the socket was full), cpu (the writer waited for a CPU), gpu (the process was inside "
        "a CUDA synchronization), server (the application was slow to produce)."),
}


def alert_name(rule: str) -> str:
    """`network_send_stall` -> `AiprobeNetworkSendStall`, in Alertmanager and in the rule file."""
    return "Aiprobe" + "".join(part.title() for part in rule.split("_"))


@dataclass(frozen=True)
class Signal:
    """One measurement a rule looks at: the value compared with the threshold, and its evidence."""

    rule: str
    target: str
    value: float
    evidence: dict[str, Any] = field(default_factory=dict)


def summary(alert: Alert) -> str:
    return RULES[alert.rule].summary.format(value=alert.value, target=alert.target)


class RuleEngine:
    def __init__(self, rules: dict[str, RuleConfig]) -> None:
        self._rules = {name: cfg for name, cfg in rules.items() if cfg.enabled}
        self._active: dict[tuple[str, str], Alert] = {}
        self._resolved: list[Alert] = []

    def _crosses(self, rule: str, value: float, *, clearing: bool) -> bool:
        cfg, spec = self._rules[rule], RULES[rule]
        limit = cfg.clear_threshold if clearing else cfg.threshold
        return value < limit if spec.fires_below else value > limit

    def evaluate(self, signals: list[Signal], now: float) -> list[Alert]:
        """Update state from this refresh's signals; return copies of alerts that changed state."""
        changed: list[Alert] = []
        seen: set[tuple[str, str]] = set()
        for signal in signals:
            if signal.rule not in self._rules:
                continue
            key = (signal.rule, signal.target)
            seen.add(key)
            alert = self._active.get(key)
            holds = self._crosses(signal.rule, signal.value, clearing=alert is not None)
            if alert is None and holds:
                alert = self._open(signal, now)
                changed.append(copy.deepcopy(alert))
            elif alert is not None and holds:
                alert.value, alert.evidence = signal.value, signal.evidence
                alert.summary = summary(alert)
            elif alert is not None:
                changed.extend(self._close(alert, now))
                continue
            if alert is not None and alert.state == "pending" and now - alert.active_since >= self._for(alert):
                alert.state, alert.since = "firing", now
                changed.append(copy.deepcopy(alert))
        for key in set(self._active) - seen:  # the target vanished: its condition no longer holds
            changed.extend(self._close(self._active[key], now))
        self._resolved = [a for a in self._resolved if now - (a.resolved_at or now) < RESOLVED_RETENTION_SECONDS]
        return changed

    def _for(self, alert: Alert) -> float:
        return self._rules[alert.rule].for_seconds

    def _open(self, signal: Signal, now: float) -> Alert:
        alert = Alert(signal.rule, self._rules[signal.rule].severity, signal.target, "pending", signal.value,
                      signal.evidence, active_since=now, since=now)
        alert.summary = summary(alert)
        self._active[alert.key] = alert
        return alert

    def _close(self, alert: Alert, now: float) -> list[Alert]:
        """A firing alert becomes resolved (and is kept a while); a pending one becomes inactive."""
        del self._active[alert.key]
        if alert.state == "firing":
            alert.state, alert.since, alert.resolved_at = "resolved", now, now
            self._resolved.append(alert)
        else:
            alert.state, alert.since = "inactive", now
        return [copy.deepcopy(alert)]

    @property
    def active(self) -> list[Alert]:
        return list(self._active.values())

    @property
    def firing(self) -> list[Alert]:
        return [a for a in self._active.values() if a.state == "firing"]

    @property
    def resolved(self) -> list[Alert]:
        return list(self._resolved)
