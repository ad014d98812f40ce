"""The agent: one per node. It runs every probe the config selects (the registry, `aiprobe.probes`,
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
from collections.abc import Callable
from typing import Any

from . import __version__
from .config import Config
from .containers import CgroupIndex, SocketOwners, Workload, cgroup_of_pid, workload_of
from .deltas import Rates, Window
from .flows import SNAPSHOT_FLOWS
from .histogram import quantile
from .loader import ProbeUnavailable
from .model import (
    Alert,
    CudaContext,
    CudaGpu,
    CudaProcess,
    FlowRecord,
    GpuInfo,
    GpuProcess,
    HostInfo,
    InterfaceTotals,
    ProbeStatus,
    ProcessRow,
    ProcessSendLatency,
    Readings,
    Snapshot,
    StreamEndpoint,
    StreamStall,
    TcpCounters,
    TcpSummary,
)
from .names import process_name
from .probes import Probe, ProbeSpec, selected
from .rules import RuleEngine, Signal
from .streams import CAUSES as STALL_CAUSES
from .supervisor import SUPERVISOR
from .system import kernel_release

log = logging.getLogger("aiprobe.agent")

# /healthz fails when the refresh loop or a part stalls longer than this many refreshes (and seconds).
HEALTH_GRACE_REFRESHES = 3
MIN_HEALTH_GRACE_SECONDS = 5.0

# Alert rules judge latency histograms over this recent window rather than since start.
SIGNAL_WINDOW_SECONDS = 10.0
MIN_SENDS_FOR_P99 = 1
MIN_SEGMENTS_FOR_RETRANSMIT_RATIO = 100


def _unavailable_reason(exc: Exception) -> str:
    """A probe's one reason when it has one (NVML missing), else every strategy's."""
    if isinstance(exc, ProbeUnavailable) and len(exc.reasons) == 1:
        return next(iter(exc.reasons.values()))
    return str(exc)


class Agent:
    """Probes + correlation + rules. `start()`, then `refresh()` once per interval, then `close()`."""

    def __init__(self, config: Config, *, on_transitions: Callable[[list[Alert], float], None] | None = None) -> None:
        self.config = config
        self._on_transitions = on_transitions
        self._probes: dict[str, Probe] = {}
        self._down: dict[str, ProbeStatus] = {}
        self._cgroups = CgroupIndex()
        self._sockets = SocketOwners()
        self._rules = RuleEngine(config.rules)
        self._rates = Rates()
        self._windows = Window(SIGNAL_WINDOW_SECONDS)
        self._workloads: dict[int, Workload] = {}
        self._last_refresh: float | None = None
        self._refreshed_at: float | None = None  # monotonic
        self._snapshot: dict[str, Any] = {}
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
        probe = spec.factory(self.config, self._probes)
        try:
            probe.start()
        except Exception as exc:  # a probe that cannot run says why; the others keep going
            log.warning("probe %s unavailable: %s", spec.name, exc)
            self._down[spec.name] = ProbeStatus(False, reason=_unavailable_reason(exc))
            probe.close()
            return
        self._probes[spec.name] = probe

    @property
    def status(self) -> dict[str, ProbeStatus]:
        """Every selected probe's status, in registry order."""
        statuses = {**{name: probe.status() for name, probe in self._probes.items()}, **self._down}
        return {spec.name: statuses[spec.name] for spec in selected(self.config.probes) if spec.name in statuses}

    def close(self) -> None:
        while self._probes:
            _, probe = self._probes.popitem()  # the last started first: sched before the cuda it runs in
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
        grace = max(HEALTH_GRACE_REFRESHES * self.config.interval_seconds, MIN_HEALTH_GRACE_SECONDS)
        fresh = self._refreshed_at is not None and time.monotonic() - self._refreshed_at <= grace
        return bool(self._snapshot) and fresh and not SUPERVISOR.down(longer_than=grace)

    def snapshot(self) -> dict[str, Any]:
        return self._snapshot

    # --- one refresh ---

    def refresh(self) -> dict[str, Any]:
        now = time.time()
        readings = Readings()
        for name, probe in list(self._probes.items()):
            readings.records[name] = self._read(name, probe.read, readings.collectors)
        # Joins read /proc and cgroupfs, which any process shapes: a failure costs the joins, not the refresh.
        self._collect("join", lambda: self._join(readings), readings.collectors)
        self._add_rates(readings, now)
        signals = self._collect("rules", lambda: self._signals(readings, now), readings.collectors) or []
        self._rates.end_round()
        self._windows.end_round()
        transitions = self._rules.evaluate(signals, now)
        if transitions and self._on_transitions is not None:
            self._on_transitions(transitions, now)
        readings.probes = self.status
        readings.map_usage = {name: probe.map_usage() for name, probe in self._probes.items()}
        readings.events_lost = {name: probe.events_lost() for name, probe in self._probes.items()}
        readings.alerts = self._rules.active
        SUPERVISOR.fill(readings)
        self.readings = readings
        self._last_refresh = now
        self._refreshed_at = time.monotonic()
        self._snapshot = self._build_snapshot(readings, now).to_dict()
        return self._snapshot

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

    def _workload_of_pid(self, pid: int) -> Workload:
        if pid not in self._workloads:
            path = cgroup_of_pid(pid)
            self._workloads[pid] = workload_of(path) if path is not None else Workload("")
        return self._workloads[pid]

    def _workload(self, cgroup_id: int, pid: int | None) -> Workload:
        """A record's cgroup when the kernel gave one, else its process's current cgroup."""
        if cgroup_id:
            return self._cgroups.workload(cgroup_id)
        return self._workload_of_pid(pid) if pid is not None else Workload("")

    def _join(self, r: Readings) -> None:
        """Fill every record's container and pod; flows also get the pid and comm owning their socket,
        where the host's namespace holds it."""
        live_pids: set[int] = set()
        for flow in r.of(FlowRecord):
            flow.pid = self._sockets.owner(flow.local_address, flow.local_port, flow.remote_address,
                                           flow.remote_port)
            flow.comm = _comm(flow.pid) if flow.pid is not None else None
            flow.container = self._workload(flow.cgroup_id, flow.pid).container
            live_pids.update([flow.pid] if flow.pid is not None else [])
        for send in r.of(ProcessSendLatency):
            workload = self._workload(send.cgroup_id, send.pid)
            send.container, send.pod_uid = workload.container, workload.pod_uid
            live_pids.add(send.pid)
        for stream in [*r.of(StreamEndpoint), *r.of(StreamStall)]:
            stream.container = self._workload(stream.cgroup_id, stream.pid).container
            live_pids.add(stream.pid)
        for proc in [*r.of(CudaProcess), *r.of(CudaContext), *r.of(GpuProcess)]:
            workload = self._workload_of_pid(proc.pid)
            proc.container, proc.pod_uid = workload.container, workload.pod_uid
            live_pids.add(proc.pid)
        self._workloads = {pid: w for pid, w in self._workloads.items() if pid in live_pids}
        _join_active_contexts(r.of(GpuInfo), r.of(CudaGpu))

    def _add_rates(self, r: Readings, now: float) -> None:
        """Per-second rates of cumulative counters over the interval since the last refresh, each
        source by its identity."""
        for send in r.of(ProcessSendLatency):
            (send.bytes_per_second,) = self._rates.rate(("send", send.identity()), [send.bytes], now)
        for cuda in r.of(CudaProcess):
            counters = [cuda.context_switches, cuda.kernel_launches, cuda.syncs, cuda.graph_launches]
            (cuda.context_switches_per_second, cuda.kernel_launches_per_second, cuda.syncs_per_second,
             cuda.graph_launches_per_second) = self._rates.rate(("cuda", cuda.identity()), counters, now)
        for stream in r.of(StreamEndpoint):
            (stream.streams_per_second,) = self._rates.rate(("streams", stream.identity()), [stream.streams], now)
        for side in r.of(InterfaceTotals):
            side.bytes_per_second, side.packets_per_second = \
                self._rates.rate(("interface", side.identity()), [side.bytes, side.packets], now)

    # --- rules input ---

    def _recent(self, kind: str, identity: tuple[Any, ...], buckets: list[tuple[float, int]],
                now: float) -> list[tuple[float, float]]:
        """The cumulative buckets of what the window saw of this source's histogram."""
        counts = self._windows.recent((kind, identity), [float(count) for _, count in buckets], now)
        return [(le, count) for (le, _), count in zip(buckets, counts, strict=True)]

    def _signals(self, r: Readings, now: float) -> list[Signal]:
        signals: list[Signal] = []
        for proc in r.of(ProcessSendLatency):
            stall = self._send_stall(proc, now)
            if stall is not None:
                signals.append(stall)
        for cuda in r.of(CudaProcess):
            switches = cuda.context_switches_per_second
            signals.append(Signal("cuda_context_switch_storm", _target(cuda), switches, {
                "context_switches_per_second": round(switches, 1), "pid": cuda.pid}))
            recent = self._recent("runq", cuda.identity(), cuda.runqueue_histogram, now)
            p99 = quantile(recent, 0.99)
            if p99 is not None:
                signals.append(Signal("gpu_threads_starved", _target(cuda), p99, {
                    "runqueue_delay_p99_seconds": round(p99, 6), "wakeups": int(recent[-1][1]),
                    "involuntary_preemptions": cuda.involuntary_preemptions, "pid": cuda.pid}))
        signals += self._gpu_signals(r)
        signals += time_slicing_signals(r.of(CudaGpu), r.of(CudaContext), r.of(GpuInfo))
        signals += self._tcp_signals(r, now)
        signals += self._stream_signals(r, now)
        return signals

    def _stream_signals(self, r: Readings, now: float) -> list[Signal]:
        """Stalls of each process's responses in the window, their causes as evidence."""
        by_target: dict[str, dict[str, Any]] = {}
        for endpoint in r.of(StreamEndpoint):
            recent = self._windows.recent(("stalls", endpoint.identity()), [float(endpoint.stalls.get(c, 0))
                                                                            for c in STALL_CAUSES], now)
            seen = by_target.setdefault(_target(endpoint), {"pid": endpoint.pid, "ports": set(), "causes": {}})
            for cause, count in zip(STALL_CAUSES, recent, strict=True):
                if count:
                    seen["causes"][cause] = seen["causes"].get(cause, 0) + int(count)
                    seen["ports"].add(f"{endpoint.port}/{endpoint.protocol}")
        signals = []
        for target, seen in by_target.items():
            causes = seen["causes"]
            signals.append(Signal("token_streams_stalling", target, float(sum(causes.values())), {
                "cause": max(causes, key=causes.get) if causes else "", "stalls_by_cause": causes,
                "endpoints": sorted(seen["ports"]), "pid": seen["pid"], "window_seconds": SIGNAL_WINDOW_SECONDS,
                "threshold_seconds": self.config.stream_stall_threshold_ms / 1e3}))
        return signals

    def _send_stall(self, proc: ProcessSendLatency, now: float) -> Signal | None:
        """The worse of two p99s over the window: how long sends blocked, and how long sockets stayed
        unwritable (asynchronous servers never block in a send: their stalls show only there)."""
        recent = self._recent("send", proc.identity(), proc.histogram, now)
        # Most processes never find a socket full: no window kept for them.
        waits = self._recent("unwritable", proc.identity(), proc.unwritable_histogram, now) \
            if proc.unwritable_count else []
        sends = recent[-1][1] if recent else 0
        send_p99 = quantile(recent, 0.99) if sends >= MIN_SENDS_FOR_P99 else None
        unwritable_p99 = quantile(waits, 0.99)
        worst = max((p99 for p99 in (send_p99, unwritable_p99) if p99 is not None), default=None)
        if worst is None:
            return None
        return Signal("network_send_stall", _target(proc), worst, {
            "send_p99_seconds": None if send_p99 is None else round(send_p99, 6), "sends": int(sends),
            "unwritable_p99_seconds": None if unwritable_p99 is None else round(unwritable_p99, 6),
            "unwritable_periods": int(waits[-1][1]) if waits else 0, "window_seconds": SIGNAL_WINDOW_SECONDS,
            "pid": proc.pid, "threshold_seconds": self.config.rules["network_send_stall"].threshold})

    def _gpu_signals(self, r: Readings) -> list[Signal]:
        signals = []
        ingress = sum(side.bytes_per_second for side in r.of(InterfaceTotals) if side.direction == "ingress")
        for gpu in r.of(GpuInfo):
            util = gpu.utilization_gpu_ratio
            if util is None:
                continue
            target = f"gpu{gpu.index}"
            signals.append(Signal("gpu_saturated", target, util, {"utilization_ratio": util, "uuid": gpu.uuid}))
            if ingress >= self.config.traffic_floor_bytes_per_second:
                signals.append(Signal("gpu_idle_with_traffic", target, util, {
                    "utilization_ratio": util, "ingress_bytes_per_second": round(ingress), "uuid": gpu.uuid}))
        return signals + context_switch_signals(r.of(GpuInfo))

    def _tcp_signals(self, r: Readings, now: float) -> list[Signal]:
        signals = []
        elapsed = now - self._last_refresh if self._last_refresh is not None else 0.0
        for tcp in r.of(TcpCounters):
            counters = [tcp.listen_drops, tcp.retransmitted_segments, tcp.sent_segments]
            drops, retransmitted, sent = self._rates.rate(("tcp",), counters, now)
            if elapsed <= 0:
                continue
            # ListenDrops alone: the kernel counts every ListenOverflows in ListenDrops too.
            signals.append(Signal("listen_queue_overflow", "host", drops, {
                "listen_overflows": tcp.listen_overflows, "listen_drops": tcp.listen_drops,
                "per_second": round(drops, 3)}))
            if sent * elapsed >= MIN_SEGMENTS_FOR_RETRANSMIT_RATIO:
                signals.append(Signal("tcp_retransmits_high", "host", retransmitted / sent, {
                    "retransmit_ratio": round(retransmitted / sent, 4), "segments_sent": round(sent * elapsed)}))
        return signals

    # --- the snapshot document (docs/snapshot.md) ---

    def _build_snapshot(self, r: Readings, now: float) -> Snapshot:
        flows = sorted(r.of(FlowRecord), key=lambda f: f.bytes_per_second, reverse=True)
        tcp = next(iter(r.of(TcpCounters)), None)
        return Snapshot(
            host=HostInfo(self.hostname, kernel_release(), __version__, now, self.config.interval_seconds),
            probes=r.probes,
            processes=self._processes(r),
            flows=flows[:SNAPSHOT_FLOWS],
            interfaces=r.of(InterfaceTotals),
            gpus=r.of(GpuInfo),
            tcp=None if tcp is None else TcpSummary(
                **vars(tcp), retransmit_ratio=tcp.retransmitted_segments / tcp.sent_segments
                if tcp.sent_segments else 0.0),
            alerts=self._rules.active + self._rules.resolved,
            streams=sorted(r.of(StreamEndpoint), key=lambda e: e.streams_per_second, reverse=True),
        )

    @staticmethod
    def _processes(r: Readings) -> list[ProcessRow]:
        rows: dict[int, ProcessRow] = {}

        def row(pid: int, comm: str, container: str, pod_uid: str) -> ProcessRow:
            return rows.setdefault(pid, ProcessRow(pid, comm or _comm(pid), container, pod_uid))

        for send in r.of(ProcessSendLatency):
            entry = row(send.pid, send.comm, send.container, send.pod_uid)
            entry.send_count, entry.send_bytes = send.count, send.bytes
            entry.send_bytes_per_second = send.bytes_per_second
            entry.send_p50_seconds, entry.send_p99_seconds = send.p50_seconds, send.p99_seconds
            entry.send_errors, entry.send_unwritable_p99_seconds = dict(send.errors), send.unwritable_p99_seconds
        for cuda in r.of(CudaProcess):
            entry = row(cuda.pid, cuda.comm, cuda.container, cuda.pod_uid)
            entry.cuda_context_switches_per_second = cuda.context_switches_per_second
            entry.cuda_kernel_launches_per_second = cuda.kernel_launches_per_second
            entry.cuda_syncs_per_second = cuda.syncs_per_second
            entry.cuda_graph_launches_per_second = cuda.graph_launches_per_second
            entry.cuda_counted_at = cuda.counted_at or None
            entry.cuda_time_to_first_launch_seconds = cuda.cold_start.to_first_launch_seconds \
                if cuda.cold_start else None
            entry.runqueue_delay_p99_seconds = cuda.runqueue_delay_p99_seconds
        for gpu in r.of(GpuProcess):
            entry = row(gpu.pid, gpu.comm, gpu.container, gpu.pod_uid)
            entry.gpus.append(gpu.gpu_index)
            entry.gpu_memory_used_bytes = (entry.gpu_memory_used_bytes or 0) + (gpu.used_memory_bytes or 0)
            if gpu.sm_utilization_ratio is not None:
                entry.gpu_utilization_ratio = (entry.gpu_utilization_ratio or 0) + gpu.sm_utilization_ratio
        return sorted(rows.values(), key=lambda p: p.send_bytes_per_second or 0, reverse=True)


def _join_active_contexts(infos: list[GpuInfo], gpus: list[CudaGpu]) -> None:
    """Each NVML GPU's active CUDA contexts (the cuda probe names a GPU by index or UUID)."""
    active = {gpu.gpu: gpu.active_contexts for gpu in gpus}
    for info in infos:
        info.cuda_active_contexts = active.get(str(info.index), active.get(info.uuid, 0))


def _rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def switching_evidence(info: GpuInfo | None) -> dict[str, Any]:
    """The GPU's own measure of its context switches (GPM): share of time and mean time per switch."""
    if info is None:
        return {"context_switching_ratio": None, "context_switch_seconds": None}
    return {"context_switching_ratio": _rounded(info.context_switching_ratio, 4),
            "context_switch_seconds": _rounded(info.context_switch_seconds, 9)}


def context_switch_signals(infos: list[GpuInfo]) -> list[Signal]:
    """gpu_context_switch_overhead: per GPU with GPM, the switching share of its busiest engine."""
    signals = []
    for info in infos:
        if info.context_switching_ratio is None:
            continue
        busiest = max(info.engines, key=lambda engine: engine.context_switching_ratio)
        signals.append(Signal("gpu_context_switch_overhead", f"gpu{info.index}", info.context_switching_ratio, {
            **switching_evidence(info), "engine": busiest.engine,
            "context_switches_per_second": _rounded(info.context_switches_per_second, 1),
            "active_contexts": info.cuda_active_contexts, "uuid": info.uuid}))
    return signals


def time_slicing_signals(gpus: list[CudaGpu], contexts: list[CudaContext], infos: list[GpuInfo]) -> list[Signal]:
    """gpu_time_sliced: per GPU, the contexts that launched work since the last refresh, with their
    processes, launch rates, and the GPU's utilization and own measure of its switching (NVML, matched
    by index or UUID) as evidence."""
    by_key = {key: info for info in infos for key in (str(info.index), info.uuid)}
    signals = []
    for gpu in gpus:
        active = [c for c in contexts if c.active and c.gpu == gpu.gpu]
        info = by_key.get(gpu.gpu)
        signals.append(Signal("gpu_time_sliced", f"gpu{gpu.gpu}", gpu.active_contexts, {
            "contexts": [{"pid": c.pid, "process": f"{c.comm or c.pid}@{c.container}", "context": c.context,
                          "launches_per_second": round(c.launches_per_second, 1)} for c in active],
            "utilization_ratio": None if info is None else info.utilization_gpu_ratio,
            **switching_evidence(info)}))
    return signals


def _target(proc: ProcessSendLatency | CudaProcess | StreamEndpoint) -> str:
    return f"{proc.comm or proc.pid}@{proc.container}"


def _comm(pid: int) -> str:
    # The kernel's comm, as sendlat and cuda records carry it, so one process has one `process` label.
    return process_name(pid) or str(pid)
