"""The agent: one per node. It runs every probe the config selects (the registry, `aiprobe.registry`,
says which exist), joins what they see per process and container, evaluates bottleneck rules, and
builds the snapshot (docs/snapshot.md) that `/api/v1/snapshot` serves and `aiprobe top` shows.
`aiprobe agent` (aiprobe.commands.agent) serves it with /metrics; `top` runs it in-process when
no agent runs.

Each refresh is a round of collectors in node_exporter's sense — one per probe, plus `rules` —
each timed and reported as aiprobe_collector_duration_seconds / _success.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from . import __version__
from .budget import RefreshPacer
from .config import Config, RuleConfig
from .containers import CgroupIndex, SocketOwners, Workload, cgroup_of_pid, workload_of
from .deltas import Matrix, Rates, Trend, Window
from .kubelet import KubeletLogs
from .loader import ProbeUnavailable
from .model import Alert, HostInfo, ProbeStatus, ProcessRow, Readings, Snapshot
from .names import process_name
from .refresh import SIGNAL_WINDOW_SECONDS, ProcessRows
from .registry import Face, Part, Probe, ProbeSpec, faces, rules, selected
from .rules import RuleEngine, Signal
from .supervisor import SUPERVISOR
from .system import kernel_release

log = logging.getLogger("aiprobe.agent")

# /healthz fails when the refresh loop or a part stalls longer than this many refreshes (and seconds).
HEALTH_GRACE_REFRESHES = 3
MIN_HEALTH_GRACE_SECONDS = 5.0



def _unavailable_reason(exc: Exception) -> str:
    """A probe's one reason when it has one (NVML missing), else every strategy's."""
    if isinstance(exc, ProbeUnavailable) and len(exc.reasons) == 1:
        return next(iter(exc.reasons.values()))
    return str(exc)


class Agent:
    """Probes + correlation + rules. `start()`, then `refresh()` once per interval, then `close()`.
    To the probes' hooks it is their `refresh.Refresh`."""

    def __init__(self, config: Config, *, on_transitions: Callable[[list[Alert], float], None] | None = None) -> None:
        self.config = config
        self._on_transitions = on_transitions
        self._probes: dict[str, Probe] = {}
        self._faces: dict[str, Face] = {}  # every running probe and part, by name
        self._down: dict[str, ProbeStatus] = {}
        self._cgroups = CgroupIndex()
        self._kubelet = KubeletLogs(Path(config.pod_logs), Path(config.container_logs))
        self._sockets = SocketOwners()
        self._rules = RuleEngine(rules(), config.rules)
        self.pacer = RefreshPacer(config.interval_seconds, config.refresh_budget)  # where a loop paces refresh()
        self._rates = Rates()
        self._windows = Window(SIGNAL_WINDOW_SECONDS)
        self._trends = Trend(SIGNAL_WINDOW_SECONDS)
        self._workloads: dict[int, Workload] = {}
        self._comms: dict[int, str] = {}  # this refresh's: a process with many flows is read once
        self._last_refresh: float | None = None
        self.elapsed = 0.0  # since the last refresh
        self._refreshed_at: float | None = None  # monotonic
        self._snapshot: Snapshot | None = None  # the latest refresh's, its document made when asked for
        self._document: dict[str, Any] | None = None
        self._document_lock = threading.Lock()
        self.readings = Readings()
        # The newest read of each SPEC.read_at_scrape probe, by refresh or scrape: (monotonic time, record).
        self._newest: dict[str, tuple[float, Any]] = {}
        self._newest_lock = threading.Lock()
        self._read_at_scrape = {s.name for s in selected(config.probes) if s.read_at_scrape}
        self._scraped: tuple[Readings, Readings] | None = None  # (the refresh it came from, what a scrape got)
        self.hostname = socket.gethostname()

    # --- life cycle ---

    def start(self) -> None:
        for spec in selected(self.config.probes):
            self._start_probe(spec)

    def _start_probe(self, spec: ProbeSpec) -> None:
        if spec.factory is None:
            return
        probe = spec.factory(self.config)
        try:
            probe.start()
        except Exception as exc:  # a probe that cannot run says why; the others keep going
            log.warning("probe %s unavailable: %s", spec.name, exc)
            self._down[spec.name] = ProbeStatus(False, reason=_unavailable_reason(exc))
            for part in spec.parts:
                self._down[part.name] = ProbeStatus(False, reason=f"runs inside the {spec.name} probe, which is "
                                                                  "not running")
            probe.close()
            return
        self._probes[spec.name] = probe
        self._faces.update({spec.name: probe, **probe.parts()})

    def _selected_faces(self) -> list[Part]:
        return sorted((face for spec in selected(self.config.probes) for face in spec.faces),
                      key=lambda face: face.order)

    @property
    def status(self) -> dict[str, ProbeStatus]:
        """Every selected probe's and part's status, in registry order."""
        statuses = {**{name: face.status() for name, face in self._faces.items()}, **self._down}
        return {face.name: statuses[face.name] for face in self._selected_faces() if face.name in statuses}

    def close(self) -> None:
        self._faces.clear()
        while self._probes:
            _, probe = self._probes.popitem()  # the last started first
            try:
                probe.close()
            except Exception as exc:  # closing the others matters more
                log.warning("closing probe failed: %s", exc)

    def __enter__(self) -> Agent:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def healthy(self) -> bool:
        """A snapshot, refreshed lately, and no part of the agent down for longer than a few refreshes."""
        grace = max(HEALTH_GRACE_REFRESHES * self.pacer.longest, MIN_HEALTH_GRACE_SECONDS)
        fresh = self._refreshed_at is not None and time.monotonic() - self._refreshed_at <= grace
        return self._snapshot is not None and fresh and not SUPERVISOR.down(longer_than=grace)

    def snapshot(self) -> dict[str, Any]:
        """The latest refresh's snapshot document, made at the first call after it: a refresh nobody
        reads (the agent's, between two snapshot API calls) makes none (thousands of histograms)."""
        with self._document_lock:
            if self._document is None:
                self._document = self._snapshot.to_dict() if self._snapshot is not None else {}
            return self._document

    # --- one refresh ---

    def refresh(self) -> None:
        now = time.time()
        readings = Readings()
        for name, face in list(self._faces.items()):
            readings.records[name] = self._read(name, face.read, readings.collectors)
        self.elapsed = now - self._last_refresh if self._last_refresh is not None else 0.0
        # Joins read /proc and cgroupfs, which any process shapes: a failure costs the joins, not the refresh.
        self._collect("join", lambda: self._join(readings), readings.collectors)
        self._add_rates(readings, now)
        signals = self._collect("rules", lambda: self._signals(readings, now), readings.collectors) or []
        self._rates.end_round()
        self._windows.end_round()
        self._trends.end_round()
        transitions = self._rules.evaluate(signals, now)
        if transitions and self._on_transitions is not None:
            self._on_transitions(transitions, now)
        readings.probes = self.status
        readings.map_usage = {name: face.map_usage() for name, face in self._faces.items()}
        readings.events_lost = {name: face.events_lost() for name, face in self._faces.items()}
        readings.alerts = self._rules.active
        SUPERVISOR.fill(readings)
        self.readings = readings
        self._last_refresh = now
        self._refreshed_at = time.monotonic()
        snapshot = self._build_snapshot(readings, now)
        with self._document_lock:
            self._snapshot, self._document = snapshot, None

    @property
    def alerts(self) -> list[Alert]:
        """Firing alerts and those resolved recently: what Alertmanager should know about."""
        return self._rules.firing + self._rules.resolved

    def scrape_readings(self) -> Readings:
        """What /metrics renders at a scrape: the last refresh's readings, with the SPEC.read_at_scrape
        probes' (flows) newest read, read again now unless a read is younger than half an interval, as
        node_exporter reads at scrape time (`read_for_scrape`: flows reads again only the flows of its
        latest read's records, so a scrape costs the same whatever the flow table holds). So two
        scrapes an interval apart never see the same read (a flat step in rate()), and a burst of
        scrapes costs one read. The same object comes back while nothing changed, so the exporter
        renders each reading once."""
        last = self.readings
        collectors = dict(last.collectors)
        for name in self._read_at_scrape:
            with self._newest_lock:
                at = self._newest.get(name, (None, None))[0]
            probe = self._probes.get(name)
            if probe is not None and (at is None or time.monotonic() - at >= self.config.interval_seconds / 2):
                self._read(name, probe.read_for_scrape, collectors)
        with self._newest_lock:
            fresh = {name: record for name, (_at, record) in self._newest.items()}
        cached = self._scraped
        if cached is not None and cached[0] is last and all(cached[1].records[n] is r for n, r in fresh.items()):
            return cached[1]
        readings = dataclasses.replace(last, records={**last.records, **fresh}, collectors=collectors)
        self._scraped = (last, readings)
        return readings

    def _read(self, name: str, read: Callable[[], Any], collectors: dict[str, tuple[float, bool]]) -> Any:
        record = self._collect(name, read, collectors)
        finished = time.monotonic()
        if record is not None and name in self._read_at_scrape:
            with self._newest_lock:  # the probe reads one at a time: the one that finished last read last
                if finished >= self._newest.get(name, (0.0, None))[0]:
                    self._newest[name] = (finished, record)
        return record

    def _collect(self, name: str, read: Callable[[], Any], collectors: dict[str, tuple[float, bool]]) -> Any:
        started = time.perf_counter()
        error = None
        try:
            result = read()
        except Exception as exc:  # e.g. an interface vanished mid-read: report, keep the agent running
            result, error = None, exc
        SUPERVISOR.collected(name, error)  # logged once per distinct error, counted every time
        collectors[name] = (time.perf_counter() - started, error is None)
        return result

    # --- joins: who is behind a pid, a cgroup or a socket ---

    def _hooked(self, readings: Readings) -> list[tuple[Part, Any]]:
        """Each running probe and part with its reading of this refresh, in registry order."""
        return [(face, readings.records[face.name]) for face in self._selected_faces()
                if readings.records.get(face.name) is not None]

    def workload_of_pid(self, pid: int) -> Workload:
        if pid not in self._workloads:
            path = cgroup_of_pid(pid)
            self._workloads[pid] = workload_of(path) if path is not None else Workload("")
        return self._kubelet.named(self._workloads[pid])

    def workload(self, cgroup_id: int, pid: int | None) -> Workload:
        if cgroup_id:
            return self._kubelet.named(self._cgroups.workload(cgroup_id))
        return self.workload_of_pid(pid) if pid is not None else Workload("")

    def socket_owner(self, local_address: str, local_port: int, remote_address: str, remote_port: int) -> int | None:
        return self._sockets.owner(local_address, local_port, remote_address, remote_port)

    def comm(self, pid: int) -> str:
        if pid not in self._comms:
            self._comms[pid] = _comm(pid)
        return self._comms[pid]

    def rule(self, name: str) -> RuleConfig:
        return self._rules.settings[name]

    def rate(self, source: tuple[Any, ...], counters: list[float] | list[int], now: float) -> list[float]:
        return self._rates.rate(source, counters, now)

    def recent(self, source: tuple[Any, ...], counts: Sequence[float], now: float) -> list[float]:
        return self._windows.recent(source, counts, now)

    def recent_all(self, sources: Sequence[tuple[Any, ...]], counts: Matrix, now: float) -> Matrix:
        return self._windows.recent_all(sources, counts, now)

    def trend(self, source: tuple[Any, ...], counts: Sequence[float],
              now: float) -> tuple[list[float], list[float]]:
        return self._trends.counts(source, counts, now)

    def mean_trend(self, source: tuple[Any, ...], values: list[float],
                   now: float) -> tuple[list[float] | None, list[float] | None]:
        return self._trends.means(source, values, now)

    def _join(self, readings: Readings) -> None:
        """Every probe's join, each pid's comm read once for the refresh; the cache of pids' workloads keeps
        the pids some record still names."""
        live_pids: set[int] = set()
        self._comms = {}
        for spec, reading in self._hooked(readings):
            live_pids.update(spec.hooks.join(reading, readings, self))
        self._workloads = {pid: w for pid, w in self._workloads.items() if pid in live_pids}

    def _add_rates(self, readings: Readings, now: float) -> None:
        for spec, reading in self._hooked(readings):
            spec.hooks.rates(reading, self, now)

    def _signals(self, readings: Readings, now: float) -> list[Signal]:
        return [signal for spec, reading in self._hooked(readings)
                for signal in spec.hooks.signals(reading, readings, self, now)]

    # --- the snapshot document (docs/snapshot.md) ---

    def _build_snapshot(self, readings: Readings, now: float) -> Snapshot:
        sections = {name: section.empty for face in faces() for name, section in face.hooks.sections.items()}
        for spec, reading in self._hooked(readings):
            sections.update(spec.hooks.snapshot(reading))
        return Snapshot(
            host=HostInfo(self.hostname, kernel_release(), __version__, now, self.pacer.wait),
            probes=readings.probes, processes=self._processes(readings),
            # copies: the engine changes its alerts in place, and the document may be made after the next refresh
            alerts=[dataclasses.replace(a) for a in self._rules.active + self._rules.resolved], sections=sections,
        )

    def _processes(self, readings: Readings) -> list[ProcessRow]:
        """One row per process, whichever probes saw it; the busiest senders first."""
        rows = ProcessRows(self.comm)
        for spec, reading in self._hooked(readings):
            spec.hooks.process_rows(reading, rows)
        return sorted(rows.rows.values(), key=lambda p: p.send_bytes_per_second or 0, reverse=True)


def _comm(pid: int) -> str:
    # The kernel's comm, as sendlat and cuda records carry it, so one process has one `process` label.
    return process_name(pid) or str(pid)
