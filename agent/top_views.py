"""What `aiprobe top` shows: the header and its views, declared as columns over docs/snapshot.md fields:
processes (with each probe's columns), each probe's own views (flows, streams, GPUs), and alerts.
The interactive screen and `--batch` text both render these."""

from __future__ import annotations

from functools import cache
from typing import Any

from . import formatting, registry
from .formatting import Column, View, table


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


def _processes(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    return list(snapshot.get("processes") or [])


ALERTS = View(
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
    identity=("rule", "target"), key="a",
)


@cache
def views() -> dict[str, View]:
    """The views in order: processes (each probe's columns after the process's own), each probe's
    views in registry order, then alerts."""
    faces = registry.faces()
    processes = View(
        "processes", "Processes",
        (
            Column("COMM", "comm", 15, numeric=False),
            Column("PID", "pid", 7, text=str),
            Column("CONTAINER", "container", 12, numeric=False),
            *(column for face in faces for column in face.process_columns),
        ),
        "send_bytes_per_second", True, tuple(face.name for face in faces if face.process_columns), _processes,
        identity=("pid",), key="p",
    )
    return {view.name: view for view in (processes, *(view for face in faces for view in face.views), ALERTS)}


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
    for view in views().values():
        lines += ["", f"{view.title.upper()}", *probe_notices(view, snapshot)]
        lines += table(view.columns, visible_rows(view, snapshot, view.sort_key, view.descending))
    return "\n".join(lines)
