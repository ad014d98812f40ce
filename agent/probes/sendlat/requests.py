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
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import numpy as np

from ...histogram import NS_PER_SECOND, REQUEST_BOUNDS, KernelBuckets, exported_buckets, kernel_buckets, quantile
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

# The counter of requests each aggregate map had no room for.
FULL_COUNTERS = {"request_stats": "request_endpoints_full", "client_stats": "client_endpoints_full"}
NO_RESPONSES = "; counts nothing: the syscall strategy reads no response's bytes (no protocol, no status)"
SPAN = ("each response of an accepted connection (as streams time it), counted when it ends: its status from "
        "its first write (HTTP/1.x status line; HTTP/2 :status where HPACK's static table, a literal or a "
        "dynamic-table entry seen inserted spells it; gRPC: the trailers' grpc-status likewise), its method "
        "from its request's first read, its duration from the request's last read to the response's last write; "
        "requests sent on connections the host opened (HTTP/1.x), from their first send "
        "to their response's last read, counted at the next request or the close")
# The streams part's strategies (the same programs), with what this part sees under each.
STRATEGIES = tuple(dataclasses.replace(s, span=SPAN + (NO_RESPONSES if s.name == "syscall" else ""))
                   for s in STREAMS_STRATEGIES)


def _method(code: int) -> str:
    """enum http_method's label of `code`; "_OTHER" for a value this agent does not know."""
    return METHODS[code] if code < len(METHODS) else "_OTHER"


def _requests(key: dict[str, Any], value: Any, started: int) -> tuple[Requests, KernelBuckets]:
    """One entry of `request_stats` (a BTF ctypes struct, read field by field: its 433 slots are many),
    and its durations at full resolution (for its endpoint's quantiles)."""
    protocol = PROTOCOLS[key["protocol"]] if key["protocol"] < len(PROTOCOLS) else "tcp"
    duration = value.duration
    fine = kernel_buckets(duration.slots)
    kind = functools.partial(RpcRequests, grpc_status=key["rpc_status"] - 1) if protocol == "grpc" else HttpRequests
    return kind(
        pid=key["tgid"], comm=comm_text(bytes(value.comm)), cgroup_id=key["cgroup_id"], port=key["port"],
        protocol=protocol, method=_method(key["method"]),
        status_code=key["status"], count=duration.count + value.durations_unknown,
        duration_sum_seconds=duration.sum_ns / NS_PER_SECOND,
        duration_histogram=exported_buckets(fine), p50_seconds=quantile(fine, 0.5), p99_seconds=quantile(fine, 0.99),
        durations_unknown=value.durations_unknown, request_bytes=value.request_bytes,
        response_bytes=value.response_bytes, start_ticks=started,
    ), fine


def _client_requests(key: dict[str, Any], value: Any, started: int) -> ClientRequests:
    """One entry of `client_stats`."""
    fine, ttfb = kernel_buckets(value.duration.slots), kernel_buckets(value.ttfb.slots)
    return ClientRequests(
        pid=key["tgid"], comm=comm_text(bytes(value.comm)), cgroup_id=key["cgroup_id"],
        server_address=ip_text(bytes(key["addr"]), key["family"] == socket.AF_INET6), server_port=key["port"],
        method=_method(key["method"]), status_code=key["status"],
        count=value.duration.count, duration_sum_seconds=value.duration.sum_ns / NS_PER_SECOND,
        duration_histogram=exported_buckets(fine), ttfb_sum_seconds=value.ttfb.sum_ns / NS_PER_SECOND,
        ttfb_histogram=exported_buckets(ttfb), p50_seconds=quantile(fine, 0.5), p99_seconds=quantile(fine, 0.99),
        ttfb_p50_seconds=quantile(ttfb, 0.5), start_ticks=started,
    )


def _statuses(records: list[Requests]) -> dict[str, int]:
    statuses: dict[str, int] = defaultdict(int)
    for record in records:
        statuses[record.status_label or "unknown"] += record.count
    return dict(sorted(statuses.items()))


def _endpoints(entries: Iterable[tuple[Requests, KernelBuckets]]) -> list[RequestEndpoint]:
    """Per (process, port, protocol): the entries' counts by status class, quantiles over their durations."""
    groups: dict[tuple[int, int, int, str], list[tuple[Requests, KernelBuckets]]] = defaultdict(list)
    for record, fine in entries:
        groups[(record.pid, record.cgroup_id, record.port, record.protocol)].append((record, fine))
    endpoints = []
    for members in groups.values():
        first, merged = members[0]
        if len(members) > 1:  # cumulative counts add up as the slots do
            merged = KernelBuckets(np.sum([fine.cumulative for _, fine in members], axis=0))
        records = [record for record, _ in members]
        endpoints.append(RequestEndpoint(
            pid=first.pid, comm=first.comm, cgroup_id=first.cgroup_id, port=first.port, protocol=first.protocol,
            count=sum(r.count for r in records),
            client_errors=sum(r.count for r in records if 400 <= r.status_code < 500),
            server_errors=sum(r.count for r in records if r.status_code >= 500),
            throttled=sum(r.count for r in records if r.status_code == 429),
            status_unknown=sum(r.count for r in records if not r.status_code),
            p50_seconds=quantile(merged, 0.5), p99_seconds=quantile(merged, 0.99), statuses=_statuses(records),
            start_ticks=first.start_ticks,
        ))
    return endpoints


class RequestsProbe(InStreamLogic):
    """The requests side of a running `SendLatencyProbe` (`host`) whose streams part runs."""

    part = "requests"

    def __init__(self, host: Probe | None) -> None:
        super().__init__(host)
        self._started = False
        self._counted: dict[str, int] = {}  # entries by map, at the last read

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
        served, sent = self._entries_of("request_stats"), self._entries_of("client_stats")
        self._counted = {"request_stats": len(served), "client_stats": len(sent)}
        entries = [_requests(key, value, self._starts.of(key["tgid"])) for key, value in served]
        clients = [_client_requests(key, value, self._starts.of(key["tgid"])) for key, value in sent]
        self._starts.keep_only({key["tgid"] for key, _ in [*served, *sent]})
        records = [record for record, _ in entries]
        return RequestsSnapshot(
            strategy=self.strategy or "", span=SPAN,
            http=[r for r in records if isinstance(r, HttpRequests)],
            rpc=[r for r in records if isinstance(r, RpcRequests)],
            endpoints=_endpoints(entries),
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
