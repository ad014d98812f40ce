"""TCP send latency: how long each send to a TCP socket takes (bpf/sendlat.bpf.c).

The kernel aggregates: per (process, cgroup) exact counts of successful and failed sends and
log-linear histograms (16 buckets per power of two) of send time and of how long sockets stayed
unwritable; counters per flow; only sends slower than a threshold leave it one by one, through a
ring buffer. `SendLatencyProbe.read()`
turns the maps into model records (`SendLatencySnapshot`); `aiprobe sendlat` prints them.
"""

from __future__ import annotations

import errno
import operator
import socket
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ... import btf, libbpf, procfs
from ...budget import CpuBudget
from ...features import helper_available, sk_storage_in_tracing
from ...histogram import FAST_BOUNDS, NS_PER_SECOND, Histograms, Summary, no_observations, summaries_of
from ...loader import (
    BpfObject,
    Lazy,
    Loaded,
    Map,
    ProbeUnavailable,
    RingRecords,
    Strategy,
    attach_all,
    enum_labels,
)
from ...metrics import PROCESS_LABELS, Family
from ...model import MapUsage, ProbeStatus
from ...names import comm_text, ip_text
from ...registry import Face, Loading, Probe, ProbeSpec, Unavailable, strategies_named
from .hooks import SendLatencyHooks
from .loops import OBJECT, object_name
from .records import FlowSendStats, ProcessSendLatency, SendLatencySnapshot, SlowSend
from .requests import PART as REQUESTS
from .requests import RequestsProbe  # counted by the stream logic when responses end (bpf/requests.h)
from .rules import NETWORK_SEND_STALL
from .settings import RequestsSettings, SendLatencySettings, StreamsSettings
from .streams import PART as STREAMS
from .streams import RECEIVE_SIDE, StreamsProbe  # the stream logic shares sendlat's programs (bpf/streams.h)
from .view import PROCESS_COLUMNS

if TYPE_CHECKING:
    from ...config import Config

# Slow sends kept between two reads; beyond this they count as lost (a reader that stopped reading).
MAX_PENDING_SLOW_SENDS = 65536
_STATS_MAPS = ("procs", "flows")
# Where tracing programs cannot use task storage (before 5.12) each thread's state is an entry of a
# preallocated hash by thread id (bpf/sendlat.bpf.c, threads_by_tid), emptied as threads exit by this
# program: room for this many threads (128 bytes each, 2 MiB).
THREAD_EXIT = "sendlat_thread_exit"
THREAD_ENTRIES = 16384
# Where BTF programs cannot use socket storage (before 5.11) per-socket state is an entry of a
# preallocated hash by socket address (bpf/sk_state.h), deleted as its connection closes (by
# sendlat_socket_close for `sockets`, by streams_set_state for the others): room per map, and what it
# takes (entry: value and 8-byte key, plus ~48 bytes of the kernel's; 8.6 MiB in all).
SOCKET_CLOSE = "sendlat_socket_close"
SOCKET_ENTRIES = {
    "stream_sockets": 8192,  # accepted connections in flight (784 bytes each: 6.8 MiB)
    "client_sockets": 16384,  # connections the host opened (56 bytes each: 1.75 MiB)
    "sockets": 4096,  # sockets unwritable at once (8 bytes each: 0.25 MiB)
}
# `procs` entries read, decoded and summed at a time (1.8 MB of values): a refresh's memory stays flat
# however many processes send (5,000 short-lived senders: test_hostile).
READ_AT_ONCE = 512
# Indexes of the `counters` array (enum sendlat_counter in bpf/sendlat.h).
_LOST_EVENTS, _PROCS_FULL, _THREADS_FULL = range(3)


def _error_label(name: str) -> str:
    """An errno's name as errno(3) spells it (EAGAIN); the rest in lower case (other)."""
    return name if hasattr(errno, name) else name.lower()


# Failed sends by error, as enum send_error (bpf/sendlat.h) names them.
SEND_ERRORS = enum_labels(OBJECT, "send_error", "SEND_ERROR_", _error_label)


def threads_by_tid() -> bool:
    """Whether thread state must live in a hash by thread id: tracing programs may not use task
    storage here (tried: the helper's load, by libbpf)."""
    return not helper_available(libbpf.BPF_PROG_TYPE_RAW_TRACEPOINT, libbpf.BPF_FUNC_TASK_STORAGE_GET)


def sockets_by_address() -> bool:
    """Whether per-socket state must live in hashes by socket address: BTF programs may not use socket
    storage here (tried: a tiny program's load)."""
    return not sk_storage_in_tracing().available


def place_state(obj: BpfObject) -> None:
    """Before load: where tracing programs lack task or socket storage, their maps become preallocated
    hashes, the programs read them so (rodata) and the programs that empty them load."""
    by_tid, by_address = threads_by_tid(), sockets_by_address()
    obj.set_rodata(threads_by_tid=by_tid, sockets_by_address=by_address)
    if by_tid:
        obj.maps["threads"].retype(libbpf.BPF_MAP_TYPE_HASH, 0, THREAD_ENTRIES)
        obj.programs[THREAD_EXIT].autoload = True
    if by_address:
        for name, entries in SOCKET_ENTRIES.items():
            obj.maps[name].retype(libbpf.BPF_MAP_TYPE_HASH, 0, entries, key_size=8)
        obj.programs[SOCKET_CLOSE].autoload = True


def _error_count(name: str) -> Any:
    return lambda record: record.errors.get(name, 0)


def _from_config(config: Config) -> SendLatencyProbe:
    settings = config.settings(SendLatencySettings)
    return SendLatencyProbe(threshold_ms=settings.slow_send_threshold_ms, per_flow=False,
                            cpu_budget=settings.sendlat_cpu_budget or None,
                            strategies=strategies_named(SPEC, config.strategies.get("sendlat")),
                            stall_threshold_ms=config.settings(StreamsSettings).stream_stall_threshold_ms,
                            count_requests=config.settings(RequestsSettings).count_requests)


SPEC = ProbeSpec(
    name="sendlat",
    description="tcp_sendmsg latency per process, container and flow",
    strategies=(
        Strategy(
            "fentry", programs=("sendlat_fentry", "sendlat_fexit", *RECEIVE_SIDE["fentry"]),
            features=("fentry", "ringbuf"),
            span="tcp_sendmsg entry to return (fentry/fexit)",
        ),
        Strategy(
            "kprobe", programs=("sendlat_kprobe", "sendlat_kretprobe"), features=("kprobe", "ringbuf"),
            span="tcp_sendmsg entry to return (kprobe/kretprobe); no unwritable time (socket storage is for "
                 "BTF programs)",
        ),
        # Only TCP sends pay for these two tracepoints; the span starts with the socket locked.
        Strategy(
            "tracepoint",
            programs=("sendlat_tcp_send_start", "sendlat_tcp_send_end", *RECEIVE_SIDE["tracepoint"]),
            features=("tp_btf", "tcp_send_tp", "sock_length_tp", "ringbuf"),
            span="first copy into the socket (tcp:tcp_sendmsg_locked) to the return of the TCP socket's sendmsg "
                 "(sock:sock_send_length); misses syscall entry and lock_sock waits; counts every TCP sendmsg of "
                 "user threads, times those that reach the copy loop on sockets without kTLS or another "
                 "upper-layer protocol",
        ),
        # Every syscall on the host pays for raw sys_enter: for kernels without tcp:tcp_sendmsg_locked.
        Strategy(
            "syscall",
            programs=("sendlat_sys_enter", "sendlat_sock_send_length", *RECEIVE_SIDE["syscall"]),
            features=("tp_btf", "sock_length_tp", "ringbuf"),
            span="send syscall entry (write, writev, sendto, sendmsg, sendmmsg) to the return of the "
                 "TCP socket's sendmsg (sys_enter to sock:sock_send_length)",
        ),
    ),
    bpf_object=OBJECT,
    order=20,
    factory=_from_config,
    parts=(STREAMS, REQUESTS),
    settings=SendLatencySettings,
    command="aiprobe.probes.sendlat.command:command",
    metrics=(
        Family("aiprobe_tcp_send_bytes_total", "counter", "Bytes sent by successful TCP sends.", ProcessSendLatency,
               "bytes", PROCESS_LABELS, per_identity=True),
        Family("aiprobe_tcp_sends_total", "counter", "Successful TCP sends (that returned bytes).",
               ProcessSendLatency, "count", PROCESS_LABELS, per_identity=True),
        Family("aiprobe_tcp_send_errors_total", "counter",
               "Failed TCP sends, by error; EAGAIN (also EWOULDBLOCK) is back-pressure on a non-blocking socket.",
               ProcessSendLatency, labels=PROCESS_LABELS, per_identity=True, expand_label="error",
               expand=Lazy(lambda: ((name, _error_count(name)) for name in SEND_ERRORS))),
        Family("aiprobe_tcp_sendmsg_duration_seconds", "histogram",
               "Duration of successful TCP sends (log-linear buckets; 1 in aiprobe_tcp_send_timing_sample_every "
               "timed).", ProcessSendLatency, "histogram", PROCESS_LABELS, sum_field="sum_seconds",
               per_identity=True, buckets=FAST_BOUNDS),
        Family("aiprobe_tcp_sends_timed_total", "counter",
               "Successful TCP sends that were timed (all, or 1 in aiprobe_tcp_send_timing_sample_every per "
               "thread while the CPU budget is exceeded).", ProcessSendLatency, "timed", PROCESS_LABELS,
               per_identity=True),
        Family("aiprobe_tcp_send_timing_sample_every", "gauge",
               "1 send in this many per thread is timed now (1: all); the CPU budget sets it.",
               SendLatencySnapshot, "sample_every"),
        Family("aiprobe_tcp_sends_uncounted_total", "counter",
               "TCP sends not counted: their process found the per-process table full (or, on kernels whose "
               "tracing programs lack task storage, their thread the per-thread table).",
               SendLatencySnapshot, "uncounted_sends"),
        Family("aiprobe_tcp_socket_unwritable_seconds", "histogram",
               "How long sockets stayed unwritable: from a send that found the buffer full (EAGAIN, or a short "
               "non-blocking send) to the next successful send on the socket.", ProcessSendLatency,
               "unwritable_histogram", PROCESS_LABELS, sum_field="unwritable_sum_seconds", per_identity=True,
               buckets=FAST_BOUNDS),
    ),
    hooks=SendLatencyHooks(),
    process_columns=PROCESS_COLUMNS,
    rules=(NETWORK_SEND_STALL,),
)


# --- self-limiting overhead ---

# What the default strategy's programs add per send, timed and untimed, from `make bench` on the dev
# box (added CPU time per send, empty programs' share included; rounded up). The budget multiplies
# them by the send rate: an estimate that costs nothing to make, not a measurement.
TIMED_SEND_COST_NS = 600
UNTIMED_SEND_COST_NS = 400
MAX_SAMPLE_EVERY = 1024


class TimingBudget(CpuBudget):
    """Keeps the estimated CPU time of sendlat's programs within `cpu_budget` (a fraction of one
    CPU): past it, 1 send in N is timed (N at most MAX_SAMPLE_EVERY); counts and bytes stay exact."""

    def __init__(self, cpu_budget: float) -> None:
        super().__init__(cpu_budget, MAX_SAMPLE_EVERY, self.cpu_share)

    @staticmethod
    def cpu_share(sends_per_second: float, every: int) -> float:
        """Estimated CPU of the programs (fraction of one CPU) at this rate, timing 1 send in `every`."""
        per_send_ns = UNTIMED_SEND_COST_NS + (TIMED_SEND_COST_NS - UNTIMED_SEND_COST_NS) / every
        return sends_per_second * per_send_ns / NS_PER_SECOND

    def sends_per_second(self, processes: Sequence[ProcessSendLatency], now: float) -> float:
        return self.rate({(p.pid, p.cgroup_id): p.count + sum(p.errors.values()) for p in processes}, now)


# --- decoding map entries ---

def _endpoints(flow: dict[str, Any]) -> dict[str, Any]:
    return {
        "local_address": ip_text(flow["local_addr"], flow["family"] == socket.AF_INET6),
        "local_port": flow["local_port"],
        "remote_address": ip_text(flow["remote_addr"], flow["family"] == socket.AF_INET6),
        "remote_port": flow["remote_port"],
    }


_Slot = tuple[bytes, int, int, int]  # a `proc_slots` entry: raw key, tgid, cgroup id, `procs` index


def _proc_slots(index_of: Map) -> Iterator[_Slot]:
    """(raw key, tgid, cgroup id, `procs` index) of each entry of `proc_slots`, a batch decoded at a
    time in C (10k sending processes: no Python object per field)."""
    fields = btf.dtype_of(index_of.key_type, ("tgid", "cgroup_id"))
    for count, keys, values in index_of.raw_items():
        decoded = np.frombuffer(keys, fields, count)
        yield from zip(np.frombuffer(keys, f"V{index_of.key_size}", count).tolist(), decoded["tgid"].tolist(),
                       decoded["cgroup_id"].tolist(), np.frombuffer(values, np.uint32, count).tolist(), strict=True)


def _processes(slots: list[_Slot], rows: np.ndarray[Any, np.dtype[np.uint8]], value_type: Any,
               waits_of: dict[int, Any], waited_of: dict[int, Summary]) -> list[ProcessSendLatency]:
    """The processes of these `proc_slots` entries from their `procs` values (byte rows), each field of all
    of them decoded at once, and their `unwritable` entries (BTF ctypes structs, by `procs` index) and summaries."""
    def column(path: str) -> list[int]:
        return cast(list[int], btf.u64_field(rows, value_type, path)[:, 0].tolist())

    comm_at, comm_size = btf.field_offset(value_type, "comm"), value_type.comm.size
    comms = rows[:, comm_at:comm_at + comm_size].copy().view(f"S{comm_size}")[:, 0].tolist()  # as comm_text takes it
    errors = btf.u64_field(rows, value_type, "errors", len(SEND_ERRORS)).tolist()
    latencies = Histograms.of_field(rows, value_type, "latency", range(len(rows))).summaries()
    return [
        ProcessSendLatency(
            pid=tgid,
            comm=comm_text(comm),
            cgroup_id=cgroup_id,
            count=timed + untimed,
            bytes=sent,
            sum_seconds=sum_ns / NS_PER_SECOND,
            p50_seconds=latency.p50,
            p99_seconds=latency.p99,
            histogram=latency.buckets,
            start_ticks=procfs.ticks_of_boottime(started),
            timed=timed,
            errors={name: count for name, count in zip(SEND_ERRORS, failed, strict=True) if count},
            unwritable_count=waits.count if (waits := waits_of.get(index)) is not None else 0,
            unwritable_sum_seconds=waits.sum_ns / NS_PER_SECOND if waits is not None else 0.0,
            unwritable_p99_seconds=waited.p99 if (waited := waited_of.get(index)) is not None else None,
            unwritable_histogram=waited.buckets if waited is not None else no_observations(),
        )
        for (_, tgid, cgroup_id, index), comm, timed, untimed, sent, sum_ns, started, failed, latency in zip(
            slots, comms, column("latency.count"), column("untimed_sends"), column("bytes"),
            column("latency.sum_ns"), column("start_boottime_ns"), errors, latencies, strict=True)
    ]


def _in_ranges(slots: list[_Slot]) -> list[list[_Slot]]:
    """`proc_slots` entries (in index order) in runs whose indexes span at most READ_AT_ONCE: one read each."""
    runs: list[list[_Slot]] = []
    for slot in slots:
        if not runs or slot[3] - runs[-1][0][3] >= READ_AT_ONCE:
            runs.append([])
        runs[-1].append(slot)
    return runs


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


def _attach(obj: BpfObject, strategy: Strategy) -> None:
    """Every `procs` index made free (the lowest on top of the stack) and, where threads or sockets are hashes,
    their exits and closes followed, before the first send is seen."""
    free = obj.maps["free_procs"]
    for index in reversed(range(obj.maps["procs"].max_entries)):
        free.push(index)
    for name in (THREAD_EXIT, SOCKET_CLOSE):
        if obj.programs[name].autoload:
            obj.programs[name].attach()
    attach_all(obj, strategy)


class SendLatencyProbe(Probe):
    """TCP send latency of every process (or of `pid` only). Slow sends (>= threshold_ms) are kept
    from one `read()` to the next; call `poll()` in between to see them as they happen."""

    spec = SPEC

    def __init__(
        self, threshold_ms: float = 10.0, pid: int | None = None, strategies: Sequence[Strategy] | None = None,
        per_flow: bool = True, cpu_budget: float | None = None, stall_threshold_ms: float | None = None,
        count_requests: bool = True,
    ) -> None:
        """`per_flow=False` skips the per-flow counters (in the kernel too): the agent takes flows
        from the flows probe, and reading thousands of connections each second is not free.
        `cpu_budget` (a fraction of one CPU) makes each read() adapt timing to the send rate.
        `stall_threshold_ms` runs the streams part too (`parts()`), with that stall threshold, and
        with it the requests part unless `count_requests` is False."""
        super().__init__()
        if threshold_ms < 0:
            raise ValueError("threshold_ms must not be negative")
        self.threshold_ms = threshold_ms
        self.pid = pid
        self.per_flow = per_flow
        self._strategies = tuple(strategies) if strategies is not None else SPEC.strategies
        self._slow_sends: RingRecords[SlowSend] | None = None
        self._entries: dict[str, int] = {}  # map name -> entries at the last read
        self._sends: dict[int, int] = {}  # procs index -> its sends and failed sends at the last read
        self.sample_every = 1
        self._budget = TimingBudget(cpu_budget) if cpu_budget is not None else None
        self._stall_threshold_ms = stall_threshold_ms
        self._count_requests = count_requests
        self._streams: Face | None = None
        self._requests: Face | None = None

    def start(self) -> None:
        if self.loaded is not None:
            return
        self.loaded = self.loading().load(SPEC)
        try:
            self._slow_sends = RingRecords(self.loaded.obj, "slow_sends", "slow_send_event", _slow_send,
                                           MAX_PENDING_SLOW_SENDS)
            if self._stall_threshold_ms is not None:
                self._streams = self._start_part(StreamsProbe(self, self._stall_threshold_ms))
                # Requests are counted by the stream logic: without it, none (and the same reason).
                if not isinstance(self._streams, StreamsProbe):
                    self._requests = self._streams
                else:
                    self._requests = self._start_part(RequestsProbe(self)) if self._count_requests \
                        else Unavailable("off in the config (count_requests = false)")
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _start_part(part: Probe) -> Face:
        """A part on this probe's programs, started, or why it cannot run on this strategy."""
        try:
            part.start()
        except ProbeUnavailable as exc:
            return Unavailable("; ".join(exc.reasons.values()))
        except Exception as exc:  # the part cannot run; the send latency it rides on keeps going
            part.close()
            return Unavailable(str(exc))
        return part

    def parts(self) -> dict[str, Face]:
        faces = {STREAMS.name: self._streams, REQUESTS.name: self._requests}
        return {name: face for name, face in faces.items() if face is not None}

    def loading(self) -> Loading:
        return Loading(self._strategies, self._configure, _attach, bpf_object=object_name())

    def _configure(self, obj: BpfObject, _strategy: Strategy) -> None:
        place_state(obj)
        obj.set_rodata(slow_threshold_ns=round(self.threshold_ms * 1e6), target_tgid=self.pid or 0,
                       count_flows=self.per_flow)

    def set_sample_every(self, every: int) -> None:
        """Time 1 send in `every` per thread from now on (1: all); counts and bytes stay exact."""
        if every < 1:
            raise ValueError("sample_every must be at least 1")
        # `sample_every` is the only variable of .data: nothing else writes it concurrently.
        self._loaded().obj.set_data(".data", sample_every=every)
        self.sample_every = every

    def _loaded(self) -> Loaded:
        if self.loaded is None:
            raise RuntimeError("SendLatencyProbe is not started")
        return self.loaded

    def poll(self, timeout_ms: int = 0) -> list[SlowSend]:
        """Wait up to timeout_ms for slow sends; returns the new ones (read() returns them too)."""
        self._loaded()
        assert self._slow_sends is not None  # made with the object
        return self._slow_sends.poll(timeout_ms)

    def read(self) -> SendLatencySnapshot:
        """Everything counted since start. Entries of processes that have exited are reported this
        once and then deleted, so the maps (and the cost of reading them) follow live processes."""
        loaded = self._loaded()
        obj = loaded.obj
        assert self._slow_sends is not None
        slow_sends = self._slow_sends.take()
        processes = self._read_processes(obj)
        if self._budget is not None:
            rate = self._budget.sends_per_second(processes, time.monotonic())
            every = self._budget.every(rate, self.sample_every)
            if every != self.sample_every:
                self.set_sample_every(every)
        flows = [_flow(key, value) for key, value in self._read_and_prune(obj, "flows")] if self.per_flow else []
        return SendLatencySnapshot(
            strategy=loaded.strategy.name,
            span=loaded.strategy.span,
            processes=processes,
            flows=flows,
            slow_sends=slow_sends,
            lost_events=self.events_lost(),
            uncounted_sends=sum(obj.maps["counters"].lookup(i).value for i in (_PROCS_FULL, _THREADS_FULL)),
            sample_every=self.sample_every,
        )

    def _read_processes(self, obj: BpfObject) -> list[ProcessSendLatency]:
        """Every process's entry; those of exited processes are then freed for reuse. An entry whose
        counts moved since the last read is of a process that was alive since: only new entries and those
        that did not move are checked, with one syscall each."""
        index_of, procs, unwritable = obj.maps["proc_slots"], obj.maps["procs"], obj.maps["unwritable"]
        exited, sends = [], {}
        waits_of = {index.value: waits for index, waits in unwritable.items()}  # few: one read, not one per process
        waited_of = dict(zip(waits_of, summaries_of([waits.slots for waits in waits_of.values()]), strict=True))
        slots = sorted(_proc_slots(index_of), key=operator.itemgetter(3))
        processes = []
        for run in _in_ranges(slots):
            first = run[0][3]
            rows = procs.array_range(first, run[-1][3] - first + 1)[[index - first for *_, index in run]]
            processes += _processes(run, rows, procs.value_type, waits_of, waited_of)
        for position, ((raw_key, tgid, _, index), process) in enumerate(zip(slots, processes, strict=True)):
            sends[index] = moved = process.count + sum(process.errors.values())
            if self._sends.get(index, moved) == moved and procfs.exited(tgid):
                exited.append((raw_key, index))
                # Read again now that it is gone: what it sent after the read above (it may have sent
                # all it did and exited since) goes into its last record, not away with the entry.
                processes[position], = _processes([slots[position]], procs.array_range(index, 1),
                                                  procs.value_type, waits_of, waited_of)
        self._sends = sends
        self._entries["procs"] = len(processes)
        for raw_key, index in exited:
            # No thread of the process is left to use the index: zero it, then hand it back (the next
            # process to take it is new at the next read).
            del sends[index]
            index_of.delete(raw_key)
            procs.update(index, procs.value_type())
            unwritable.delete(index)
            obj.maps["free_procs"].push(index)
        return processes

    def _read_and_prune(self, obj: BpfObject, map_name: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """Every entry; those of exited processes deleted, as the delete found them (what the process
        sent after the read, before it exited, still counts)."""
        stats = obj.maps[map_name]
        table = stats.table()
        keys = [btf.decode(stats.key_type.from_buffer_copy(packed)) for packed in table.keys]
        self._entries[map_name] = len(keys)
        table.delete(stats, [i for i, key in enumerate(keys) if procfs.exited(key["tgid"])])
        return [(key, btf.decode(value)) for key, value in zip(keys, table.values(), strict=True)]

    def events_lost(self) -> int:
        dropped = self._slow_sends.dropped if self._slow_sends is not None else 0
        if self.loaded is None:
            return dropped
        return int(self.loaded.obj.maps["counters"].lookup(_LOST_EVENTS).value) + dropped

    def status(self) -> ProbeStatus:
        """As every probe's, and while over its CPU budget, how much of the traffic it times."""
        status = super().status()
        if status.up and self.sample_every > 1:
            status.span += f"; timing 1 in {self.sample_every} sends per thread (CPU budget), counts exact"
        return status

    def map_usage(self) -> list[MapUsage]:
        """Sizes as of the last read (per-thread and per-socket state lives with the thread and the
        socket, or on kernels without that storage in hashes emptied as they go: THREAD_ENTRIES,
        SOCKET_ENTRIES)."""
        if self.loaded is None:
            return []
        maps = self.loaded.obj.maps
        return [MapUsage(name, self._entries.get(name, 0), maps[name].max_entries) for name in _STATS_MAPS]

    def close(self) -> None:
        for part in (self._requests, self._streams):
            if isinstance(part, Probe):
                part.close()
        self._streams = self._requests = None
        self._slow_sends = None  # its ring is freed with the object
        super().close()
