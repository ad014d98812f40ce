"""The flows probe's records: per-flow and per-interface counts from tc/XDP."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...model import JOINED, Identity, Placed, Record


@dataclass
class FlowRecord(Placed):
    interface: str
    direction: str  # "ingress" | "egress"
    protocol: str  # "tcp", "udp", ... or the IP protocol number
    local_address: str  # this host's side
    local_port: int
    remote_address: str
    remote_port: int
    bytes: int
    packets: int
    bytes_per_second: float
    packets_per_second: float
    cgroup_id: int  # egress: the sending socket's cgroup v2 id; 0 when unknown
    first_seen: float  # Unix time of the flow's first frame
    last_seen: float  # its latest frame came at or after this: the start of the table read before it
    tcp_syn: int = 0
    tcp_fin: int = 0
    tcp_rst: int = 0
    # The process owning the socket (host network namespace only) and its container.
    pid: int | None = field(default=None, metadata=JOINED)
    comm: str | None = field(default=None, metadata=JOINED)

    def identity(self) -> Identity:
        return (self.interface, self.direction, self.protocol, self.local_address, self.local_port,
                self.remote_address, self.remote_port)


@dataclass
class InterfaceTotals(Record):
    """Everything one interface moved in one direction since the probe attached to it: wire frames
    (a GSO/GRO skb counts as its segments, each with its headers; bpf/flows.h)."""

    interface: str
    direction: str
    bytes: int
    packets: int
    tcp_syn: int = 0  # TCP segments with SYN, FIN, RST: of its flows, those deleted included
    tcp_fin: int = 0
    tcp_rst: int = 0
    bytes_per_second: float = 0.0  # since the probe's latest read of the whole table before this one
    packets_per_second: float = 0.0

    def identity(self) -> Identity:
        return self.interface, self.direction


@dataclass
class InterfaceAttachment(Record):
    """How the flows programs sit on one interface, or why they could not."""

    interface: str
    ifindex: int
    ingress: str | None = None  # "tcx" | "clsact" | "xdp"
    egress: str | None = None  # "tcx" | "clsact"
    error: str = ""  # why a direction has no program
    xdp_refused: str = ""  # the interface matched xdp_interfaces, and why ingress is counted at tc instead

    def describe(self) -> str:
        hooks = ", ".join(f"{d} {getattr(self, d) or 'none'}" for d in ("ingress", "egress"))
        notes = "; ".join(n for n in (self.error, self.xdp_refused) if n)
        return f"{self.interface}: {hooks}" + (f" ({notes})" if notes else "")


@dataclass
class FlowsSnapshot(Record):
    timestamp: float
    interval_seconds: float
    flows: list[FlowRecord]
    interfaces: list[InterfaceTotals]
    evictions: int  # monotonic: flows evicted to make room
    insert_failures: int  # monotonic: new flows that found the table full (counted per interface only)
    malformed_frames: int  # monotonic: frames with truncated or inconsistent headers
    attachments: list[InterfaceAttachment]
    lost_frames: int = 0  # monotonic: frames counted nowhere, not even in interface totals (struct lost_counters)
