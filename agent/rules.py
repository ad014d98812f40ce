"""Bottleneck rules: thresholds with a `for` duration and hysteresis; pending -> firing -> resolved.

The agent turns each refresh into `Signal`s (one number per rule and target, with the evidence that
explains it); the engine keeps per-(rule, target) state and returns the transitions, which the alert
outputs (JSON lines, Alertmanager) and `aiprobe_bottleneck_active` consume.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .config import RuleConfig
from .model import Alert

RESOLVED_RETENTION_SECONDS = 15 * 60


@dataclass(frozen=True)
class RuleSpec:
    """A rule, declared by the probe whose figures it judges (its package's rules.py): which way its
    value crosses the threshold, a sentence for humans, the same rule in PromQL for
    deploy/prometheus/aiprobe-rules.yml (generated from these declarations), and its default
    thresholds.

    `query` is what the agent's value is in PromQL; the rule file compares it with the threshold the
    same way the engine does, then adds `guard`. In the Prometheus texts, %(threshold)s,
    %(threshold_percent)s and %(traffic_floor)s stand for the configured values."""

    fires_below: bool
    summary: str
    query: str
    prometheus_summary: str
    description: str
    guard: str = ""
    name: str = field(default="", kw_only=True)
    default: RuleConfig = field(default=RuleConfig(), kw_only=True)  # `[rules.<name>]` overrides it


@dataclass(frozen=True, kw_only=True)
class FleetRule:
    """A Prometheus rule over many nodes' series (a workload's replicas run on several nodes, each
    watched by its own agent), so PromQL only: no counterpart in the engine, no `[rules.<name>]`.
    A recording rule when `record` names its series, else an alert named after `name` as the
    engine's are (AiprobeXxx, label `rule`)."""

    expr: str
    record: str = ""
    name: str = ""
    for_seconds: float = 0
    severity: str = "warning"
    summary: str = ""
    description: str = ""


PROCESS = "instance, process, container"


def histogram_quantile(q: float, histogram: str, by: str, window: str, selector: str = "") -> str:
    """A histogram's q-quantile per `by` over `window`, in PromQL: from its classic buckets, or from
    its native histogram where Prometheus keeps that instead (native histograms on: 2.x drops the
    classic series then)."""
    return (f"(\n  histogram_quantile({q}, sum by ({by}, le) (rate({histogram}_bucket{selector}{window})))\n"
            f"  or histogram_quantile({q}, sum by ({by}) (rate({histogram}{selector}{window})))\n)")


def observation_rate(histogram: str, by: str, window: str, selector: str = "") -> str:
    """A histogram's observations per second per `by` over `window`, in PromQL: from its classic
    `_count`, or from its native histogram where Prometheus keeps that instead."""
    return (f"(\n  sum by ({by}) (rate({histogram}_count{selector}{window}))\n"
            f"  or sum by ({by}) (histogram_count(rate({histogram}{selector}{window})))\n)")


def p99(histogram: str) -> str:
    """A histogram's p99 over a minute, per process and container, in PromQL."""
    return histogram_quantile(0.99, histogram, PROCESS, "[1m]")


def added_in_window(counter: str, window: str = "5m") -> str:
    """What a counter added in the rule file's window, in PromQL: a series born within it (its first
    failure, its first Xid) has no sample `window` before, so it counts from 0."""
    return f"({counter} - ({counter} offset {window} or {counter} * 0))"


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


def settings(specs: Iterable[RuleSpec], configured: dict[str, RuleConfig]) -> dict[str, RuleConfig]:
    """Each rule's thresholds: the configured ones, else its declared defaults."""
    return {spec.name: configured.get(spec.name, spec.default) for spec in specs}


class RuleEngine:
    """Judges the signals of the declared rules with their thresholds (`configured` overrides
    the declared defaults)."""

    def __init__(self, specs: Iterable[RuleSpec], configured: dict[str, RuleConfig]) -> None:
        self._specs = {spec.name: spec for spec in specs}
        self.settings = settings(self._specs.values(), configured)
        self._rules = {name: cfg for name, cfg in self.settings.items() if cfg.enabled}
        self._active: dict[tuple[str, str], Alert] = {}
        self._resolved: list[Alert] = []

    def _summary(self, alert: Alert) -> str:
        return self._specs[alert.rule].summary.format(value=alert.value, target=alert.target)

    def _crosses(self, rule: str, value: float, *, clearing: bool) -> bool:
        cfg, spec = self._rules[rule], self._specs[rule]
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
                alert.summary = self._summary(alert)
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
        alert.summary = self._summary(alert)
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
