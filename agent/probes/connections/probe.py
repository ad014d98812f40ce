"""Connection set-up per listening TCP socket: its accept queue (length, capacity, half-open
requests) and the path quality of the connections it accepted (smoothed RTT, retransmitted segments,
from their tcp_info) from sock_diag, with no BPF; its overflows and how long connections wait in its
accept queue from hooks at the drop and at accept() (bpf/connections.bpf.c).

The BPF side is optional: where no strategy of the chain loads, the probe runs on sock_diag alone
(`sock_diag`) and says why; overflows and accept waits are then null. Sockets of the agent's network
namespace only: a pod with a network namespace of its own keeps its listeners there.
"""

from __future__ import annotations

import errno
import os
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ... import sockdiag
from ...btf import kernel_enum_names
from ...histogram import (
    FAST_BOUNDS,
    NS_PER_SECOND,
    exported_buckets,
    hist_slots,
    kernel_buckets,
    no_observations,
    quantile,
    slot_of_nanoseconds,
)
from ...libbpf import BpfError
from ...loader import BpfObject, ProbeUnavailable, Strategy, enum_labels
from ...metrics import PROCESS_LABELS, Family
from ...model import MapUsage, ProbeStatus
from ...names import process_name
from ...registry import Loading, Probe, ProbeSpec, strategies_named
from .hooks import ConnectionsHooks
from .records import ConnectionsSnapshot, Listener, ReuseportGroup
from .rules import ACCEPT_QUEUE_SATURATED, REUSEPORT_IMBALANCE
from .view import VIEW

if TYPE_CHECKING:
    from ...config import Config

OBJECT = "connections"
SOCK_DIAG = "sock_diag"
COUNTERS = enum_labels(OBJECT, "connections_counter", "CONN_")  # as enum connections_counter names them
LISTEN_OVERFLOW_REASON = "SKB_DROP_REASON_TCP_LISTEN_OVERFLOW"
# An inode whose owner a scan did not find is looked for again after this long, then twice as long
# after each further miss up to the maximum (a scan reads every process's descriptors, and a listener
# owned from outside the agent's pid namespace is never found).
OWNER_RESCAN_SECONDS, OWNER_RESCAN_MAX_SECONDS = 5.0, 320.0
# The connection table (half-open requests; connected sockets' RTTs and retransmits) is dumped at most
# this often: the kernel walks its whole established hash (~5 ms a dump, half a core-percent at every
# refresh, however few connections), Python then costs ~6 µs a connection (80 ms at 12k connections),
# and a path's quality changes slowly.
PATH_QUALITY_SECONDS = 10.0

STRATEGIES = (
    Strategy(
        "fentry",
        programs=("cn_syn_fentry", "cn_ack4_fentry", "cn_ack6_fentry", "cn_ready4_fexit", "cn_ready6_fexit",
                  "cn_accept_fexit"),
        features=("fentry", "syn_recv_fexit"),
        span="overflows at tcp_conn_request and tcp_v{4,6}_syn_recv_sock entry (the kernel's own test); handshake "
             "from the first SYN-ACK to tcp_v{4,6}_syn_recv_sock's return, accept wait from there to "
             "inet_csk_accept's (fentry/fexit)",
    ),
    Strategy(
        "kprobe",
        programs=("cn_syn_kprobe", "cn_ack4_kprobe", "cn_ack6_kprobe", "cn_ready4_kret", "cn_ready6_kret",
                  "cn_acc_kprobe", "cn_acc_kret"),
        features=("kprobe",),
        span="overflows at tcp_conn_request and tcp_v{4,6}_syn_recv_sock entry (the kernel's own test); handshake "
             "from the first SYN-ACK to tcp_v{4,6}_syn_recv_sock's return, accept wait from there to "
             "inet_csk_accept's (kprobe/kretprobe)",
    ),
    Strategy(
        "tracepoint",
        programs=("cn_drop_tp",),
        features=("tp_btf",),
        span="overflows of the handshake's last ACK only (skb:kfree_skb, reason TCP_LISTEN_OVERFLOW, 6.15+): a SYN "
             "dropped at a full queue is not seen; no handshake time, no accept wait",
    ),
    Strategy(SOCK_DIAG, span="accept queues and half-open requests from sock_diag; no overflows per listener, "
                             "no handshake time, no accept wait"),
)


def _from_config(config: Config) -> ConnectionsProbe:
    return ConnectionsProbe(strategies_named(SPEC, config.strategies.get(SPEC.name)))


def _configure(obj: BpfObject, strategy: Strategy) -> None:
    """Before loading: count at this namespace's listeners only (those sock_diag lists, whose overflows
    TcpExt ListenOverflows counts); fentry only where the kernel has bpf_get_func_ret, the tracepoint
    strategy only where it names listen overflows as a drop reason (either program's load would fail
    there, its verifier's log naming neither)."""
    obj.set_rodata(netns_inum=os.stat("/proc/self/ns/net").st_ino)
    if strategy.name == "fentry" and "BPF_FUNC_get_func_ret" not in _kernel_enum("bpf_func_id"):
        raise BpfError(errno.EOPNOTSUPP, "the kernel lacks bpf_get_func_ret (5.17), which reads the return "
                                         "values of tcp_v{4,6}_syn_recv_sock and inet_csk_accept at fexit")
    if strategy.name == "tracepoint" and LISTEN_OVERFLOW_REASON not in _kernel_enum("skb_drop_reason"):
        raise BpfError(errno.EOPNOTSUPP, f"the kernel has no drop reason {LISTEN_OVERFLOW_REASON} (6.15+)")


def _kernel_enum(name: str) -> list[str]:
    """The enumerators of the kernel's `enum name` (BTF), none where it has no such enum; a strategy
    that needs them cannot run where its BTF cannot be read."""
    try:
        return kernel_enum_names(name)
    except KeyError:
        return []
    except OSError as exc:
        raise BpfError(errno.EOPNOTSUPP, f"cannot read the kernel's enum {name}: {exc}") from None


class ListenerOwners:
    """Socket inode -> owning pid, kept while the socket listens and its owner lives: a scan reads every
    process's descriptors, so it runs only for inodes not yet found, and for those a scan missed only
    once their wait is over (OWNER_RESCAN_SECONDS, doubled at each miss)."""

    def __init__(self) -> None:
        self._pids: dict[int, int] = {}
        self._missed: dict[int, tuple[float, float]] = {}  # inode -> (when to look again, the wait before it)

    def of(self, inodes: set[int], now: float) -> dict[int, int]:
        self._pids = {i: pid for i, pid in self._pids.items() if i in inodes and os.path.exists(f"/proc/{pid}")}
        self._missed = {i: missed for i, missed in self._missed.items() if i in inodes}
        wanted = {i for i in inodes - self._pids.keys() if i not in self._missed or now >= self._missed[i][0]}
        if wanted:
            found = sockdiag.owners(wanted)
            self._pids |= found
            for inode in wanted - found.keys():
                wait = min(2 * self._missed[inode][1], OWNER_RESCAN_MAX_SECONDS) if inode in self._missed \
                    else OWNER_RESCAN_SECONDS
                self._missed[inode] = (now + wait, wait)
        return {i: self._pids[i] for i in inodes if i in self._pids}


class ListenerIndex:
    """The listener a request or an accepted connection belongs to: the one of its local address and
    port, else the wildcard one of its family, else a dual-stack ::; a reuseport group's first socket
    takes them all (the kernel does not say which of the group holds one). A socket whose local port no
    one listens on (a client's) belongs to none."""

    def __init__(self, listeners: Iterable[sockdiag.DiagSocket]) -> None:
        self._by_key: dict[tuple[int, str, int], int] = {}
        for listener in listeners:
            self._by_key.setdefault((listener.family, listener.local_address, listener.local_port), listener.cookie)

    def of(self, s: sockdiag.DiagSocket) -> int | None:
        """The cookie of `s`'s listener, None without one."""
        wildcard = "0.0.0.0" if s.family == socket.AF_INET else "::"
        for key in ((s.family, s.local_address, s.local_port), (s.family, wildcard, s.local_port),
                    (socket.AF_INET6, "::", s.local_port)):
            if key in self._by_key:
                return self._by_key[key]
        return None


def half_open_by_listener(requests: Iterable[sockdiag.DiagSocket],
                          listeners: list[sockdiag.DiagSocket]) -> dict[int, int]:
    """Requests in SYN_RECV per listener cookie (ListenerIndex)."""
    index = ListenerIndex(listeners)
    counts: dict[int, int] = {}
    for request in requests:
        if (cookie := index.of(request)) is not None:
            counts[cookie] = counts.get(cookie, 0) + 1
    return counts


@dataclass
class PathQuality:
    """One listener's accepted connections: their smoothed RTTs, sampled at each read (`now`: this
    read's, in kernel slots), and their retransmitted segments since the probe started."""

    slots: list[int]  # every read's RTT samples since the probe started, in kernel slots
    now: list[int]
    connections: int = 0
    retransmitted: int = 0
    sum_seconds: float = 0.0  # of the RTT samples in `slots`

    @classmethod
    def empty(cls) -> PathQuality:
        return cls([0] * hist_slots(), [0] * hist_slots())


class PathQualities:
    """Path quality per listener cookie from each read's connected sockets. A connection's retransmits
    count from the first read (those before it are its history, not the probe's) or from when a later
    read first sees it; its last total is kept by socket cookie, for connections of the latest dump
    only, so what it retransmits after its last read before closing is lost."""

    def __init__(self) -> None:
        self._retransmits: dict[int, int] = {}  # connection cookie -> its total_retrans at the last read
        self._listeners: dict[int, PathQuality] = {}
        self._first = True

    def read(self, listeners: list[sockdiag.DiagSocket],
             connections: Iterable[sockdiag.DiagSocket]) -> dict[int, PathQuality]:
        index = ListenerIndex(listeners)
        kept = {s.cookie: self._listeners.get(s.cookie) or PathQuality.empty() for s in listeners}
        for quality in kept.values():
            quality.now = [0] * len(quality.now)
            quality.connections = 0
        retransmits: dict[int, int] = {}
        for connection in connections:
            cookie = index.of(connection)
            if connection.info is None and connection.cookie in self._retransmits:
                retransmits[connection.cookie] = self._retransmits[connection.cookie]  # not counted anew next time
            if cookie is None or connection.info is None:
                continue
            quality, info = kept[cookie], connection.info
            quality.connections += 1
            retransmits[connection.cookie] = info.total_retrans
            before = self._retransmits.get(connection.cookie, info.total_retrans if self._first else 0)
            quality.retransmitted += max(info.total_retrans - before, 0)
            if connection.state == sockdiag.TCP_ESTABLISHED and info.rtt_us > 0:
                slot = slot_of_nanoseconds(info.rtt_us * 1000, len(quality.now))
                quality.now[slot] += 1
                quality.slots[slot] += 1
                quality.sum_seconds += info.rtt_us / 1e6
        self._retransmits, self._listeners, self._first = retransmits, kept, False
        return kept


def _group_sizes(listeners: list[sockdiag.DiagSocket]) -> dict[tuple[int, str, int], int]:
    sizes: dict[tuple[int, str, int], int] = {}
    for s in listeners:
        key = (s.family, s.local_address, s.local_port)
        sizes[key] = sizes.get(key, 0) + 1
    return sizes


def _timed(record: Listener, name: str, hist: Any) -> None:
    """A `struct hist` of the listener's entry (None: no entry yet) into its fields `<name>_*`."""
    if hist is None:
        setattr(record, f"{name}_histogram", no_observations())
        return
    fine = kernel_buckets(hist.slots)
    setattr(record, f"{name}_sum_seconds", hist.sum_ns / NS_PER_SECOND)
    setattr(record, f"{name}_p50_seconds", quantile(fine, 0.5))
    setattr(record, f"{name}_p99_seconds", quantile(fine, 0.99))
    setattr(record, f"{name}_histogram", exported_buckets(fine))


def _path(record: Listener, quality: PathQuality) -> None:
    """A listener's connections and their RTTs (quantiles of this read's) and retransmits into its record."""
    now, since_start = kernel_buckets(quality.now), kernel_buckets(quality.slots)
    record.connections = quality.connections
    record.retransmitted_segments = quality.retransmitted
    record.rtt_p50_seconds = quantile(now, 0.5)
    record.rtt_p99_seconds = quantile(now, 0.99)
    record.rtt_histogram = exported_buckets(since_start)
    record.rtt_sum_seconds = quality.sum_seconds


def _measured(record: Listener, stats: Any) -> None:
    """Fill a listener's counts from its `listeners` entry (zero when the hooks saw nothing of it)."""
    record.overflows = stats.overflows if stats is not None else 0
    record.accepted = stats.accepted if stats is not None else 0
    _timed(record, "accept_wait", stats.accept_wait if stats is not None else None)
    _timed(record, "handshake", stats.handshake if stats is not None else None)


class ConnectionsProbe(Probe):
    """Listeners from sock_diag at each read, with the BPF counts where a strategy loaded."""

    def __init__(self, strategies: tuple[Strategy, ...] = STRATEGIES,
                 path_interval: float = PATH_QUALITY_SECONDS) -> None:
        super().__init__()
        self._strategies = strategies
        self._owners = ListenerOwners()
        self._paths = PathQualities()
        self._path_interval = path_interval
        self._next_paths = 0.0  # monotonic time of the next dump of the connection table
        self._latest_paths: dict[int, PathQuality] = {}
        self._latest_half_open: dict[int, int] = {}
        self._skipped: dict[str, str] = {}
        self._diag_only = False
        self._seen: set[int] = set()  # cookies listening at the previous read
        self._retired_overflows = 0  # of entries deleted: listeners that closed
        self._listener_count = 0

    def start(self) -> None:
        try:
            sockdiag.listening()
        except OSError as exc:
            raise ProbeUnavailable(SPEC.name, {SOCK_DIAG: f"sock_diag: {exc}"}) from None
        with_bpf = tuple(s for s in self._strategies if s.programs)
        self._diag_only = not with_bpf
        if with_bpf:
            try:
                self.loaded = self.loading().load(SPEC, with_bpf)
            except ProbeUnavailable as exc:
                if not any(s.name == SOCK_DIAG for s in self._strategies):
                    raise
                self._skipped, self._diag_only = exc.reasons, True

    def loading(self) -> Loading:
        return Loading(self._strategies, _configure)

    @property
    def strategy(self) -> str | None:
        return SOCK_DIAG if self._diag_only else super().strategy

    @property
    def skipped(self) -> dict[str, str]:
        return self._skipped or super().skipped

    def status(self) -> ProbeStatus:
        if self._diag_only:
            return ProbeStatus(True, SOCK_DIAG, STRATEGIES[-1].span)
        return super().status()

    def close(self) -> None:
        self._diag_only = False
        super().close()

    def read(self) -> ConnectionsSnapshot:
        listeners = sorted(sockdiag.listening(), key=lambda s: (s.local_port, s.family, s.local_address, s.inode))
        groups = _group_sizes(listeners)
        owners = self._owners.of({s.inode for s in listeners}, time.monotonic())
        stats = self._stats({s.cookie for s in listeners})
        paths, half_open = self._connection_table(listeners)
        records = []
        for s in listeners:
            pid = owners.get(s.inode)
            record = Listener(
                family=sockdiag.FAMILIES[s.family], local_address=s.local_address, local_port=s.local_port,
                queue_length=s.receive_queue, queue_capacity=s.send_queue, half_open=half_open.get(s.cookie, 0),
                inode=s.inode, cookie=s.cookie, pid=pid, comm=process_name(pid) if pid is not None else "",
                reuseport_group=groups[(s.family, s.local_address, s.local_port)])
            _path(record, paths.get(s.cookie) or PathQuality.empty())
            if stats is not None:
                _measured(record, stats.get(s.cookie))
            records.append(record)
        self._listener_count = len(records)
        unattributed = self._retired_overflows + (stats[0].overflows if stats and 0 in stats else 0)
        return ConnectionsSnapshot(time.time(), records, unattributed)

    def _connection_table(self, listeners: list[sockdiag.DiagSocket]) -> tuple[dict[int, PathQuality], dict[int, int]]:
        """Each listener's path quality and half-open requests: from a new dump of the connection table
        once its interval is over, else the latest (a listener opened since has none yet)."""
        if time.monotonic() >= self._next_paths:
            table = sockdiag.connection_table()
            self._latest_paths = self._paths.read(listeners, (s for s in table if s.state != sockdiag.TCP_SYN_RECV))
            self._latest_half_open = half_open_by_listener((s for s in table if s.state == sockdiag.TCP_SYN_RECV),
                                                           listeners)
            self._next_paths = time.monotonic() + self._path_interval
        return self._latest_paths, self._latest_half_open

    def _stats(self, listening: set[int]) -> dict[int, Any] | None:
        """The `listeners` table by cookie (None without BPF). An entry of a socket that listened at
        neither this read nor the previous one is deleted, its overflows kept as unattributed."""
        if self.loaded is None:
            return None
        table = self.loaded.obj.maps["listeners"]
        stats = {key.value: value for key, value in table.items()}
        for cookie in set(stats) - listening - self._seen - {0}:
            gone = table.pop(cookie)
            self._retired_overflows += gone.overflows if gone is not None else 0
        self._seen = listening
        return stats

    def map_usage(self) -> list[MapUsage]:
        if self.loaded is None:
            return []
        full = self.loaded.obj.maps["counters"].lookup([*COUNTERS].index("listeners_full"))
        return [MapUsage("listeners", self._listener_count, self.loaded.obj.maps["listeners"].max_entries,
                         full.value if full is not None else 0)]


LISTENER_LABELS = (("address", "local_address"), ("port", "local_port"), *PROCESS_LABELS)


def _listener(name: str, kind: str, help_text: str, value: str, **extra: Any) -> Family:
    return Family(name, kind, help_text, Listener, value, LISTENER_LABELS, **extra)


SPEC = ProbeSpec(
    name="connections",
    description="connection set-up per listening socket: accept queues, half-open requests, overflows, accept wait, "
                "RTT and retransmits of its connections",
    strategies=STRATEGIES,
    bpf_object=OBJECT,
    order=55,
    factory=_from_config,
    command="aiprobe.probes.connections.command:command",
    metrics=(
        _listener("aiprobe_listen_queue_length", "gauge",
                  "Connections complete and waiting for accept() in a listening socket's accept queue (sock_diag).",
                  "queue_length"),
        _listener("aiprobe_listen_queue_capacity", "gauge",
                  "The accept queue's capacity in force (listen()'s backlog, capped by net.core.somaxconn); the "
                  "queue overflows above it.", "queue_capacity"),
        _listener("aiprobe_listen_half_open_connections", "gauge",
                  "Connection requests in SYN_RECV at a listener's address and port (a reuseport group's first "
                  "socket holds its group's), at the latest dump of the connection table (every 10 s at most).",
                  "half_open"),
        _listener("aiprobe_listen_overflows_total", "counter",
                  "Connections a listener's full accept queue dropped (SYN or last ACK); summed over listeners, the "
                  "host's TcpExt ListenOverflows.", "overflows", per_identity=True),
        _listener("aiprobe_listen_accepted_connections_total", "counter",
                  "Connections accept() returned from a listener.", "accepted", per_identity=True),
        _listener("aiprobe_listen_connections", "gauge",
                  "Connected sockets a listener accepted, open now (sock_diag: ESTABLISHED and the closing states "
                  "that may still send).", "connections"),
        _listener("aiprobe_tcp_rtt_seconds", "histogram",
                  "Smoothed RTT (tcp_info tcpi_rtt) of a listener's ESTABLISHED connections, sampled at each agent "
                  "refresh: one observation per connection per refresh (sock_diag).",
                  "rtt_histogram", sum_field="rtt_sum_seconds", per_identity=True, buckets=FAST_BOUNDS),
        _listener("aiprobe_listen_retransmitted_segments_total", "counter",
                  "Segments a listener's accepted connections retransmitted (tcp_info tcpi_total_retrans, from each "
                  "connection's first refresh on; what one retransmits after its last refresh before it closes is "
                  "lost); beside the host's aiprobe_tcp_retransmitted_segments_total.",
                  "retransmitted_segments", per_identity=True),
        _listener("aiprobe_accept_wait_seconds", "histogram",
                  "How long connections waited in the accept queue: handshake complete to accept() returning them.",
                  "accept_wait_histogram", sum_field="accept_wait_sum_seconds", per_identity=True,
                  buckets=FAST_BOUNDS),
        _listener("aiprobe_tcp_handshake_seconds", "histogram",
                  "Server side of TCP handshakes: the first SYN-ACK sent to the handshake complete (the client's "
                  "ACK, or with TCP_DEFER_ACCEPT its first data); connections from SYN cookies left out.",
                  "handshake_histogram", sum_field="handshake_sum_seconds", per_identity=True,
                  buckets=FAST_BOUNDS),
        Family("aiprobe_reuseport_imbalance_ratio", "gauge",
               "Listeners sharing an address and port (SO_REUSEPORT): the busiest socket's share of the connections "
               "accepted in the last 10 s over the mean share (1: even); absent without accepts.",
               ReuseportGroup, "imbalance_ratio", (("address", "local_address"), ("port", "local_port"))),
        Family("aiprobe_listen_unattributed_overflows_total", "counter",
               "Overflows at listeners that closed, or opened after the agent's last read.",
               ConnectionsSnapshot, "unattributed_overflows"),
    ),
    hooks=ConnectionsHooks(),
    rules=(ACCEPT_QUEUE_SATURATED, REUSEPORT_IMBALANCE),
    views=(VIEW,),
)
