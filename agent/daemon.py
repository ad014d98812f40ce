"""`aiprobe agent`: one daemon per node. It runs every probe the kernel allows, joins what they see
per process and container, evaluates bottleneck rules, and serves /metrics, /healthz and
/api/v1/snapshot (docs/snapshot.md). `aiprobe top` builds the same snapshot in-process through
`Agent` when no agent is running.

Each refresh is a round of collectors in node_exporter's sense — one per probe, plus `netstat`
and `rules` — each timed and reported as aiprobe_collector_duration_seconds / _success.
"""

from __future__ import annotations

import logging
import os
import resource
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import click

from . import __version__, libbpf
from .config import PROBE_NAMES, Config, ConfigError, load
from .containers import CgroupIndex, SocketOwners, Workload, cgroup_of_pid, workload_of
from .histogram import Rates, WindowedHistograms, buckets_from_json, quantile
from .names import endpoint, process_name
from .netstat import read_tcp_counters
from .rules import Alert, RuleEngine, Signal
from .system import kernel_release

log = logging.getLogger("aiprobe.agent")

# Alert rules judge latency histograms over this recent window rather than since start.
SIGNAL_WINDOW_SECONDS = 10.0
SNAPSHOT_FLOWS = 200
MIN_SENDS_FOR_P99 = 1
MIN_SEGMENTS_FOR_RETRANSMIT_RATIO = 100


def _flows(config: Config) -> Any:
    from .flows import FlowsProbe

    return FlowsProbe(interfaces=list(config.interfaces), exclude=list(config.exclude),
                      idle_timeout=config.flow_idle_seconds)


def _sendlat(config: Config) -> Any:
    from .sendlat import SendLatencyProbe

    return SendLatencyProbe(threshold_ms=config.slow_send_threshold_ms, per_flow=False)


def _cuda(_config: Config) -> Any:
    from .cuda import CudaProbe

    return CudaProbe()


def _nvml(_config: Config) -> Any:
    from .nvml import NvmlCollector

    return NvmlCollector()


PROBE_FACTORIES: dict[str, Callable[[Config], Any]] = {
    "flows": _flows, "sendlat": _sendlat, "cuda": _cuda, "nvml": _nvml,
}
# Which field of exporters.prometheus.Readings each probe's reading fills.
READING_OF = {"flows": "flows", "sendlat": "sendlat", "cuda": "cuda", "nvml": "gpus"}


@dataclass
class ProbeStatus:
    up: bool
    strategy: str | None = None
    span: str = ""
    reason: str = ""

    def to_dict(self) -> dict:
        return {"up": self.up, "strategy": self.strategy, "span": self.span, "reason": self.reason}


def _span(probe: Any) -> str:
    loaded = getattr(probe, "loaded", None)
    return loaded.strategy.span if loaded is not None else ""


class Agent:
    """Probes + correlation + rules. `start()`, then `refresh()` once per interval, then `close()`."""

    def __init__(self, config: Config, *, on_transitions: Callable[[list[Alert], float], None] | None = None) -> None:
        self.config = config
        self._on_transitions = on_transitions
        self._probes: dict[str, Any] = {}
        self.status: dict[str, ProbeStatus] = {}
        self._cgroups = CgroupIndex()
        self._sockets = SocketOwners()
        self._rules = RuleEngine(config.rules)
        self._rates = Rates()
        self._windows = WindowedHistograms(SIGNAL_WINDOW_SECONDS)
        self._workloads: dict[int, Workload] = {}
        self._last_tcp: tuple[float, dict] | None = None
        self._snapshot: dict = {}
        self.readings: Any = None
        self.hostname = socket.gethostname()

    # --- life cycle ---

    def start(self) -> None:
        for name in self.config.probes:
            self._start_probe(name)
        if "cuda" in self._probes:
            sched = getattr(self._probes["cuda"], "sched_strategy", None)
            self.status["sched"] = ProbeStatus(sched is not None, sched, "wakeup to on-CPU of GPU-driving threads",
                                               "" if sched else "scheduler tracepoints unavailable")

    def _start_probe(self, name: str) -> None:
        try:
            probe = PROBE_FACTORIES[name](self.config)
            if name == "nvml":
                if not probe.available:
                    self.status[name] = ProbeStatus(False, reason=probe.reason)
                    return
                self._probes[name] = probe
                self.status[name] = ProbeStatus(True, "nvml", "NVML samples")
                return
            probe.start()
        except Exception as exc:  # a probe that cannot run says why; the others keep going
            log.warning("probe %s unavailable: %s", name, exc)
            self.status[name] = ProbeStatus(False, reason=str(exc))
            return
        self._probes[name] = probe
        self.status[name] = ProbeStatus(True, probe.strategy, _span(probe))

    def close(self) -> None:
        while self._probes:
            _, probe = self._probes.popitem()
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
        return bool(self._snapshot)

    def snapshot(self) -> dict:
        return self._snapshot

    # --- one refresh ---

    def refresh(self) -> dict:
        from aiprobe.exporters.prometheus import Readings

        now = time.time()
        readings = Readings(probes={})
        collectors: dict[str, tuple[float, bool]] = {}
        for name, probe in list(self._probes.items()):
            setattr(readings, READING_OF[name], self._collect(name, probe.read, collectors))
        readings.tcp = self._collect("netstat", read_tcp_counters, collectors)
        self._annotate(readings)
        self._add_rates(readings, now)
        signals = self._collect("rules", lambda: self._signals(readings, now), collectors) or []
        transitions = self._rules.evaluate(signals, now)
        if transitions and self._on_transitions is not None:
            self._on_transitions(transitions, now)
        readings.collectors = collectors
        readings.probes = {name: status.to_dict() for name, status in self.status.items()}
        readings.map_usage = [
            {"probe": name, "map": u.map, "entries": u.entries, "capacity": u.capacity}
            for name, probe in self._probes.items() for u in getattr(probe, "map_usage", list)()
        ]
        readings.events_lost = {name: probe.events_lost() for name, probe in self._probes.items()
                                if hasattr(probe, "events_lost")}
        readings.alerts = [a.to_dict() for a in self._rules.active]
        self.readings = readings
        self._snapshot = self._build_snapshot(readings, now)
        return self._snapshot

    @property
    def alerts(self) -> list[Alert]:
        """Firing alerts and those resolved recently: what Alertmanager should know about."""
        return self._rules.firing + self._rules.resolved

    def _collect(self, name: str, read: Callable[[], Any], collectors: dict[str, tuple[float, bool]]) -> Any:
        started = time.perf_counter()
        try:
            value = read()
            result = value.to_dict() if hasattr(value, "to_dict") else value
            ok = True
        except Exception as exc:  # e.g. an interface vanished mid-read: report, keep the agent running
            log.warning("collector %s failed: %s", name, exc)
            result, ok = None, False
        collectors[name] = (time.perf_counter() - started, ok)
        return result

    # --- correlation: who is behind a pid or a cgroup ---

    def _workload_of_pid(self, pid: int) -> Workload:
        if pid not in self._workloads:
            path = cgroup_of_pid(pid)
            self._workloads[pid] = workload_of(path) if path is not None else Workload("")
        return self._workloads[pid]

    def _annotate(self, r: Any) -> None:
        """Add `container` / `pod_uid` (and `comm` where missing) to every record; flows also get
        the `pid` and `comm` owning their socket, where the host's namespace holds it."""
        live_pids: set[int] = set()
        comms: dict[int, str] = {}
        for record in (r.flows or {}).get("flows", []):
            pid = self._sockets.owner(record["local_address"], record["local_port"], record["remote_address"],
                                      record["remote_port"])
            if pid is not None and pid not in comms:
                comms[pid] = _comm(pid)
                live_pids.add(pid)
            # Egress frames carry their socket's cgroup; ingress ones only the owner pid tells.
            workload = (self._cgroups.workload(record["cgroup_id"]) if record.get("cgroup_id")
                        else self._workload_of_pid(pid) if pid is not None else Workload(""))
            record.update(pid=pid, comm=comms.get(pid), container=workload.container)
        for record in (r.sendlat or {}).get("processes", []):
            workload = (self._cgroups.workload(record["cgroup_id"]) if record.get("cgroup_id")
                        else self._workload_of_pid(record["pid"]))
            record.update(container=workload.container, pod_uid=workload.pod_uid)
            live_pids.add(record["pid"])
        for section in ((r.cuda or {}).get("processes", []), (r.gpus or {}).get("processes", [])):
            for record in section:
                workload = self._workload_of_pid(record["pid"])
                record.update(container=workload.container, pod_uid=workload.pod_uid)
                record.setdefault("comm", _comm(record["pid"]))
                live_pids.add(record["pid"])
        self._workloads = {pid: w for pid, w in self._workloads.items() if pid in live_pids}

    # Cumulative per-process counters that also matter per second: (section, counter field).
    _RATED = (("sendlat", "bytes"), ("cuda", "context_switches"), ("cuda", "kernel_launches"), ("cuda", "syncs"))

    def _add_rates(self, r: Any, now: float) -> None:
        """Add `<counter>_per_second` to process records, over the interval since the last refresh."""
        live: set[tuple[str, int]] = set()
        for section, counter in self._RATED:
            for proc in (getattr(r, section) or {}).get("processes", []):
                source = (counter, proc["pid"])
                live.add(source)
                proc[f"{counter}_per_second"] = self._rates.rate(source, proc.get(counter) or 0, now)
        self._rates.forget(live)

    # --- rules input ---

    def _signals(self, r: Any, now: float) -> list[Signal]:
        signals: list[Signal] = []
        for proc in (r.sendlat or {}).get("processes", []):
            recent = self._windows.observe(("send", proc["pid"]), buckets_from_json(proc.get("histogram")), now)
            sends = recent[-1][1] if recent else 0
            p99 = quantile(recent, 0.99) if sends >= MIN_SENDS_FOR_P99 else None
            if p99 is not None:
                signals.append(Signal("network_send_stall", _target(proc), p99, {
                    "send_p99_seconds": round(p99, 6), "sends": int(sends), "window_seconds": SIGNAL_WINDOW_SECONDS,
                    "pid": proc["pid"], "threshold_seconds": self.config.rules["network_send_stall"].threshold}))
        for proc in (r.cuda or {}).get("processes", []):
            switches = proc["context_switches_per_second"]
            signals.append(Signal("cuda_context_switch_storm", _target(proc), switches, {
                "context_switches_per_second": round(switches, 1), "pid": proc["pid"]}))
            runqueue = buckets_from_json(proc.get("runqueue_histogram"))
            recent = self._windows.observe(("runq", proc["pid"]), runqueue, now)
            p99 = quantile(recent, 0.99)
            if p99 is not None:
                signals.append(Signal("gpu_threads_starved", _target(proc), p99, {
                    "runqueue_delay_p99_seconds": round(p99, 6), "wakeups": int(recent[-1][1]),
                    "involuntary_preemptions": proc.get("involuntary_preemptions", 0), "pid": proc["pid"]}))
        signals += self._gpu_signals(r)
        signals += self._tcp_signals(r.tcp, now)
        return signals

    def _ingress_bytes_per_second(self, r: Any) -> float:
        return sum(row.get("bytes_per_second", 0.0) for row in (r.flows or {}).get("interfaces", [])
                   if row.get("direction") == "ingress")

    def _gpu_signals(self, r: Any) -> list[Signal]:
        signals = []
        ingress = self._ingress_bytes_per_second(r)
        for gpu in (r.gpus or {}).get("gpus", []):
            util = gpu.get("utilization_gpu_ratio")
            if util is None:
                continue
            target = f"gpu{gpu['index']}"
            signals.append(Signal("gpu_saturated", target, util, {"utilization_ratio": util, "uuid": gpu.get("uuid")}))
            if ingress >= self.config.traffic_floor_bytes_per_second:
                signals.append(Signal("gpu_idle_with_traffic", target, util, {
                    "utilization_ratio": util, "ingress_bytes_per_second": round(ingress), "uuid": gpu.get("uuid")}))
        return signals

    def _tcp_signals(self, tcp: dict | None, now: float) -> list[Signal]:
        if tcp is None:
            return []
        last, self._last_tcp = self._last_tcp, (now, tcp)
        if last is None or now <= last[0]:
            return []
        elapsed, before = now - last[0], last[1]
        drops = (tcp["listen_overflows"] - before["listen_overflows"]) + (tcp["listen_drops"] - before["listen_drops"])
        signals = [Signal("listen_queue_overflow", "host", drops / elapsed, {
            "listen_overflows": tcp["listen_overflows"], "listen_drops": tcp["listen_drops"],
            "per_second": round(drops / elapsed, 3)})]
        sent = tcp["sent_segments"] - before["sent_segments"]
        if sent >= MIN_SEGMENTS_FOR_RETRANSMIT_RATIO:
            ratio = (tcp["retransmitted_segments"] - before["retransmitted_segments"]) / sent
            signals.append(Signal("tcp_retransmits_high", "host", ratio, {
                "retransmit_ratio": round(ratio, 4), "segments_sent": sent}))
        return signals

    # --- the snapshot document (docs/snapshot.md) ---

    def _build_snapshot(self, r: Any, now: float) -> dict:
        flows = sorted((r.flows or {}).get("flows", []), key=lambda f: f.get("bytes_per_second", 0), reverse=True)
        tcp = dict(r.tcp or {})
        if tcp:
            tcp["retransmit_ratio"] = (tcp["retransmitted_segments"] / tcp["sent_segments"]
                                       if tcp.get("sent_segments") else 0.0)
        return {
            "host": {"hostname": self.hostname, "kernel": kernel_release(), "version": __version__, "time": now,
                     "interval_seconds": self.config.interval_seconds},
            "probes": r.probes,
            "processes": self._processes(r),
            "flows": flows[:SNAPSHOT_FLOWS],
            "interfaces": (r.flows or {}).get("interfaces", []),
            "gpus": (r.gpus or {}).get("gpus", []),
            "tcp": tcp,
            "alerts": [a.to_dict() for a in self._rules.active + self._rules.resolved],
        }

    def _processes(self, r: Any) -> list[dict]:
        rows: dict[int, dict] = {}

        def row(record: dict) -> dict:
            pid = record["pid"]
            return rows.setdefault(pid, {
                "pid": pid, "comm": record.get("comm") or _comm(pid), "container": record.get("container", "host"),
                "pod_uid": record.get("pod_uid", ""), "send_count": None, "send_bytes": None,
                "send_bytes_per_second": None, "send_p50_seconds": None, "send_p99_seconds": None,
                "cuda_context_switches_per_second": None, "cuda_kernel_launches_per_second": None,
                "cuda_syncs_per_second": None, "runqueue_delay_p99_seconds": None,
                "gpu_utilization_ratio": None, "gpu_memory_used_bytes": None, "gpus": []})

        for proc in (r.sendlat or {}).get("processes", []):
            row(proc).update(
                send_count=proc.get("count"), send_bytes=proc.get("bytes"),
                send_bytes_per_second=proc["bytes_per_second"],
                send_p50_seconds=proc.get("p50_seconds"), send_p99_seconds=proc.get("p99_seconds"))
        for proc in (r.cuda or {}).get("processes", []):
            row(proc).update(
                cuda_context_switches_per_second=proc["context_switches_per_second"],
                cuda_kernel_launches_per_second=proc["kernel_launches_per_second"],
                cuda_syncs_per_second=proc["syncs_per_second"],
                runqueue_delay_p99_seconds=proc.get("runqueue_delay_p99_seconds"))
        for proc in (r.gpus or {}).get("processes", []):
            entry = row(proc)
            entry["gpus"].append(proc.get("gpu_index"))
            used = proc.get("used_memory_bytes") or 0
            entry["gpu_memory_used_bytes"] = (entry["gpu_memory_used_bytes"] or 0) + used
            if proc.get("sm_utilization_ratio") is not None:
                entry["gpu_utilization_ratio"] = (entry["gpu_utilization_ratio"] or 0) + proc["sm_utilization_ratio"]
        self._windows.forget({(kind, pid) for kind in ("send", "runq") for pid in rows})
        return sorted(rows.values(), key=lambda p: p["send_bytes_per_second"] or 0, reverse=True)


def _target(proc: dict) -> str:
    return f"{proc.get('comm') or proc['pid']}@{proc.get('container', 'host')}"


def _comm(pid: int) -> str:
    # The kernel's comm, as sendlat and cuda records carry it, so one process has one `process` label.
    return process_name(pid) or str(pid)


# --- the command ---


def _csv(value: str | None) -> list[str] | None:
    return [item.strip() for item in value.split(",") if item.strip()] if value else None


class ConfigProblem(click.ClickException):
    exit_code = 2

    def show(self, file: Any = None) -> None:
        click.echo(f"aiprobe: config: {self.format_message()}", err=True)


@click.command()
@click.option("--config", "config_path", metavar="PATH", help="TOML config (docs/config.md).")
@click.option("--listen", help="HOST:PORT to serve /metrics, /healthz, /api/v1/snapshot (default 0.0.0.0:9645).")
@click.option("--interfaces", help="Comma-separated globs of interfaces to watch (default: all up, except lo).")
@click.option("--probes", help=f"Comma-separated probes to run (default: {','.join(PROBE_NAMES)}).")
@click.option("--alertmanager", "alertmanager_url", help="Alertmanager base URL to push alerts to.")
@click.option("--web.config.file", "web_config_file", metavar="PATH",
              help="TLS and basic auth, in the Prometheus exporter-toolkit web config format.")
@click.option("--dcgm-compatible", "dcgm", is_flag=True, default=None,
              help="Also export DCGM-exporter metric names for existing GPU dashboards.")
def command(config_path: str | None, listen: str | None, interfaces: str | None, probes: str | None,
            alertmanager_url: str | None, web_config_file: str | None, dcgm: bool | None) -> None:
    """Run every available probe and serve Prometheus metrics, health and the snapshot API."""
    from .cli import require_privileges, ticks

    try:
        config = load(config_path, listen=listen, interfaces=_csv(interfaces), probes=_csv(probes),
                      alertmanager_url=alertmanager_url, web_config_file=web_config_file,
                      dcgm_compatible_metrics=dcgm)
    except ConfigError as exc:
        raise ConfigProblem(str(exc)) from None
    require_privileges()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="aiprobe: %(message)s")
    _raise_open_files_limit()
    run_agent(config, ticks)


def _raise_open_files_limit() -> None:
    """The soft limit of open files up to the hard one (as Prometheus does): clients, probes, the
    CUDA scan and netlink share it, and the usual soft 1024 is within reach of any local user."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, 1 << 20), hard))


def run_agent(config: Config, ticks: Callable[[float | None, float], Any]) -> None:
    from aiprobe.exporters.alerts import AlertmanagerPusher, JsonLinesSink
    from aiprobe.exporters.http import AgentHTTPServer
    from aiprobe.exporters.prometheus import AgentCollector, registry_for
    from aiprobe.exporters.webconfig import load_web_config

    sink = JsonLinesSink(config.alert_log)
    pusher = (AlertmanagerPusher(config.alertmanager_url, instance=socket.gethostname())
              if config.alertmanager_url else None)

    def on_transitions(transitions: list[Alert], now: float) -> None:
        sink.write(transitions, now)
        if pusher is not None:
            pusher.update(agent.alerts, changed=True)

    agent = Agent(config, on_transitions=on_transitions)
    collector = AgentCollector(top_flows=config.top_flows, dcgm_compatible=config.dcgm_compatible_metrics,
                               build_info={"version": __version__, "kernel": kernel_release(),
                                           "libbpf": libbpf.version()})
    try:
        web = load_web_config(config.web_config_file) if config.web_config_file else None
    except ConfigError as exc:
        raise ConfigProblem(str(exc)) from None
    try:
        server = AgentHTTPServer(config.listen_address, registry_for(collector), agent.snapshot, lambda: agent.healthy,
                                 web=web, snapshot_remote=config.snapshot_api == "network")
    except OSError as exc:
        raise ConfigProblem(f"listen {config.listen}: {exc.strerror}") from None
    try:
        agent.start()
        for name, status in agent.status.items():
            log.info("probe %s: %s", name, status.strategy if status.up else f"unavailable ({status.reason})")
        agent.refresh()
        collector.update(agent.readings)
        server.start()
        log.info("serving %s://%s/metrics (pid %d)", "https" if server.tls else "http",
                 endpoint(config.listen_address[0], server.port), os.getpid())
        for _ in ticks(None, config.interval_seconds):
            agent.refresh()
            collector.update(agent.readings)
            if pusher is not None:
                pusher.update(agent.alerts, changed=False)  # keeps resends current
    finally:
        server.close()
        agent.close()
        if pusher is not None:
            pusher.close()
        sink.close()
