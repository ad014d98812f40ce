"""TCP send latency: how long each send to a TCP socket takes (bpf/sendlat.bpf.c).

The kernel aggregates: a log2 histogram per (process, cgroup), counters per flow, and only sends
slower than a threshold leave it one by one, through a ring buffer. `SendLatencyProbe.read()`
turns the maps into model records (`SendLatencySnapshot`); `aiprobe sendlat` prints them.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from . import btf
from .histogram import NS_PER_SECOND, log2_buckets, quantile
from .loader import BpfObject, Loaded, Strategy, load_first
from .metrics import PROCESS_LABELS, Family
from .model import FlowSendStats, MapUsage, ProcessSendLatency, SendLatencySnapshot, SlowSend
from .names import comm_text, ip_text
from .probes import Probe, ProbeSpec, strategies_named
from .procfs import StartTimes

if TYPE_CHECKING:
    from .config import Config

OBJECT = "sendlat"
# Slow sends kept between two reads; beyond this they count as lost (a reader that stopped reading).
MAX_PENDING_SLOW_SENDS = 65536
_STATS_MAPS = ("procs", "flows", "starts")

def _from_config(config: Config) -> SendLatencyProbe:
    return SendLatencyProbe(threshold_ms=config.slow_send_threshold_ms, per_flow=False,
                            strategies=strategies_named(SPEC, config.strategies.get("sendlat")))


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
    bpf_object=OBJECT,
    order=20,
    factory=lambda config, _running: _from_config(config),
    config_keys=("slow_send_threshold_ms",),
    command="aiprobe.commands.sendlat:command",
    metrics=(
        Family("aiprobe_tcp_send_bytes_total", "counter", "Bytes passed to tcp_sendmsg.", ProcessSendLatency,
               "bytes", PROCESS_LABELS, per_identity=True),
        Family("aiprobe_tcp_sendmsg_duration_seconds", "histogram", "Duration of tcp_sendmsg calls (log2 buckets).",
               ProcessSendLatency, "histogram", PROCESS_LABELS, sum_field="sum_seconds", per_identity=True),
    ),
)


# --- decoding map entries ---

def _endpoints(flow: dict[str, Any]) -> dict[str, Any]:
    return {
        "local_address": ip_text(flow["local_addr"], flow["family"] == socket.AF_INET6),
        "local_port": flow["local_port"],
        "remote_address": ip_text(flow["remote_addr"], flow["family"] == socket.AF_INET6),
        "remote_port": flow["remote_port"],
    }


def _process(key: dict[str, Any], value: dict[str, Any], started: int) -> ProcessSendLatency:
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
        start_ticks=started,
    )


def _flow(key: dict[str, Any], value: dict[str, Any]) -> FlowSendStats:
    return FlowSendStats(
        pid=key["tgid"], **_endpoints(key),
        count=value["count"], bytes=value["bytes"], sum_seconds=value["sum_ns"] / NS_PER_SECOND,
    )


def _slow_send(event: dict[str, Any]) -> SlowSend:
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
        self._event_type: Any = None  # the ctypes struct of a slow_send_event (from the object's BTF)
        self._pending: list[SlowSend] = []
        self._dropped = 0
        self._entries: dict[str, int] = {}  # map name -> entries at the last read
        self._starts = StartTimes()

    def start(self) -> None:
        if self.loaded is not None:
            return
        self.loaded = load_first(SPEC.name, OBJECT, self._strategies, configure=self._configure)
        try:
            obj = self.loaded.obj
            if obj.btf is None:
                raise RuntimeError(f"{OBJECT}.bpf.o carries no BTF")
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

    def _loaded(self) -> Loaded:
        if self.loaded is None:
            raise RuntimeError("SendLatencyProbe is not started")
        return self.loaded

    def poll(self, timeout_ms: int = 0) -> list[SlowSend]:
        """Wait up to timeout_ms for slow sends; returns the new ones (read() returns them too)."""
        self._loaded()
        before = len(self._pending)
        self._ring.poll(timeout_ms)
        return self._pending[before:]

    def read(self) -> SendLatencySnapshot:
        """Everything counted since start. Entries of processes that have exited are reported this
        once and then deleted, so the maps (and the cost of reading them) follow live processes."""
        loaded = self._loaded()
        obj = loaded.obj
        self.poll(0)
        slow_sends, self._pending = self._pending, []
        entries = self._read_and_prune(obj, "procs")
        processes = [_process(key, value, self._starts.of(key["tgid"])) for key, value in entries]
        self._starts.keep_only({key["tgid"] for key, _ in entries})
        flows = [_flow(key, value) for key, value in self._read_and_prune(obj, "flows")] if self.per_flow else []
        return SendLatencySnapshot(
            strategy=loaded.strategy.name,
            span=loaded.strategy.span,
            processes=processes,
            flows=flows,
            slow_sends=slow_sends,
            lost_events=self.events_lost(),
        )

    def _read_and_prune(self, obj: BpfObject, map_name: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        stats = obj.maps[map_name]
        entries = [(key, btf.decode(key), btf.decode(value)) for key, value in stats.items()]
        self._entries[map_name] = len(entries)
        stats.delete_keys(raw for raw, key, _ in entries if not os.path.exists(f"/proc/{key['tgid']}"))
        return [(key, value) for _, key, value in entries]

    def events_lost(self) -> int:
        if self.loaded is None:
            return self._dropped
        return int(self.loaded.obj.maps["counters"].lookup(0).value) + self._dropped

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
