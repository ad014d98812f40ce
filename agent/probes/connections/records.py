"""The connections probe's records: listening sockets, their queues and what happened at them."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...model import HISTOGRAM, JOINED, Histogram, Identity, Placed, Record


@dataclass
class Listener(Placed):
    """A listening TCP socket of the host's network namespace: its queues and the path quality of the
    connections it accepted from sock_diag, its overflows and accept waits from the probe's hooks (null
    where no hook runs)."""

    family: str  # "ipv4" | "ipv6" (an ipv6 listener on :: takes IPv4 too unless IPV6_V6ONLY)
    local_address: str  # 0.0.0.0 or :: for every address
    local_port: int
    queue_length: int  # connections complete, waiting for accept() (idiag_rqueue)
    queue_capacity: int  # the backlog in force (idiag_wqueue): the queue overflows above it
    half_open: int  # requests in SYN_RECV at its address and port (a reuseport group's first socket)
    inode: int
    cookie: int  # the kernel's socket cookie
    pid: int | None  # the lowest pid holding it (a pre-forking server's parent); null when unseen
    comm: str  # that process's name, "" when unseen
    reuseport_group: int = 1  # sockets listening at this address and port (SO_REUSEPORT)
    connections: int = 0  # connected sockets it accepted, open now (a reuseport group's first socket)
    retransmitted_segments: int = 0  # by those since the probe started (tcpi_total_retrans' increases)
    rtt_sum_seconds: float = 0.0
    rtt_p50_seconds: float | None = None  # of its ESTABLISHED connections at this read; null without one
    rtt_p99_seconds: float | None = None
    # Their smoothed RTTs (tcpi_rtt), one sample per connection per read since the probe started.
    rtt_histogram: Histogram | None = field(default=None, metadata=HISTOGRAM)
    overflows: int | None = None  # connections dropped since the probe started: its accept queue was full
    accepted: int | None = None  # connections accept() returned since the probe started
    accept_wait_sum_seconds: float = 0.0
    accept_wait_p50_seconds: float | None = None
    accept_wait_p99_seconds: float | None = None
    # Handshake complete to accept() returning the connection; null where no hook runs.
    accept_wait_histogram: Histogram | None = field(default=None, metadata=HISTOGRAM)
    handshake_sum_seconds: float = 0.0
    handshake_p50_seconds: float | None = None
    handshake_p99_seconds: float | None = None
    # Its first SYN-ACK sent to the handshake complete (connections made from SYN cookies left out).
    handshake_histogram: Histogram | None = field(default=None, metadata=HISTOGRAM)
    queue_ratio: float = field(default=0.0, metadata=JOINED)  # queue_length / queue_capacity
    overflows_per_second: float = field(default=0.0, metadata=JOINED)
    accepted_per_second: float = field(default=0.0, metadata=JOINED)

    def identity(self) -> Identity:
        return (self.cookie,)


@dataclass
class ReuseportGroup(Record):
    """Listeners sharing one address and port (SO_REUSEPORT), judged over the last 10 s."""

    family: str
    local_address: str
    local_port: int
    sockets: int
    accepted: int  # connections its sockets accepted in the window
    # The busiest socket's share of them over the mean share (1: even); null without accepts or hooks.
    imbalance_ratio: float | None
    stuck_pids: list[int]  # owners of sockets that accepted nothing in the window while connections waited


@dataclass
class ConnectionsSnapshot(Record):
    timestamp: float
    listeners: list[Listener]
    # Overflows (since the probe started) at listeners no read had seen yet, or since closed.
    unattributed_overflows: int = 0
    reuseport_groups: list[ReuseportGroup] = field(default_factory=list, metadata=JOINED)
