"""TCP send latency: how long each send to a TCP socket takes (bpf/sendlat.bpf.c).

The kernel aggregates: a log2 histogram per (process, cgroup), counters per flow, and only sends
slower than a threshold leave it one by one, through a ring buffer. `SendLatencyProbe.read()`
turns the maps into a `SendLatencySnapshot`; `aiprobe sendlat` prints it.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import click

from . import btf
from .cli import AiprobeError, duration_option, emit_json, friendly_errors, json_option, require_privileges, ticks
from .histogram import NS_PER_SECOND, buckets_to_json, log2_buckets, quantile
from .loader import BpfObject, Strategy, load_first
from .names import comm_text, endpoint, ip_text
from .probes import MapUsage, Probe, ProbeSpec

OBJECT = "sendlat"
# Slow sends kept between two reads; beyond this they count as lost (a reader that stopped reading).
MAX_PENDING_SLOW_SENDS = 65536
_STATS_MAPS = ("procs", "flows", "starts")

SPEC = ProbeSpec(
    name="sendlat",
    description="tcp_sendmsg latency per process, container and flow",
    strategies=(
        Strategy(
            "fentry", programs=("sendlat_fentry", "sendlat_fexit"), features=("fentry", "ringbuf"),
            span="tcp_sendmsg entry to return (fentry/fexit)",
        ),
        Strategy(
            "kprobe", programs=("sendlat_kprobe", "sendlat_kretprobe"), features=("kprobe", "ringbuf"),
            span="tcp_sendmsg entry to return (kprobe/kretprobe)",
        ),
        # Only TCP sends pay for these two tracepoints; the span starts with the socket locked.
        Strategy(
            "tracepoint",
            programs=("sendlat_tcp_send_start", "sendlat_tcp_send_end", "sendlat_thread_exit"),
            features=("tp_btf", "tcp_send_tp", "ringbuf"),
            span="first copy into the socket (tcp:tcp_sendmsg_locked) to the return of the TCP socket's sendmsg "
                 "(sock:sock_send_length); misses syscall entry and lock_sock waits; counts sends that copy "
                 "at least one byte, by user threads, on sockets without kTLS or another upper-layer protocol",
        ),
        # Every syscall on the host pays for raw sys_enter: for kernels without tcp:tcp_sendmsg_locked.
        Strategy(
            "syscall",
            programs=("sendlat_sys_enter", "sendlat_sock_send_length", "sendlat_thread_exit"),
            features=("tp_btf", "ringbuf"),
            span="send syscall entry (write, writev, sendto, sendmsg, sendmmsg) to the return of the "
                 "TCP socket's sendmsg (sys_enter to sock:sock_send_length)",
        ),
    ),
)


# --- snapshot ---

@dataclass
class ProcessSendLatency:
    """Sends of one process in one cgroup since the probe started (monotonic counters)."""

    pid: int
    comm: str
    cgroup_id: int
    count: int
    bytes: int
    sum_seconds: float
    p50_seconds: float | None  # None before the first send
    p99_seconds: float | None
    histogram: list[tuple[float, int]]

    def to_dict(self) -> dict:
        # Not asdict(): it deep-copies the 36 buckets of every process each refresh.
        return {**vars(self), "histogram": buckets_to_json(self.histogram)}


@dataclass
class FlowSendStats:
    """Sends of one process on one TCP connection since the probe started."""

    pid: int
    local_address: str
    local_port: int
    remote_address: str
    remote_port: int
    count: int
    bytes: int
    sum_seconds: float


@dataclass
class SlowSend:
    """One send slower than the threshold."""

    pid: int
    tid: int
    comm: str
    cgroup_id: int
    local_address: str
    local_port: int
    remote_address: str
    remote_port: int
    bytes: int
    duration_seconds: float


@dataclass
class SendLatencySnapshot:
    strategy: str
    span: str
    processes: list[ProcessSendLatency] = field(default_factory=list)
    flows: list[FlowSendStats] = field(default_factory=list)
    slow_sends: list[SlowSend] = field(default_factory=list)  # since the previous read
    lost_events: int = 0  # slow sends lost since start

    def to_dict(self) -> dict:
        return {
            "strategy": self.strategy,
            "span": self.span,
            "processes": [p.to_dict() for p in self.processes],
            "flows": [dict(vars(f)) for f in self.flows],
            "slow_sends": [dict(vars(s)) for s in self.slow_sends],
            "lost_events": self.lost_events,
        }


# --- decoding map entries ---

def _endpoints(flow: dict) -> dict[str, Any]:
    return {
        "local_address": ip_text(flow["local_addr"], flow["family"] == socket.AF_INET6),
        "local_port": flow["local_port"],
        "remote_address": ip_text(flow["remote_addr"], flow["family"] == socket.AF_INET6),
        "remote_port": flow["remote_port"],
    }


def _process(key: dict, value: dict) -> ProcessSendLatency:
    latency = value["latency"]
    buckets = log2_buckets(latency["slots"])
    return ProcessSendLatency(
        pid=key["tgid"],
        comm=comm_text(value["comm"]),
        cgroup_id=key["cgroup_id"],
        count=latency["count"],
        bytes=value["bytes"],
        sum_seconds=latency["sum_ns"] / NS_PER_SECOND,
        p50_seconds=quantile(buckets, 0.5),
        p99_seconds=quantile(buckets, 0.99),
        histogram=buckets,
    )


def _flow(key: dict, value: dict) -> FlowSendStats:
    return FlowSendStats(
        pid=key["tgid"], **_endpoints(key),
        count=value["count"], bytes=value["bytes"], sum_seconds=value["sum_ns"] / NS_PER_SECOND,
    )


def _slow_send(event: dict) -> SlowSend:
    return SlowSend(
        pid=event["flow"]["tgid"], tid=event["tid"], comm=comm_text(event["comm"]), cgroup_id=event["cgroup_id"],
        **_endpoints(event["flow"]), bytes=event["bytes"], duration_seconds=event["duration_ns"] / NS_PER_SECOND,
    )


class SendLatencyProbe(Probe):
    """TCP send latency of every process (or of `pid` only). Slow sends (>= threshold_ms) are kept
    from one `read()` to the next; call `poll()` in between to see them as they happen."""

    spec = SPEC

    def __init__(
        self, threshold_ms: float = 10.0, pid: int | None = None, strategies: Sequence[Strategy] | None = None,
        per_flow: bool = True,
    ) -> None:
        """`per_flow=False` skips the per-flow counters (in the kernel too): the agent takes flows
        from the flows probe, and reading thousands of connections each second is not free."""
        super().__init__()
        if threshold_ms < 0:
            raise ValueError("threshold_ms must not be negative")
        self.threshold_ms = threshold_ms
        self.pid = pid
        self.per_flow = per_flow
        self._strategies = tuple(strategies) if strategies is not None else SPEC.strategies
        self._ring: Any = None
        self._event_type: type | None = None
        self._pending: list[SlowSend] = []
        self._dropped = 0
        self._entries: dict[str, int] = {}  # map name -> entries at the last read

    def start(self) -> None:
        if self.loaded is not None:
            return
        self.loaded = load_first(SPEC.name, OBJECT, self._strategies, configure=self._configure)
        try:
            obj = self.loaded.obj
            self._event_type = obj.btf.struct_ctype("slow_send_event")
            self._ring = obj.ring_buffer("slow_sends", self._on_slow_send)
        except BaseException:
            self.close()
            raise

    def _configure(self, obj: BpfObject, _strategy: Strategy) -> None:
        obj.set_rodata(slow_threshold_ns=round(self.threshold_ms * 1e6), target_tgid=self.pid or 0,
                       count_flows=self.per_flow)

    def _on_slow_send(self, data: bytes) -> None:
        if len(self._pending) >= MAX_PENDING_SLOW_SENDS:
            self._dropped += 1
            return
        self._pending.append(_slow_send(btf.decode(self._event_type.from_buffer_copy(data))))

    def _obj(self) -> BpfObject:
        if self.loaded is None:
            raise RuntimeError("SendLatencyProbe is not started")
        return self.loaded.obj

    def poll(self, timeout_ms: int = 0) -> list[SlowSend]:
        """Wait up to timeout_ms for slow sends; returns the new ones (read() returns them too)."""
        self._obj()
        before = len(self._pending)
        self._ring.poll(timeout_ms)
        return self._pending[before:]

    def read(self) -> SendLatencySnapshot:
        """Everything counted since start. Entries of processes that have exited are reported this
        once and then deleted, so the maps (and the cost of reading them) follow live processes."""
        obj = self._obj()
        self.poll(0)
        slow_sends, self._pending = self._pending, []
        processes = [_process(key, value) for key, value in self._read_and_prune(obj, "procs")]
        flows = [_flow(key, value) for key, value in self._read_and_prune(obj, "flows")] if self.per_flow else []
        return SendLatencySnapshot(
            strategy=self.loaded.strategy.name,
            span=self.loaded.strategy.span,
            processes=processes,
            flows=flows,
            slow_sends=slow_sends,
            lost_events=self.events_lost(),
        )

    def _read_and_prune(self, obj: BpfObject, map_name: str) -> list[tuple[dict, dict]]:
        stats = obj.maps[map_name]
        entries = [(key, btf.decode(key), btf.decode(value)) for key, value in stats.items()]
        self._entries[map_name] = len(entries)
        stats.delete_keys(raw for raw, key, _ in entries if not os.path.exists(f"/proc/{key['tgid']}"))
        return [(key, value) for _, key, value in entries]

    def events_lost(self) -> int:
        if self.loaded is None:
            return self._dropped
        return self.loaded.obj.maps["counters"].lookup(0).value + self._dropped

    def map_usage(self) -> list[MapUsage]:
        """Sizes as of the last read (the per-thread `starts` map is counted now)."""
        if self.loaded is None:
            return []
        maps = self.loaded.obj.maps
        sizes = {**self._entries, "starts": len(maps["starts"].items())}
        return [MapUsage(name, sizes.get(name, 0), maps[name].max_entries) for name in _STATS_MAPS]

    def close(self) -> None:
        self._ring = None  # freed with the object
        super().close()


# --- aiprobe sendlat ---

_SLOW_HEADER = f"{'TIME':<9} {'PID':>7} {'COMM':<16} {'LOCAL':<24} {'REMOTE':<24} {'BYTES':>9} {'MS':>9}"


def _print_slow_send(send: SlowSend) -> None:
    click.echo(
        f"{time.strftime('%H:%M:%S'):<9} {send.pid:>7} {send.comm:<16} "
        f"{endpoint(send.local_address, send.local_port):<24} {endpoint(send.remote_address, send.remote_port):<24} "
        f"{send.bytes:>9} {send.duration_seconds * 1e3:>9.3f}"
    )


def _print_histogram(process: ProcessSendLatency) -> None:
    """bcc-style log2 histogram of one process, in nanoseconds."""
    click.echo(
        f"\npid {process.pid} ({process.comm}) cgroup {process.cgroup_id}: {process.count} sends, "
        f"{process.bytes} bytes, p50 {process.p50_seconds * 1e6:.1f} us, p99 {process.p99_seconds * 1e6:.1f} us"
    )
    counts = [cumulative - below for (_, cumulative), (_, below) in
              zip(process.histogram, [(0.0, 0), *process.histogram[:-1]], strict=True)]
    used = [i for i, count in enumerate(counts) if count]
    if not used:
        return
    widest = max(counts)
    click.echo(f"{'nsecs':>24} : {'count':<8} distribution")
    for slot in range(used[0], used[-1] + 1):
        stars = "*" * round(40 * counts[slot] / widest)
        upper = "inf" if slot == len(counts) - 1 else str(2 ** (slot + 1) - 1)
        click.echo(f"{2 ** slot:>11} -> {upper:<10} : {counts[slot]:<8} |{stars:<40}|")


@click.command()
@duration_option
@click.option("--pid", type=click.IntRange(min=1), default=None, help="Only this process (its pid / tgid).")
@click.option(
    "--threshold-ms", type=click.FloatRange(min=0), default=10.0, show_default=True,
    help="Print each send slower than this as it happens.",
)
@json_option
@friendly_errors
def command(duration: float | None, pid: int | None, threshold_ms: float, as_json: bool) -> None:
    """TCP send latency per process, and each slow send as it happens (like bcc's tools)."""
    require_privileges()
    if pid is not None and not _process_exists(pid):
        raise AiprobeError(f"no process with pid {pid}")
    with SendLatencyProbe(threshold_ms=threshold_ms, pid=pid) as probe:
        # Status on stderr (stdout is the data): also tells a caller that the probe is attached.
        click.echo(f"Tracing TCP sends ({probe.strategy}: {probe.loaded.strategy.span}); Ctrl-C to end.", err=True)
        if not as_json:
            click.echo(f"Sends slower than {threshold_ms:g} ms:\n{_SLOW_HEADER}")
        for _ in ticks(duration, 0.2):
            for send in probe.poll(0):
                if not as_json:
                    _print_slow_send(send)
        snapshot = probe.read()
    if as_json:
        emit_json(snapshot.to_dict())
        return
    for process in sorted(snapshot.processes, key=lambda p: (p.pid, p.cgroup_id)):
        _print_histogram(process)
    if snapshot.lost_events:
        click.echo(f"\n{snapshot.lost_events} slow-send events lost", err=True)


def _process_exists(pid: int) -> bool:
    import psutil

    return psutil.pid_exists(pid)
