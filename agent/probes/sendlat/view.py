"""The send path in `aiprobe top`: its columns of the process table, the streams and requests views."""

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


# The columns naming a server (a process on a listening port, by protocol), and how its rows are followed.
ENDPOINT_COLUMNS = (
    Column("PORT", "port", 6, text=str),
    Column("PROTO", "protocol", 6, numeric=False),
    Column("PROCESS", "comm", 15, numeric=False),
    Column("CONTAINER", "container", 12, numeric=False),
)
ENDPOINT_IDENTITY = ("pid", "port", "protocol")

STREAMS_VIEW = View(
    "streams", "Streams",
    (
        *ENDPOINT_COLUMNS,
        Column("STREAMS", "streams_per_second", 8),
        Column("TTFB p50", "ttfb_p50_seconds", 9),
        Column("TTFB p99", "ttfb_p99_seconds", 9),
        Column("GAP p50", "gap_p50_seconds", 9),
        Column("GAP p99", "gap_p99_seconds", 9),
        Column("STALLS", "stall_count", 7, text=str),
        Column("BY CAUSE", "stalls_text", 24, numeric=False),
    ),
    "streams_per_second", True, ("streams",), _stream_rows, identity=ENDPOINT_IDENTITY, key="t",
)


def _percent(share: float) -> str:
    return f"{share:.1%}"


# The shares of the requests answered in the last interval, by status class.
SHARE_COLUMNS = tuple(Column(title, f"{share}_share", 7, text=_percent)
                      for title, share in (("4xx", "client_error"), ("5xx", "server_error"), ("429", "throttled")))

REQUESTS_VIEW = View(
    "requests", "Requests",
    (*ENDPOINT_COLUMNS, Column("REQ/s", "requests_per_second", 8), *SHARE_COLUMNS,
     Column("p50", "p50_seconds", 9), Column("p99", "p99_seconds", 9)),
    "requests_per_second", True, ("requests",), lambda snapshot: list(snapshot.get("requests") or []),
    identity=ENDPOINT_IDENTITY, key="r",
)
