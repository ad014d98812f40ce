"""The flows probe in `aiprobe top`: its view of the snapshot's `flows`."""

from __future__ import annotations

from typing import Any

from ...formatting import Column, View
from ...names import endpoint


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



VIEW = View(
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
    identity=("interface", "direction", "protocol", "local", "remote"), key="f",
)
