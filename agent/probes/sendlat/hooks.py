"""The send path in the agent's refresh: each process's send rate, the send-stall, stream-stall and
request-error rules, its columns of the process table, and the snapshot's `streams` and `requests`."""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

import numpy as np

from ...model import Readings
from ...refresh import SIGNAL_WINDOW_SECONDS, Hooks, ProcessRows, Refresh, Section, recent_p99s, target
from ...rules import Signal
from .records import (
    CAUSES,
    ClientRequests,
    ProcessSendLatency,
    RequestEndpoint,
    Requests,
    RequestsSnapshot,
    SendLatencySnapshot,
    StreamEndpoint,
    StreamsSnapshot,
    StreamStall,
    TlsHandshakes,
)
from .settings import StreamsSettings

MIN_SENDS_FOR_P99 = 1


class SendLatencyHooks(Hooks):
    def join(self, reading: SendLatencySnapshot, readings: Readings, refresh: Refresh) -> Iterable[int]:
        for send in reading.processes:
            workload = refresh.workload(send.cgroup_id, send.pid)
            workload.label(send)
            send.pod_uid = workload.pod_uid
        return {send.pid for send in reading.processes}

    def rates(self, reading: SendLatencySnapshot, refresh: Refresh, now: float) -> None:
        for send in reading.processes:
            (send.bytes_per_second,) = refresh.rate(("send", send.identity()), [send.bytes], now)

    def signals(self, reading: SendLatencySnapshot, readings: Readings, refresh: Refresh,
                now: float) -> list[Signal]:
        return send_stalls(reading.processes, refresh, now)

    def process_rows(self, reading: SendLatencySnapshot, rows: ProcessRows) -> None:
        for send in reading.processes:
            entry = rows.row(send)
            entry.send_count, entry.send_bytes = send.count, send.bytes
            entry.send_bytes_per_second = send.bytes_per_second
            entry.send_p50_seconds, entry.send_p99_seconds = send.p50_seconds, send.p99_seconds
            entry.send_errors, entry.send_unwritable_p99_seconds = dict(send.errors), send.unwritable_p99_seconds


def send_stalls(procs: list[ProcessSendLatency], refresh: Refresh, now: float) -> list[Signal]:
    """Per process, the worse of two p99s over the window: how long sends blocked, and how long sockets
    stayed unwritable (asynchronous servers never block in a send: their stalls show only there). Only
    the processes whose stall could hold the rule, firing or clearing, have a signal: the rule engine reads
    a missing one as one that does not hold, and thousands of quiet senders need none."""
    send_p99s, sends = recent_p99s(refresh, "send", procs, _SENT, now)
    # Most processes never find a socket full: no window kept for them.
    waiting = [i for i, proc in enumerate(procs) if proc.unwritable_count]
    wait_p99s, periods = recent_p99s(refresh, "unwritable", [procs[i] for i in waiting], _WAITED, now)
    send_p99 = np.where(np.array(sends) >= MIN_SENDS_FOR_P99, np.array(send_p99s, np.float64), np.nan)
    unwritable_p99 = np.full(len(procs), np.nan)
    unwritable_p99[waiting] = np.array(wait_p99s, np.float64)
    worst = np.fmax(send_p99, unwritable_p99)  # NaN where neither was seen
    rule = refresh.rule("network_send_stall")
    periods_of = dict(zip(waiting, periods, strict=True))
    return [Signal("network_send_stall", target(procs[i]), worst[i].item(), {
        "send_p99_seconds": _rounded(send_p99[i]), "sends": int(sends[i]),
        "unwritable_p99_seconds": _rounded(unwritable_p99[i]), "unwritable_periods": int(periods_of.get(i, 0)),
        "window_seconds": SIGNAL_WINDOW_SECONDS, "pid": procs[i].pid, "threshold_seconds": rule.threshold})
        for i in np.flatnonzero(worst > min(rule.threshold, rule.clear_threshold)).tolist()]


def _rounded(seconds: np.float64) -> float | None:
    return None if np.isnan(seconds) else round(seconds.item(), 6)


_SENT = operator.attrgetter("histogram")
_WAITED = operator.attrgetter("unwritable_histogram")


class StreamsHooks(Hooks):
    sections = {"streams": Section(StreamEndpoint), "tls_handshakes": Section(TlsHandshakes)}

    def join(self, reading: StreamsSnapshot, readings: Readings, refresh: Refresh) -> Iterable[int]:
        streams: list[StreamEndpoint | StreamStall | TlsHandshakes] = [*reading.endpoints, *reading.stalls,
                                                                        *reading.tls_handshakes]
        for stream in streams:
            refresh.workload(stream.cgroup_id, stream.pid).label(stream)
        return {stream.pid for stream in streams}

    def rates(self, reading: StreamsSnapshot, refresh: Refresh, now: float) -> None:
        for stream in reading.endpoints:
            (stream.streams_per_second,) = refresh.rate(("streams", stream.identity()), [stream.streams], now)

    def signals(self, reading: StreamsSnapshot, readings: Readings, refresh: Refresh, now: float) -> list[Signal]:
        """Stalls of each process's responses in the window, their causes as evidence."""
        by_target: dict[str, dict[str, Any]] = {}
        for endpoint in reading.endpoints:
            recent = refresh.recent(("stalls", endpoint.identity()),
                                    [float(endpoint.stalls.get(c, 0)) for c in CAUSES], now)
            seen = by_target.setdefault(target(endpoint), {"pid": endpoint.pid, "ports": set(), "causes": {}})
            for cause, count in zip(CAUSES, recent, strict=True):
                if count:
                    seen["causes"][cause] = seen["causes"].get(cause, 0) + int(count)
                    seen["ports"].add(f"{endpoint.port}/{endpoint.protocol}")
        threshold = refresh.config.settings(StreamsSettings).stream_stall_threshold_ms / 1e3
        return [Signal("token_streams_stalling", name, float(sum(seen["causes"].values())), {
            "cause": max(seen["causes"], key=seen["causes"].get) if seen["causes"] else "",
            "stalls_by_cause": seen["causes"], "endpoints": sorted(seen["ports"]), "pid": seen["pid"],
            "window_seconds": SIGNAL_WINDOW_SECONDS, "threshold_seconds": threshold})
            for name, seen in by_target.items()]

    def snapshot(self, reading: StreamsSnapshot) -> dict[str, Any]:
        return {"streams": sorted(reading.endpoints, key=lambda e: e.streams_per_second, reverse=True),
                "tls_handshakes": sorted(reading.tls_handshakes, key=lambda h: (h.port, h.tls_version, h.pid))}


class RequestsHooks(Hooks):
    sections = {"requests": Section(RequestEndpoint), "client_requests": Section(ClientRequests)}

    def join(self, reading: RequestsSnapshot, readings: Readings, refresh: Refresh) -> Iterable[int]:
        records: list[RequestEndpoint | Requests | ClientRequests] = [
            *reading.endpoints, *reading.http, *reading.rpc, *reading.clients]
        for record in records:
            refresh.workload(record.cgroup_id, record.pid).label(record)
        return {record.pid for record in records}

    def rates(self, reading: RequestsSnapshot, refresh: Refresh, now: float) -> None:
        """Requests per second and the shares of 4xx, 5xx and 429 among them, over the last interval."""
        for endpoint in reading.endpoints:
            total, client, server, throttled = refresh.rate(("requests", endpoint.identity()), [
                endpoint.count, endpoint.client_errors, endpoint.server_errors, endpoint.throttled], now)
            endpoint.requests_per_second = total
            if total:
                endpoint.client_error_share, endpoint.server_error_share = client / total, server / total
                endpoint.throttled_share = throttled / total

    def signals(self, reading: RequestsSnapshot, readings: Readings, refresh: Refresh, now: float) -> list[Signal]:
        """Per endpoint, the shares of 5xx and of 429 among the requests answered in the window."""
        signals = []
        for endpoint in reading.endpoints:
            total, server, throttled = refresh.recent(("requests", endpoint.identity()), [
                float(endpoint.count), float(endpoint.server_errors), float(endpoint.throttled)], now)
            if not total:
                continue
            name = f":{endpoint.port} {target(endpoint)}"
            evidence = {"port": endpoint.port, "protocol": endpoint.protocol, "process": endpoint.comm,
                        "pid": endpoint.pid, "requests": int(total), "server_errors": int(server),
                        "throttled": int(throttled), "statuses": endpoint.statuses,
                        "window_seconds": SIGNAL_WINDOW_SECONDS}
            signals.append(Signal("http_server_errors", name, server / total, evidence))
            signals.append(Signal("http_throttled", name, throttled / total, evidence))
        return signals

    def snapshot(self, reading: RequestsSnapshot) -> dict[str, Any]:
        return {"requests": sorted(reading.endpoints, key=lambda e: e.requests_per_second, reverse=True),
                "client_requests": sorted(reading.clients, key=lambda r: (r.server_address, r.server_port, r.pid,
                                                                          r.method, r.status_code))}
