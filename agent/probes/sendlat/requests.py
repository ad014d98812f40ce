"""Requests and errors from the wire (RED metrics): each response the streams logic times, counted when
it ends per (process, cgroup, listening port, protocol, method, status code) in the kernel
(bpf/requests.h), exported with OpenTelemetry's names as Beyla/OBI export them to Prometheus. The client
side: HTTP/1.x requests the host sends on connections it opened, per (process, cgroup, server address and
port, method, status code) (bpf/client_programs.h).

It rides on the streams part's logic inside sendlat's programs (no program of its own): `RequestsProbe`
switches it on in the host's object and reads map `request_stats`. docs/requests.md has the rules.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import socket
import time
from collections import defaultdict
from typing import Any

import numpy as np

from ... import btf, procfs
from ...histogram import (
    NS_PER_SECOND,
    REQUEST_BOUNDS,
    Histograms,
    Summary,
    field_slots,
    hist_slots,
    slot_of_nanoseconds,
    summaries_of,
)
from ...loader import Map, MapTable
from ...metrics import PROCESS_LABELS, Family, Getter
from ...model import MapUsage, ProbeStatus
from ...names import comm_text, ip_text
from ...registry import Part, Probe
from .hooks import RequestsHooks
from .loops import bounded_walks
from .records import (
    METHODS,
    PROTOCOLS,
    ClientRequests,
    HttpRequests,
    RequestEndpoint,
    Requests,
    RequestsSnapshot,
    RpcRequests,
)
from .rules import HTTP_SERVER_ERRORS, HTTP_THROTTLED, REPLICA_SKEW
from .settings import RequestsSettings
from .streams import STRATEGIES as STREAMS_STRATEGIES
from .streams import InStreamLogic
from .view import REQUESTS_VIEW

# A client request whose response's end the kernel cannot see is counted by the agent once its response has
# had no read for this long (docs/requests.md).
IDLE_FLUSH_NS = 1_000_000_000
# The counter of requests each aggregate map had no room for.
FULL_COUNTERS = {"request_stats": "request_endpoints_full", "client_stats": "client_endpoints_full"}
NO_RESPONSES = "; counts nothing: the syscall strategy reads no response's bytes (no protocol, no status)"
SPAN = ("each response of an accepted connection (as streams time it), counted when it ends: its status from "
        "its first write (HTTP/1.x status line; HTTP/2 :status where HPACK's static table, a literal or a "
        "dynamic-table entry seen inserted spells it; gRPC: the trailers' grpc-status likewise), its method "
        "from its request's first read, its duration from the request's last read to the response's last write; "
        "requests sent on connections the host opened (HTTP/1.x), from their first send "
        "to their response's last read, counted at the read ending the response (Content-Length, last chunk), "
        "else after 1 s without a read, the next request or the close")
# The streams part's strategies (the same programs), with what this part sees under each.
STRATEGIES = tuple(dataclasses.replace(s, span=SPAN + (NO_RESPONSES if s.name == "syscall" else ""))
                   for s in STREAMS_STRATEGIES)


def _method(code: int) -> str:
    """enum http_method's label of `code`; "_OTHER" for a value this agent does not know."""
    return METHODS[code] if code < len(METHODS) else "_OTHER"


def _requests(key: dict[str, Any], value: Any, started: int, duration: Summary) -> Requests:
    """One entry of `request_stats` (a BTF ctypes struct, read field by field: its 433 slots are many)."""
    protocol = PROTOCOLS[key["protocol"]] if key["protocol"] < len(PROTOCOLS) else "tcp"
    kind = functools.partial(RpcRequests, grpc_status=key["rpc_status"] - 1) if protocol == "grpc" else HttpRequests
    return kind(
        pid=key["tgid"], comm=comm_text(bytes(value.comm)), cgroup_id=key["cgroup_id"], port=key["port"],
        protocol=protocol, method=_method(key["method"]),
        status_code=key["status"], count=value.duration.count + value.durations_unknown,
        duration_sum_seconds=value.duration.sum_ns / NS_PER_SECOND, duration_histogram=duration.buckets,
        p50_seconds=duration.p50, p99_seconds=duration.p99, durations_unknown=value.durations_unknown,
        request_bytes=value.request_bytes, response_bytes=value.response_bytes, start_ticks=started,
    )


Counts = np.ndarray[Any, np.dtype[np.uint64]]


@dataclasses.dataclass
class ClientCounts:
    """The requests of one `client_stats` key: the kernel's entry's, or those the agent counted itself (the
    idle flush), or both added."""

    duration: Counts  # slots of `struct hist`
    ttfb: Counts
    count: int = 0
    duration_sum_ns: int = 0
    ttfb_sum_ns: int = 0
    comm: bytes = b""

    @classmethod
    def of(cls, value: Any, duration: Counts, ttfb: Counts) -> ClientCounts:
        """A `client_stats` value's, with its histograms' slots."""
        return cls(duration, ttfb, value.duration.count, value.duration.sum_ns, value.ttfb.sum_ns, bytes(value.comm))

    def count_pending(self, entry: Any) -> None:
        """Counts a `client_pending` entry, as the kernel counts a request (bpf/client_programs.h)."""
        duration, ttfb = entry.last_read_ns - entry.request_ns, entry.first_read_ns - entry.request_ns
        if duration >= 0:
            self.duration[slot_of_nanoseconds(duration, len(self.duration))] += 1
            self.count += 1
            self.duration_sum_ns += duration
        if ttfb >= 0:
            self.ttfb[slot_of_nanoseconds(ttfb, len(self.ttfb))] += 1
            self.ttfb_sum_ns += ttfb
        self.comm = self.comm.strip(b"\0") or bytes(entry.comm)

    def __add__(self, other: ClientCounts) -> ClientCounts:
        return ClientCounts(self.duration + other.duration, self.ttfb + other.ttfb, self.count + other.count,
                            self.duration_sum_ns + other.duration_sum_ns, self.ttfb_sum_ns + other.ttfb_sum_ns,
                            self.comm.strip(b"\0") or other.comm)


def _client_requests(key: dict[str, Any], counts: ClientCounts, started: int, duration: Summary,
                     ttfb: Summary) -> ClientRequests:
    """The requests of one `client_stats` key."""
    return ClientRequests(
        pid=key["tgid"], comm=comm_text(counts.comm), cgroup_id=key["cgroup_id"],
        server_address=ip_text(bytes(key["addr"]), key["family"] == socket.AF_INET6), server_port=key["port"],
        method=_method(key["method"]), status_code=key["status"],
        count=counts.count, duration_sum_seconds=counts.duration_sum_ns / NS_PER_SECOND,
        duration_histogram=duration.buckets, ttfb_sum_seconds=counts.ttfb_sum_ns / NS_PER_SECOND,
        ttfb_histogram=ttfb.buckets, p50_seconds=duration.p50, p99_seconds=duration.p99,
        ttfb_p50_seconds=ttfb.p50, start_ticks=started,
    )


ClientIdentity = tuple[Any, ...]  # a client_stats key's field values


def _no_slots() -> Counts:
    return np.zeros(hist_slots(), dtype=np.uint64)


class IdleFlush:
    """The agent's side of client requests whose response's end the kernel cannot see (map client_pending):
    one whose response has had no read for IDLE_FLUSH_NS is counted here, once; the kernel counts those it
    ends first (the next request, the close). Whichever deletes the entry counts it."""

    def __init__(self) -> None:
        self.counted: dict[ClientIdentity, tuple[dict[str, Any], ClientCounts]] = {}

    def flush(self, pending: Map) -> None:
        """Counts the requests of `pending` idle for IDLE_FLUSH_NS (bpf_ktime_get_ns's clock: CLOCK_MONOTONIC)."""
        idle_since = time.monotonic_ns() - IDLE_FLUSH_NS
        decoded: dict[bytes, dict[str, Any]] = {}  # a client sends many requests a round
        for key, entry in pending.items():
            if entry.last_read_ns <= idle_since and pending.delete(key):
                packed = bytes(entry.key)
                client_key = decoded.get(packed) or decoded.setdefault(packed, btf.decode(entry.key))
                _, counts = self.counted.setdefault(
                    tuple(client_key.values()), (client_key, ClientCounts(_no_slots(), _no_slots())))
                counts.count_pending(entry)

    def added(self, table: MapTable, entries: list[tuple[dict[str, Any], Any]]
              ) -> list[tuple[dict[str, Any], ClientCounts]]:
        """The `client_stats` entries (read whole as `table`) with the requests counted here added; those of exited
        processes (absent from `entries` once deleted there) are reported this once more, then forgotten."""
        every = range(len(entries))
        durations, ttfbs = (field_slots(table.rows(), table.value_type, name, every) for name in ("duration", "ttfb"))
        merged = {tuple(key.values()): (key, ClientCounts.of(value, duration, ttfb))
                  for (key, value), duration, ttfb in zip(entries, durations, ttfbs, strict=True)}
        for identity, (key, counts) in self.counted.items():
            kernel = merged.get(identity)
            merged[identity] = (key, kernel[1] + counts if kernel else counts)
        self.counted = {identity: entry for identity, entry in self.counted.items()
                        if not procfs.exited(entry[0]["tgid"])}
        return list(merged.values())


def _statuses(records: list[Requests]) -> dict[str, int]:
    statuses: dict[str, int] = defaultdict(int)
    for record in records:
        statuses[record.status_label or "unknown"] += record.count
    return dict(sorted(statuses.items()))


def _endpoints(records: list[Requests], durations: Histograms) -> list[RequestEndpoint]:
    """Per (process, port, protocol): the records' counts by status class, quantiles over their durations
    (`durations`: the records' own, in their order; summed where an endpoint has several records)."""
    groups: dict[tuple[int, int, int, str], list[int]] = {}
    for index, r in enumerate(records):
        groups.setdefault((r.pid, r.cgroup_id, r.port, r.protocol), []).append(index)
    several = [group for group in groups.values() if len(group) > 1]
    summed = durations.summed(several)
    merged = zip(summed.quantiles(0.5), summed.quantiles(0.99), strict=True)
    quantiles = {group[0]: both for group, both in zip(several, merged, strict=True)}
    endpoints = []
    for group in groups.values():
        members = [records[index] for index in group]
        first = members[0]
        p50, p99 = quantiles.get(group[0], (first.p50_seconds, first.p99_seconds))
        endpoints.append(RequestEndpoint(
            pid=first.pid, comm=first.comm, cgroup_id=first.cgroup_id, port=first.port, protocol=first.protocol,
            count=sum(r.count for r in members),
            client_errors=sum(r.count for r in members if 400 <= r.status_code < 500),
            server_errors=sum(r.count for r in members if r.status_code >= 500),
            throttled=sum(r.count for r in members if r.status_code == 429),
            status_unknown=sum(r.count for r in members if not r.status_code),
            p50_seconds=p50, p99_seconds=p99, statuses=_statuses(members), start_ticks=first.start_ticks,
        ))
    return endpoints


class RequestsProbe(InStreamLogic):
    """The requests side of a running `SendLatencyProbe` (`host`) whose streams part runs."""

    part = "requests"

    def __init__(self, host: Probe | None) -> None:
        super().__init__(host)
        self._started = False
        self._counted: dict[str, int] = {}  # entries by map, at the last read
        self._idle_flush = IdleFlush()

    def start(self) -> None:
        self._runnable_host()
        self._set(requests_enabled=1)
        self._started = True

    def status(self) -> ProbeStatus:
        if not self._started or self.strategy is None:
            return ProbeStatus(False, reason="not started")
        span = next(s.span for s in STRATEGIES if s.name == self.strategy)
        overflows = {usage.map: usage.overflows for usage in self.map_usage() if usage.overflows}
        return ProbeStatus(True, self.strategy, span, overflows=overflows)

    def read(self) -> RequestsSnapshot:
        """Everything counted since start; entries of exited processes are reported once more, then deleted."""
        self._idle_flush.flush(self._obj().maps["client_pending"])
        (served_table, served), (sent_table, sent) = self._entries_of("request_stats"), self._entries_of("client_stats")
        self._counted = {"request_stats": len(served), "client_stats": len(sent)}
        durations = Histograms.of_field(served_table.rows(), served_table.value_type, "duration", range(len(served)))
        records = [_requests(key, value, self._starts.of(key["tgid"]), duration)
                   for (key, value), duration in zip(served, durations.summaries(), strict=True)]
        sent_counts = self._idle_flush.added(sent_table, sent)
        clients = [_client_requests(key, counts, self._starts.of(key["tgid"]), duration, ttfb)
                   for (key, counts), duration, ttfb in zip(
                       sent_counts, summaries_of([counts.duration for _, counts in sent_counts]),
                       summaries_of([counts.ttfb for _, counts in sent_counts]), strict=True)]
        self._starts.keep_only({key["tgid"] for key, _ in served} | {record.pid for record in clients})
        return RequestsSnapshot(
            strategy=self.strategy or "", span=SPAN,
            http=[r for r in records if isinstance(r, HttpRequests)],
            rpc=[r for r in records if isinstance(r, RpcRequests)],
            endpoints=_endpoints(records, durations),
            uncounted_requests=self._uncounted("request_stats"),
            clients=clients, uncounted_client_requests=self._uncounted("client_stats"),
        )

    def _uncounted(self, name: str) -> int:
        """Requests that found map `name` full, since start."""
        return self._counter(FULL_COUNTERS[name])

    def map_usage(self) -> list[MapUsage]:
        try:
            maps = self._obj().maps
            capacities = {name: maps[name].max_entries for name in FULL_COUNTERS}
        except RuntimeError:
            return []
        return [MapUsage(name, self._counted.get(name, 0), capacity, self._uncounted(name))
                for name, capacity in capacities.items()]

    def close(self) -> None:
        """Switch the requests logic off in the host's object (it stays loaded with sendlat)."""
        if self._started and self._host_loaded() is not None:
            self._set(requests_enabled=0)
        self._started = False
        self._host = None


def _one_bucket(count_of: str) -> Any:
    """A histogram of sizes whose buckets are not kept: its count and sum only (the +Inf bucket)."""
    return lambda record: [(math.inf, getattr(record, count_of))]


def _constant(value: str) -> Getter:
    return lambda _: value


HTTP_LABELS: tuple[tuple[str, Getter], ...] = (
    ("http_request_method", "method"), ("http_response_status_code", lambda r: r.status_label), ("server_port", "port"),
    ("url_scheme", _constant("http")), *PROCESS_LABELS)
CLIENT_LABELS: tuple[tuple[str, Getter], ...] = (
    ("http_request_method", "method"), ("http_response_status_code", lambda r: r.status_label),
    ("server_address", "server_address"), ("server_port", "server_port"), *PROCESS_LABELS)
RPC_LABELS: tuple[tuple[str, Getter], ...] = (
    ("rpc_system", _constant("grpc")), ("rpc_grpc_status_code", lambda r: r.grpc_status_label), ("server_port", "port"),
    *PROCESS_LABELS)

PART = Part(
    name="requests",
    description="requests and errors of TCP servers, and HTTP/1.x requests the host sends, from the wire: "
                "status codes, methods, durations (OpenTelemetry's HTTP and RPC server and HTTP client metrics)",
    strategies=STRATEGIES,
    order=26,
    limitations=bounded_walks,
    settings=RequestsSettings,
    command="aiprobe.probes.sendlat.requests_command:command",
    metrics=(
        Family("http_server_request_duration_seconds", "histogram",
               "Duration of HTTP requests served: the request's last read to the response's last write.",
               HttpRequests, "duration_histogram", HTTP_LABELS, sum_field="duration_sum_seconds", per_identity=True,
               buckets=REQUEST_BOUNDS,
               doc_note="http_response_status_code is empty where the status was not readable (docs/requests.md)."),
        Family("http_server_request_body_size_bytes", "histogram",
               "Bytes read for HTTP requests served, headers included (count and sum only).", HttpRequests,
               _one_bucket("count"), HTTP_LABELS, sum_field="request_bytes", per_identity=True),
        Family("http_server_response_body_size_bytes", "histogram",
               "Bytes of the body writes of HTTP responses (count and sum only).", HttpRequests,
               _one_bucket("count"), HTTP_LABELS, sum_field="response_bytes", per_identity=True),
        Family("rpc_server_duration_seconds", "histogram",
               "Duration of gRPC calls served: the request's last frame to the response's last write.",
               RpcRequests, "duration_histogram", RPC_LABELS, sum_field="duration_sum_seconds", per_identity=True,
               buckets=REQUEST_BOUNDS,
               doc_note="rpc_grpc_status_code is empty where the trailers' grpc-status was not readable "
                        "(docs/requests.md)."),
        Family("http_client_request_duration_seconds", "histogram",
               "Duration of HTTP/1.x requests sent on connections the host opened: the request's first send to "
               "the response's last read.", ClientRequests, "duration_histogram", CLIENT_LABELS,
               sum_field="duration_sum_seconds", per_identity=True, buckets=REQUEST_BOUNDS),
        Family("aiprobe_http_client_time_to_first_byte_seconds", "histogram",
               "Time to first byte of HTTP/1.x requests sent: the request's first send to the response's first "
               "read.", ClientRequests, "ttfb_histogram", CLIENT_LABELS, sum_field="ttfb_sum_seconds",
               per_identity=True, buckets=REQUEST_BOUNDS,
               doc_note="OpenTelemetry has no client time to first byte: aiprobe's own name (docs/requests.md)."),
    ),
    hooks=RequestsHooks(),
    views=(REQUESTS_VIEW,),
    rules=(HTTP_SERVER_ERRORS, HTTP_THROTTLED),
    fleet_rules=REPLICA_SKEW,
)
