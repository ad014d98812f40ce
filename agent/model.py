"""The agent's one model: every record a probe returns, and the snapshot the agent joins them into.

Probes return these records; the agent adds what it joins (container, pod, socket owner) and rates;
`/metrics`, `/api/v1/snapshot`, `aiprobe top` and every `--json` are views over the same records.
docs/snapshot.md documents every field (tests/test_model.py fails on one that is not).

A field marked JOINED is filled by the agent, not the probe: a probe's own `--json` leaves it out.
A field marked HISTOGRAM holds cumulative (le_seconds, count) buckets, written as
[{"le_seconds", "count"}] in documents.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from .histogram import buckets_to_json

JOINED = {"joined": True}
HISTOGRAM = {"histogram": True}

Histogram = list[tuple[float, int]]  # cumulative (le_seconds, count); the last le is +Inf
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
            out[name] = buckets_to_json(item) if is_histogram else document(item, joined=joined)
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


# --- network ---


@dataclass
class FlowRecord(Record):
    interface: str
    direction: str  # "ingress" | "egress"
    protocol: str  # "tcp", "udp", ... or the IP protocol number
    local_address: str  # this host's side
    local_port: int
    remote_address: str
    remote_port: int
    bytes: int
    packets: int
    bytes_per_second: float
    packets_per_second: float
    cgroup_id: int  # egress: the sending socket's cgroup v2 id; 0 when unknown
    first_seen: float  # Unix time
    last_seen: float
    tcp_syn: int = 0
    tcp_fin: int = 0
    tcp_rst: int = 0
    # The process owning the socket (host network namespace only) and its container.
    pid: int | None = field(default=None, metadata=JOINED)
    comm: str | None = field(default=None, metadata=JOINED)
    container: str = field(default="host", metadata=JOINED)

    def identity(self) -> Identity:
        return (self.interface, self.direction, self.protocol, self.local_address, self.local_port,
                self.remote_address, self.remote_port)


@dataclass
class InterfaceTotals(Record):
    """Everything one interface moved in one direction since the probe attached to it: wire frames
    (a GSO/GRO skb counts as its segments, each with its headers; bpf/flows.h)."""

    interface: str
    direction: str
    bytes: int
    packets: int
    tcp_syn: int = 0  # TCP segments with SYN, FIN, RST: of its flows, those deleted included
    tcp_fin: int = 0
    tcp_rst: int = 0
    bytes_per_second: float = field(default=0.0, metadata=JOINED)
    packets_per_second: float = field(default=0.0, metadata=JOINED)

    def identity(self) -> Identity:
        return self.interface, self.direction


@dataclass
class InterfaceAttachment(Record):
    """How the flows programs sit on one interface, or why they could not."""

    interface: str
    ifindex: int
    ingress: str | None = None  # "tcx" | "clsact" | "xdp"
    egress: str | None = None  # "tcx" | "clsact"
    error: str = ""  # why a direction has no program
    xdp_refused: str = ""  # the interface matched xdp_interfaces, and why ingress is counted at tc instead

    def describe(self) -> str:
        hooks = ", ".join(f"{d} {getattr(self, d) or 'none'}" for d in ("ingress", "egress"))
        notes = "; ".join(n for n in (self.error, self.xdp_refused) if n)
        return f"{self.interface}: {hooks}" + (f" ({notes})" if notes else "")


@dataclass
class FlowsSnapshot(Record):
    timestamp: float
    interval_seconds: float
    flows: list[FlowRecord]
    interfaces: list[InterfaceTotals]
    evictions: int  # monotonic: flows evicted to make room
    insert_failures: int  # monotonic: new flows that found the table full (counted per interface only)
    malformed_frames: int  # monotonic: frames with truncated or inconsistent headers
    attachments: list[InterfaceAttachment]
    lost_frames: int = 0  # monotonic: frames counted nowhere, not even in interface totals (struct lost_counters)


@dataclass
class TcpCounters(Record):
    """Host-wide kernel TCP counters (/proc/net/netstat, /proc/net/snmp), monotonic."""

    listen_overflows: int
    listen_drops: int
    retransmitted_segments: int
    sent_segments: int


# --- processes ---


@dataclass
class ProcessSendLatency(Record):
    """Sends of one process in one cgroup since the probe started (monotonic counters). Failed
    sends are not sends: they are counted apart, by error."""

    pid: int
    comm: str
    cgroup_id: int
    count: int  # successful sends (that returned bytes)
    bytes: int
    sum_seconds: float  # of the timed sends
    p50_seconds: float | None  # None before the first timed send
    p99_seconds: float | None
    histogram: Histogram = field(metadata=HISTOGRAM)  # timed sends (all, or 1 in N per thread)
    start_ticks: int = 0  # the process's start (/proc/PID/stat): with pid and cgroup, its identity
    timed: int = 0  # sends in `histogram`
    errors: dict[str, int] = field(default_factory=dict)  # failed sends by error; EAGAIN is back-pressure
    # Unwritable time: from a send that found the socket full (EAGAIN, or a short non-blocking
    # send) to the next successful send on it.
    unwritable_count: int = 0
    unwritable_sum_seconds: float = 0.0
    unwritable_p99_seconds: float | None = None
    unwritable_histogram: Histogram = field(default_factory=list, metadata=HISTOGRAM)
    bytes_per_second: float = field(default=0.0, metadata=JOINED)
    container: str = field(default="host", metadata=JOINED)
    pod_uid: str = field(default="", metadata=JOINED)

    def identity(self) -> Identity:
        return self.pid, self.start_ticks, self.cgroup_id


@dataclass
class FlowSendStats(Record):
    """Sends of one process on one TCP connection since the probe started."""

    pid: int
    local_address: str
    local_port: int
    remote_address: str
    remote_port: int
    count: int
    bytes: int
    sum_seconds: float


@dataclass
class SocketEvent(Record):
    """What a kernel event on a TCP connection says of where it happened: thread, process, connection."""

    pid: int
    tid: int
    comm: str
    cgroup_id: int
    local_address: str
    local_port: int
    remote_address: str
    remote_port: int


@dataclass
class SlowSend(SocketEvent):
    """One send slower than the threshold."""

    bytes: int
    duration_seconds: float


@dataclass
class SendLatencySnapshot(Record):
    strategy: str
    span: str
    processes: list[ProcessSendLatency] = field(default_factory=list)
    flows: list[FlowSendStats] = field(default_factory=list)
    slow_sends: list[SlowSend] = field(default_factory=list)  # since the previous read
    lost_events: int = 0  # slow sends lost since start
    uncounted_sends: int = 0  # sends of processes beyond the table's capacity, since start
    sample_every: int = 1  # 1 send in this many per thread is timed now; counts are exact regardless


@dataclass
class StreamEndpoint(Record):
    """Responses of one process (in one cgroup) on one listening port, by protocol, since the probe
    started (monotonic counters). A response starts at its first body write; see docs/streams.md."""

    pid: int
    comm: str
    cgroup_id: int
    port: int  # the listening (local) port
    protocol: str  # "sse" | "grpc" | "http2" | "http" | "tls" | "tcp" (not recognised)
    streams: int  # responses that wrote a first byte
    chunks: int  # their writes, headers-only and last-chunk writes excluded
    bytes: int
    completed: int  # responses that ended (the next request, the last chunk or the connection's end)
    ttfb_p50_seconds: float | None
    ttfb_p99_seconds: float | None
    ttfb_sum_seconds: float
    ttfb_histogram: Histogram = field(metadata=HISTOGRAM)
    gaps: int = 0
    gap_p50_seconds: float | None = None
    gap_p99_seconds: float | None = None
    gap_sum_seconds: float = 0.0
    gap_histogram: Histogram = field(default_factory=list, metadata=HISTOGRAM)
    duration_sum_seconds: float = 0.0
    duration_histogram: Histogram = field(default_factory=list, metadata=HISTOGRAM)
    stalls: dict[str, int] = field(default_factory=dict)  # cause -> gaps above the threshold
    durations_unknown: int = 0  # ended responses whose duration could not be known: not in duration_histogram
    start_ticks: int = 0
    streams_per_second: float = field(default=0.0, metadata=JOINED)
    container: str = field(default="host", metadata=JOINED)
    pod_uid: str = field(default="", metadata=JOINED)

    def identity(self) -> Identity:
        return self.pid, self.start_ticks, self.cgroup_id, self.port, self.protocol


@dataclass
class StreamStall(SocketEvent):
    """One gap between two writes of a response above the threshold, with the evidence of its cause."""

    protocol: str
    stream_id: int  # the HTTP/2 stream; 0: the connection's response (HTTP/1.x, TLS, TCP)
    gap_seconds: float
    elapsed_seconds: float  # from the request to the write that ended the gap
    chunk: int  # that write's number in the response, from 1
    cause: str  # "network" | "cpu" | "gpu" | "server"
    unwritable_seconds: float  # the socket was full during the gap
    blocked_send_seconds: float  # the write ending the gap blocked (timed sends only)
    runqueue_seconds: float  # the writing thread waited runnable for a CPU
    cuda_sync_seconds: float  # a thread of the process was inside a CUDA synchronization (cuda probe)
    container: str = field(default="host", metadata=JOINED)


@dataclass
class StreamsSnapshot(Record):
    strategy: str
    span: str
    stall_threshold_seconds: float
    endpoints: list[StreamEndpoint] = field(default_factory=list)
    stalls: list[StreamStall] = field(default_factory=list)  # since the previous read
    lost_stalls: int = 0  # stall events lost since start
    uncounted_streams: int = 0  # responses beyond the endpoint table's capacity, since start
    untimed_h2_streams: int = 0  # HTTP/2 streams beyond the streams timed at once on a connection, since start
    cuda_syncs_seen: bool = False  # the cuda probe runs: stalls spent in CUDA synchronizations are `gpu`


@dataclass
class ColdStart(Record):
    """Where a process started while aiprobe watched spent its CUDA start-up (seconds; null: the
    step has not happened). Measured from the process's start (its fork; exec follows at once for
    a spawned program)."""

    to_init_seconds: float | None  # start -> first cuInit
    init_seconds: float  # in cuInit
    context_creates: int  # cuCtxCreate*, cuDevicePrimaryCtxRetain
    context_create_seconds: float
    module_loads: int  # cuModuleLoad*, cuLibraryLoad*
    module_load_seconds: float
    to_first_launch_seconds: float | None  # start -> first kernel or graph launch


@dataclass
class CudaProcess(Record):
    pid: int
    comm: str
    library: str
    # A thread's current context became a different one (cuCtxSetCurrent, push/pop, create,
    # destroy, cudaSetDevice): per thread, not the GPU time-slicing between contexts (CudaGpu).
    context_switches: int
    kernel_launches: int
    syncs: int
    sync_seconds_sum: float
    sync_p99_seconds: float | None
    sync_histogram: Histogram = field(metadata=HISTOGRAM)
    runqueue_delay_seconds_sum: float = 0.0
    runqueue_delay_p99_seconds: float | None = None
    runqueue_histogram: Histogram = field(default_factory=list, metadata=HISTOGRAM)
    involuntary_preemptions: int = 0
    gpu_threads: int = 0  # threads ever seen calling into libcuda / libcudart
    start_ticks: int = 0
    graph_launches: int = 0
    runtime_launches: int = 0  # of kernel and graph launches, those counted at libcudart's entry points
    # Of kernel_launches, those estimated (not seen) while the launch probes were duty-cycled (CPU budget).
    estimated_launches: int = 0
    counted_at: str = ""  # "runtime", "driver", "runtime+driver": the layers its launches were counted at
    runtime: str = ""  # "" (none seen), "shared" (a libcudart file) or "static" (linked into the executable)
    runtime_library: str = ""
    stream_syncs: int = 0
    device_syncs: int = 0
    event_syncs: int = 0
    stream_sync_seconds_sum: float = 0.0
    device_sync_seconds_sum: float = 0.0
    event_sync_seconds_sum: float = 0.0
    cold_start: ColdStart | None = None  # processes started while aiprobe watched
    context_switches_per_second: float = field(default=0.0, metadata=JOINED)
    kernel_launches_per_second: float = field(default=0.0, metadata=JOINED)
    graph_launches_per_second: float = field(default=0.0, metadata=JOINED)
    syncs_per_second: float = field(default=0.0, metadata=JOINED)
    container: str = field(default="host", metadata=JOINED)
    pod_uid: str = field(default="", metadata=JOINED)

    def identity(self) -> Identity:
        return self.pid, self.start_ticks


@dataclass
class CudaContext(Record):
    """A context that launched work, in its process."""

    pid: int
    comm: str
    context: str  # the CUcontext value, "primary:N" (device N's primary context) or "unknown"
    device: int  # CUDA device ordinal in the process; -1: created before aiprobe watched
    gpu: str  # the physical GPU (index, or UUID), through the process's CUDA_VISIBLE_DEVICES
    kernel_launches: int
    graph_launches: int
    launches_per_second: float  # kernel + graph launches, since the previous read
    active: bool  # launched since the previous read
    container: str = field(default="host", metadata=JOINED)
    pod_uid: str = field(default="", metadata=JOINED)


@dataclass
class CudaGpu(Record):
    """A GPU and the contexts that launched work on it since the previous read: two or more busy
    contexts are time-sliced by the GPU (each switch saves and restores the GPU's state)."""

    gpu: str
    active_contexts: int
    contexts: list[str]  # "pid/context"
    pids: list[int]
    launches_per_second: float


@dataclass
class AttachedLibrary(Record):
    """One probed library file: which entry points it defined, or why it could not be probed."""

    path: str
    host_path: str
    symbols: list[str] = field(default_factory=list)
    error: str = ""
    kind: str = "driver"  # "driver" (libcuda), "runtime" (libcudart) or "static runtime" (an executable)


@dataclass
class CudaSnapshot(Record):
    processes: list[CudaProcess]
    sched_strategy: str | None
    libraries: list[AttachedLibrary]
    contexts: list[CudaContext] = field(default_factory=list)
    gpus: list[CudaGpu] = field(default_factory=list)
    # Fraction of the time the kernel-launch probes are attached (1: every launch counted; less:
    # duty-cycled under the CPU budget, launch counts partly estimated).
    launch_duty_cycle: float = 1.0


# --- GPUs ---


@dataclass
class GpuEngine(Record):
    """Context switches of one graphics engine of a GPU (GPM's GR0..GR7: GR0 alone without MIG, one or
    more per GPU instance under MIG), between this read and the previous one."""

    engine: int
    context_switches_per_second: float | None  # over the engine's elapsed cycles at the SM clock
    context_switching_ratio: float  # of the engine's time spent switching contexts
    context_switch_seconds: float | None  # mean time per switch: cycles per switch / SM clock; None without switches


@dataclass
class GpuInfo(Record):
    index: int
    uuid: str
    name: str
    utilization_gpu_ratio: float | None = None
    utilization_memory_ratio: float | None = None
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None
    memory_free_bytes: int | None = None
    power_watts: float | None = None
    temperature_celsius: float | None = None
    sm_clock_hz: int | None = None
    memory_clock_hz: int | None = None
    clock_event_reasons: list[str] | None = None
    pcie_tx_bytes_per_second: int | None = None
    pcie_rx_bytes_per_second: int | None = None
    compute_mode: str | None = None
    # GPM, between this read and the previous one (None on the first read or without GPM).
    gpm_context_switch_requests: float | None = None
    gpm_context_switch_cycles_per_request: float | None = None
    gpm_context_switch_active_ratio: float | None = None
    # The same for every graphics engine in base units; the GPU's: switches per second and mean time
    # per switch over all its engines, the switching share of its busiest engine.
    context_switches_per_second: float | None = None
    context_switching_ratio: float | None = None
    context_switch_seconds: float | None = None
    engines: list[GpuEngine] = field(default_factory=list)
    # CUDA contexts that launched work on this GPU in the last refresh (the cuda probe): 2 or more are time-sliced.
    cuda_active_contexts: int | None = field(default=None, metadata=JOINED)


@dataclass
class GpuProcess(Record):
    pid: int  # host pid namespace
    comm: str
    gpu_index: int
    gpu_uuid: str
    used_memory_bytes: int | None
    sm_utilization_ratio: float | None = None
    container: str = field(default="host", metadata=JOINED)
    pod_uid: str = field(default="", metadata=JOINED)


@dataclass
class GpuSnapshot(Record):
    available: bool
    reason: str = ""
    gpus: list[GpuInfo] = field(default_factory=list)
    processes: list[GpuProcess] = field(default_factory=list)


# --- the agent's own records ---


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
    interval_seconds: float


@dataclass
class ProcessRow(Record):
    """One process joined across probes: its sends, its CUDA calls, its GPUs (null: no such data)."""

    pid: int
    comm: str
    container: str = "host"
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
class TcpSummary(TcpCounters):
    """The snapshot's `tcp`: the counters and the ratio since boot."""

    retransmit_ratio: float = 0.0


@dataclass
class Snapshot(Record):
    """`/api/v1/snapshot` (docs/snapshot.md)."""

    host: HostInfo
    probes: dict[str, ProbeStatus]
    processes: list[ProcessRow]
    flows: list[FlowRecord]
    interfaces: list[InterfaceTotals]
    gpus: list[GpuInfo]
    tcp: TcpSummary | None
    alerts: list[Alert]
    streams: list[StreamEndpoint] = field(default_factory=list)

    def to_dict(self, *, joined: bool = True) -> dict[str, Any]:
        result = super().to_dict(joined=joined)
        if result["tcp"] is None:
            result["tcp"] = {}
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
    process_labels_folded: int = 0  # the exporter's: process names summed into process="other" so far

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
