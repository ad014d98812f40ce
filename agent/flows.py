"""Per-flow throughput: XDP counts what arrives, tc counts what leaves (bpf/flows.bpf.c).

`FlowsProbe` attaches both programs to every selected interface (following interfaces that come
and go), and `read()` turns the flow table into `FlowRecord`s with rates over the interval
since the previous read. Idle flows expire here, in user space; when the table runs full the
stalest flows are evicted and counted. Interface totals add the flows that expired or were evicted
and the frames no flow could hold, so they stay exact and monotonic: the numbers behind
`aiprobe_interface_bytes_total`.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from fnmatch import fnmatch
from typing import TYPE_CHECKING, Any

from .deltas import Deltas
from .libbpf import BpfError
from .loader import (
    BpfObject,
    Link,
    Program,
    Strategy,
    load_first,
    program_name,
    tc_clsact_detach,
    tc_clsact_query,
)
from .metrics import Family
from .model import FlowRecord, FlowsSnapshot, InterfaceAttachment, InterfaceTotals, MapUsage
from .names import ip_text
from .netlink import LinkInfo, LinkWatcher, xdp_program_id
from .probes import Probe, ProbeSpec

if TYPE_CHECKING:
    from collections.abc import Mapping

    from .config import Config

log = logging.getLogger(__name__)

XDP_PROGRAM = "flows_xdp"
TC_PROGRAM = "flows_tc"
PROGRAMS = (XDP_PROGRAM, TC_PROGRAM)



def _from_config(config: Config, _running: Mapping[str, Probe]) -> Probe:
    return FlowsProbe(interfaces=list(config.interfaces), exclude=list(config.exclude),
                      idle_timeout=config.flow_idle_seconds, strategy=config.strategies.get("flows"))


FLOW_LABELS = tuple((name, name) for name in (
    "interface", "direction", "protocol", "local_address", "local_port", "remote_address", "remote_port"))
_SIDE = (("interface", "interface"), ("direction", "direction"))
# What `aiprobe_flow_*` sum the flows outside the top K into, per interface and direction.
_OTHER = (("protocol", ""), ("local_address", ""), ("local_port", ""), ("remote_address", "other"),
          ("remote_port", ""))
METRICS = (
    Family("aiprobe_flow_bytes_total", "counter", "Bytes of a flow (L2 frame lengths as seen at XDP / tc), top "
           "flows by rate; the rest summed per interface and direction as remote_address=\"other\".",
           FlowRecord, "bytes", FLOW_LABELS, top_by="bytes_per_second", rest=_OTHER),
    Family("aiprobe_flow_packets_total", "counter", "Packets of a flow; same selection as aiprobe_flow_bytes_total.",
           FlowRecord, "packets", FLOW_LABELS, top_by="bytes_per_second", rest=_OTHER),
    Family("aiprobe_interface_bytes_total", "counter",
           "Bytes seen on an interface, expired and evicted flows included.", InterfaceTotals, "bytes", _SIDE),
    Family("aiprobe_interface_packets_total", "counter", "Packets seen on an interface.", InterfaceTotals,
           "packets", _SIDE),
    Family("aiprobe_flow_tcp_flags_total", "counter", "TCP segments with SYN, FIN or RST (`flag` = syn, fin, rst).",
           FlowRecord, labels=_SIDE, per_identity=True, expand_label="flag",
           expand=(("syn", "tcp_syn"), ("fin", "tcp_fin"), ("rst", "tcp_rst"))),
)

SPEC = ProbeSpec(
    name="flows",
    description="per-flow bytes and packets: XDP ingress, tc egress",
    strategies=(
        Strategy("xdp+tcx", PROGRAMS, ("xdp_link", "tcx"), span="L2 frames at XDP (ingress) and tc (egress)"),
        Strategy("xdp+clsact", PROGRAMS, ("xdp_link", "tc_clsact"),
                 span="L2 frames at XDP (ingress) and tc clsact (egress)"),
    ),
    bpf_object="flows",
    order=10,
    factory=_from_config,
    config_keys=("interfaces", "exclude", "flow_idle_seconds", "top_flows"),
    command="aiprobe.commands.flows:command",
    metrics=METRICS,
)
# How each strategy attaches the egress program.
TC_MODES = {"xdp+tcx": "tcx", "xdp+clsact": "clsact"}
# Our clsact filter's identity: only a filter with both, running our program, is ever removed.
TC_HANDLE = 0xA1B0
TC_PRIORITY = 0xA1B0

DEFAULT_MAX_FLOWS = 16384
# Above EVICT_ABOVE of capacity, the stalest flows are evicted down to EVICT_TO, so new flows
# find room in the kernel instead of failing to insert.
EVICT_ABOVE = 0.9
EVICT_TO = 0.8
DIRECTIONS = ("ingress", "egress")  # indexed by enum flow_direction (bpf/flows.h)
PROTOCOLS = {1: "icmp", 2: "igmp", 6: "tcp", 17: "udp", 47: "gre", 50: "esp", 51: "ah", 58: "icmpv6", 132: "sctp"}
_FOREIGN_XDP = (errno.EEXIST, errno.EBUSY)


@dataclass
class _Unattributed:
    """Frames of one interface and direction that are in no flow (struct iface_counters, summed)."""

    FIELDS = ("packets", "bytes", "insert_failures", "malformed")
    packets: int
    bytes: int
    insert_failures: int
    malformed: int


@dataclass
class InterfaceFilter:
    """Which interfaces to watch: glob lists; by default every interface but loopback."""

    include: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)

    def wants(self, link: LinkInfo) -> bool:
        if any(fnmatch(link.name, glob) for glob in self.exclude):
            return False
        if self.include:
            return any(fnmatch(link.name, glob) for glob in self.include)
        return not link.loopback


# --- attaching to one interface ---


def _foreign_xdp_reason(ifindex: int, exc: BpfError) -> str:
    prog_id = xdp_program_id(ifindex)
    if prog_id is None:
        return str(exc)
    return f"another XDP program holds the interface ({program_name(prog_id)!r}, id {prog_id}); left in place"


def _attach_xdp(program: Program, link: LinkInfo, state: InterfaceAttachment) -> Link | None:
    """Native mode where the driver has it, else generic; never over someone else's program."""
    errors = []
    for mode in ("native", "generic"):
        try:
            attached = program.attach_xdp(link.index, mode)
        except BpfError as exc:
            if exc.errno in _FOREIGN_XDP:
                state.xdp_error = _foreign_xdp_reason(link.index, exc)
                return None
            errors.append(f"{mode}: {exc}")
            continue
        state.xdp = mode
        return attached
    state.xdp_error = "; ".join(errors)
    return None


def remove_stale_tc_filter(link: LinkInfo) -> None:
    """A filter with our handle and priority that runs our program was left by a run that could not
    detach (SIGKILL, crash): netlink attachments outlive their process. Remove it, say so; refuse
    to touch one that runs anything else."""
    prog_id = tc_clsact_query(link.index, "egress", handle=TC_HANDLE, priority=TC_PRIORITY)
    if prog_id is None:
        return
    owner = program_name(prog_id)
    if owner is not None and owner != TC_PROGRAM:
        raise BpfError(errno.EEXIST, f"clsact handle {TC_HANDLE:#x} priority {TC_PRIORITY} on {link.name} "
                       f"runs another program ({owner!r}, id {prog_id})")
    tc_clsact_detach(link.index, "egress", handle=TC_HANDLE, priority=TC_PRIORITY)
    log.warning("removed a stale aiprobe tc filter (program id %d) from %s, left by an earlier run", prog_id, link.name)


def _attach_tc(program: Program, link: LinkInfo, mode: str, state: InterfaceAttachment) -> Link | None:
    try:
        if mode == "tcx":
            attached = program.attach_tcx(link.index, "egress")
        else:
            remove_stale_tc_filter(link)
            attached = program.attach_tc_clsact(link.index, "egress", handle=TC_HANDLE, priority=TC_PRIORITY)
    except BpfError as exc:
        state.tc_error = str(exc)
        return None
    state.tc = mode
    return attached


@dataclass
class _Attached:
    state: InterfaceAttachment
    links: list[Link]


def _attach_interface(obj: BpfObject, link: LinkInfo, tc_mode: str) -> _Attached:
    state = InterfaceAttachment(link.name, link.index)
    if not link.ethernet:
        state.xdp_error = state.tc_error = "not an Ethernet interface: frames carry no Ethernet header"
        return _Attached(state, [])
    links = [
        _attach_xdp(obj.programs[XDP_PROGRAM], link, state),
        _attach_tc(obj.programs[TC_PROGRAM], link, tc_mode, state),
    ]
    return _Attached(state, [x for x in links if x is not None])


# --- accounting between reads ---


@dataclass
class _Ledger:
    """What read() remembers: last totals per flow (for rates), and counts of flows gone from the map."""

    deltas: Deltas = field(default_factory=Deltas)  # per flow key: (bytes, packets) for rates
    retired_bytes: Counter = field(default_factory=Counter)  # (ifindex, direction) -> bytes
    retired_packets: Counter = field(default_factory=Counter)
    retired_failures: int = 0
    retired_malformed: int = 0
    evictions: int = 0
    last_read_ns: int = 0

    def retire(self, key: Any, counters: Any) -> None:
        where = (key.ifindex, key.direction)
        self.retired_bytes[where] += counters.bytes
        self.retired_packets[where] += counters.packets

    def forget(self, ifindex: int) -> None:
        for where in [w for w in self.retired_bytes if w[0] == ifindex]:
            del self.retired_bytes[where], self.retired_packets[where]


class FlowsProbe(Probe):
    """XDP ingress + tc egress flow accounting on the selected interfaces."""

    spec = SPEC

    def __init__(
        self,
        interfaces: list[str] | None = None,
        exclude: list[str] | None = None,
        idle_timeout: float = 30.0,
        max_flows: int = DEFAULT_MAX_FLOWS,
        strategy: str | None = None,
    ) -> None:
        super().__init__()
        self.filter = InterfaceFilter(list(interfaces or []), list(exclude or []))
        self.idle_timeout = idle_timeout
        self.max_flows = max_flows
        self._strategies = tuple(s for s in SPEC.strategies if strategy in (None, s.name))
        if not self._strategies:
            raise ValueError(f"unknown flows strategy {strategy!r}; one of {', '.join(TC_MODES)}")
        self._lock = threading.Lock()
        self._attached: dict[int, _Attached] = {}
        self._watcher: LinkWatcher | None = None
        self._ledger = _Ledger()
        self._flow_count = 0

    # --- life cycle ---

    def start(self) -> None:
        watcher = LinkWatcher(self._on_link, self._on_removed)
        links = watcher.start()
        try:
            self.loaded = load_first(
                SPEC.name, SPEC.bpf_object, self._strategies,
                configure=lambda obj, _s: setattr(obj.maps["flows"], "max_entries", self.max_flows),
                attach=lambda obj, strategy: self._attach_initial(obj, strategy, links),
            )
        except BaseException:
            watcher.stop()
            raise
        self._ledger.last_read_ns = time.monotonic_ns()
        self._watcher = watcher
        watcher.run_in_background()

    def _attach_initial(self, obj: BpfObject, strategy: Strategy, links: list[LinkInfo]) -> None:
        wanted = [link for link in links if link.up and self.filter.wants(link)]
        attached = {link.index: _attach_interface(obj, link, TC_MODES[strategy.name]) for link in wanted}
        tried = [attached[link.index].state for link in wanted if link.ethernet]
        if tried and not any(s.tc for s in tried):
            # The egress hook failed everywhere: this kernel lacks the strategy, try the next one.
            raise BpfError(errno.EOPNOTSUPP, f"{TC_MODES[strategy.name]} attach: {tried[0].tc_error}")
        self._attached = attached

    def close(self) -> None:
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.stop()
        with self._lock:
            self._attached = {}
        super().close()

    # --- interfaces coming and going (watcher thread) ---

    def _on_link(self, link: LinkInfo) -> None:
        with self._lock:
            if self.loaded is None:
                return
            known = self._attached.get(link.index)
            if known is not None:
                known.state.interface = link.name  # renames keep the attachment
                return
            if link.up and self.filter.wants(link):
                self._attached[link.index] = _attach_interface(
                    self.loaded.obj, link, TC_MODES[self.loaded.strategy.name]
                )
                log.info("attached to %s", self._attached[link.index].state.describe())

    def _on_removed(self, ifindex: int) -> None:
        with self._lock:
            gone = self._attached.pop(ifindex, None)
            if gone is None or self.loaded is None:
                return
            for link in gone.links:
                self.loaded.obj.release(link)
            self._ledger.forget(ifindex)

    def attachments(self) -> list[InterfaceAttachment]:
        with self._lock:
            return [a.state for a in self._attached.values()]

    # --- reading ---

    def read(self) -> FlowsSnapshot:
        if self.loaded is None:
            raise RuntimeError("FlowsProbe.read() before start()")
        obj = self.loaded.obj
        now_ns = time.monotonic_ns()
        with self._lock:
            names = {index: a.state.interface for index, a in self._attached.items()}
            attachments = [a.state for a in self._attached.values()]
        live = self._live_flows(obj, names)
        self._drop_stale(obj, live, now_ns)
        interval = max(now_ns - self._ledger.last_read_ns, 1) / 1e9
        to_wall = time.time() - time.monotonic()
        flows = [self._record(raw, key, c, names, interval, to_wall) for raw, (key, c) in live.items()]
        flows.sort(key=lambda f: (f.bytes_per_second, f.bytes), reverse=True)
        self._ledger.deltas.end_round()
        self._ledger.last_read_ns = now_ns
        self._flow_count = len(live)
        unattributed = self._unattributed(obj, names)
        return FlowsSnapshot(
            timestamp=time.time(),
            interval_seconds=interval,
            flows=flows,
            interfaces=self._interface_totals(live, unattributed, names),
            evictions=self._ledger.evictions,
            insert_failures=self._ledger.retired_failures + sum(v.insert_failures for v in unattributed.values()),
            malformed_frames=self._ledger.retired_malformed + sum(v.malformed for v in unattributed.values()),
            attachments=attachments,
        )

    def _live_flows(self, obj: BpfObject, names: dict[int, str]) -> dict[bytes, tuple[Any, Any]]:
        """The flow table (struct flow_counters per flow); flows of interfaces we no longer watch
        are deleted."""
        flows_map = obj.maps["flows"]
        live, orphans = {}, []
        for key, counters in flows_map.items():
            if key.ifindex in names:
                live[bytes(key)] = (key, counters)
            else:
                orphans.append(key)
        flows_map.delete_keys(orphans)
        return live

    def _drop_stale(self, obj: BpfObject, live: dict[bytes, tuple[Any, Any]], now_ns: int) -> None:
        """Expire idle flows; if the table is nearly full, evict the stalest. Their counts move to
        the interface totals, so nothing they counted is lost."""
        idle_ns = int(self.idle_timeout * 1e9)
        expired = [raw for raw, (_k, c) in live.items() if now_ns - c.last_seen_ns > idle_ns]
        remaining = len(live) - len(expired)
        evicted: list[bytes] = []
        if remaining > EVICT_ABOVE * self.max_flows:
            expired_set = set(expired)
            by_age = sorted((raw for raw in live if raw not in expired_set), key=lambda r: live[r][1].last_seen_ns)
            evicted = by_age[: remaining - int(EVICT_TO * self.max_flows)]
        self._ledger.evictions += len(evicted)
        for raw in [*expired, *evicted]:
            key, counters = live.pop(raw)
            obj.maps["flows"].delete(key)
            self._ledger.retire(key, counters)

    def _record(self, raw: bytes, key: Any, c: Any, names: dict[int, str], interval: float,
                to_wall: float) -> FlowRecord:
        added_bytes, added_packets = self._ledger.deltas.increase(raw, (c.bytes, c.packets))
        return FlowRecord(
            interface=names[key.ifindex],
            direction=DIRECTIONS[key.direction],
            protocol=PROTOCOLS.get(key.protocol, str(key.protocol)),
            local_address=ip_text(bytes(key.local_addr), key.family == 6),
            local_port=key.local_port,
            remote_address=ip_text(bytes(key.remote_addr), key.family == 6),
            remote_port=key.remote_port,
            bytes=c.bytes,
            packets=c.packets,
            bytes_per_second=added_bytes / interval,
            packets_per_second=added_packets / interval,
            cgroup_id=c.cgroup_id,
            first_seen=to_wall + c.first_seen_ns / 1e9,
            last_seen=to_wall + c.last_seen_ns / 1e9,
            tcp_syn=c.tcp_syn,
            tcp_fin=c.tcp_fin,
            tcp_rst=c.tcp_rst,
        )

    def _unattributed(self, obj: BpfObject, names: dict[int, str]) -> dict[tuple[int, int], _Unattributed]:
        """Frames in no flow, per (ifindex, direction); entries of vanished interfaces are folded
        into the global failure counts and deleted."""
        unattributed_map = obj.maps["unattributed"]
        out: dict[tuple[int, int], _Unattributed] = {}
        for key, per_cpu in unattributed_map.items():
            counts = _Unattributed(*(sum(getattr(v, name) for v in per_cpu) for name in _Unattributed.FIELDS))
            if key.ifindex in names:
                out[(key.ifindex, key.direction)] = counts
                continue
            self._ledger.retired_failures += counts.insert_failures
            self._ledger.retired_malformed += counts.malformed
            unattributed_map.delete(key)
        return out

    def _interface_totals(
        self, live: dict[bytes, tuple[Any, Any]], unattributed: dict[tuple[int, int], _Unattributed],
        names: dict[int, str],
    ) -> list[InterfaceTotals]:
        byte_totals, packet_totals = Counter(self._ledger.retired_bytes), Counter(self._ledger.retired_packets)
        for key, c in live.values():
            byte_totals[(key.ifindex, key.direction)] += c.bytes
            packet_totals[(key.ifindex, key.direction)] += c.packets
        for where, extra in unattributed.items():
            byte_totals[where] += extra.bytes
            packet_totals[where] += extra.packets
        return [
            InterfaceTotals(name, DIRECTIONS[d], byte_totals[(index, d)], packet_totals[(index, d)])
            for index, name in sorted(names.items(), key=lambda item: item[1])
            for d in range(len(DIRECTIONS))
        ]

    def map_usage(self) -> list[MapUsage]:
        return [MapUsage("flows", self._flow_count, self.max_flows)]
