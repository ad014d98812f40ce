"""The agent's one model: every record a probe returns, and the snapshot the agent joins them into.

Probes return these records; the agent adds what it joins (container, pod, socket owner) and rates;
`/metrics`, `/api/v1/snapshot`, `aiprobe top` and every `--json` are views over the same records.
docs/snapshot.md documents every field (tests/test_model.py fails on one that is not).

A field marked JOINED is filled by the agent, not the probe: a probe's own `--json` leaves it out.
A field marked HISTOGRAM holds cumulative (le_seconds, count) buckets, written as
[{"le_seconds", "count"}] in documents; None (null, and absent from /metrics) where the probe could
not measure it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from .histogram import Buckets, buckets_to_json

JOINED = {"joined": True}
HISTOGRAM = {"histogram": True}

Histogram = Buckets  # cumulative (le_seconds, count); the last le is +Inf (aiprobe.histogram)
Identity = tuple[Any, ...]


_LAYOUTS: dict[type, tuple[tuple[str, bool, bool], ...]] = {}


def _layout(cls: type) -> tuple[tuple[str, bool, bool], ...]:
    """(name, joined, histogram) of each field, computed once per class."""
    if cls not in _LAYOUTS:
        _LAYOUTS[cls] = tuple((f.name, bool(f.metadata.get("joined")), bool(f.metadata.get("histogram")))
                              for f in fields(cls))
    return _LAYOUTS[cls]


def document(value: Any, *, joined: bool = True) -> Any:
    """A record (or list / dict of them) as plain JSON types; `joined=False` leaves out the fields the
    agent joins in. Flat fields are copied, not deep-copied: thousands of flows go through here."""
    if isinstance(value, Record):
        out: dict[str, Any] = {}
        for name, is_joined, is_histogram in _layout(type(value)):
            if is_joined and not joined:
                continue
            item = getattr(value, name)
            out[name] = buckets_to_json(item) if is_histogram and item is not None else document(item, joined=joined)
        return out
    if isinstance(value, list | tuple):
        return [document(item, joined=joined) for item in value]
    if isinstance(value, dict):
        return {key: document(item, joined=joined) for key, item in value.items()}
    return value


class Record:
    """Base of every model dataclass: one way to a JSON document."""

    def to_dict(self, *, joined: bool = False) -> dict[str, Any]:
        result: dict[str, Any] = document(self, joined=joined)
        return result


@dataclass(kw_only=True)
class Placed(Record):
    """A record of a process's, with the workload the agent's join placed it in: its labels
    (containers.Workload.label)."""

    container: str = field(default="host", metadata=JOINED)
    namespace: str = field(default="", metadata=JOINED)  # Kubernetes' (kubelet.py)
    pod: str = field(default="", metadata=JOINED)


# --- the agent's own records (each probe's are in its package: agent/probes/<name>/records.py) ---


@dataclass
class ProbeStatus(Record):
    up: bool
    strategy: str | None = None
    span: str = ""
    reason: str = ""
    # What each bounded map of the probe could not hold since it started (MapUsage.overflows), where any.
    overflows: dict[str, int] = field(default_factory=dict)


@dataclass
class MapUsage(Record):
    """How full a bounded BPF map is (exported as aiprobe_bpf_map_entries / _capacity), and what it
    could not hold: entries that failed to insert or were evicted (monotonic; _overflows_total)."""

    map: str
    entries: int
    capacity: int
    overflows: int = 0


@dataclass
class Alert(Record):
    rule: str
    severity: str
    target: str
    state: str  # "pending" | "firing" | "resolved" | "inactive" (a pending alert that cleared)
    value: float
    evidence: dict[str, Any]
    active_since: float  # when the condition started holding
    since: float  # when the current state began
    resolved_at: float | None = None
    summary: str = ""

    @property
    def key(self) -> tuple[str, str]:
        return self.rule, self.target


@dataclass
class HostInfo(Record):
    hostname: str
    kernel: str
    version: str
    time: float
    interval_seconds: float  # the wait before this refresh: interval_seconds, or longer where refreshes are paced


@dataclass
class ProcessRow(Record):
    """One process joined across probes: its sends, its CUDA calls, its GPUs (null: no such data)."""

    pid: int
    comm: str
    container: str = "host"
    namespace: str = ""
    pod: str = ""
    pod_uid: str = ""
    send_count: int | None = None
    send_bytes: int | None = None
    send_bytes_per_second: float | None = None
    send_p50_seconds: float | None = None
    send_p99_seconds: float | None = None
    send_errors: dict[str, int] = field(default_factory=dict)  # failed sends by error (EAGAIN: back-pressure)
    send_unwritable_p99_seconds: float | None = None  # how long its sockets stayed unwritable
    cuda_context_switches_per_second: float | None = None
    cuda_kernel_launches_per_second: float | None = None
    cuda_syncs_per_second: float | None = None
    cuda_graph_launches_per_second: float | None = None
    cuda_counted_at: str | None = None  # the layers its launches were counted at ("runtime+driver", ...)
    # Started while the agent runs: from its start to its first kernel or graph launch.
    cuda_time_to_first_launch_seconds: float | None = None
    runqueue_delay_p99_seconds: float | None = None
    gpu_utilization_ratio: float | None = None
    gpu_memory_used_bytes: int | None = None
    gpus: list[int] = field(default_factory=list)


@dataclass
class Snapshot(Record):
    """`/api/v1/snapshot` (docs/snapshot.md): the agent's own parts, and the sections each probe fills
    (`refresh.Hooks.snapshot`), each as it reads when its probe is not running."""

    host: HostInfo
    probes: dict[str, ProbeStatus]
    processes: list[ProcessRow]
    alerts: list[Alert]
    sections: dict[str, Any] = field(default_factory=dict)

    def to_dict(self, *, joined: bool = True) -> dict[str, Any]:
        head = {"host": self.host, "probes": self.probes, "processes": self.processes}
        result: dict[str, Any] = document({**head, **self.sections, "alerts": self.alerts}, joined=joined)
        return result


@dataclass
class Readings:
    """One refresh: every record each probe returned (by probe name), and the agent's own state."""

    records: dict[str, Any] = field(default_factory=dict)  # probe name -> its reading
    probes: dict[str, ProbeStatus] = field(default_factory=dict)
    map_usage: dict[str, list[MapUsage]] = field(default_factory=dict)
    events_lost: dict[str, int] = field(default_factory=dict)
    alerts: list[Alert] = field(default_factory=list)  # active (pending + firing)
    collectors: dict[str, tuple[float, bool]] = field(default_factory=dict)  # name -> (seconds, success)
    # The agent's own health (aiprobe.supervisor), cumulative:
    collector_errors: dict[str, int] = field(default_factory=dict)  # collector -> failed refreshes
    thread_restarts: dict[str, int] = field(default_factory=dict)  # background thread -> restarts
    attach_errors: dict[tuple[str, str, str], int] = field(default_factory=dict)  # (probe, target, reason)
    notifications: dict[str, int] = field(default_factory=dict)  # Alertmanager pushes by result
    alert_log_errors: int = 0

    def of(self, kind: type[Any]) -> list[Any]:
        """Every record of `kind`, whichever probe returned it (directly or inside its reading)."""
        found: list[Any] = []
        for reading in self.records.values():
            if isinstance(reading, kind):
                found.append(reading)
            elif isinstance(reading, Record):
                for name, _, _ in _layout(type(reading)):
                    value = getattr(reading, name)
                    if isinstance(value, list) and value and isinstance(value[0], kind):
                        found.extend(value)
        return found
