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
    """What a rule means: which way its value crosses the threshold, and a sentence for humans."""

    fires_below: bool
    summary: str


RULES: dict[str, RuleSpec] = {
    "network_send_stall": RuleSpec(
        False, "tcp_sendmsg p99 {value:.3g}s in {target}: sends block on full socket buffers "
        "(slow clients, backpressure or congestion)"),
    "gpu_saturated": RuleSpec(False, "{target} is {value:.0%} busy: the GPU is the bottleneck"),
    "gpu_idle_with_traffic": RuleSpec(
        True, "{target} is only {value:.0%} busy while the endpoint receives traffic: "
        "the bottleneck is on the host side (CPU, scheduling, batching, network)"),
    "gpu_threads_starved": RuleSpec(
        False, "GPU-driving threads of {target} wait {value:.3g}s (p99) for a CPU: the GPU is starved by the host"),
    "cuda_context_switch_storm": RuleSpec(
        False, "{target} switches CUDA contexts {value:.0f} times/s: context-switch overhead"),
    "listen_queue_overflow": RuleSpec(
        False, "{value:.3g} connections/s overflow or drop at listen queues: accept backlog too small "
        "or the server accepts too slowly"),
    "tcp_retransmits_high": RuleSpec(False, "{value:.1%} of TCP segments are retransmitted: network loss"),
}


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
