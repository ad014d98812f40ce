"""The send path in `aiprobe top`: its columns of the process table and the streams view."""

from __future__ import annotations

from typing import Any

from ...formatting import Column, View

PROCESS_COLUMNS = (
    Column("SEND p50", "send_p50_seconds", 9),
    Column("SEND p99", "send_p99_seconds", 9),
    Column("SEND", "send_bytes_per_second", 10),
)
# Stall causes in the order the view lists them.
STALL_CAUSES = ("network", "cpu", "gpu", "server")


def _stream_rows(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    """Endpoints with their stalls as `network 2 cpu 1` and their total (for sorting)."""
    rows = []
    for stream in snapshot.get("streams") or []:
        stalls = stream.get("stalls") or {}
        rows.append({**stream, "stall_count": sum(stalls.values()),
                     "stalls_text": " ".join(f"{c} {stalls[c]}" for c in STALL_CAUSES if stalls.get(c)) or "-"})
    return rows



STREAMS_VIEW = View(
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
    identity=("pid", "port", "protocol"), key="t",
)
