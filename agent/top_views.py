"""What `aiprobe top` shows: the header and five views (processes, flows, streams, GPUs, alerts), declared as
columns over docs/snapshot.md fields. The interactive screen and `--batch` text both render these."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import formatting
from .formatting import Column, table
from .names import endpoint


@dataclass(frozen=True)
class View:
    name: str
    title: str
    columns: tuple[Column, ...]
    sort_key: str  # the default sort column
    descending: bool
    probes: tuple[str, ...]  # probes whose data fills this view: a down one says why in the view
    rows: Callable[[dict[str, Any]], list[dict[str, Any]]]
    identity: tuple[str, ...] = ()  # row fields naming the same row across refreshes (the cursor follows it)

    def row_id(self, row: dict[str, Any]) -> tuple[Any, ...]:
        return tuple(row.get(field) for field in self.identity)

    def column_index(self, key: str) -> int:
        return next(i for i, column in enumerate(self.columns) if column.key == key)

    def cells(self, row: dict[str, Any]) -> list[str]:
        return [column.cell(row) for column in self.columns]


def _flow_rows(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {
            **flow,
            "local": endpoint(flow.get("local_address"), flow.get("local_port")),
            "remote": endpoint(flow.get("remote_address"), flow.get("remote_port")),
            "dir": {"ingress": "in", "egress": "out"}.get(flow.get("direction"), flow.get("direction")),
        }
        for flow in snapshot.get("flows") or []
    ]


def _evidence(evidence: dict[str, Any]) -> str:
    """`send_p99=310 ms threshold=50 ms`: each value in its unit, the unit suffix dropped from the name."""
    return " ".join(f"{formatting.without_unit(key)}={formatting.field(key, value)}" for key, value in evidence.items())


def _alert_rows(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    now = (snapshot.get("host") or {}).get("time")
    return [
        {
            **alert,
            "age_seconds": None if now is None or alert.get("since") is None else now - alert["since"],
            "evidence_text": _evidence(alert.get("evidence") or {}),
        }
        for alert in snapshot.get("alerts") or []
    ]


STALL_CAUSES = ("network", "cpu", "gpu", "server")


def _stream_rows(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    """Endpoints with their stalls as `network 2 cpu 1` and their total (for sorting)."""
    rows = []
    for stream in snapshot.get("streams") or []:
        stalls = stream.get("stalls") or {}
        rows.append({**stream, "stall_count": sum(stalls.values()),
                     "stalls_text": " ".join(f"{c} {stalls[c]}" for c in STALL_CAUSES if stalls.get(c)) or "-"})
    return rows


def _listed(field: str) -> Callable[[dict[str, Any]], list[dict[str, Any]]]:
    return lambda snapshot: list(snapshot.get(field) or [])


VIEWS: dict[str, View] = {
    view.name: view
    for view in (
        View(
            "processes", "Processes",
            (
                Column("COMM", "comm", 15, numeric=False),
                Column("PID", "pid", 7, text=str),
                Column("CONTAINER", "container", 12, numeric=False),
                Column("SEND p50", "send_p50_seconds", 9),
                Column("SEND p99", "send_p99_seconds", 9),
                Column("SEND", "send_bytes_per_second", 10),
                Column("THR CTX", "cuda_context_switches_per_second", 8),  # a thread changing its context
                Column("LAUNCH", "cuda_kernel_launches_per_second", 8),
                Column("GRAPHS", "cuda_graph_launches_per_second", 8),
                Column("1ST LAUNCH", "cuda_time_to_first_launch_seconds", 10),  # cold start, recent processes
                Column("RUNQ p99", "runqueue_delay_p99_seconds", 9),
                Column("GPU", "gpu_utilization_ratio", 5),
                Column("GPU MEM", "gpu_memory_used_bytes", 9),
            ),
            "send_bytes_per_second", True, ("sendlat", "cuda", "sched", "nvml"), _listed("processes"),
            identity=("pid",),
        ),
        View(
            "flows", "Flows",
            (
                Column("DIR", "dir", 3, numeric=False),
                Column("PROTO", "protocol", 5, numeric=False),
                Column("LOCAL", "local", 21, numeric=False),
                Column("REMOTE", "remote", 21, numeric=False),
                Column("RATE", "bytes_per_second", 10),
                Column("PKTS", "packets_per_second", 7),
                Column("TOTAL", "bytes", 9),
                Column("PACKETS", "packets", 8),
                Column("IFACE", "interface", 10, numeric=False),
                Column("PROCESS", "comm", 15, numeric=False),
                Column("CONTAINER", "container", 12, numeric=False),
            ),
            "bytes_per_second", True, ("flows",), _flow_rows,
            identity=("interface", "direction", "protocol", "local", "remote"),
        ),
        View(
            "streams", "Streams",
            (
                Column("PORT", "port", 6, text=str),
                Column("PROTO", "protocol", 6, numeric=False),
                Column("PROCESS", "comm", 15, numeric=False),
                Column("CONTAINER", "container", 12, numeric=False),
                Column("STREAMS", "streams_per_second", 8),
                Column("TTFB p50", "ttfb_p50_seconds", 9),
                Column("TTFB p99", "ttfb_p99_seconds", 9),
                Column("GAP p50", "gap_p50_seconds", 9),
                Column("GAP p99", "gap_p99_seconds", 9),
                Column("STALLS", "stall_count", 7, text=str),
                Column("BY CAUSE", "stalls_text", 24, numeric=False),
            ),
            "streams_per_second", True, ("streams",), _stream_rows,
            identity=("pid", "port", "protocol"),
        ),
        View(
            "gpus", "GPUs",
            (
                Column("GPU", "index", 3, text=str),
                Column("NAME", "name", 16, numeric=False),
                Column("UTIL", "utilization_gpu_ratio", 5),
                Column("MEM%", "utilization_memory_ratio", 5),
                Column("MEM USED", "memory_used_bytes", 9),
                Column("MEM TOTAL", "memory_total_bytes", 9),
                Column("POWER", "power_watts", 8),
                Column("TEMP", "temperature_celsius", 6),
                Column("SM CLK", "sm_clock_hz", 9),
                Column("MEM CLK", "memory_clock_hz", 9),
                Column("THROTTLE", "clock_event_reasons", 20, numeric=False),
                Column("CUDA CTXS", "cuda_active_contexts", 9),  # 2+: time-sliced between contexts
                # The GPU's own measure of that time-slicing (GPM): its switches, and its busiest engine's share.
                Column("CTX SW", "context_switches_per_second", 8),
                Column("SWITCHING", "context_switching_ratio", 9),
            ),
            "index", False, ("nvml",), _listed("gpus"),
            identity=("index",),
        ),
        View(
            "alerts", "Alerts",
            (
                Column("SINCE", "age_seconds", 6, text=formatting.age),
                Column("STATE", "state", 7, numeric=False),
                Column("RULE", "rule", 25, numeric=False),
                Column("TARGET", "target", 18, numeric=False),
                Column("EVIDENCE", "evidence_text", 44, numeric=False),
                Column("SEVERITY", "severity", 8, numeric=False),
            ),
            "age_seconds", False, (), _alert_rows,
            identity=("rule", "target"),
        ),
    )
}


def sort_rows(rows: list[dict[str, Any]], key: str, descending: bool) -> list[dict[str, Any]]:
    """Rows ordered by raw field values (not their text); rows without the value always go last."""
    present = [row for row in rows if row.get(key) is not None]
    missing = [row for row in rows if row.get(key) is None]
    return sorted(present, key=lambda row: row[key], reverse=descending) + missing


def matches(view: View, row: dict[str, Any], query: str) -> bool:
    """A row matches a filter when any of its cells, as shown, contains the query (case-insensitive)."""
    query = query.lower()
    return any(query in cell.lower() for cell in view.cells(row))


def visible_rows(
    view: View, snapshot: dict[str, Any], sort_key: str, descending: bool, query: str = ""
) -> list[dict[str, Any]]:
    rows = [row for row in view.rows(snapshot) if not query or matches(view, row, query)]
    return sort_rows(rows, sort_key, descending)


def header_lines(snapshot: dict[str, Any]) -> list[str]:
    """Host, kernel, GPU count and alerts; then the strategy each probe runs (or that it is down)."""
    host = snapshot.get("host") or {}
    alerts = snapshot.get("alerts") or []
    states = [alert.get("state") for alert in alerts]
    gpus = len(snapshot.get("gpus") or [])
    probes = " ".join(
        f"{name}:{probe.get('strategy') if probe.get('up') else 'DOWN'}"
        for name, probe in (snapshot.get("probes") or {}).items()
    )
    lost = " ".join(f"{name}.{table}:{count}" for name, probe in (snapshot.get("probes") or {}).items()
                    for table, count in (probe.get("overflows") or {}).items())
    # What a probe's CPU budget holds back now: the parts of its span that say so.
    limited = "; ".join(f"{name}: {part.strip()}" for name, probe in (snapshot.get("probes") or {}).items()
                        if probe.get("up") for part in (probe.get("span") or "").split(";") if "(CPU budget)" in part)
    return [
        f"{host.get('hostname', '?')} · kernel {host.get('kernel', '?')} · {gpus} GPU{'s' if gpus != 1 else ''}"
        f" · alerts: {states.count('firing')} firing, {states.count('pending')} pending",
        f"probes: {probes or 'none'}",
        *([f"LOST (full BPF tables: entries evicted or never stored): {lost}"] if lost else []),
        *([f"CPU budget: {limited}"] if limited else []),
    ]


def probe_notices(view: View, snapshot: dict[str, Any]) -> list[str]:
    """One line per probe this view needs that is down, with its reason."""
    probes = snapshot.get("probes") or {}
    return [
        f"{name} probe down: {probes[name].get('reason') or 'no reason given'}"
        for name in view.probes
        if name in probes and not probes[name].get("up")
    ]


def text_report(snapshot: dict[str, Any]) -> str:
    """One snapshot as plain text, every view a table in its default order (`top --batch`)."""
    lines = header_lines(snapshot)
    for view in VIEWS.values():
        lines += ["", f"{view.title.upper()}", *probe_notices(view, snapshot)]
        lines += table(view.columns, visible_rows(view, snapshot, view.sort_key, view.descending))
    return "\n".join(lines)
