"""The connections probe in `aiprobe top`: its view of the snapshot's `listeners` (an idle host shows
its listeners and their queues), with the RTT and retransmits of the connections each accepted."""

from __future__ import annotations

from typing import Any

from ...formatting import Column, View
from ...names import endpoint

# title, row field, width: numbers right-aligned, the fields in TEXT left-aligned
LAYOUT = (
    ("LISTEN", "listen", 26), ("QUEUE", "queue_length", 6), ("CAP", "queue_capacity", 6),
    ("FULL", "queue_ratio", 5), ("SYN_RECV", "half_open", 8), ("OVERFL/S", "overflows_per_second", 8),
    ("OVERFLOWS", "overflows", 9), ("ACCEPT/S", "accepted_per_second", 8), ("WAIT P99", "accept_wait_p99_seconds", 9),
    ("HANDSHAKE P99", "handshake_p99_seconds", 13), ("CONNS", "connections", 6), ("RTT P50", "rtt_p50_seconds", 8),
    ("RTT P99", "rtt_p99_seconds", 8), ("RETRANS", "retransmitted_segments", 8),
    ("GROUP", "reuseport_group", 5), ("PID", "pid", 7), ("PROCESS", "comm", 15), ("CONTAINER", "container", 12),
)
TEXT = {"listen", "comm", "container"}


def _listener_rows(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    return [{**listener, "listen": endpoint(listener.get("local_address"), listener.get("local_port"))}
            for listener in snapshot.get("listeners") or []]


VIEW = View(
    "listeners", "Listeners",
    tuple(Column(title, key, width, numeric=key not in TEXT, text=str if key == "pid" else None)
          for title, key, width in LAYOUT),
    "queue_ratio", True, ("connections",), _listener_rows, identity=("cookie",), key="l",
)
