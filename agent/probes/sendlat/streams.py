"""Token streams seen from the wire: time to first byte, gaps between chunks and stalls of every
response a TCP server writes (bpf/streams.h, inside bpf/sendlat.bpf.c).

The stream logic shares sendlat's programs on the send path (one program per event), so it runs
inside the sendlat probe's object: `StreamsProbe` switches it on there, sets the stall threshold,
and reads the per-endpoint aggregates (port, protocol, process, cgroup) and the stall events.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

from ... import btf
from ...histogram import NS_PER_SECOND, REQUEST_BOUNDS, STREAM_BOUNDS, Summary, field_summaries
from ...loader import BpfObject, Lazy, Loaded, MapTable, ProbeUnavailable, RingRecords, Strategy, enum_labels
from ...metrics import PROCESS_LABELS, Family
from ...model import MapUsage, ProbeStatus
from ...names import comm_text, ip_text
from ...procfs import StartTimes
from ...registry import Part, Probe
from .hooks import StreamsHooks
from .loops import bounded_walks
from .records import CAUSES, PROTOCOLS, TLS_VERSIONS, StreamEndpoint, StreamsSnapshot, StreamStall, TlsHandshakes
from .rules import TOKEN_STREAMS_STALLING
from .settings import StreamsSettings
from .view import STREAMS_VIEW

MAX_PENDING_STALLS = 65536
COUNTERS = enum_labels("sendlat", "stream_counter", "STREAM_COUNTER_")
GPU_CAUSE = "gpu cause: CUDA synchronizations, from the cuda probe"
NO_GPU_CAUSE = "no gpu cause: the cuda probe is not running"
_SPAN = ("request: the server's last read before it writes (HTTP/2: the client's last frame on the stream); "
         "response: its writes, from the first body byte (an HTTP/1.x headers-only write and chunked encoding's "
         "last chunk are not chunks; HTTP/2: DATA frames, by stream) until the next request, the last chunk, "
         "the stream's end or the connection's end; connections accepted after start")
# The stream programs each of sendlat's strategies loads besides its own (kprobes cannot use socket
# storage: no streams there).
RECEIVE_SIDE = {
    "fentry": ("streams_fexit_recv", "streams_set_state"),
    "tracepoint": ("streams_recv", "streams_set_state"),
    "syscall": ("streams_recv", "streams_set_state"),
}
STRATEGIES = (
    Strategy("fentry", programs=RECEIVE_SIDE["fentry"], features=("fentry",), span=_SPAN),
    Strategy("tracepoint", programs=RECEIVE_SIDE["tracepoint"], features=("tp_btf", "tcp_send_tp", "sock_length_tp"),
             span=_SPAN),
    Strategy("syscall", programs=RECEIVE_SIDE["syscall"], features=("tp_btf", "sock_length_tp"),
             span=_SPAN + "; protocols unread (no message at syscall entry)"),
)


def _endpoint(key: dict[str, Any], value: Any, started: int, ttfb: Summary, gap: Summary,
              duration: Summary) -> StreamEndpoint:
    """One endpoint from its `stream_stats` entry (a BTF ctypes struct, read field by field, as
    sendlat's processes are: decoding it whole costs a third of the read) and its histograms."""
    return StreamEndpoint(
        pid=key["tgid"], comm=comm_text(bytes(value.comm)), cgroup_id=key["cgroup_id"], port=key["port"],
        protocol=PROTOCOLS[key["protocol"]] if key["protocol"] < len(PROTOCOLS) else "tcp",
        streams=value.streams, chunks=value.chunks, bytes=value.bytes,
        completed=value.duration.count + value.durations_unknown,
        ttfb_p50_seconds=ttfb.p50, ttfb_p99_seconds=ttfb.p99,
        ttfb_sum_seconds=value.ttfb.sum_ns / NS_PER_SECOND, ttfb_histogram=ttfb.buckets,
        gaps=value.gap.count, gap_p50_seconds=gap.p50, gap_p99_seconds=gap.p99,
        gap_sum_seconds=value.gap.sum_ns / NS_PER_SECOND, gap_histogram=gap.buckets,
        duration_sum_seconds=value.duration.sum_ns / NS_PER_SECOND,
        duration_histogram=duration.buckets, durations_unknown=value.durations_unknown,
        stalls=dict(zip(CAUSES, value.stalls[:], strict=True)),
        start_ticks=started,
    )


def _handshakes(key: dict[str, Any], value: Any, started: int, handshake: Summary) -> TlsHandshakes:
    """One process's TLS handshakes from its `stream_stats` entry (as _endpoint reads it)."""
    return TlsHandshakes(
        pid=key["tgid"], comm=comm_text(bytes(value.comm)), cgroup_id=key["cgroup_id"], port=key["port"],
        tls_version=TLS_VERSIONS[key["tls_version"]], count=value.handshake.count,
        sum_seconds=value.handshake.sum_ns / NS_PER_SECOND, p50_seconds=handshake.p50,
        p99_seconds=handshake.p99, histogram=handshake.buckets, start_ticks=started,
    )


def _with_summaries(table: MapTable, entries: list[tuple[dict[str, Any], Any]], indexes: list[int],
                    *fields: str) -> Iterator[tuple[tuple[dict[str, Any], Any], tuple[Summary, ...]]]:
    """These entries (by index) with the summaries of these histograms of their values."""
    summaries = field_summaries(table.rows(), table.value_type, indexes, *fields)
    return zip((entries[index] for index in indexes), summaries, strict=True)


def _stall(event: dict[str, Any]) -> StreamStall:
    v6 = event["family"] == socket.AF_INET6
    return StreamStall(
        pid=event["tgid"], tid=event["tid"], comm=comm_text(event["comm"]), cgroup_id=event["cgroup_id"],
        local_address=ip_text(event["local_addr"], v6), local_port=event["local_port"],
        remote_address=ip_text(event["remote_addr"], v6), remote_port=event["remote_port"],
        protocol=PROTOCOLS[event["protocol"]] if event["protocol"] < len(PROTOCOLS) else "tcp",
        stream_id=event["stream_id"], gap_seconds=event["gap_ns"] / NS_PER_SECOND,
        elapsed_seconds=event["elapsed_ns"] / NS_PER_SECOND,
        chunk=event["chunk"], cause=CAUSES[event["cause"]] if event["cause"] < len(CAUSES) else "server",
        unwritable_seconds=event["unwritable_ns"] / NS_PER_SECOND,
        blocked_send_seconds=event["blocked_send_ns"] / NS_PER_SECOND,
        runqueue_seconds=event["runqueue_ns"] / NS_PER_SECOND,
        cuda_sync_seconds=event["cuda_sync_ns"] / NS_PER_SECOND,
    )


class InStreamLogic(Probe):
    """A part whose logic runs inside the programs of a running `SendLatencyProbe` (`host`): the stream
    logic, and what rides on it."""

    part = ""  # its name

    def __init__(self, host: Probe | None) -> None:
        super().__init__()
        self._host = host
        self._entries = 0
        self._starts = StartTimes()
        self._keys: dict[str, dict[bytes, dict[str, Any]]] = {}  # map -> its keys decoded, by their bytes

    def _host_loaded(self) -> Loaded | None:
        return self._host.loaded if self._host is not None else None

    def _obj(self) -> BpfObject:
        loaded = self._host_loaded()
        if loaded is None:
            raise RuntimeError(f"{type(self).__name__} is not started")
        return loaded.obj

    def _runnable_host(self) -> Loaded:
        """The host, loaded with a strategy the stream logic runs on; ProbeUnavailable otherwise."""
        host = self._host_loaded()
        if host is None:
            raise ProbeUnavailable(self.part, {self.part: "runs inside the sendlat probe, which is not running"})
        if host.strategy.name not in RECEIVE_SIDE:
            raise ProbeUnavailable(self.part, {host.strategy.name: "needs socket storage (BTF programs)"})
        return host

    def _entries_of(self, name: str) -> tuple[MapTable, list[tuple[dict[str, Any], Any]]]:
        """Map `name` read whole, and its (decoded key, value) entries; those of exited processes are deleted
        from it (reported this once more, as the delete found them)."""
        stats, known = self._obj().maps[name], self._keys.get(name, {})
        table = stats.table()
        keys = [known.get(packed) or btf.decode(stats.key_type.from_buffer_copy(packed)) for packed in table.keys]
        self._keys[name] = dict(zip(table.keys, keys, strict=True))
        table.delete(stats, [i for i, key in enumerate(keys) if self._gone(key["tgid"])])
        return table, list(zip(keys, table.values(), strict=True))

    def _gone(self, pid: int) -> bool:
        """Whether `pid` had exited when this round first read its start (one read per process and round)."""
        self._starts.of(pid)
        return self._starts.gone(pid)

    def _counter(self, name: str) -> int:
        """Counter `name` of map `stream_counters` (enum stream_counter's name in lower case, no prefix)."""
        counted: int = self._obj().maps["stream_counters"].lookup(COUNTERS.index(name)).value
        return counted

    def _set(self, **values: int) -> None:
        """Write variables of the object's `.data.streams` section (stream settings only live there)."""
        self._obj().set_data(".data.streams", **values)

    @property
    def strategy(self) -> str | None:
        loaded = self._host_loaded()
        return loaded.strategy.name if loaded is not None else None


class StreamsProbe(InStreamLogic):
    """The stream side of a running `SendLatencyProbe` (`host`). Stalls (gaps >= stall_threshold_ms)
    are kept from one `read()` to the next; `poll()` shows them as they happen."""

    part = "streams"

    def __init__(self, host: Probe | None, stall_threshold_ms: float = 250.0) -> None:
        super().__init__(host)
        if stall_threshold_ms <= 0:
            raise ValueError("stall_threshold_ms must be positive")
        self.stall_threshold_ms = stall_threshold_ms
        self._stalls: RingRecords[StreamStall] | None = None
        self._syncs_shared: bool | None = None  # as last told to the programs (None: not since start)

    def start(self) -> None:
        host = self._runnable_host()
        self._stalls = RingRecords(host.obj, "stream_stalls", "stream_stall_event", _stall, MAX_PENDING_STALLS)
        self._set(stall_threshold_ns=round(self.stall_threshold_ms * 1e6), streams_enabled=1)
        self._syncs_shared = None
        self._share_cuda_syncs()

    def status(self) -> ProbeStatus:
        loaded = self._host_loaded()
        if loaded is None or self._stalls is None:
            return ProbeStatus(False, reason="not started")
        span = next(s.span for s in STRATEGIES if s.name == loaded.strategy.name)
        gpu = GPU_CAUSE if self.cuda_syncs_seen() else NO_GPU_CAUSE
        return ProbeStatus(True, loaded.strategy.name, f"{span}; {gpu}")

    def cuda_syncs_seen(self) -> bool:
        """Whether the cuda probe runs beside: it writes the synchronization times that make stalls `gpu`
        (map cuda_sync_time, shared; without it the map is the streams' own, and stays empty)."""
        return "cuda" in self._obj().sharing("cuda_sync_time")

    def _share_cuda_syncs(self) -> bool:
        """cuda_syncs_seen(), told to the programs as it changes (each read: the cuda probe starts and
        stops on its own): they look a writing process up in cuda_sync_time only while it is written."""
        seen = self.cuda_syncs_seen()
        if seen != self._syncs_shared:
            self._set(cuda_syncs_shared=int(seen))
            self._syncs_shared = seen
        return seen

    def _stall_records(self) -> RingRecords[StreamStall]:
        if self._stalls is None:
            raise RuntimeError("StreamsProbe is not started")
        return self._stalls

    def poll(self, timeout_ms: int = 0) -> list[StreamStall]:
        """Wait up to timeout_ms for stalls; returns the new ones (read() returns them too)."""
        return self._stall_records().poll(timeout_ms)

    def read(self) -> StreamsSnapshot:
        """Everything counted since start; endpoints of exited processes are reported once more, then
        deleted."""
        stalls = self._stall_records().take()
        table, entries = self._entries_of("stream_stats")
        self._entries = len(entries)
        served = [index for index, (key, _) in enumerate(entries) if not key["tls_version"]]
        tls = [index for index, (key, _) in enumerate(entries) if 0 < key["tls_version"] < len(TLS_VERSIONS)]
        endpoints = [_endpoint(key, value, self._starts.of(key["tgid"]), *histograms)
                     for (key, value), histograms in _with_summaries(table, entries, served, "ttfb", "gap", "duration")]
        handshakes = [_handshakes(key, value, self._starts.of(key["tgid"]), *histograms)
                      for (key, value), histograms in _with_summaries(table, entries, tls, "handshake")]
        self._starts.keep_only({key["tgid"] for key, _ in entries})
        return StreamsSnapshot(
            strategy=self.strategy or "", span=self.status().span,
            stall_threshold_seconds=self.stall_threshold_ms / 1e3,
            endpoints=endpoints, stalls=stalls, lost_stalls=self.events_lost(),
            uncounted_streams=self._counter("endpoints_full"), untimed_h2_streams=self._counter("h2_untimed"),
            cuda_syncs_seen=self._share_cuda_syncs(), tls_handshakes=handshakes,
        )

    def events_lost(self) -> int:
        try:
            lost = self._counter("lost_stalls")
        except RuntimeError:
            lost = 0
        return lost + (self._stalls.dropped if self._stalls is not None else 0)

    def map_usage(self) -> list[MapUsage]:
        try:
            capacity = self._obj().maps["stream_stats"].max_entries
        except RuntimeError:
            return []
        return [MapUsage("stream_stats", self._entries, capacity)]

    def close(self) -> None:
        """Switch the stream logic off in the host's object (it stays loaded with sendlat)."""
        if self._stalls is not None and self._host is not None and self._host.loaded is not None:
            self._set(streams_enabled=0)
            self._host.loaded.obj.release(self._stalls.ring)
        self._stalls = None
        self._host = None


def _stalls_of(cause: str) -> Any:
    return lambda endpoint: endpoint.stalls.get(cause, 0)


STREAM_LABELS = (("port", "port"), ("protocol", "protocol"), *PROCESS_LABELS)

PART = Part(
    name="streams",
    description="token streams: time to first byte, chunk gaps and stalls of every response a TCP server writes",
    strategies=STRATEGIES,
    order=25,
    limitations=bounded_walks,
    settings=StreamsSettings,
    command="aiprobe.probes.sendlat.streams_command:command",
    metrics=(
        Family("aiprobe_streams_total", "counter", "Responses that wrote a first body byte.", StreamEndpoint,
               "streams", STREAM_LABELS, per_identity=True),
        Family("aiprobe_stream_chunks_total", "counter", "Writes of responses (chunks).", StreamEndpoint,
               "chunks", STREAM_LABELS, per_identity=True),
        Family("aiprobe_stream_bytes_total", "counter", "Bytes written in responses.", StreamEndpoint,
               "bytes", STREAM_LABELS, per_identity=True),
        Family("aiprobe_stream_ttfb_seconds", "histogram",
               "Time to first byte: request received to the response's first body write.", StreamEndpoint,
               "ttfb_histogram", STREAM_LABELS, sum_field="ttfb_sum_seconds", per_identity=True,
               buckets=REQUEST_BOUNDS),
        Family("aiprobe_stream_chunk_gap_seconds", "histogram", "Time between successive writes of a response.",
               StreamEndpoint, "gap_histogram", STREAM_LABELS, sum_field="gap_sum_seconds", per_identity=True,
               buckets=REQUEST_BOUNDS),
        Family("aiprobe_stream_duration_seconds", "histogram",
               "Request received to the last write, of responses that ended.", StreamEndpoint,
               "duration_histogram", STREAM_LABELS, sum_field="duration_sum_seconds", per_identity=True,
               buckets=STREAM_BOUNDS),
        Family("aiprobe_stream_durations_unknown_total", "counter",
               "Responses that ended with a last write before their request (a read and a write racing on "
               "the connection): not in aiprobe_stream_duration_seconds.", StreamEndpoint, "durations_unknown",
               STREAM_LABELS, per_identity=True),
        Family("aiprobe_stream_stalls_total", "counter",
               "Gaps between writes above the stall threshold, by cause: network (the socket was full), cpu "
               "(the writer waited for a CPU), gpu (the process was inside a CUDA synchronization), server.",
               StreamEndpoint, "", STREAM_LABELS, per_identity=True, expand_label="cause",
               expand=Lazy(lambda: ((cause, _stalls_of(cause)) for cause in CAUSES))),
        Family("aiprobe_tls_handshake_seconds", "histogram",
               "Server-side TLS handshakes: the read of the client's ClientHello to the read of its Finished, "
               "by the version the ServerHello chose.", TlsHandshakes, "histogram",
               (("port", "port"), ("tls_version", "tls_version"), *PROCESS_LABELS), sum_field="sum_seconds",
               per_identity=True, buckets=REQUEST_BOUNDS),
    ),
    hooks=StreamsHooks(),
    views=(STREAMS_VIEW,),
    rules=(TOKEN_STREAMS_STALLING,),
)
