"""Prometheus exposition: probe readings become metric families through small declarative tables
(in the spirit of ebpf_exporter's decoders), rebuilt once per refresh so a scrape only serializes.

Labels stay bounded: processes are labelled by name and container (never pid), flows only for the
top K by rate with the rest summed per interface and direction into `remote_address="other"`.
Counters stay monotonic while their sources (pids, flows) come and go: `DeltaTracker` adds each
source's increase to its label set and forgets sources that vanished.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiprobe.histogram import buckets_from_json
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

FLOW_LABELS = ("interface", "direction", "protocol", "local_address", "local_port", "remote_address", "remote_port")
PROCESS_LABELS = ("process", "container")
GPU_LABELS = (("gpu", "index"), ("uuid", "uuid"))


@dataclass(frozen=True)
class FieldMetric:
    """One numeric field of a record exported as one metric (`scale` converts units)."""

    name: str
    field: str
    help: str
    kind: str = "gauge"
    scale: float = 1.0


GPU_METRICS = (
    FieldMetric("aiprobe_gpu_utilization_ratio", "utilization_gpu_ratio", "Fraction of time a kernel ran on the GPU."),
    FieldMetric("aiprobe_gpu_memory_utilization_ratio", "utilization_memory_ratio",
                "Fraction of time device memory was read or written."),
    FieldMetric("aiprobe_gpu_memory_used_bytes", "memory_used_bytes", "GPU memory in use."),
    FieldMetric("aiprobe_gpu_memory_total_bytes", "memory_total_bytes", "GPU memory installed."),
    FieldMetric("aiprobe_gpu_power_watts", "power_watts", "GPU power draw."),
    FieldMetric("aiprobe_gpu_temperature_celsius", "temperature_celsius", "GPU temperature."),
    FieldMetric("aiprobe_gpu_sm_clock_hertz", "sm_clock_hz", "GPU SM clock."),
    FieldMetric("aiprobe_gpu_memory_clock_hertz", "memory_clock_hz", "GPU memory clock."),
    FieldMetric("aiprobe_gpu_pcie_tx_bytes_per_second", "pcie_tx_bytes_per_second", "PCIe transmit throughput."),
    FieldMetric("aiprobe_gpu_pcie_rx_bytes_per_second", "pcie_rx_bytes_per_second", "PCIe receive throughput."),
)

# DCGM-exporter names and units, so dashboards built for dcgm-exporter keep working (--dcgm-compatible).
DCGM_METRICS = (
    FieldMetric("DCGM_FI_DEV_GPU_UTIL", "utilization_gpu_ratio", "GPU utilization (in %).", scale=100),
    FieldMetric("DCGM_FI_DEV_MEM_COPY_UTIL", "utilization_memory_ratio", "Memory utilization (in %).", scale=100),
    FieldMetric("DCGM_FI_DEV_FB_USED", "memory_used_bytes", "Framebuffer memory used (in MiB).", scale=1 / 2**20),
    FieldMetric("DCGM_FI_DEV_FB_FREE", "memory_free_bytes", "Framebuffer memory free (in MiB).", scale=1 / 2**20),
    FieldMetric("DCGM_FI_DEV_POWER_USAGE", "power_watts", "Power draw (in W)."),
    FieldMetric("DCGM_FI_DEV_GPU_TEMP", "temperature_celsius", "GPU temperature (in C)."),
    FieldMetric("DCGM_FI_DEV_SM_CLOCK", "sm_clock_hz", "SM clock frequency (in MHz).", scale=1e-6),
    FieldMetric("DCGM_FI_DEV_MEM_CLOCK", "memory_clock_hz", "Memory clock frequency (in MHz).", scale=1e-6),
)
DCGM_LABELS = (("gpu", "index"), ("UUID", "uuid"), ("modelName", "name"))

TCP_COUNTERS = (
    FieldMetric("aiprobe_tcp_listen_overflows_total", "listen_overflows",
                "Connections dropped because a listen queue was full (TcpExt ListenOverflows).", "counter"),
    FieldMetric("aiprobe_tcp_listen_drops_total", "listen_drops",
                "Connection requests dropped at listen sockets (TcpExt ListenDrops).", "counter"),
    FieldMetric("aiprobe_tcp_retransmitted_segments_total", "retransmitted_segments",
                "TCP segments retransmitted (Tcp RetransSegs).", "counter"),
    FieldMetric("aiprobe_tcp_sent_segments_total", "sent_segments", "TCP segments sent (Tcp OutSegs).", "counter"),
)

# Per-process counters summed over the pids of one (process, container): (metric, record field, help).
SENDLAT_COUNTERS = (
    FieldMetric("aiprobe_tcp_send_bytes_total", "bytes", "Bytes passed to tcp_sendmsg.", "counter"),
)
CUDA_COUNTERS = (
    FieldMetric("aiprobe_cuda_context_switches_total", "context_switches",
                "Times a thread's current CUDA context changed to a different one.", "counter"),
    FieldMetric("aiprobe_cuda_kernel_launches_total", "kernel_launches", "CUDA kernel launches.", "counter"),
    FieldMetric("aiprobe_gpu_thread_involuntary_preemptions_total", "involuntary_preemptions",
                "Times a GPU-driving thread was preempted while runnable.", "counter"),
)
# (metric, record field holding cumulative buckets, field with the sum of seconds, help)
SENDLAT_HISTOGRAMS = (
    ("aiprobe_tcp_sendmsg_duration_seconds", "histogram", "sum_seconds", "Duration of tcp_sendmsg calls."),
)
CUDA_HISTOGRAMS = (
    ("aiprobe_cuda_sync_duration_seconds", "sync_histogram", "sync_seconds_sum",
     "Duration of cuStreamSynchronize / cuCtxSynchronize calls."),
    ("aiprobe_gpu_thread_runqueue_delay_seconds", "runqueue_histogram", "runqueue_delay_seconds_sum",
     "Time GPU-driving threads waited runnable for a CPU (wakeup to on-CPU)."),
)


def _family(name: str, help_text: str, kind: str, labels: Sequence[str]) -> Metric:
    cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
    return cls(name.removesuffix("_total") if kind == "counter" else name, help_text, labels=list(labels))


def field_families(
    specs: Iterable[FieldMetric], labels: Sequence[tuple[str, str]], records: Iterable[dict]
) -> list[Metric]:
    """One family per spec, one sample per record that has a value for it (None: not supported)."""
    records = list(records)
    families = []
    for spec in specs:
        family = _family(spec.name, spec.help, spec.kind, [label for label, _ in labels])
        for record in records:
            value = record.get(spec.field)
            if value is not None:
                family.add_metric([str(record.get(key, "")) for _, key in labels], float(value) * spec.scale)
        families.append(family)
    return families


class DeltaTracker:
    """Increase of each source's cumulative values since the last refresh (a reset counts from 0)."""

    def __init__(self) -> None:
        self._last: dict[Hashable, Sequence[float]] = {}
        self._seen: set[Hashable] = set()

    def delta(self, source: Hashable, values: Sequence[float]) -> Sequence[float]:
        self._seen.add(source)
        last = self._last.get(source)
        self._last[source] = values
        if last is None or len(last) != len(values):
            return values
        increase = [v - p for v, p in zip(values, last, strict=True)]
        return values if min(increase) < 0 else increase  # a decrease is a reset: count from 0

    def end_round(self) -> None:
        """Forget sources not seen since the previous call (a reused pid then counts afresh)."""
        self._last = {k: v for k, v in self._last.items() if k in self._seen}
        self._seen = set()


@dataclass
class Totals:
    """Monotonic per-label-set sums fed by a DeltaTracker."""

    tracker: DeltaTracker = field(default_factory=DeltaTracker)
    sums: dict[tuple, list[float]] = field(default_factory=dict)

    def add(self, labels: tuple, source: Hashable, values: Sequence[float]) -> None:
        delta = self.tracker.delta(source, values)
        if len(self.sums.get(labels, delta)) != len(delta):  # bucket layout changed: start this label set over
            del self.sums[labels]
        _accumulate(self.sums, labels, delta)


@dataclass
class Readings:
    """One refresh worth of probe output as plain dicts (records already carry `container`)."""

    flows: dict | None = None
    sendlat: dict | None = None
    cuda: dict | None = None
    gpus: dict | None = None
    tcp: dict | None = None
    probes: dict[str, dict] = field(default_factory=dict)  # name -> {"up", "strategy", ...}
    map_usage: list[dict] = field(default_factory=list)  # {"probe", "map", "entries", "capacity"}
    events_lost: dict[str, int] = field(default_factory=dict)
    alerts: list[dict] = field(default_factory=list)  # active (pending + firing)
    collectors: dict[str, tuple[float, bool]] = field(default_factory=dict)  # name -> (seconds, success)


class AgentCollector(Collector):
    """prometheus_client collector serving the families built by the last `update()`."""

    def __init__(self, *, top_flows: int, dcgm_compatible: bool, build_info: dict[str, str]) -> None:
        self._top_flows = top_flows
        self._dcgm = dcgm_compatible
        self._build_info = build_info
        self._lock = threading.Lock()
        self._families: list[Metric] = []
        self._flow_deltas = DeltaTracker()
        self._other_flows: dict[tuple[str, str], list[float]] = {}  # (interface, direction) -> [bytes, packets]
        self._tcp_flags: dict[tuple[str, str], list[float]] = {}  # (interface, direction) -> [syn, fin, rst]
        self._process_totals: dict[str, Totals] = {}
        self._bucket_bounds: dict[str, list[float]] = {}  # histogram field -> le bounds (fixed per probe)

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            return list(self._families)

    def update(self, readings: Readings) -> None:
        families = [*self._self_metrics(readings), *self._flow_metrics(readings.flows)]
        families += self._process_metrics("sendlat", readings.sendlat, SENDLAT_COUNTERS, SENDLAT_HISTOGRAMS)
        families += self._process_metrics("cuda", readings.cuda, CUDA_COUNTERS, CUDA_HISTOGRAMS)
        gpus = (readings.gpus or {}).get("gpus", [])
        families += field_families(GPU_METRICS, GPU_LABELS, gpus)
        if self._dcgm:
            families += field_families(DCGM_METRICS, DCGM_LABELS, gpus)
        families += [_clock_event_reasons(gpus), *self._gpu_process_metrics(readings.gpus)]
        families += field_families(TCP_COUNTERS, (), [readings.tcp] if readings.tcp else [])
        families.append(self._bottlenecks(readings.alerts))
        with self._lock:
            self._families = families

    # --- families ---

    def _self_metrics(self, r: Readings) -> list[Metric]:
        info = GaugeMetricFamily("aiprobe_build_info", "aiprobe version, kernel and libbpf; always 1.",
                                 labels=list(self._build_info))
        info.add_metric(list(self._build_info.values()), 1)
        up = GaugeMetricFamily("aiprobe_probe_up", "1 when the probe runs, with the strategy it runs.",
                               labels=["probe", "strategy"])
        for name, status in r.probes.items():
            up.add_metric([name, status.get("strategy") or "none"], 1 if status.get("up") else 0)
        entries = GaugeMetricFamily("aiprobe_bpf_map_entries", "Entries in a bounded BPF map.", labels=["probe", "map"])
        capacity = GaugeMetricFamily("aiprobe_bpf_map_capacity", "Capacity (max_entries) of a bounded BPF map.",
                                     labels=["probe", "map"])
        for usage in r.map_usage:
            entries.add_metric([usage["probe"], usage["map"]], usage["entries"])
            capacity.add_metric([usage["probe"], usage["map"]], usage["capacity"])
        lost = CounterMetricFamily("aiprobe_events_lost", "Events a probe could not deliver (ring buffer full).",
                                   labels=["probe"])
        for probe, count in r.events_lost.items():
            lost.add_metric([probe], count)
        duration = GaugeMetricFamily("aiprobe_collector_duration_seconds", "Time the last refresh of a collector took.",
                                     labels=["collector"])
        success = GaugeMetricFamily("aiprobe_collector_success", "1 when the last refresh of a collector succeeded.",
                                    labels=["collector"])
        for name, (seconds, ok) in r.collectors.items():
            duration.add_metric([name], seconds)
            success.add_metric([name], 1 if ok else 0)
        return [info, up, entries, capacity, lost, duration, success]

    def _flow_metrics(self, flows: dict | None) -> list[Metric]:
        labels = list(FLOW_LABELS)
        flow_bytes = CounterMetricFamily("aiprobe_flow_bytes", "Bytes of a flow (L2 frames), top flows by rate; "
                                         "the rest summed per interface and direction as remote_address=\"other\".",
                                         labels=labels)
        flow_packets = CounterMetricFamily("aiprobe_flow_packets", "Packets of a flow; same selection as "
                                           "aiprobe_flow_bytes_total.", labels=labels)
        iface_bytes = CounterMetricFamily("aiprobe_interface_bytes", "Bytes seen by aiprobe on an interface.",
                                          labels=["interface", "direction"])
        iface_packets = CounterMetricFamily("aiprobe_interface_packets", "Packets seen by aiprobe on an interface.",
                                            labels=["interface", "direction"])
        tcp_flags = CounterMetricFamily("aiprobe_flow_tcp_flags", "TCP SYN, FIN and RST segments seen in flows.",
                                        labels=["interface", "direction", "flag"])
        families = [flow_bytes, flow_packets, iface_bytes, iface_packets, tcp_flags]
        if not flows:
            return families
        records = sorted(flows.get("flows", []), key=lambda f: f.get("bytes_per_second", 0), reverse=True)
        for rank, flow in enumerate(records):
            key = (flow["interface"], flow["direction"], flow["protocol"], flow["local_address"],
                   str(flow["local_port"]), flow["remote_address"], str(flow["remote_port"]))
            side = key[:2]
            # Per-flow increases feed "other" and the flag counters, so both stay monotonic as flows churn.
            delta = self._flow_deltas.delta(key, (flow["bytes"], flow["packets"], flow.get("tcp_syn", 0),
                                                  flow.get("tcp_fin", 0), flow.get("tcp_rst", 0)))
            if rank < self._top_flows:
                flow_bytes.add_metric(key, flow["bytes"])
                flow_packets.add_metric(key, flow["packets"])
            else:
                _accumulate(self._other_flows, side, delta[:2])
            if any(delta[2:]):
                _accumulate(self._tcp_flags, side, delta[2:])
        self._flow_deltas.end_round()
        for (iface, direction), (nbytes, npackets) in self._other_flows.items():
            other_key = [iface, direction, "", "", "", "other", ""]
            flow_bytes.add_metric(other_key, nbytes)
            flow_packets.add_metric(other_key, npackets)
        for (iface, direction), values in self._tcp_flags.items():
            for flag, value in zip(("syn", "fin", "rst"), values, strict=True):
                tcp_flags.add_metric([iface, direction, flag], value)
        for row in flows.get("interfaces", []):
            iface_bytes.add_metric([row["interface"], row["direction"]], row["bytes"])
            iface_packets.add_metric([row["interface"], row["direction"]], row["packets"])
        return families

    def _process_metrics(
        self, probe: str, reading: dict | None, counters: Sequence[FieldMetric],
        histograms: Sequence[tuple[str, str, str, str]],
    ) -> list[Metric]:
        """Counters and histograms per (process, container), summed monotonically over pids."""
        totals = self._process_totals.setdefault(probe, Totals())
        for record in (reading or {}).get("processes", []):
            labels = (str(record.get("comm", "")), str(record.get("container", "host")))
            values: list[float] = [float(record.get(spec.field) or 0) for spec in counters]
            for _, hist_field, sum_field, _ in histograms:
                buckets = buckets_from_json(record.get(hist_field) or [])
                self._bucket_bounds[hist_field] = [le for le, _ in buckets]
                values += [float(record.get(sum_field) or 0), *(count for _, count in buckets)]
            totals.add(labels, record["pid"], values)
        totals.tracker.end_round()
        families = [_family(spec.name, spec.help, "counter", PROCESS_LABELS) for spec in counters]
        hist_families = [HistogramMetricFamily(name, help_text, labels=list(PROCESS_LABELS))
                         for name, _, _, help_text in histograms]
        for labels, values in totals.sums.items():
            for family, value in zip(families, values, strict=False):
                family.add_metric(list(labels), value)
            offset = len(counters)
            for family, (_, hist_field, _, _) in zip(hist_families, histograms, strict=True):
                bounds = self._bucket_bounds.get(hist_field) or []
                total_sum, counts = values[offset], values[offset + 1: offset + 1 + len(bounds)]
                offset += 1 + len(bounds)
                if counts:
                    family.add_metric(list(labels), _prometheus_buckets(bounds, counts), total_sum)
        return [*families, *hist_families]

    def _gpu_process_metrics(self, gpus: dict | None) -> list[Metric]:
        used = GaugeMetricFamily("aiprobe_gpu_process_memory_used_bytes", "GPU memory used by processes.",
                                 labels=["gpu", "process", "container"])
        sums: dict[tuple[str, str, str], float] = {}
        for proc in (gpus or {}).get("processes", []):
            key = (str(proc.get("gpu_index", "")), str(proc.get("comm", "")), str(proc.get("container", "host")))
            sums[key] = sums.get(key, 0.0) + float(proc.get("used_memory_bytes") or 0)
        for key, value in sums.items():
            used.add_metric(list(key), value)
        return [used]

    @staticmethod
    def _bottlenecks(alerts: list[dict]) -> Metric:
        active = GaugeMetricFamily("aiprobe_bottleneck_active", "1 while a bottleneck rule fires for a target.",
                                   labels=["rule", "severity", "target"])
        for alert in alerts:
            if alert["state"] == "firing":
                active.add_metric([alert["rule"], alert["severity"], alert["target"]], 1)
        return active


def _clock_event_reasons(gpus: list[dict]) -> Metric:
    """Every known reason per GPU as 0/1, so the series set stays fixed while reasons come and go."""
    from aiprobe.nvml import CLOCK_EVENT_REASONS

    active = GaugeMetricFamily("aiprobe_gpu_clock_event_reason_active",
                               "1 while NVML reports this reason for lowered clocks (throttling), else 0.",
                               labels=["gpu", "uuid", "reason"])
    for gpu in gpus:
        reasons = gpu.get("clock_event_reasons")
        if reasons is None:  # NOT_SUPPORTED on this GPU
            continue
        for reason in CLOCK_EVENT_REASONS.values():
            active.add_metric([str(gpu["index"]), str(gpu.get("uuid", "")), reason], 1 if reason in reasons else 0)
    return active


def _accumulate(sums: dict[tuple, list[float]], key: tuple, delta: Sequence[float]) -> None:
    current = sums.setdefault(key, [0.0] * len(delta))
    for i, value in enumerate(delta):
        current[i] += value


def _prometheus_buckets(bounds: Sequence[float], counts: Sequence[float]) -> list[tuple[str, float]]:
    buckets = [("+Inf" if math.isinf(le) else repr(float(le)), count) for le, count in zip(bounds, counts, strict=True)]
    if not buckets or buckets[-1][0] != "+Inf":
        buckets.append(("+Inf", counts[-1] if counts else 0.0))
    return buckets


def registry_for(collector: AgentCollector, *, process_metrics: bool = True) -> Any:
    """A registry holding the agent's collector (and the standard process_* self-metrics)."""
    from prometheus_client import CollectorRegistry, ProcessCollector

    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    if process_metrics:
        ProcessCollector(registry=registry)
    return registry

