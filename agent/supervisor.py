"""Background parts of the agent under supervision. A part is a loop in its own thread (the CUDA
library scan, the link watcher, the Alertmanager pusher, the HTTP server) or a collector the
refresh loop calls. When a thread's loop raises, the supervisor logs it, counts it
(aiprobe_thread_restarts_total) and runs the loop again after a back-off, until its owner stops it;
collector failures are counted (aiprobe_collector_errors_total). A part that stays down longer than
a few refreshes makes /healthz fail, so the kubelet restarts an agent that cannot heal itself.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("aiprobe.supervisor")

FIRST_BACKOFF_SECONDS = 0.5
MAX_BACKOFF_SECONDS = 30.0
# A loop that ran this long before failing starts its back-off from the beginning again.
STABLE_SECONDS = 60.0
# A collector failing this many refreshes in a row is down.
FAILED_REFRESHES_DOWN = 3


@dataclass
class Part:
    name: str
    restarts: int = 0  # threads: times its loop was run again after raising
    errors: int = 0  # collectors: failed reads; threads: exceptions
    down_since: float | None = None  # monotonic time it failed and has not run again since
    consecutive_failures: int = 0
    last_error: str = ""
    collector: bool = False  # a collector of the refresh loop, not a thread
    logged: set[str] = field(default_factory=set)  # error texts logged already: each once


class Supervisor:
    def __init__(self) -> None:
        self.parts: dict[str, Part] = {}
        self._lock = threading.Lock()
        # Alert outputs: Alertmanager pushes by result, alert_log transitions lost.
        self.notifications: Counter[str] = Counter()
        self.alert_log_errors = 0

    def _part(self, name: str) -> Part:
        with self._lock:
            return self.parts.setdefault(name, Part(name))

    def _note_error(self, part: Part, exc: BaseException, what: str) -> None:
        part.errors += 1
        part.last_error = f"{type(exc).__name__}: {exc}"[:300]
        if part.last_error not in part.logged and len(part.logged) < 100:  # each distinct failure once
            part.logged.add(part.last_error)
            log.warning("%s %s failed: %s", what, part.name, part.last_error)

    # --- threads ---

    def start_thread(self, name: str, loop: Callable[[], None], stop: threading.Event) -> threading.Thread:
        """Run `loop` in a daemon thread until it returns or `stop` is set, running it again after a
        back-off whenever it raises."""
        part = self._part(name)
        thread = threading.Thread(target=self._run, args=(part, loop, stop), name=f"aiprobe-{name}", daemon=True)
        thread.start()
        return thread

    def _run(self, part: Part, loop: Callable[[], None], stop: threading.Event) -> None:
        backoff = FIRST_BACKOFF_SECONDS
        while not stop.is_set():
            started = time.monotonic()
            part.down_since = None
            try:
                loop()
                return
            except Exception as exc:  # the part, not the agent
                part.down_since = time.monotonic()
                self._note_error(part, exc, "thread")
            if time.monotonic() - started >= STABLE_SECONDS:
                backoff = FIRST_BACKOFF_SECONDS
            if stop.wait(backoff):
                return
            backoff = min(backoff * 2, MAX_BACKOFF_SECONDS)
            part.restarts += 1

    # --- collectors ---

    def collected(self, name: str, error: BaseException | None) -> None:
        """Record one read of collector `name`: None when it worked."""
        part = self._part(name)
        part.collector = True
        if error is None:
            part.consecutive_failures = 0
            part.down_since = None
            return
        self._note_error(part, error, "collector")
        part.consecutive_failures += 1
        if part.consecutive_failures >= FAILED_REFRESHES_DOWN and part.down_since is None:
            part.down_since = time.monotonic()

    def fill(self, readings: Any) -> None:
        """Copy the counts into one refresh's readings (model.Readings), for the exporter."""
        with self._lock:
            parts = list(self.parts.values())
        readings.collector_errors = {p.name: p.errors for p in parts if p.collector}
        readings.thread_restarts = {p.name: p.restarts for p in parts if not p.collector}
        readings.attach_errors = dict(ATTACHMENTS.errors)
        readings.notifications = dict(self.notifications)
        readings.alert_log_errors = self.alert_log_errors

    # --- health ---

    def down(self, longer_than: float) -> list[str]:
        """Parts down for longer than `longer_than` seconds."""
        now = time.monotonic()
        with self._lock:
            parts = list(self.parts.values())
        return [p.name for p in parts if p.down_since is not None and now - p.down_since > longer_than]


# --- attachments: per interface and per library ---

_REASONS = {
    errno.EBUSY: "busy", errno.EEXIST: "busy",  # another program holds the hook
    errno.EOPNOTSUPP: "unsupported", 524: "unsupported", errno.EINVAL: "unsupported",  # 524: ENOTSUPP
    errno.EPERM: "permission", errno.EACCES: "permission",
    errno.ENOENT: "gone", errno.ENODEV: "gone", errno.ENXIO: "gone", errno.ESRCH: "gone",
    errno.EMFILE: "resources", errno.ENFILE: "resources", errno.ENOMEM: "resources",
}


def attach_reason(exc: BaseException) -> str:
    """A bounded label value for why an attach failed."""
    return _REASONS.get(getattr(exc, "errno", None) or 0, "other")


class Attachments:
    """Attach failures by (probe, target, reason), each distinct failure of a target logged once;
    aiprobe_attach_errors_total."""

    def __init__(self) -> None:
        self.errors: dict[tuple[str, str, str], int] = {}
        self._logged: dict[tuple[str, str], str] = {}
        self._lock = threading.Lock()

    def failed(self, probe: str, target: str, reason: str, detail: str) -> None:
        with self._lock:
            key = (probe, target, reason)
            self.errors[key] = self.errors.get(key, 0) + 1
            if self._logged.get((probe, target)) == detail:
                return
            self._logged[(probe, target)] = detail
        log.warning("%s: cannot attach to %s (%s): %s; retrying with back-off", probe, target, reason, detail)

    def succeeded(self, probe: str, target: str) -> None:
        with self._lock:
            if self._logged.pop((probe, target), None) is not None:
                log.info("%s: attached to %s", probe, target)


class Backoff:
    """When to try a failed target again: after `first` seconds, doubling up to `most`."""

    def __init__(self, first: float = 1.0, most: float = 60.0) -> None:
        self._first, self._most = first, most
        self._pending: dict[object, tuple[float, float]] = {}  # target -> (due, delay)

    def due(self, target: object, now: float) -> bool:
        pending = self._pending.get(target)
        return pending is None or now >= pending[0]

    def failed(self, target: object, now: float) -> None:
        delay = min(self._pending[target][1] * 2, self._most) if target in self._pending else self._first
        self._pending[target] = (now + delay, delay)

    def forget(self, target: object) -> None:
        self._pending.pop(target, None)

    def waiting(self) -> list[object]:
        return list(self._pending)


# One per process: the parts are created deep inside probes and exporters, the agent reads them all.
SUPERVISOR = Supervisor()
ATTACHMENTS = Attachments()
