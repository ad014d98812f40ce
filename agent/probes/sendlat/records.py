"""The send path's records: send latency per process and flow, slow sends, token streams, requests (served
and sent)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...loader import enum_labels
from ...model import HISTOGRAM, JOINED, Histogram, Identity, Placed, Record

# As enum stream_protocol and enum stall_cause (bpf/streams.h) name them; the stream logic is in sendlat's object.
PROTOCOLS = enum_labels("sendlat", "stream_protocol", "STREAM_PROTOCOL_")
CAUSES = enum_labels("sendlat", "stall_cause", "STALL_")
# As enum tls_version names them ("1_3" is "1.3"); the first, "none", is no version.
TLS_VERSIONS = enum_labels("sendlat", "tls_version", "TLS_VERSION_", lambda name: name.lower().replace("_", "."))
# As enum http_method names them; OTHER (not one of them, or not readable) is OpenTelemetry's "_OTHER".
METHODS = enum_labels("sendlat", "http_method", "HTTP_METHOD_", lambda name: "_OTHER" if name == "OTHER" else name)


@dataclass
class ProcessSendLatency(Placed):
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


class ServerEndpoint:
    """What names a server's records: a process (in a cgroup) on a listening port, by protocol."""

    pid: int
    start_ticks: int
    cgroup_id: int
    port: int
    protocol: str

    def identity(self) -> Identity:
        return self.pid, self.start_ticks, self.cgroup_id, self.port, self.protocol


@dataclass
class StreamEndpoint(ServerEndpoint, Placed):
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
    pod_uid: str = field(default="", metadata=JOINED)


@dataclass
class TlsHandshakes(Placed):
    """Server-side TLS handshakes of one process (in one cgroup) on one listening port, by version, since
    the probe started: from the read of the client's ClientHello to the read of its Finished."""

    pid: int
    comm: str
    cgroup_id: int
    port: int  # the listening (local) port
    tls_version: str  # "1.3" | "1.2" | "1.1" | "1.0", from the ServerHello
    count: int
    sum_seconds: float
    p50_seconds: float | None
    p99_seconds: float | None
    histogram: Histogram = field(metadata=HISTOGRAM)
    start_ticks: int = 0

    def identity(self) -> Identity:
        return self.pid, self.start_ticks, self.cgroup_id, self.port, self.tls_version


@dataclass
class StreamStall(SocketEvent, Placed):
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
    tls_handshakes: list[TlsHandshakes] = field(default_factory=list)


@dataclass
class Requests(Placed):
    """Requests one process (in one cgroup) answered on one listening port, by protocol, method and status
    code, since the probe started (monotonic counters): responses that ended (docs/requests.md)."""

    pid: int
    comm: str
    cgroup_id: int
    port: int  # the listening (local) port
    protocol: str  # "http" | "sse" | "http2" | "grpc"
    method: str  # "GET", "POST", ...; "_OTHER": another method, or not readable
    status_code: int  # the response's (HTTP/2: :status); 0: not readable
    count: int
    duration_sum_seconds: float
    duration_histogram: Histogram = field(metadata=HISTOGRAM)  # request received -> the response's last write
    p50_seconds: float | None = None
    p99_seconds: float | None = None
    durations_unknown: int = 0  # responses whose last write preceded their request: not in duration_histogram
    request_bytes: int = 0  # read for the requests, headers included
    response_bytes: int = 0  # of the responses' body writes (a write of the headers alone excluded)
    start_ticks: int = 0

    def identity(self) -> Identity:
        return self.pid, self.start_ticks, self.cgroup_id, self.port, self.protocol, self.method, self.status_code

    @property
    def status_label(self) -> str:
        return status_label(self.status_code)


def status_label(status_code: int) -> str:
    """A status code as a label value; empty (no label) where it was not readable."""
    return str(status_code) if status_code else ""


class HttpRequests(Requests):
    """HTTP requests (HTTP/1.x, Server-Sent Events, cleartext HTTP/2)."""


@dataclass
class RpcRequests(Requests):
    """gRPC calls (HTTP/2 whose DATA frames hold gRPC messages, or whose trailers a grpc-status);
    `status_code` is the HTTP :status."""

    grpc_status: int = -1  # the trailers' grpc-status (0: OK); -1: not readable (docs/requests.md)

    def identity(self) -> Identity:
        return (*super().identity(), self.grpc_status)

    @property
    def grpc_status_label(self) -> str:
        """The grpc-status as a label value; empty where it was not readable."""
        return str(self.grpc_status) if self.grpc_status >= 0 else ""


@dataclass
class RequestEndpoint(ServerEndpoint, Placed):
    """All requests of one process on one listening port and protocol: counts by status class and the
    duration's quantiles, since start; shares and rates over the last refresh interval."""

    pid: int
    comm: str
    cgroup_id: int
    port: int
    protocol: str
    count: int
    client_errors: int  # 4xx
    server_errors: int  # 5xx
    throttled: int  # 429
    status_unknown: int  # not readable (HTTP/2: a dynamic-table index)
    p50_seconds: float | None
    p99_seconds: float | None
    statuses: dict[str, int] = field(default_factory=dict)  # status code ("unknown": not readable) -> requests
    start_ticks: int = 0
    requests_per_second: float = field(default=0.0, metadata=JOINED)
    client_error_share: float = field(default=0.0, metadata=JOINED)  # of the requests in the last interval
    server_error_share: float = field(default=0.0, metadata=JOINED)
    throttled_share: float = field(default=0.0, metadata=JOINED)


@dataclass
class ClientRequests(Placed):
    """HTTP/1.x requests one process (in one cgroup) sent to one server (address, port) on connections it
    opened, by method and status code, since the probe started: those whose response was read and that
    ended (the read completing its body; where its head does not tell, 1 s without a read, the next request
    on the connection or its close; docs/requests.md)."""

    pid: int
    comm: str  # empty until the sender itself ends one of them (a close may end them in softirq)
    cgroup_id: int
    server_address: str
    server_port: int
    method: str  # "GET", "POST", ...
    status_code: int  # the response's status line; 0: not readable
    count: int
    duration_sum_seconds: float
    duration_histogram: Histogram = field(metadata=HISTOGRAM)  # the request's first send -> the response's last read
    ttfb_sum_seconds: float
    ttfb_histogram: Histogram = field(metadata=HISTOGRAM)  # the request's first send -> the response's first read
    p50_seconds: float | None = None
    p99_seconds: float | None = None
    ttfb_p50_seconds: float | None = None
    start_ticks: int = 0

    def identity(self) -> Identity:
        return (self.pid, self.start_ticks, self.cgroup_id, self.server_address, self.server_port, self.method,
                self.status_code)

    @property
    def status_label(self) -> str:
        return status_label(self.status_code)


@dataclass
class RequestsSnapshot(Record):
    """A read of the requests part: every (process, port, protocol, method, status) entry since start, HTTP's
    and gRPC's apart (their metric families differ), and their sums per server."""

    strategy: str
    span: str
    http: list[HttpRequests] = field(default_factory=list)
    rpc: list[RpcRequests] = field(default_factory=list)
    endpoints: list[RequestEndpoint] = field(default_factory=list)
    uncounted_requests: int = 0  # responses beyond the request table's capacity, since start
    clients: list[ClientRequests] = field(default_factory=list)  # requests the host sent
    uncounted_client_requests: int = 0  # beyond the client table's capacity, since start
