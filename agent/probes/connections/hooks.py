"""The connections probe in the agent's refresh: each listener's container, its rates and queue
ratio, its reuseport group's balance, the rules' signals and the snapshot's `listeners`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ...model import Readings
from ...refresh import Hooks, Refresh, Section
from ...rules import Signal
from .records import ConnectionsSnapshot, Listener, ReuseportGroup

# An overflow means the queue was full: the saturation rule sees at least this ratio then.
OVERFLOWING_RATIO = 1.0


def listener_target(listener: Listener) -> str:
    """A rule's target for a listener: its port and process, `:8000 python3@host`."""
    return f":{listener.local_port} {listener.comm or listener.pid or '?'}@{listener.container}"


def _evidence(listener: Listener) -> dict[str, Any]:
    return {"address": listener.local_address, "port": listener.local_port, "pid": listener.pid,
            "process": listener.comm, "container": listener.container, "queue_length": listener.queue_length,
            "queue_capacity": listener.queue_capacity, "overflows_per_second": round(listener.overflows_per_second, 3)}


def reuseport_groups(listeners: list[Listener], accepted_recently: dict[int, float]) -> list[ReuseportGroup]:
    """The groups of sockets sharing an address and port, with the busiest one's share of the window's
    accepts over the mean share, and the owners of sockets that accepted nothing while connections waited."""
    members: dict[tuple[str, str, int], list[Listener]] = {}
    for listener in listeners:
        if listener.reuseport_group > 1:
            members.setdefault((listener.family, listener.local_address, listener.local_port), []).append(listener)
    groups = []
    for (family, address, port), sockets in members.items():
        counts = [accepted_recently.get(s.cookie) for s in sockets]
        measured = [c for c in counts if c is not None]
        total = sum(measured)
        ratio = max(measured) / (total / len(measured)) if measured and total > 0 else None
        stuck = [s.pid for s, c in zip(sockets, counts, strict=True)
                 if c == 0 and s.queue_length > 0 and s.pid is not None]
        groups.append(ReuseportGroup(family, address, port, len(sockets), round(total), ratio, stuck))
    return groups


class ConnectionsHooks(Hooks):
    sections = {"listeners": Section(Listener), "reuseport_groups": Section(ReuseportGroup)}

    def join(self, reading: ConnectionsSnapshot, readings: Readings, refresh: Refresh) -> Iterable[int]:
        for listener in reading.listeners:
            if listener.pid is not None:
                refresh.workload_of_pid(listener.pid).label(listener)
        return {listener.pid for listener in reading.listeners if listener.pid is not None}

    def rates(self, reading: ConnectionsSnapshot, refresh: Refresh, now: float) -> None:
        recent: dict[int, float] = {}
        for listener in reading.listeners:
            # listen(0) holds one connection: its capacity counts as 1
            listener.queue_ratio = listener.queue_length / max(listener.queue_capacity, 1)
            if listener.accepted is None or listener.overflows is None:
                continue
            source = ("listener", listener.identity())
            listener.overflows_per_second, listener.accepted_per_second = \
                refresh.rate(source, [listener.overflows, listener.accepted], now)
            (recent[listener.cookie],) = refresh.recent(source, [float(listener.accepted)], now)
        reading.reuseport_groups = reuseport_groups(reading.listeners, recent)

    def signals(self, reading: ConnectionsSnapshot, readings: Readings, refresh: Refresh, now: float) -> list[Signal]:
        signals = []
        for listener in reading.listeners:
            overflowing = listener.overflows_per_second > 0
            ratio = max(listener.queue_ratio, OVERFLOWING_RATIO) if overflowing else listener.queue_ratio
            signals.append(Signal("accept_queue_saturated", listener_target(listener), ratio, _evidence(listener)))
            if listener.overflows is not None:
                signals.append(Signal("listen_queue_overflow", listener_target(listener),
                                      listener.overflows_per_second, _evidence(listener)))
        for group in reading.reuseport_groups:
            if group.imbalance_ratio is not None:
                target = f":{group.local_port} {group.local_address}"
                signals.append(Signal("reuseport_imbalance", target, group.imbalance_ratio, {
                    "address": group.local_address, "port": group.local_port, "sockets": group.sockets,
                    "accepted": group.accepted, "stuck_pids": group.stuck_pids,
                    "processes": sorted({s.comm for s in reading.listeners if s.local_port == group.local_port})}))
        return signals

    def snapshot(self, reading: ConnectionsSnapshot) -> dict[str, Any]:
        return {"listeners": reading.listeners, "reuseport_groups": reading.reuseport_groups}
