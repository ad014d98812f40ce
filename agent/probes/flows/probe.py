"""Per-flow throughput at tc ingress and egress, counted as wire frames (bpf/flows.bpf.c).

`FlowsProbe` attaches tc programs (TCX, clsact where the kernel lacks it) to both directions of
every selected interface (following interfaces that come and go), and `read()` turns the flow table
into `FlowRecord`s with rates over the interval since the previous read: of every flow, or of the
`top` fastest, idle flows filling the rest (the agent's: an idle flow keeps its record, so a long-lived
connection stays in the snapshot between its requests). A read's cost follows what changed, not what
the table holds: it copies the table in raw batches, touches in Python only the flows stamped since
its previous read (table.py) and makes `top` records at most; a scrape reads again only
the flows of the latest records. Several aiprobes may watch one interface (the agent, an engineer's
`aiprobe flows`): TCX links stack; under clsact each has a filter handle of its own, and only a
filter of ours whose program no process holds (left by a killed run: netlink attachments outlive
their process) is removed.

Why tc and not XDP by default: tc leaves the data path as it is. Ingress tc sees skbs after GRO
(one program run per batch of segments, each counted), egress tc sees them before GSO, and neither
changes a device's offloads. XDP is opt-in per interface (`xdp_interfaces`), native mode on
physical NICs only: its cost per frame is lower and it sees every frame before GRO, but attaching
it resets the receive queues on many NIC drivers (a link blip), and on virtual devices it slows
the traffic it watches: native XDP on a veth switches TSO/GSO off on its peer (every segment then
crosses the pair on its own: a third of the throughput here), and generic XDP linearizes each skb.

Packets and bytes are what crosses the wire: a GSO/GRO skb counts as its segments, each with its
own headers (bpf/flows.h). They match `/proc/net/snmp` segment counts; an interface counter that
counts skbs (veth, lo) is short by the extra segments and their headers.

Idle flows expire here, in user space; when the table runs full the stalest flows are evicted and
counted. Interface totals add the flows that expired or were evicted
and the frames no flow could hold, so they stay exact and monotonic: the numbers behind
`aiprobe_interface_bytes_total`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ... import libbpf
from ...btf import dtype_of
from ...features import helper_available, network_features
from ...libbpf import BpfError
from ...loader import (
    BpfObject,
    Link,
    Loaded,
    ProbeUnavailable,
    Program,
    Strategy,
    enum_labels,
    program_name,
    tc_clsact_detach,
    tc_clsact_query,
)
from ...metrics import Family, Series
from ...model import Identity, MapUsage, ProbeStatus
from ...names import ip_text
from ...netlink import LinkInfo, LinkWatcher, current_links, xdp_program_id
from ...registry import Loading, Probe, ProbeSpec
from ...supervisor import ATTACHMENTS, Backoff, attach_reason
from .hooks import SNAPSHOT_FLOWS, FlowsHooks
from .kernel import KernelFlows, size_flow_table
from .records import FlowRecord, FlowsSnapshot, InterfaceAttachment, InterfaceTotals
from .settings import FlowsSettings
from .table import KEY_FIELDS, SUMMED, VALUE_FIELDS, FlowTable, raw_keys
from .view import VIEW

if TYPE_CHECKING:
    from collections.abc import Callable

    from ...config import Config

log = logging.getLogger(__name__)

XDP_PROGRAM = "flows_xdp"  # loaded only where interfaces opted in to XDP (FlowsProbe's xdp_interfaces)
TC_PROGRAM_OF = {"ingress": "flows_ingress", "egress": "flows_egress"}  # kernel names: 15 chars at most
PROGRAMS = tuple(TC_PROGRAM_OF.values())


def _from_config(config: Config) -> Probe:
    settings = config.settings(FlowsSettings)
    return FlowsProbe(interfaces=list(settings.interfaces), exclude=list(settings.exclude),
                      idle_timeout=settings.flow_idle_seconds, max_flows=settings.max_flows,
                      strategy=config.strategies.get("flows"), xdp_interfaces=list(settings.xdp_interfaces),
                      top=max(settings.top_flows, SNAPSHOT_FLOWS), read_budget=READ_BUDGET)


FLOW_LABEL_NAMES = ("interface", "direction", "protocol", "local_address", "local_port", "remote_address",
                    "remote_port")
FLOW_LABELS = tuple((name, "") for name in FLOW_LABEL_NAMES)  # named only: TopFlows gives their values
_SIDE = (("interface", "interface"), ("direction", "direction"))


def _top_flows(field: str) -> Callable[[Config], Callable[[list[FlowsSnapshot]], list[Series]]]:
    return lambda config: TopFlows(config.settings(FlowsSettings).top_flows, field)


METRICS = (
    Family("aiprobe_flow_bytes_total", "counter",
           "Wire bytes of a flow (L2 frames, Ethernet header included; a GSO/GRO batch counts each segment with "
           "its headers) since it got its series: the top K flows by rate, sticky, and the rest per interface "
           "and direction as remote_address=\"other\", so the series sum to aiprobe_interface_bytes_total.",
           FlowsSnapshot, labels=FLOW_LABELS, series=_top_flows("bytes")),
    Family("aiprobe_flow_packets_total", "counter",
           "Wire packets (segments) of a flow; the same series as aiprobe_flow_bytes_total.",
           FlowsSnapshot, labels=FLOW_LABELS, series=_top_flows("packets")),
    Family("aiprobe_interface_bytes_total", "counter",
           "Wire bytes through an interface (as aiprobe_flow_bytes_total counts them), expired and evicted "
           "flows and frames in no flow included. A veth or lo counter counts a GSO batch as one packet "
           "with its headers once.", InterfaceTotals, "bytes", _SIDE),
    Family("aiprobe_interface_packets_total", "counter",
           "Wire packets (TCP/UDP segments, not skbs) through an interface; matches /proc/net/snmp segments.",
           InterfaceTotals, "packets", _SIDE),
    Family("aiprobe_flow_tcp_flags_total", "counter", "TCP segments with SYN, FIN or RST (`flag` = syn, fin, rst).",
           InterfaceTotals, labels=_SIDE, expand_label="flag",
           expand=(("syn", "tcp_syn"), ("fin", "tcp_fin"), ("rst", "tcp_rst"))),
    Family("aiprobe_flow_evictions_total", "counter",
           "Flows evicted from the full flow table to make room (their counts stay in the interface totals).",
           FlowsSnapshot, "evictions"),
    Family("aiprobe_flow_insert_failures_total", "counter",
           "New flows that found the flow table full (their frames count in the interface totals only).",
           FlowsSnapshot, "insert_failures"),
    Family("aiprobe_flow_lost_frames_total", "counter",
           "Frames counted nowhere, not even in the interface totals (the per-interface table was full).",
           FlowsSnapshot, "lost_frames"),
)

SPEC = ProbeSpec(
    name="flows",
    description="per-flow wire packets and bytes: tc ingress and egress (XDP ingress where opted in)",
    strategies=(
        Strategy("tcx", PROGRAMS, ("tcx",), span="wire frames at tc ingress (after GRO) and egress (before GSO)"),
        Strategy("clsact", PROGRAMS, ("tc_clsact",),
                 span="wire frames at tc clsact ingress (after GRO) and egress (before GSO)"),
    ),
    bpf_object="flows",
    order=10,
    factory=_from_config,
    settings=FlowsSettings,
    check_notes=lambda: _check_notes(),  # defined with the attach code below
    command="aiprobe.probes.flows.command:command",
    metrics=METRICS,
    read_at_scrape=True,
    hooks=FlowsHooks(),
    views=(VIEW,),
)
# Each strategy's name is how it attaches the tc programs: "tcx" or "clsact".
TC_MODES = tuple(s.name for s in SPEC.strategies)
# Our clsact filters' identity: priority TC_PRIORITY, one handle of TC_HANDLES per aiprobe running
# on the interface. Only a filter with both, running our program that no process holds, is ever removed.
TC_HANDLES = range(0xA1B0, 0xA1B0 + 16)
TC_PRIORITY = 0xA1B0

DEFAULT_MAX_FLOWS = 16384  # FlowsProbe's own (the CLI's, tests'); the agent's is FlowsSettings.max_flows
# How long a scrape waits for a read under way (seconds a large table's read can take on a busy node).
SCRAPE_WAIT_SECONDS = 0.25
# The agent's reads of the whole flow table pace themselves: the next is due once READ_BUDGET of one core
# has paid for the CPU time the last one took, MAX_READ_SECONDS apart at most. Reads in between read
# again only the flows of the latest records (as a scrape does): a table of 100k flows that all change
# each second costs what the budget allows, not a core's tenth.
READ_BUDGET = 0.01
MAX_READ_SECONDS = 30.0  # flow_idle_seconds' default: expiry lags one idle time at most
# Above EVICT_ABOVE of capacity, the stalest flows are evicted down to EVICT_TO, so new flows
# find room in the kernel instead of failing to insert.
EVICT_ABOVE = 0.9
EVICT_TO = 0.8
DIRECTIONS = enum_labels("flows", "flow_direction", "FLOW_")  # as enum flow_direction (bpf/flows.h) names them
# Rates are taken against the latest read at least this old, never over a sliver of time (a final
# read right after the last tick would read 0).
MIN_RATE_WINDOW_NS = 100_000_000
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


def _matches(name: str, globs: list[str]) -> bool:
    return any(fnmatch(name, glob) for glob in globs)


@dataclass
class InterfaceFilter:
    """Which interfaces to watch (glob lists; by default every interface but loopback), and where to
    count ingress with XDP instead of tc."""

    include: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)
    xdp: list[str] = field(default_factory=list)

    def wants(self, link: LinkInfo) -> bool:
        if _matches(link.name, self.exclude):
            return False
        if self.include:
            return _matches(link.name, self.include)
        return not link.loopback

    def wants_xdp(self, link: LinkInfo) -> bool:
        return _matches(link.name, self.xdp)


# --- attaching to one interface ---


def xdp_refusal(link: LinkInfo) -> str:
    """Why XDP must not count this interface's ingress, "" when it may (a physical NIC)."""
    if link.kind == "veth":
        return ("XDP refused on veth: native XDP switches TSO/GSO off on its peer and generic XDP "
                "linearizes every skb; ingress counted at tc")
    if link.kind or link.loopback:
        return f"XDP refused on a virtual device ({link.kind or 'loopback'}): no driver XDP; ingress counted at tc"
    return ""


CLOCK_MONOTONIC_COARSE = 6  # linux/time.h; bpf_ktime_get_coarse_ns()'s clock, which Python's time lacks


def xdp_multi_buffer() -> bool:
    """Whether this kernel runs XDP programs on multi-buffer frames (5.18+): bpf_xdp_get_buff_len came
    with BPF_F_XDP_HAS_FRAGS."""
    return helper_available(libbpf.BPF_PROG_TYPE_XDP, libbpf.BPF_FUNC_XDP_GET_BUFF_LEN)


def flow_clock() -> int:
    """The clock the programs stamp flows with (bpf/flows.bpf.c), and reads write as flows_clock:
    CLOCK_MONOTONIC_COARSE, or CLOCK_MONOTONIC where the kernel lacks bpf_ktime_get_coarse_ns (5.11)."""
    coarse = helper_available(libbpf.BPF_PROG_TYPE_SCHED_CLS, libbpf.BPF_FUNC_KTIME_GET_COARSE_NS)
    return CLOCK_MONOTONIC_COARSE if coarse else time.CLOCK_MONOTONIC


def enable_xdp(obj: BpfObject) -> None:
    """Load the XDP program too, taking multi-buffer frames where the kernel has them: only then
    does the kernel let it attach where the MTU exceeds a page. Without, it counts single-buffer
    frames (bpf/flows.bpf.c) and attaches up to a page's MTU."""
    program = obj.programs[XDP_PROGRAM]
    program.autoload = True
    if xdp_multi_buffer():
        program.flags |= libbpf.BPF_F_XDP_HAS_FRAGS


def _foreign_xdp_reason(ifindex: int, exc: BpfError) -> str:
    prog_id = xdp_program_id(ifindex)
    if prog_id is None:
        return str(exc)
    return f"another XDP program holds the interface ({program_name(prog_id)!r}, id {prog_id}); left in place"


def _check_notes() -> dict[str, tuple[str, list[str]]]:
    try:
        held = foreign_xdp_holders()
    except Exception as exc:  # netlink refused: say so in the list, check goes on
        held = [f"cannot list interfaces: {exc}"]
    return {"xdp_held_by_others": ("XDP hooks held by other programs (flows attaches there once they leave):",
                                   held)}


def foreign_xdp_holders() -> list[str]:
    """Interfaces whose XDP hook another program holds, as "eth0: 'name' (id N)": flows leaves them
    in place and attaches there once they leave (`aiprobe check` lists them)."""
    held = []
    for link in current_links():
        prog_id = xdp_program_id(link.index)
        if prog_id is not None and (name := program_name(prog_id)) != XDP_PROGRAM:
            held.append(f"{link.name}: {name!r} (id {prog_id})")
    return held


# Why each hook of one interface failed, (reason label, detail): counted and logged once per attempt.
_Failures = list[tuple[str, str]]


def _attach_xdp(program: Program, link: LinkInfo, state: InterfaceAttachment, failures: _Failures) -> Link | None:
    """Native mode only: generic XDP runs on skbs after GRO, slower than tc and blind to the
    segments of a batch. Never over someone else's program."""
    try:
        attached = program.attach_xdp(link.index, "native")
    except BpfError as exc:
        reason = _foreign_xdp_reason(link.index, exc) if exc.errno in _FOREIGN_XDP else f"native XDP: {exc}"
        state.xdp_refused = f"{reason}; ingress counted at tc"
        failures.append((attach_reason(exc), state.xdp_refused))
        return None
    state.ingress = "xdp"
    return attached


def programs_held_by_processes() -> set[int]:
    """Ids of the BPF programs that live processes hold descriptors of (their fdinfo's `prog_id:`)."""
    held = set()
    for fd in Path("/proc").glob("[0-9]*/fd/*"):
        with contextlib.suppress(OSError, StopIteration):  # processes and descriptors come and go
            if os.readlink(fd) == "anon_inode:bpf-prog":
                fdinfo = (fd.parent.parent / "fdinfo" / fd.name).read_text()
                held.add(int(next(line for line in fdinfo.splitlines() if line.startswith("prog_id:")).split()[1]))
    return held


class _HeldPrograms:
    """Whether a process holds a program. A clsact filter keeps its program loaded after its process
    is gone: one no process holds is a leftover, one still held belongs to a running aiprobe. A scan
    reads every process's descriptors, so a hit in a recent scan is trusted (one scan for a running
    aiprobe's filters on many interfaces) while a miss is always scanned again (a program loaded a
    moment ago is never taken for a leftover)."""

    TRUST_SECONDS = 10.0

    def __init__(self) -> None:
        self._scan: tuple[float, frozenset[int]] = (float("-inf"), frozenset())

    def __contains__(self, prog_id: int) -> bool:
        at, ids = self._scan
        if prog_id in ids and time.monotonic() - at < self.TRUST_SECONDS:
            return True
        self._scan = (time.monotonic(), frozenset(programs_held_by_processes()))
        return prog_id in self._scan[1]


PROGRAMS_HELD = _HeldPrograms()


def _claim_tc_handle(link: LinkInfo, direction: str, handle: int) -> bool:
    """Whether our filter may go at this handle: there is none, or one of ours that no process holds
    any more (left by a run that could not detach: SIGKILL, crash), removed here. A filter running
    another program, or ours held by a live aiprobe (the agent, `aiprobe flows`), is left alone."""
    prog_id = tc_clsact_query(link.index, direction, handle=handle, priority=TC_PRIORITY)
    if prog_id is None:
        return True
    if program_name(prog_id) != TC_PROGRAM_OF[direction] or prog_id in PROGRAMS_HELD:
        return False
    with contextlib.suppress(BpfError):  # ENOENT: another aiprobe starting now removed it first
        tc_clsact_detach(link.index, direction, handle=handle, priority=TC_PRIORITY)
    log.warning("removed a stale aiprobe tc %s filter (handle %#x, program id %d) from %s, left by an earlier run",
                direction, handle, prog_id, link.name)
    return True


def attach_tc_clsact(program: Program, link: LinkInfo, direction: str) -> Link:
    """Our own filter, at the first of TC_HANDLES that is free or held by a leftover: each aiprobe on
    an interface has its own, so none removes or replaces another's."""
    for handle in TC_HANDLES:
        if not _claim_tc_handle(link, direction, handle):
            continue
        try:
            return program.attach_tc_clsact(link.index, direction, handle=handle, priority=TC_PRIORITY)
        except BpfError as exc:
            if exc.errno != errno.EEXIST:
                raise
            # Another aiprobe took this handle between our look and our attach: try the next one.
    raise BpfError(errno.EBUSY, f"clsact {direction} on {link.name}: all {len(TC_HANDLES)} aiprobe filter "
                   f"handles (priority {TC_PRIORITY:#x}) run live programs")


def _attach_tc(obj: BpfObject, link: LinkInfo, mode: str, direction: str,
               state: InterfaceAttachment, failures: _Failures) -> Link | None:
    program = obj.programs[TC_PROGRAM_OF[direction]]
    attached: Link
    try:
        if mode == "tcx":
            attached = program.attach_tcx(link.index, direction)
        else:
            attached = attach_tc_clsact(program, link, direction)
    except BpfError as exc:
        state.error = "; ".join(e for e in (state.error, f"{direction}: {exc}") if e)
        failures.append((attach_reason(exc), f"{direction}: {exc}"))
        return None
    setattr(state, direction, mode)
    return attached


def _retryable(state: InterfaceAttachment) -> bool:
    """A hook failed on an interface whose frames we could parse, or another XDP program holds one
    whose ingress we were asked to count with XDP: worth trying again later."""
    failed = state.error or "another XDP program" in state.xdp_refused
    return bool(failed) and "not an Ethernet interface" not in state.error


@dataclass
class _Attached:
    state: InterfaceAttachment
    links: list[Link]


def _attach_interface(obj: BpfObject, link: LinkInfo, tc_mode: str, xdp_refused: str | None) -> _Attached:
    """`xdp_refused`: None where XDP is not wanted, else why it may not count ingress ("" if it may)."""
    state = InterfaceAttachment(link.name, link.index)
    if not link.ethernet:
        state.error = "not an Ethernet interface: frames carry no Ethernet header"
        return _Attached(state, [])
    failures: _Failures = []
    links = [_attach_tc(obj, link, tc_mode, "egress", state, failures)]
    if xdp_refused is not None:
        state.xdp_refused = xdp_refused
        if not state.xdp_refused:
            links.append(_attach_xdp(obj.programs[XDP_PROGRAM], link, state, failures))
    if state.ingress is None:
        links.append(_attach_tc(obj, link, tc_mode, "ingress", state, failures))
    if failures:
        ATTACHMENTS.failed(SPEC.name, link.name, failures[0][0], "; ".join(detail for _, detail in failures))
    return _Attached(state, [x for x in links if x is not None])


# --- accounting between reads ---

FIRST_SEEN = VALUE_FIELDS.index("first_seen_ns")


@dataclass
class _Gone:
    """Raw keys of the flows a read deletes."""

    expired: list[bytes]
    orphans: list[bytes]  # of interfaces no longer watched


@dataclass
class _Ledger:
    """What read() remembers besides the flows: when reads began, and counts of what left the table
    and the unattributed table."""

    # flow_clock() as each read began, oldest first, back to the latest one an idle timeout
    # old: each read writes it as the programs' flows_clock, what a frame stamps as last_seen.
    started: deque[int] = field(default_factory=deque)
    retired_failures: int = 0
    retired_malformed: int = 0
    evictions: int = 0

    def since(self) -> int:
        """The last_seen from which a flow changed since the previous read copied it: a frame counted
        after that stamps that read's start or later; the read before it gives a margin for a frame
        whose adds and stamp another CPU saw out of order."""
        return self.started[-2] if len(self.started) >= 2 else 0

    def idle_cutoff(self, idle_since: int) -> int:
        """The last_seen below which a flow has had no frame since `idle_since`. A frame stamps the latest
        clock written before it, so a stamp before a read's start that is no later than `idle_since`
        means no frame since: never expiring a flow whose frames came after its stamp, however far
        apart reads are. 0 (nothing expires) until the reads reach back that far."""
        while len(self.started) > 2 and self.started[1] <= idle_since:
            self.started.popleft()
        return self.started[0] if self.started and self.started[0] <= idle_since else 0


class FlowsProbe(Probe):
    """tc (or opt-in XDP) ingress + tc egress flow accounting on the selected interfaces."""

    spec = SPEC

    def __init__(
        self,
        interfaces: list[str] | None = None,
        exclude: list[str] | None = None,
        idle_timeout: float = 30.0,
        max_flows: int = DEFAULT_MAX_FLOWS,
        strategy: str | None = None,
        xdp_interfaces: list[str] | None = None,
        top: int | None = None,
        read_budget: float | None = None,
    ) -> None:
        """`top`: how many flows each read makes records of (the fastest, then idle ones); None: every flow.
        `read_budget`: the share of one core the reads of the whole table may take (READ_BUDGET); None:
        every read() reads the whole table."""
        super().__init__()
        self.filter = InterfaceFilter(list(interfaces or []), list(exclude or []), list(xdp_interfaces or []))
        self.idle_timeout = idle_timeout
        self.max_flows = max_flows
        self.top = top
        self.read_budget = read_budget
        self._strategies = tuple(s for s in SPEC.strategies if strategy in (None, s.name))
        if not self._strategies:
            raise ValueError(f"unknown flows strategy {strategy!r}; one of {', '.join(TC_MODES)}")
        self._lock = threading.Lock()
        self._read_lock = threading.Lock()
        self._attached: dict[int, _Attached] = {}
        self._watcher: LinkWatcher | None = None
        self._ledger = _Ledger()
        self._unattributed_count = 0
        self._last_snapshot: FlowsSnapshot | None = None
        self._served: FlowsSnapshot | None = None  # the latest read() or read_for_scrape() result
        self._recorded: list[tuple[bytes, int, FlowRecord]] = []  # the last snapshot's flows: key, first_seen_ns
        self._next_read_ns = 0  # CLOCK_MONOTONIC: when the whole table is read again (read_budget)
        # (interface, direction) -> its rates' baseline (CLOCK_MONOTONIC, bytes, packets) and latest rates
        self._rated: dict[Identity, tuple[int, int, int, tuple[float, float]]] = {}
        self._backoff = Backoff()  # interfaces where a hook failed: tried again (a foreign XDP program may leave)
        self._xdp_unloaded = ""  # why the XDP program is not loaded although interfaces opted in to it

    # --- life cycle ---

    def start(self) -> None:
        watcher = LinkWatcher(self._on_link, self._on_removed)
        links = watcher.start()
        try:
            self.loaded = self._load(links)
        except BaseException:
            watcher.stop()
            raise
        self._flows = KernelFlows(self.loaded.obj)
        self._table = FlowTable(dtype_of(self._flows.key_type, KEY_FIELDS),
                                dtype_of(self._flows.value_type, VALUE_FIELDS), time.monotonic_ns())
        # Fixed at start, so first_seen is the same float in every read (it tells flow incarnations apart).
        self._to_wall = time.time() - time.monotonic()
        self._watcher = watcher
        watcher.run_in_background()

    def _load(self, links: list[LinkInfo]) -> Loaded:
        """The tc programs, and the XDP one where interfaces opted in to it. An XDP program this
        kernel refuses leaves ingress at tc: it never takes the tc hooks down with it."""
        try:
            return self.loading(links, xdp=bool(self.filter.xdp)).load(SPEC)
        except ProbeUnavailable as exc:
            if not self.filter.xdp:
                raise
            self._xdp_unloaded = f"the XDP program did not load ({exc}); ingress counted at tc"
            log.warning("%s", self._xdp_unloaded)
            return self.loading(links, xdp=False).load(SPEC)

    def loading(self, links: list[LinkInfo] | None = None, xdp: bool | None = None) -> Loading:
        """How it loads, attaching to `links` (none: the hook is tried in a throwaway netns, as
        `aiprobe check` loads it), with the XDP program (None: where interfaces opted in to it)."""
        with_xdp = bool(self.filter.xdp) if xdp is None else xdp

        def configure(obj: BpfObject, _strategy: Strategy) -> None:
            size_flow_table(obj, self.max_flows)
            if with_xdp:
                enable_xdp(obj)

        return Loading(self._strategies, configure,
                       lambda obj, strategy: self._attach_initial(obj, strategy, links or []))

    def _attach_initial(self, obj: BpfObject, strategy: Strategy, links: list[LinkInfo]) -> None:
        wanted = [link for link in links if link.up and self.filter.wants(link)]
        attached = {link.index: self._attach(obj, link, strategy.name) for link in wanted}
        tried = [attached[link.index].state for link in wanted if link.ethernet]
        if tried and not any(s.egress for s in tried):
            # The egress hook failed everywhere: this kernel lacks the strategy, try the next one.
            raise BpfError(errno.EOPNOTSUPP, f"{strategy.name} attach: {tried[0].error}")
        if not tried:
            # Nothing to try the hook on yet: try it where `aiprobe check` does, so a kernel without
            # it (TCX before 6.6) falls back now, not at the first interface that comes up.
            (hook,) = strategy.features
            if not (feature := network_features()[hook]).available:
                raise BpfError(errno.EOPNOTSUPP, f"{strategy.name}: {feature.detail}")
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
                self._attached[link.index] = self._attach(self.loaded.obj, link, self.loaded.strategy.name)
                if not _retryable(self._attached[link.index].state):  # a failure was logged, with its retry
                    log.info("attached to %s", self._attached[link.index].state.describe())

    def _attach(self, obj: BpfObject, link: LinkInfo, tc_mode: str) -> _Attached:
        xdp_refused = (self._xdp_unloaded or xdp_refusal(link)) if self.filter.wants_xdp(link) else None
        attached = _attach_interface(obj, link, tc_mode, xdp_refused)
        if _retryable(attached.state):
            self._backoff.failed(link.index, time.monotonic())
        else:
            self._backoff.forget(link.index)
            ATTACHMENTS.succeeded(SPEC.name, link.name)
        return attached

    def _retry_failed(self) -> None:
        """Attach again, once their back-off is over, to interfaces where a hook failed: what did
        attach is released first, so nothing is counted twice."""
        now = time.monotonic()
        with self._lock:
            due = [index for index in self._backoff.waiting()
                   if index in self._attached and self._backoff.due(index, now)]
            if not due or self.loaded is None:
                return
            links = {link.index: link for link in current_links()}
            for index in due:
                if index not in links:
                    continue  # gone: the watcher removes it
                for link in self._attached[index].links:
                    self.loaded.obj.release(link)
                self._attached[index] = self._attach(self.loaded.obj, links[index], self.loaded.strategy.name)
                if not _retryable(self._attached[index].state):
                    log.info("attached to %s", self._attached[index].state.describe())

    def status(self) -> ProbeStatus:
        """Down, with the reason, while no interface has any of our programs (nothing is measured)."""
        status = super().status()
        with self._lock:
            states = [a.state for a in self._attached.values()]
        if status.up and not any(s.ingress or s.egress for s in states):
            errors = [f"{s.interface}: {s.error}" for s in states if s.error]
            return ProbeStatus(False, status.strategy, status.span,
                               "attached to no interface" + (f" ({'; '.join(errors[:3])})" if errors else ""))
        return status

    def _on_removed(self, ifindex: int) -> None:
        with self._lock:
            self._backoff.forget(ifindex)
            gone = self._attached.pop(ifindex, None)
            if gone is None or self.loaded is None:
                return
            for link in gone.links:
                self.loaded.obj.release(link)
            self._table.forget(ifindex)

    def attachments(self) -> list[InterfaceAttachment]:
        with self._lock:
            return [a.state for a in self._attached.values()]

    # --- reading ---

    def read(self) -> FlowsSnapshot:
        """The flow table now. Safe from several threads (the agent's refresh, the CLI): one read at
        a time, each taking rates against the latest read at least MIN_RATE_WINDOW_NS old. With a
        read_budget, a read before the whole table is due again reads only the recorded flows (`_reread`)."""
        if self.loaded is None:
            raise RuntimeError("FlowsProbe.read() before start()")
        with self._read_lock:
            self._retry_failed()
            started, cpu = time.monotonic_ns(), time.thread_time_ns()
            if started < self._next_read_ns:
                return self._reread()
            snapshot = self._read(self.loaded.obj)
            if self.read_budget is not None:
                pause = min((time.thread_time_ns() - cpu) / self.read_budget, MAX_READ_SECONDS * 1e9)
                self._next_read_ns = started + int(pause)
            return snapshot

    def read_for_scrape(self) -> FlowsSnapshot:
        """The latest read with its recorded flows' counters read again, one lookup each, and the
        interface totals moved on by what those flows added since: work bounded by the flows recorded
        (`top`), whatever the table holds. Flows outside the record catch up at the next read(). Every
        counter stays monotonic and the flows still add up to their interface. A scrape that finds a
        read under way waits SCRAPE_WAIT_SECONDS at most, then serves what it served last."""
        if self.loaded is None or self._last_snapshot is None or self._served is None:
            return self.read()
        if not self._read_lock.acquire(timeout=SCRAPE_WAIT_SECONDS):
            return self._served
        try:
            return self._reread()
        finally:
            self._read_lock.release()

    def _reread(self) -> FlowsSnapshot:
        """The latest read with its recorded flows read again and the interface totals moved on by
        their increase (read_for_scrape). Rates stay those of the latest read."""
        assert self.loaded is not None and self._last_snapshot is not None
        last = self._last_snapshot
        totals = {t.identity(): dataclasses.replace(t) for t in last.interfaces}
        records = [self._reread_flow(key, first_seen_ns, record, totals)
                   for key, first_seen_ns, record in self._recorded]
        self._served = dataclasses.replace(last, timestamp=time.time(), flows=records,
                                           interfaces=list(totals.values()))
        return self._served

    def _reread_flow(self, key: bytes, first_seen_ns: int, record: FlowRecord,
                     totals: dict[Identity, InterfaceTotals]) -> FlowRecord:
        now = self._flows.lookup(key)
        if now is None or now.first_seen_ns != first_seen_ns:
            return record  # deleted (or deleted and made again) since: the next read() says so
        side = totals[(record.interface, record.direction)]
        for name in SUMMED:
            setattr(side, name, getattr(side, name) + getattr(now, name) - getattr(record, name))
        return dataclasses.replace(record, bytes=now.bytes, packets=now.packets, tcp_syn=now.tcp_syn,
                                   tcp_fin=now.tcp_fin, tcp_rst=now.tcp_rst, last_seen=self._wall(now.last_seen_ns))

    def _read(self, obj: BpfObject) -> FlowsSnapshot:
        now_ns = time.monotonic_ns()
        # One past the coarse tick: a flow made in this tick before the write has that tick as its
        # first_seen (and last_seen), which must read as earlier than any frame stamped after the write.
        started = time.clock_gettime_ns(flow_clock()) + 1
        with self._lock:
            names = {index: a.state.interface for index, a in self._attached.items()}
            attachments = [a.state for a in self._attached.values()]
        table, ledger = self._table, self._ledger
        baseline = table.begin(now_ns, MIN_RATE_WINDOW_NS)
        since, idle_before = ledger.since(), ledger.idle_cutoff(started - int(self.idle_timeout * 1e9))
        obj.set_data(".data.clock", flows_clock=started)  # what frames from now on stamp as last_seen
        gone = self._scan(names, since, idle_before)
        self._delete(gone)
        ledger.started.append(started)
        table.end(now_ns)
        interval = max(now_ns - baseline.at_ns, 1) / 1e9
        self._recorded = self._records(names, interval)
        unattributed = self._unattributed(obj, names)
        self._unattributed_count = len(unattributed)
        self._last_snapshot = FlowsSnapshot(
            timestamp=time.time(),
            interval_seconds=interval,
            flows=[record for _key, _first_seen, record in self._recorded],
            interfaces=self._rate_interfaces(self._interface_totals(unattributed, names), now_ns),
            evictions=ledger.evictions,
            insert_failures=ledger.retired_failures + sum(v.insert_failures for v in unattributed.values()),
            malformed_frames=ledger.retired_malformed + sum(v.malformed for v in unattributed.values()),
            lost_frames=sum(per_cpu.packets for per_cpu in obj.maps["lost"].lookup(0)),
            attachments=attachments,
        )
        self._served = self._last_snapshot
        return self._last_snapshot

    def _scan(self, names: dict[int, str], since: int, idle_before: int) -> _Gone:
        """One pass over the flow table, as arrays: Python touches an entry only when its last_seen
        is `since` or later (it changed), before `idle_before` (it expired), or when it belongs to an
        interface no longer watched. Per read, work in proportion to what changed."""
        table = self._table
        keys, counters = self._flows.read(table.value_dtype)
        key_bytes = memoryview(keys)
        last_seen = counters["last_seen_ns"]
        table.update(key_bytes, counters, np.flatnonzero(last_seen >= since))
        ifindexes = np.frombuffer(keys, table.key_dtype)["ifindex"]
        watched = np.fromiter(names, np.int64, len(names))
        size = table.key_dtype.itemsize
        return _Gone(expired=raw_keys(key_bytes, size, np.flatnonzero(last_seen < idle_before)),
                     orphans=raw_keys(key_bytes, size, np.flatnonzero(~np.isin(ifindexes, watched))))

    def _delete(self, gone: _Gone) -> None:
        """Delete flows of interfaces no longer watched, expire idle flows, and if the table is nearly
        full, evict the stalest. What expired and evicted flows counted moves to the interface totals,
        so nothing they counted is lost."""
        table = self._table
        for key in gone.orphans:
            self._flows.pop(key)
        table.drop(gone.orphans)
        self._retire(gone.expired)
        if len(table) > EVICT_ABOVE * self.max_flows:
            stalest = table.stalest(len(table) - int(EVICT_TO * self.max_flows))
            self._retire(stalest)
            self._ledger.evictions += len(stalest)

    def _retire(self, keys: list[bytes]) -> None:
        """Delete flows, their counts as deleted going to their interface: nothing counted after a read is lost."""
        table = self._table
        finals = np.zeros(len(keys), table.value_dtype)
        for i, key in enumerate(keys):
            # A frame counted between the delete and its slot's zeroing (before 5.14, between the
            # lookup and the delete too) is lost, which the flows deleted here (idle, or the stalest)
            # all but never have.
            final = self._flows.pop(key)
            if final is not None:
                finals[i] = np.frombuffer(bytes(final), table.value_dtype, 1)[0]
            elif key in table.slots:  # deleted by someone else meanwhile: as last read
                finals[i] = table.values[table.slots[key]]
        table.retire(keys, finals)

    def _records(self, names: dict[int, str], interval: float) -> list[tuple[bytes, int, FlowRecord]]:
        """Records of the flows the table picks for `top` (the fastest, then idle ones so a long-lived
        connection keeps its record and the agent its owner), by rate, highest first, then by bytes."""
        table = self._table
        slots = table.recorded(self.top, interval)
        byte_rates, packet_rates = table.rates(slots, interval)
        keys = [table.keys[slot] for slot in slots.tolist()]
        decoded = np.frombuffer(b"".join(keys), table.key_dtype, len(keys)).tolist() if keys else []
        records = [(raw, value[FIRST_SEEN], self._record(key, value, rates, names)) for raw, key, value, *rates in zip(
            keys, decoded, table.values[slots].tolist(), byte_rates.tolist(), packet_rates.tolist(), strict=True)]
        records.sort(key=lambda r: (r[2].bytes_per_second, r[2].bytes), reverse=True)
        return records

    def _record(self, key: tuple[Any, ...], value: tuple[int, ...], rates: list[float],
                names: dict[int, str]) -> FlowRecord:
        """A flow from its key and counters (KEY_FIELDS and VALUE_FIELDS, decoded) and its rates."""
        ifindex, direction, family, protocol, local_port, remote_port, local_addr, remote_addr = key
        packets, nbytes, first_seen_ns, last_seen_ns, cgroup_id, tcp_syn, tcp_fin, tcp_rst = value
        return FlowRecord(
            interface=names[ifindex],
            direction=DIRECTIONS[direction],
            protocol=PROTOCOLS.get(protocol, str(protocol)),
            local_address=ip_text(local_addr, family == 6),
            local_port=local_port,
            remote_address=ip_text(remote_addr, family == 6),
            remote_port=remote_port,
            bytes=nbytes,
            packets=packets,
            bytes_per_second=rates[0],
            packets_per_second=rates[1],
            cgroup_id=cgroup_id,
            first_seen=self._wall(first_seen_ns),
            last_seen=self._wall(last_seen_ns),
            tcp_syn=tcp_syn,
            tcp_fin=tcp_fin,
            tcp_rst=tcp_rst,
        )

    def _wall(self, monotonic_ns: int) -> float:
        return self._to_wall + monotonic_ns / 1e9

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

    def _interface_totals(self, unattributed: dict[tuple[int, int], _Unattributed],
                          names: dict[int, str]) -> list[InterfaceTotals]:
        """Per interface and direction: its flows in the table, those deleted, and the frames in no flow."""
        totals = []
        for index, name in sorted(names.items(), key=lambda item: item[1]):
            for direction, direction_name in enumerate(DIRECTIONS):
                side = InterfaceTotals(name, direction_name,
                                       **dict(zip(SUMMED, self._table.totals((index, direction)), strict=True)))
                if (extra := unattributed.get((index, direction))) is not None:
                    side.bytes += extra.bytes
                    side.packets += extra.packets
                totals.append(side)
        return totals

    def _rate_interfaces(self, totals: list[InterfaceTotals], now_ns: int) -> list[InterfaceTotals]:
        """Each side's rates since the latest read at least MIN_RATE_WINDOW_NS before (0 at its first),
        taken here and not by the agent's refresh: reads of the whole table may be seconds apart
        (read_budget), and the totals in between move with the recorded flows only."""
        rated = {}
        for side in totals:
            first = (now_ns, side.bytes, side.packets, (0.0, 0.0))
            at, nbytes, packets, rates = self._rated.get(side.identity(), first)
            if now_ns - at >= MIN_RATE_WINDOW_NS:
                seconds = (now_ns - at) / 1e9
                rates = (max(side.bytes - nbytes, 0) / seconds, max(side.packets - packets, 0) / seconds)
                at, nbytes, packets = now_ns, side.bytes, side.packets
            side.bytes_per_second, side.packets_per_second = rates
            rated[side.identity()] = (at, nbytes, packets, rates)
        self._rated = rated
        return totals

    def map_usage(self) -> list[MapUsage]:
        """The flow table's overflows are its evictions and failed inserts (whose frames still count
        in the interface totals); the unattributed table's are frames counted nowhere."""
        last = self._last_snapshot
        return [
            MapUsage("flows", len(self._table), self.max_flows,
                     last.evictions + last.insert_failures if last is not None else 0),
            MapUsage("unattributed", self._unattributed_count,
                     self.loaded.obj.maps["unattributed"].max_entries if self.loaded is not None else 0,
                     last.lost_frames if last is not None else 0),
        ]


# --- what /metrics exports: the top K flows and the rest, adding up to the interface ---

# Seconds a flow may rank outside the top K before it loses its series: a flow that dips below
# the K-th for a refresh or two keeps its exact rate instead of flapping between its series and `other`.
TOP_K_HOLD_SECONDS = 30.0


@dataclass
class _Member:
    since: tuple[int, int]  # the flow's (bytes, packets) when it got its series
    out_since: float | None = None  # when it last dropped out of the ranking's top K


class TopFlows:
    """The series of one flow counter ("bytes" or "packets"): at most K flows with their own series,
    sticky (a flow keeps its series until it has ranked outside the top K by bytes/s for
    TOP_K_HOLD_SECONDS, gone idle outside it, or left the flow table: idle flows waiting to expire
    would otherwise hold every series while new ones churn past a steady flow), counting from when
    the flow got its series, so its rate is exact from the first sample and it takes nothing from
    `other`. Only a flow with a rate gets a series: idle flows are among the records too, and one would
    stay flat (or restart at 0 the series it just lost). `other` per interface and direction is the
    interface counter minus those series: the series sum to the interface counter in raw values at
    every read, and `other` never decreases (a flow that loses its series hands its count to `other`;
    one that gets a series starts at 0)."""

    def __init__(self, k: int, field: str) -> None:
        self.k = k
        self.index = ("bytes", "packets").index(field)
        self._members: dict[Identity, _Member] = {}

    def __call__(self, snapshots: list[FlowsSnapshot]) -> list[Series]:
        return [series for snapshot in snapshots for series in self._series(snapshot)]

    def _series(self, snapshot: FlowsSnapshot) -> list[Series]:
        live = {_incarnation(f): f for f in snapshot.flows}
        self._update_membership(live, snapshot.timestamp)
        own = [(_labels(live[ident]), [float(_counts(live[ident])[self.index] - member.since[self.index])])
               for ident, member in self._members.items()]
        taken: dict[tuple[str, ...], float] = {}
        for labels, (value,) in own:
            taken[labels[:2]] = taken.get(labels[:2], 0.0) + value
        other = [((t.interface, t.direction, "", "", "", "other", ""),
                  [_counts(t)[self.index] - taken.get((t.interface, t.direction), 0.0)]) for t in snapshot.interfaces]
        return own + other

    def _update_membership(self, live: dict[Identity, FlowRecord], now: float) -> None:
        ranked = sorted(live, key=lambda ident: (live[ident].bytes_per_second, live[ident].bytes), reverse=True)
        in_top = set(ranked[: self.k])
        for ident, member in list(self._members.items()):
            if ident in in_top:
                member.out_since = None
            elif member.out_since is None:
                member.out_since = now
            if ident not in live or (member.out_since is not None and (
                    now - member.out_since >= TOP_K_HOLD_SECONDS or not live[ident].bytes_per_second)):
                del self._members[ident]
        for ident in ranked[: self.k]:
            if len(self._members) >= self.k or not live[ident].bytes_per_second:
                break  # full, or this and the rest (ranked by rate) are idle
            self._members.setdefault(ident, _Member(_counts(live[ident])))


def _labels(f: FlowRecord) -> tuple[str, ...]:
    return tuple(str(getattr(f, name)) for name in FLOW_LABEL_NAMES)


def _incarnation(f: FlowRecord) -> Identity:
    # first_seen tells a flow apart from an earlier one with the same key (expired, then back).
    return (*_labels(f), f.first_seen)


def _counts(record: FlowRecord | InterfaceTotals) -> tuple[int, int]:
    return record.bytes, record.packets
