"""Alert outputs: one JSON line per state change, and Alertmanager's v2 API.

Alertmanager is fed the whole current picture (firing alerts, plus those resolved within the
retention window) on every change and again every `resend_seconds`, retrying until it answers. So
a transition made while Alertmanager is down for a few minutes still arrives once it is back, and
a firing alert whose agent died expires there on its own (`endsAt` runs a few resends ahead).
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import threading
import time
import urllib.error
import urllib.request
from datetime import UTC, datetime
from typing import IO, Any

from aiprobe.model import Alert
from aiprobe.rules import alert_name
from aiprobe.supervisor import SUPERVISOR

log = logging.getLogger("aiprobe.alerts")


def _iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, UTC).isoformat().replace("+00:00", "Z")


class JsonLinesSink:
    """Writes each alert transition as one JSON object per line (stdout for "-")."""

    def __init__(self, target: str = "-") -> None:
        self._file: IO[str] = sys.stdout if target == "-" else open(target, "a", buffering=1)  # noqa: SIM115
        self._owned = target != "-"
        self._target = target
        self.failures = 0  # transitions lost to a full disk, a vanished file system, a closed stdout

    def write(self, transitions: list[Alert], now: float) -> None:
        text = "".join(json.dumps({"time": _iso(now), **alert.to_dict()}, default=str) + "\n" for alert in transitions)
        try:
            self._file.write(text)
            self._file.flush()
        except (OSError, ValueError) as exc:  # the log is a copy of what the metrics and Alertmanager say
            self.failures += len(transitions)
            SUPERVISOR.alert_log_errors += len(transitions)
            if self.failures == len(transitions):  # the first loss is news; the count says the rest
                log.warning("alert log %s: %s; transitions are counted in aiprobe_alert_log_errors_total",
                            self._target, getattr(exc, "strerror", None) or exc)

    def close(self) -> None:
        if self._owned:
            with contextlib.suppress(OSError):  # what a full disk kept is lost either way
                self._file.close()


def alertmanager_payload(alert: Alert, *, instance: str, now: float, expires_after: float) -> dict[str, Any]:
    labels = {
        "alertname": alert_name(alert.rule),
        "rule": alert.rule,
        "severity": alert.severity,
        "target": alert.target,
        "instance": instance,
    }
    annotations = {
        "summary": alert.summary,
        "evidence": json.dumps(alert.evidence, sort_keys=True, default=str),
        **{f"evidence_{key}": str(value) for key, value in alert.evidence.items()},
    }
    ends = alert.resolved_at if alert.state == "resolved" and alert.resolved_at else now + expires_after
    return {"labels": labels, "annotations": annotations, "startsAt": _iso(alert.active_since), "endsAt": _iso(ends)}


class AlertmanagerPusher:
    """Posts the current alerts to `url`/api/v2/alerts from a background thread."""

    def __init__(self, url: str, *, instance: str, resend_seconds: float = 5.0, timeout: float = 3.0) -> None:
        self._endpoint = url.rstrip("/") + "/api/v2/alerts"
        self._instance = instance
        self._resend = resend_seconds
        self._timeout = timeout
        self._alerts: list[Alert] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.delivered = 0
        self.failures = 0
        self._last_error = ""
        self._thread = SUPERVISOR.start_thread("alertmanager", self._run, self._stop)

    def update(self, firing_and_resolved: list[Alert], *, changed: bool) -> None:
        with self._lock:
            self._alerts = list(firing_and_resolved)
        if changed:
            self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._resend)
            self._wake.clear()
            if not self._stop.is_set():
                self._post()

    def _post(self) -> None:
        now = time.time()
        with self._lock:
            payload = [alertmanager_payload(a, instance=self._instance, now=now, expires_after=4 * self._resend)
                       for a in self._alerts]
        if not payload:
            return
        request = urllib.request.Request(
            self._endpoint, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=self._timeout) as response:
                response.read()
            self.delivered += 1
            SUPERVISOR.notifications["success"] += 1
            if self._last_error:
                log.info("alertmanager %s: delivered again", self._endpoint)
                self._last_error = ""
        except Exception as exc:  # refused, timed out, HTTP errors, a URL http.client rejects: never the thread
            # Kept and sent again on the next round: Alertmanager may be restarting.
            self.failures += 1
            SUPERVISOR.notifications["failure"] += 1
            if str(exc) != self._last_error:  # each new failure once; the metric counts them all
                self._last_error = str(exc)
                log.warning("alertmanager %s: %s; will retry", self._endpoint, exc)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=self._timeout + 1)
