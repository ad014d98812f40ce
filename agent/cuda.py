"""CUDA driver uprobes: context switches, kernel launches and synchronizations per process, plus
the run-queue delay of the threads that drive the GPU (bpf/cuda.bpf.c; scheduler side: sched.py).

Libraries are found, not configured: every `libcuda.so*` file that a process maps is probed once
per file (dev, inode), whatever path or container it is reached through. A uprobe on a file covers
every process mapping it, so the probe cost grows only with calls. A background thread scans /proc
every RESCAN_INTERVAL seconds (`close()` stops it), incrementally (see LibraryScanner): a process
not seen before has its maps read at the next scan, so processes started later are picked up
within about RESCAN_INTERVAL; a process already seen is looked at again only after as long as it
has lived, at most REVISIT_INTERVAL, so a driver dlopen'ed later is found within about its age at
the dlopen (early, when frameworks usually load it) and never later than REVISIT_INTERVAL.

Counts live per process in the kernel (map `processes`) and only grow; a thread's entry in map
`threads` goes when it exits. `read()` deletes a process's entries once it has reported them with
the process already gone, so both maps stay bounded on a busy host.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import sched
from .btf import decode
from .histogram import NS_PER_SECOND, log2_buckets, quantile
from .libbpf import BpfError
from .loader import BpfObject, Strategy, load_first
from .metrics import PROCESS_LABELS, Family
from .model import AttachedLibrary, CudaProcess, CudaSnapshot, MapUsage
from .names import comm_text
from .probes import Probe, ProbeSpec, strategies_named
from .procfs import StartTimes, start_ticks

log = logging.getLogger("aiprobe.cuda")
RESCAN_INTERVAL = 1.0
REVISIT_INTERVAL = 30.0  # the longest a process already seen waits before its maps are read again
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
LIBRARY_PREFIX = "libcuda.so"
_COUNTED_MAPS = ("threads", "processes")  # bounded maps reported as aiprobe_bpf_map_entries


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



def strategies_with_scheduler(name: str | None) -> tuple[Strategy, ...]:
    """The chain, or the uprobes with only the scheduler strategy `name` (forced: `--strategy`,
    the config's `strategies.sched`)."""
    if name is None:
        return STRATEGIES
    [forced] = strategies_named(sched.SPEC, name)
    return tuple(s for s in STRATEGIES if s.name == f"uprobe+{forced.name}")


SPEC = ProbeSpec(
    name="cuda",
    description="CUDA driver calls per process: context switches, launches, syncs",
    strategies=(Strategy("uprobe", UPROBE_PROGRAMS, ("uprobe",), _UPROBE_SPAN),),
    bpf_object="cuda",
    order=30,
    factory=lambda config, _running: CudaProbe(strategies=strategies_with_scheduler(config.strategies.get("sched"))),
    command="aiprobe.commands.cuda:command",
    metrics=(
        Family("aiprobe_cuda_context_switches_total", "counter",
               "Times a thread's current CUDA context changed to a different one.", CudaProcess,
               "context_switches", PROCESS_LABELS, per_identity=True),
        Family("aiprobe_cuda_kernel_launches_total", "counter", "CUDA kernel launches.", CudaProcess,
               "kernel_launches", PROCESS_LABELS, per_identity=True),
        Family("aiprobe_cuda_sync_duration_seconds", "histogram",
               "Duration of cuStreamSynchronize / cuCtxSynchronize calls.", CudaProcess, "sync_histogram",
               PROCESS_LABELS, sum_field="sync_seconds_sum", per_identity=True),
    ),
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
        the mapped inode, else the mapping itself (a replaced or deleted file, or one on overlayfs,
        whose maps show the lower file's inode) when we may follow it (CAP_SYS_ADMIN), else the
        path through the process's root anyway."""
        through_root = f"{proc}/{self.pid}/root{self.path}"
        mapping = f"{proc}/{self.pid}/map_files/{self.address}"
        with contextlib.suppress(OSError):
            st = os.stat(through_root)
            if (st.st_dev, st.st_ino) == self.key:
                return through_root
        try:
            os.stat(mapping)
        except OSError:
            return through_root
        return mapping


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


@dataclass
class _Watched:
    start: int  # start_ticks()
    due: float  # when to look at it again (monotonic seconds)
    library: MappedLibrary | None = None


class LibraryScanner:
    """Which processes map libcuda, without reading every process's maps at every scan.

    A pid not seen before has its maps read at once. After that a process is looked at again after
    as long as it has lived (at least `interval`, at most `revisit`): a driver is usually dlopen'ed
    early (when a framework initializes CUDA), so young processes are looked at often and old ones
    rarely. A look starts by reading the start time: the same process already known to map libcuda
    needs nothing more; a reused pid is a new process.
    """

    def __init__(self, proc: Path = Path("/proc"), *, interval: float = RESCAN_INTERVAL,
                 revisit: float = REVISIT_INTERVAL, clock: Callable[[], float] = time.monotonic) -> None:
        self._proc = proc
        self._interval = interval
        self._revisit = revisit
        self._clock = clock
        self._watched: dict[int, _Watched] = {}

    def scan(self) -> list[MappedLibrary]:
        """The processes found mapping libcuda since the last scan."""
        now = self._clock()
        uptime = float((self._proc / "uptime").read_text().split()[0])
        pids = {int(entry.name) for entry in os.scandir(self._proc) if entry.name.isdigit()}
        for pid in self._watched.keys() - pids:
            del self._watched[pid]
        found = []
        for pid in pids:
            watched = self._watched.get(pid)
            if watched is not None and now < watched.due:
                continue
            start = start_ticks(pid, self._proc)
            if start is None:  # gone meanwhile
                self._watched.pop(pid, None)
                continue
            if watched is None or watched.start != start:
                watched = self._watched[pid] = _Watched(start, now)
            if watched.library is None and (library := mapped_libcuda(pid, self._proc)) is not None:
                watched.library = library
                found.append(library)
            age = uptime - start / CLOCK_TICKS
            watched.due = now + min(max(age, self._interval), self._revisit)
        return found


@contextlib.contextmanager
def own_descriptor(path: str) -> Iterator[str]:
    """`path` opened by us, as /proc/self/fd/N. The kernel refuses a uprobe on a path through
    another process's /proc/PID/root or map_files without CAP_SYS_ADMIN, but opening that path
    needs only what reading the file needs (CAP_SYS_PTRACE to follow it), and a uprobe on our own
    descriptor needs no more: the DaemonSet's capabilities suffice. The uprobe holds the inode,
    so the descriptor is closed once attached."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


def attach_entry_points(obj: BpfObject, host_path: str) -> list[str]:
    """Attach every entry point the library exports; the symbols attached."""
    attached = []
    with own_descriptor(host_path) as path:
        for entry in ENTRY_POINTS:
            try:
                obj.programs[entry.program].attach_uprobe(path, entry.symbol, retprobe=entry.retprobe)
            except BpfError as exc:
                if exc.errno != errno.ENOENT:  # ENOENT: symbol not exported by this driver version
                    raise
                continue
            if not entry.retprobe:
                attached.append(entry.symbol)
    return attached


# ---- records ----


def process_record(pid: int, entry: dict[str, Any], library: str, started: int = 0) -> CudaProcess:
    """One process from its entry in map `processes`."""
    sync, runqueue = entry["sync"], entry["runqueue"]
    sync_buckets, runqueue_buckets = log2_buckets(sync["slots"]), log2_buckets(runqueue["slots"])
    return CudaProcess(
        pid=pid,
        comm=comm_text(entry["comm"]),
        library=library,
        context_switches=entry["context_switches"],
        kernel_launches=entry["kernel_launches"],
        syncs=sync["count"],
        sync_seconds_sum=sync["sum_ns"] / NS_PER_SECOND,
        sync_p99_seconds=quantile(sync_buckets, 0.99),
        sync_histogram=sync_buckets,
        runqueue_delay_seconds_sum=runqueue["sum_ns"] / NS_PER_SECOND,
        runqueue_delay_p99_seconds=quantile(runqueue_buckets, 0.99),
        runqueue_histogram=runqueue_buckets,
        involuntary_preemptions=entry["involuntary_preemptions"],
        gpu_threads=entry["gpu_threads"],
        start_ticks=started,
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
    `strategies` defaults to tp_btf → raw_tp → tracepoint for the scheduler side, then none.
    `max_threads` overrides the capacity of map `threads` (live GPU-driving threads)."""

    spec = SPEC

    def __init__(
        self,
        *,
        proc: Path = Path("/proc"),
        rescan_interval: float = RESCAN_INTERVAL,
        on_attach: Callable[[AttachedLibrary], None] | None = None,
        strategies: Sequence[Strategy] = STRATEGIES,
        max_threads: int | None = None,
    ) -> None:
        super().__init__()
        self._strategies = strategies
        self._proc = proc
        self._interval = rescan_interval
        self._on_attach = on_attach
        self._max_threads = max_threads
        self._lock = threading.Lock()  # the loaded object and what is known of processes
        self._scan_lock = threading.Lock()  # one scan at a time
        self._scanner = LibraryScanner(proc, interval=rescan_interval)
        self._libraries: dict[tuple[int, int], AttachedLibrary] = {}
        self._process_library: dict[int, str] = {}  # pid -> library path as the process sees it
        self._reported: set[int] = set()  # pids the last read reported
        self._starts = StartTimes(proc)
        self._stop = threading.Event()
        self._scan_thread: threading.Thread | None = None

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
        self.loaded = load_first(SPEC.name, SPEC.bpf_object, self._strategies, configure=self._configure,
                                 attach=_attach_scheduler)
        self.rescan()
        self._stop.clear()
        self._scan_thread = threading.Thread(target=self._scan_loop, name="aiprobe-cuda-scan", daemon=True)
        self._scan_thread.start()

    def _configure(self, obj: BpfObject, _strategy: Strategy) -> None:
        if self._max_threads is not None:
            obj.maps["threads"].max_entries = self._max_threads

    def _scan_loop(self) -> None:
        while not self._stop.wait(self._interval):
            self.rescan()

    def rescan(self) -> list[AttachedLibrary]:
        """Probe the libcuda files mapped since the last scan; returns the newly probed ones."""
        with self._scan_lock:
            found = self._scanner.scan()
        new = []
        for mapped in found:
            with self._lock:
                if self.loaded is None:
                    return new
                self._process_library[mapped.pid] = mapped.path
                if mapped.key in self._libraries:
                    continue
                library = AttachedLibrary(mapped.path, mapped.host_path(self._proc))
                try:
                    library.symbols = attach_entry_points(self.loaded.obj, library.host_path)
                except FileNotFoundError:  # the process left before we opened its file: the next one retries
                    continue
                except (BpfError, OSError) as exc:
                    library.error = str(exc)
                    log.warning("cannot probe %s via %s: %s", library.path, library.host_path, exc)
                self._libraries[mapped.key] = library
            new.append(library)
            if self._on_attach is not None:
                self._on_attach(library)
        return new

    def read(self) -> CudaSnapshot:
        """Every process with counts. A process gone before the maps are read has its final values
        here, so its entries are deleted right after (and it is not reported again)."""
        with self._lock:
            if self.loaded is None:
                return CudaSnapshot([], self.sched_strategy, [])
            gone = {pid for pid in self._reported | self._process_library.keys()
                    if not os.path.exists(f"{self._proc}/{pid}")}
            maps = self.loaded.obj.maps
            entries = {key.value: decode(value) for key, value in maps["processes"].items()}
            processes = [process_record(pid, entry, self._process_library.get(pid, ""), self._starts.of(pid))
                         for pid, entry in sorted(entries.items())]
            self._starts.keep_only(set(entries))
            self._forget(gone)
            self._reported = entries.keys() - gone
        return CudaSnapshot(processes, self.sched_strategy, self.libraries)

    def _forget(self, pids: set[int]) -> None:
        """Delete the entries of processes that are gone. Their threads' entries normally went as
        each thread exited; without a scheduler side (no sched_process_exit) they go here."""
        maps = self.loaded.obj.maps
        maps["processes"].delete_keys(pids)
        maps["threads"].delete_keys(key for key, thread in maps["threads"].items() if thread.tgid in pids)
        for pid in pids:
            self._process_library.pop(pid, None)

    def map_usage(self) -> list[MapUsage]:
        with self._lock:
            if self.loaded is None:
                return []
            maps = [self.loaded.obj.maps[name] for name in _COUNTED_MAPS]
            return [MapUsage(m.name, sum(1 for _ in m.keys()), m.max_entries) for m in maps]

    def close(self) -> None:
        self._stop.set()
        if self._scan_thread is not None and self._scan_thread is not threading.current_thread():
            self._scan_thread.join()
        self._scan_thread = None
        with self._lock:
            super().close()
