"""The flows probe in the agent's refresh: each flow's owner and the snapshot's
`flows` (the busiest) and `interfaces`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ...model import Readings
from ...refresh import Hooks, Refresh, Section
from .records import FlowRecord, FlowsSnapshot, InterfaceTotals

SNAPSHOT_FLOWS = 200  # flows in the snapshot, the fastest first: the probe makes records of as many


class FlowsHooks(Hooks):
    sections = {"flows": Section(FlowRecord), "interfaces": Section(InterfaceTotals)}

    def join(self, reading: FlowsSnapshot, readings: Readings, refresh: Refresh) -> Iterable[int]:
        """The pid and comm owning each flow's socket, where the host's namespace holds it."""
        for flow in reading.flows:
            flow.pid = refresh.socket_owner(flow.local_address, flow.local_port, flow.remote_address,
                                            flow.remote_port)
            flow.comm = refresh.comm(flow.pid) if flow.pid is not None else None
            refresh.workload(flow.cgroup_id, flow.pid).label(flow)
        return {flow.pid for flow in reading.flows if flow.pid is not None}

    def snapshot(self, reading: FlowsSnapshot) -> dict[str, Any]:
        flows = sorted(reading.flows, key=lambda f: f.bytes_per_second, reverse=True)
        return {"flows": flows[:SNAPSHOT_FLOWS], "interfaces": reading.interfaces}
