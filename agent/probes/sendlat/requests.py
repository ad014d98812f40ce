"""Requests and errors from the wire (RED metrics): each response the streams logic times, counted when
it ends per (process, cgroup, listening port, protocol, method, status code) in the kernel
(bpf/requests.h), exported with OpenTelemetry's names as Beyla/OBI export them to Prometheus.

It rides on the streams part's logic inside sendlat's programs (no program of its own): `RequestsProbe`
switches it on in the host's object and reads map `request_stats`. docs/requests.md has the rules.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from ... import btf
from ...histogram import NS_PER_SECOND, exported_buckets, kernel_buckets, quantile
from ...loader import enum_labels
from ...metrics import PROCESS_LABELS, Family, Getter
from ...model import MapUsage, ProbeStatus
from ...names import comm_text
from ...registry import Part, Probe
from .hooks import RequestsHooks
from .records import METHODS, PROTOCOLS, HttpRequests, RequestEndpoint, Requests, RequestsSnapshot, RpcRequests
from .rules import HTTP_SERVER_ERRORS, HTTP_THROTTLED, REPLICA_SKEW
from .streams import STRATEGIES as STREAMS_STRATEGIES
from .streams import InStreamLogic
from .view import REQUESTS_VIEW

COUNTERS = enum_labels("sendlat", "stream_counter", "STREAM_COUNTER_")
NO_RESPONSES = "; counts nothing: the syscall strategy reads no response's bytes (no protocol, no status)"
SPAN = ("each response of an accepted connection (as streams time it), counted when it ends: its status from "
        "its first write (HTTP/1.x status line; HTTP/2 :status where HPACK's static table or a literal spells "
        "it), its method from its request's first read, its duration from the request's last read to the "
        "response's last write")
# The streams part's strategies (the same programs), with what this part sees under each.
STRATEGIES = tuple(dataclasses.replace(s, span=SPAN + (NO_RESPONSES if s.name == "syscall" else ""))
                   for s in STREAMS_STRATEGIES)


def _requests(key: dict[str, Any], value: Any, started: int) -> Requests:
    """One entry of `request_stats` (a BTF ctypes struct, read field by field: its 433 slots are many)."""
    protocol = PROTOCOLS[key["protocol"]] if key["protocol"] < len(PROTOCOLS) else "tcp"
    kind = RpcRequests if protocol == "grpc" else HttpRequests
    duration = value.duration
    fine = kernel_buckets(duration.slots[:])
    return kind(
        pid=key["tgid"], comm=comm_text(bytes(value.comm)), cgroup_id=key["cgroup_id"], port=key["port"],
        protocol=protocol, method=METHODS[key["method"]] if key["method"] < len(METHODS) else "_OTHER",
        status_code=key["status"], count=duration.count + value.durations_unknown,
        duration_sum_seconds=duration.sum_ns / NS_PER_SECOND,
        duration_histogram=exported_buckets(fine), p50_seconds=quantile(fine, 0.5), p99_seconds=quantile(fine, 0.99),
        durations_unknown=value.durations_unknown, request_bytes=value.request_bytes,
        response_bytes=value.response_bytes, start_ticks=started,
    )


def _statuses(records: list[Requests]) -> dict[str, int]:
    statuses: dict[str, int] = defaultdict(int)
    for record in records:
        statuses[record.status_label or "unknown"] += record.count
    return dict(sorted(statuses.items()))


def _endpoints(entries: Iterable[tuple[Requests, list[int]]]) -> list[RequestEndpoint]:
    """Per (process, port, protocol): the entries' counts by status class, quantiles over their slots."""
    groups: dict[tuple[int, int, int, str], list[tuple[Requests, list[int]]]] = defaultdict(list)
    for record, slots in entries:
        groups[(record.pid, record.cgroup_id, record.port, record.protocol)].append((record, slots))
    endpoints = []
    for members in groups.values():
        first = members[0][0]
        merged = kernel_buckets([sum(column) for column in zip(*(slots for _, slots in members), strict=True)])
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
        obj = self._obj()
        stats = obj.maps["request_stats"]
        entries = []
        for raw, value in stats.items():
            key = btf.decode(raw)
            entries.append((raw, key, _requests(key, value, self._starts.of(key["tgid"])), value.duration.slots[:]))
        self._entries = len(entries)
        self._starts.keep_only({key["tgid"] for _, key, _, _ in entries})
        stats.delete_keys(raw for raw, key, _, _ in entries if not os.path.exists(f"/proc/{key['tgid']}"))
        records = [record for _, _, record, _ in entries]
        return RequestsSnapshot(
            strategy=self.strategy or "", span=SPAN,
            http=[r for r in records if isinstance(r, HttpRequests)],
            rpc=[r for r in records if isinstance(r, RpcRequests)],
            endpoints=_endpoints((record, slots) for _, _, record, slots in entries),
            uncounted_requests=self._uncounted(),
        )

    def _uncounted(self) -> int:
        """Responses that found the request table full, since start."""
        counted: int = self._obj().maps["stream_counters"].lookup(COUNTERS.index("request_endpoints_full")).value
        return counted

    def map_usage(self) -> list[MapUsage]:
        try:
            capacity = self._obj().maps["request_stats"].max_entries
        except RuntimeError:
            return []
        return [MapUsage("request_stats", self._entries, capacity, self._uncounted())]

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
RPC_LABELS: tuple[tuple[str, Getter], ...] = (
    ("rpc_system", _constant("grpc")), ("rpc_grpc_status_code", _constant("")), ("server_port", "port"),
    *PROCESS_LABELS)

PART = Part(
    name="requests",
    description="requests and errors of TCP servers from the wire: status codes, methods, durations "
                "(OpenTelemetry's HTTP and RPC server metrics)",
    strategies=STRATEGIES,
    order=26,
    command="aiprobe.probes.sendlat.requests_command:command",
    metrics=(
        Family("http_server_request_duration_seconds", "histogram",
               "Duration of HTTP requests served: the request's last read to the response's last write.",
               HttpRequests, "duration_histogram", HTTP_LABELS, sum_field="duration_sum_seconds", per_identity=True,
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
               doc_note="rpc_grpc_status_code is empty: the trailers' grpc-status is not read (docs/requests.md)."),
    ),
    hooks=RequestsHooks(),
    views=(REQUESTS_VIEW,),
    rules=(HTTP_SERVER_ERRORS, HTTP_THROTTLED),
    fleet_rules=REPLICA_SKEW,
)
