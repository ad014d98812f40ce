"""CUDA driver uprobes: context switches, kernel launches and synchronizations per process, plus
the run-queue delay of the threads that drive the GPU (bpf/cuda.bpf.c; scheduler side: sched.py).

Libraries are found, not configured: every `libcuda.so*` file that a process maps is probed once
per file (dev, inode), whatever path or container it is reached through. A background thread
rescans /proc every RESCAN_INTERVAL seconds, so processes that start (or dlopen the driver)
later are picked up within about that time; `close()` stops it. A uprobe on a file covers every
process mapping it, so the scan cost grows with processes, the probe cost only with calls.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import click

from . import sched
from .btf import decode
from .cli import duration_option, emit_json, friendly_errors, json_option, require_privileges, ticks
from .histogram import quantile
from .libbpf import BpfError
from .loader import BpfObject, Strategy, load_first
from .probes import MapUsage, Probe, ProbeSpec

RESCAN_INTERVAL = 1.0
LIBRARY_PREFIX = "libcuda.so"
NS_PER_SECOND = 1e9


@dataclass(frozen=True)
class EntryPoint:
    symbol: str
    program: str
    retprobe: bool = False


_LAUNCHES = ("cuLaunchKernel", "cuLaunchKernel_ptsz", "cuLaunchKernelEx", "cuLaunchKernelEx_ptsz")
_SYNCS = ("cuStreamSynchronize", "cuStreamSynchronize_ptsz", "cuCtxSynchronize")

# What is probed in each library. A symbol the library does not export (the _ptsz variants, or
# cuLaunchKernelEx before CUDA 11.8) is skipped. The uretprobe of a sync attaches before its
# uprobe, so a half-attached pair can never leave a sync open forever.
ENTRY_POINTS = (
    EntryPoint("cuCtxSetCurrent", "uprobe_ctx_set_current"),
    EntryPoint("cuCtxPushCurrent_v2", "uprobe_ctx_push_current"),
    EntryPoint("cuCtxPopCurrent_v2", "uprobe_ctx_pop_current"),
    *(EntryPoint(symbol, "uprobe_launch_kernel") for symbol in _LAUNCHES),
    *(
        EntryPoint(symbol, program, retprobe)
        for symbol in _SYNCS
        for program, retprobe in (("uretprobe_sync_exit", True), ("uprobe_sync_enter", False))
    ),
)
UPROBE_PROGRAMS = tuple(dict.fromkeys(entry.program for entry in ENTRY_POINTS))
_UPROBE_SPAN = "libcuda.so entry points (cuCtx*Current, cuLaunchKernel*, cu*Synchronize)"

# The uprobes with each scheduler strategy in turn, then without a scheduler side at all.
STRATEGIES = (
    *(
        Strategy(f"uprobe+{s.name}", UPROBE_PROGRAMS + s.programs, ("uprobe", *s.features), f"{_UPROBE_SPAN}; {s.span}")
        for s in sched.STRATEGIES
    ),
    Strategy("uprobe", UPROBE_PROGRAMS, ("uprobe",), f"{_UPROBE_SPAN}; no scheduler side"),
)

SPEC = ProbeSpec(
    name="cuda",
    description="CUDA driver calls per process: context switches, launches, syncs",
    strategies=(Strategy("uprobe", UPROBE_PROGRAMS, ("uprobe",), _UPROBE_SPAN),),
)


# ---- finding the libraries ----


@dataclass(frozen=True)
class MappedLibrary:
    """A libcuda file as one process maps it."""

    pid: int
    path: str  # as the process sees it (inside its container)
    dev: int
    inode: int
    address: str  # the mapping's range, which names /proc/PID/map_files/<range>

    @property
    def key(self) -> tuple[int, int]:
        return self.dev, self.inode

    def host_path(self, proc: Path) -> str:
        """A path to the same file from here: through the process's root when that still leads to
        the mapped inode, else the mapping itself (a replaced or deleted file)."""
        through_root = f"{proc}/{self.pid}/root{self.path}"
        with contextlib.suppress(OSError):
            st = os.stat(through_root)
            if (st.st_dev, st.st_ino) == self.key:
                return through_root
        return f"{proc}/{self.pid}/map_files/{self.address}"


def mapped_libcuda(pid: int, proc: Path = Path("/proc")) -> MappedLibrary | None:
    """The libcuda file process `pid` maps, if any."""
    try:
        maps = (proc / str(pid) / "maps").read_bytes()
    except OSError:  # gone, or a kernel thread
        return None
    if LIBRARY_PREFIX.encode() not in maps:
        return None
    for line in maps.decode(errors="replace").splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6:
            continue
        path = fields[5].removesuffix(" (deleted)")
        if os.path.basename(path).startswith(LIBRARY_PREFIX):
            major, minor = (int(part, 16) for part in fields[3].split(":"))
            return MappedLibrary(pid, path, os.makedev(major, minor), int(fields[4]), fields[0])
    return None


def scan(proc: Path = Path("/proc")) -> list[MappedLibrary]:
    """Every process that maps a libcuda file."""
    pids = (int(entry.name) for entry in os.scandir(proc) if entry.name.isdigit())
    return [lib for pid in pids if (lib := mapped_libcuda(pid, proc)) is not None]


@dataclass
class AttachedLibrary:
    """One probed library file: which entry points it exported, or why it could not be probed."""

    path: str
    host_path: str
    symbols: list[str] = field(default_factory=list)
    error: str = ""


def attach_entry_points(obj: BpfObject, host_path: str) -> list[str]:
    """Attach every entry point the library exports; the symbols attached."""
    attached = []
    for entry in ENTRY_POINTS:
        try:
            obj.programs[entry.program].attach_uprobe(host_path, entry.symbol, retprobe=entry.retprobe)
        except BpfError as exc:
            if exc.errno != errno.ENOENT:  # ENOENT: symbol not exported by this driver version
                raise
            continue
        if not entry.retprobe:
            attached.append(entry.symbol)
    return attached


# ---- snapshot ----

Histogram = list[tuple[float, int]]  # cumulative (le_seconds, count); the last le is +Inf


@dataclass
class CudaProcess:
    pid: int
    comm: str
    library: str
    context_switches: int
    kernel_launches: int
    syncs: int
    sync_seconds_sum: float
    sync_p99_seconds: float | None
    sync_histogram: Histogram
    runqueue_delay_seconds_sum: float
    runqueue_delay_p99_seconds: float | None
    runqueue_histogram: Histogram
    involuntary_preemptions: int
    gpu_threads: int

    def to_dict(self) -> dict:
        record = asdict(self)
        for name in ("sync_histogram", "runqueue_histogram"):
            record[name] = [
                {"le_seconds": None if le == float("inf") else le, "count": count} for le, count in record[name]
            ]
        return record


@dataclass
class CudaSnapshot:
    processes: list[CudaProcess]
    sched_strategy: str | None
    libraries: list[AttachedLibrary]

    def to_dict(self) -> dict:
        return {
            "processes": [p.to_dict() for p in self.processes],
            "sched_strategy": self.sched_strategy,
            "libraries": [asdict(lib) for lib in self.libraries],
        }


def cumulative(slots: Iterable[int]) -> Histogram:
    """log2 slots (slot i: [2^i, 2^(i+1)) ns, the last open-ended) as cumulative buckets."""
    slots = list(slots)
    buckets, total = [], 0
    for i, count in enumerate(slots):
        total += count
        le = float("inf") if i == len(slots) - 1 else 2 ** (i + 1) / NS_PER_SECOND
        buckets.append((le, total))
    return buckets


def _add(a: dict, b: dict) -> dict:
    """Sum two decoded hist structs."""
    return {"slots": [x + y for x, y in zip(a["slots"], b["slots"], strict=True)],
            "count": a["count"] + b["count"], "sum_ns": a["sum_ns"] + b["sum_ns"]}


def process_record(pid: int, threads: list[dict], library: str) -> CudaProcess:
    """One process from its GPU-driving threads' entries in map `threads`."""
    sync, runqueue = threads[0]["sync"], threads[0]["runqueue"]
    for t in threads[1:]:
        sync, runqueue = _add(sync, t["sync"]), _add(runqueue, t["runqueue"])
    sync_buckets, runqueue_buckets = cumulative(sync["slots"]), cumulative(runqueue["slots"])
    return CudaProcess(
        pid=pid,
        comm=threads[0]["comm"].split(b"\0")[0].decode(errors="replace"),
        library=library,
        context_switches=sum(t["context_switches"] for t in threads),
        kernel_launches=sum(t["kernel_launches"] for t in threads),
        syncs=sync["count"],
        sync_seconds_sum=sync["sum_ns"] / NS_PER_SECOND,
        sync_p99_seconds=quantile(sync_buckets, 0.99),
        sync_histogram=sync_buckets,
        runqueue_delay_seconds_sum=runqueue["sum_ns"] / NS_PER_SECOND,
        runqueue_delay_p99_seconds=quantile(runqueue_buckets, 0.99),
        runqueue_histogram=runqueue_buckets,
        involuntary_preemptions=sum(t["involuntary_preemptions"] for t in threads),
        gpu_threads=len(threads),
    )


# ---- the probe ----


def _attach_scheduler(obj: BpfObject, strategy: Strategy) -> None:
    """Attach the strategy's scheduler programs; uprobes attach per library as they are found."""
    for name in strategy.programs:
        if name not in UPROBE_PROGRAMS:
            obj.programs[name].attach()


class CudaProbe(Probe):
    """CUDA driver uprobes on every libcuda file in use, plus the scheduler side. Libraries are
    rescanned by a background thread (stopped by `close()`); `on_attach` hears of each new one.
    `strategies` defaults to tp_btf → raw_tp → tracepoint for the scheduler side, then none."""

    spec = SPEC

    def __init__(
        self,
        *,
        proc: Path = Path("/proc"),
        rescan_interval: float = RESCAN_INTERVAL,
        on_attach: Callable[[AttachedLibrary], None] | None = None,
        strategies: Sequence[Strategy] = STRATEGIES,
    ) -> None:
        super().__init__()
        self._strategies = strategies
        self._proc = proc
        self._interval = rescan_interval
        self._on_attach = on_attach
        self._lock = threading.Lock()
        self._libraries: dict[tuple[int, int], AttachedLibrary] = {}
        self._process_library: dict[int, str] = {}  # pid -> library path as the process sees it
        self._stop = threading.Event()
        self._scanner: threading.Thread | None = None

    @property
    def sched_strategy(self) -> str | None:
        """tp_btf, raw_tp or tracepoint; None when no scheduler program could attach."""
        strategy = self.strategy or ""
        return strategy.split("+", 1)[1] if "+" in strategy else None

    @property
    def libraries(self) -> list[AttachedLibrary]:
        with self._lock:
            return list(self._libraries.values())

    def start(self) -> None:
        self.loaded = load_first("cuda", "cuda", self._strategies, attach=_attach_scheduler)
        self.rescan()
        self._stop.clear()
        self._scanner = threading.Thread(target=self._scan_loop, name="aiprobe-cuda-scan", daemon=True)
        self._scanner.start()

    def _scan_loop(self) -> None:
        while not self._stop.wait(self._interval):
            self.rescan()

    def rescan(self) -> list[AttachedLibrary]:
        """Probe the libcuda files mapped since the last scan; returns the newly probed ones."""
        new = []
        for mapped in scan(self._proc):
            with self._lock:
                if self.loaded is None:
                    return new
                self._process_library[mapped.pid] = mapped.path
                if mapped.key in self._libraries:
                    continue
                library = AttachedLibrary(mapped.path, mapped.host_path(self._proc))
                try:
                    library.symbols = attach_entry_points(self.loaded.obj, library.host_path)
                except BpfError as exc:
                    library.error = str(exc)
                self._libraries[mapped.key] = library
            new.append(library)
            if self._on_attach is not None:
                self._on_attach(library)
        return new

    def _thread_entries(self) -> list[dict]:
        with self._lock:
            if self.loaded is None:
                return []
            return [decode(value) for _, value in self.loaded.obj.maps["threads"].items()]

    def read(self) -> CudaSnapshot:
        by_process: dict[int, list[dict]] = defaultdict(list)
        for thread in self._thread_entries():
            by_process[thread["tgid"]].append(thread)
        with self._lock:
            libraries = dict(self._process_library)
        processes = [
            process_record(pid, threads, libraries.get(pid, "")) for pid, threads in sorted(by_process.items())
        ]
        return CudaSnapshot(processes, self.sched_strategy, self.libraries)

    def map_usage(self) -> list[MapUsage]:
        with self._lock:
            if self.loaded is None:
                return []
            threads = self.loaded.obj.maps["threads"]
            return [MapUsage("threads", sum(1 for _ in threads.keys()), threads.max_entries)]

    def close(self) -> None:
        self._stop.set()
        if self._scanner is not None and self._scanner is not threading.current_thread():
            self._scanner.join()
        self._scanner = None
        with self._lock:
            super().close()


# ---- `aiprobe cuda` ----


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.6f}"


def print_table(snapshot: CudaSnapshot) -> None:
    click.echo(f"scheduler side: {snapshot.sched_strategy or 'unavailable'}")
    click.echo(f"{'PID':>8} {'COMM':<16} {'CTX_SW':>9} {'LAUNCHES':>10} {'SYNCS':>8} {'SYNC_S':>10} "
               f"{'SYNC_P99_S':>10} {'RUNQ_P99_S':>10} {'PREEMPT':>8} LIBRARY")
    for p in snapshot.processes:
        click.echo(f"{p.pid:>8} {p.comm:<16} {p.context_switches:>9} {p.kernel_launches:>10} {p.syncs:>8} "
                   f"{p.sync_seconds_sum:>10.4f} {_seconds(p.sync_p99_seconds):>10} "
                   f"{_seconds(p.runqueue_delay_p99_seconds):>10} {p.involuntary_preemptions:>8} {p.library}")


def _announce(library: AttachedLibrary) -> None:
    outcome = f"error: {library.error}" if library.error else f"{len(library.symbols)} entry points"
    click.echo(f"aiprobe cuda: probing {library.path} via {library.host_path} ({outcome})", err=True)


@click.command()
@duration_option
@json_option
@friendly_errors
def command(duration: float | None, as_json: bool) -> None:
    """CUDA context switches, kernel launches, syncs and run-queue delay per process."""
    require_privileges()
    with CudaProbe(on_attach=_announce) as probe:
        click.echo(f"aiprobe cuda: watching for processes that map {LIBRARY_PREFIX}* "
                   f"(scheduler side: {probe.sched_strategy or 'unavailable'})", err=True)
        for _ in ticks(duration, 1.0):
            pass
        snapshot = probe.read()
    if as_json:
        emit_json(snapshot.to_dict())
    else:
        print_table(snapshot)
