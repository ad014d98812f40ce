"""CUDA uprobes: per process kernel and graph launches, synchronizations, threads changing their
current context, cold start; per context its device and launches (so GPUs shared between busy
contexts show); plus the run-queue delay of the threads that drive the GPU (bpf/cuda.bpf.c;
scheduler side: sched.py).

Two layers are probed, as frameworks reach the GPU through both: the driver (`libcuda.so*`) and the
runtime (`libcudart*.so*`, wherever it is mapped: system, Python wheels, torch/lib; or linked
statically into the executable). The runtime reaches the driver through cuGetProcAddress pointers,
which need not be the exported functions probed in libcuda, so a launch made through libcudart is
counted at libcudart's entry point, and a driver entry point firing inside it is not counted again.

Libraries are found, not configured: every CUDA library file that a process maps is probed once
per file (dev, inode), whatever path or container it is reached through; those installed where
the dynamic loader and the NVIDIA container toolkit look for them are probed at start, before any
process maps them (discovery.py), so the first process to load one has its cold start seen too.
Files are parsed by aiprobe.elf (bounded, checked) and uprobes attach at the offsets found, only
where the library defines its anchor symbol. A uprobe on a file covers every process mapping it,
so the probe cost grows only with calls. A background thread scans /proc
every RESCAN_INTERVAL seconds (`close()` stops it), incrementally (see LibraryScanner): a process
not seen before has its maps read at the next scan, so processes started later are picked up
within about RESCAN_INTERVAL; a process already seen is looked at again only after as long as it
has lived, at most REVISIT_INTERVAL, so a driver dlopen'ed later is found within about its age at
the dlopen (early, when frameworks usually load it) and never later than REVISIT_INTERVAL.

Counts live per process in the kernel (map `processes`) and only grow; a thread's entry in map
`threads` goes when it exits. `read()` deletes a process's entries once it has reported them with
the process already gone, so the maps stay bounded on a busy host (map `contexts` is also LRU).

A context is known by the value its process sees, its device from its creation or retain; a
device's primary context is one context whether a thread reached it through cudaSetDevice or
cuCtxSetCurrent. Contexts made current before aiprobe attached are one "unknown" context per
process (device -1) until a thread makes a context current again.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ... import elf
from ...btf import decode
from ...budget import CpuBudget
from ...histogram import FAST_BOUNDS, NS_PER_SECOND, exported_buckets, kernel_buckets, quantile
from ...libbpf import BpfError
from ...loader import BpfObject, Link, Map, Program, Strategy
from ...metrics import PROCESS_LABELS, Family
from ...model import MapUsage, ProbeStatus
from ...names import comm_text, printable
from ...procfs import StartTimes, start_ticks
from ...registry import Face, Loading, Probe, ProbeSpec, strategies_named
from ...supervisor import ATTACHMENTS, SUPERVISOR, Backoff, attach_reason
from . import sched
from .allocations import (
    ALLOCATION_ENTRY_POINTS,
    ALLOCATION_SYMBOLS,
    PITCH_ALLOCATION_SYMBOL,
    allocation_failures,
    expire_pending,
)
from .atomics import fetch_atomics
from .discovery import (
    DRIVER_ROOTS,
    FOUND_BY_PROCESS,
    LIBRARY_DIRECTORIES,
    InstalledLibrary,
    host_root,
    installed_libraries,
    maps_key,
)
from .hooks import CudaHooks
from .records import (
    AllocationFailures,
    AttachedLibrary,
    ColdStart,
    CudaContext,
    CudaGpu,
    CudaProcess,
    CudaSnapshot,
)
from .rules import CUDA_CONTEXT_SWITCH_STORM, CUDA_OUT_OF_MEMORY, GPU_TIME_SLICED
from .settings import CudaSettings
from .view import PROCESS_COLUMNS

RESCAN_INTERVAL = 1.0
REVISIT_INTERVAL = 30.0  # the longest a process already seen waits before its maps are read again
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
LIBRARY_PREFIX = "libcuda.so"
# libcudart.so.12, and the renamed copies wheels bundle (auditwheel: libcudart-<hash>.so.12).
RUNTIME_LIBRARY = re.compile(r"libcudart(-[0-9a-f]+)?\.so")
DRIVER, RUNTIME, STATIC_RUNTIME = "driver", "runtime", "static runtime"
# Bounded maps reported as aiprobe_bpf_map_entries.
_COUNTED_MAPS = ("threads", "processes", "contexts", "alloc_failures", "alloc_pending")


@dataclass(frozen=True)
class EntryPoint:
    symbol: str
    program: str
    retprobe: bool = False


def _with_exit(symbols: tuple[str, ...], enter: str, exit_program: str) -> tuple[EntryPoint, ...]:
    """Entry and return probes of each symbol. The return probe attaches first, so a half-attached
    pair can never leave a call open forever."""
    return tuple(entry for symbol in symbols
                 for entry in (EntryPoint(symbol, exit_program, True), EntryPoint(symbol, enter)))


def _ptsz(*symbols: str) -> tuple[str, ...]:
    """Each symbol and its per-thread default stream variant."""
    return tuple(name for symbol in symbols for name in (symbol, f"{symbol}_ptsz"))


DRIVER_KERNEL_LAUNCHES = _ptsz("cuLaunchKernel", "cuLaunchKernelEx", "cuLaunchCooperativeKernel")
RUNTIME_KERNEL_LAUNCHES = _ptsz("cudaLaunchKernel", "cudaLaunchKernelExC", "cudaLaunchCooperativeKernel")
# Their probes (the runtime's uretprobes included) are duty-cycled past the CPU budget; every other
# probe stays attached.
KERNEL_LAUNCH_SYMBOLS = frozenset(DRIVER_KERNEL_LAUNCHES + RUNTIME_KERNEL_LAUNCHES)

# What is probed in libcuda. A symbol the library does not define (the _ptsz variants, or
# cuLaunchKernelEx before CUDA 11.8) is skipped.
DRIVER_ENTRY_POINTS = (
    EntryPoint("cuCtxSetCurrent", "uprobe_ctx_set_current"),
    EntryPoint("cuCtxPushCurrent_v2", "uprobe_ctx_push_current"),
    EntryPoint("cuCtxPopCurrent_v2", "uprobe_ctx_pop_current"),
    EntryPoint("cuCtxDestroy_v2", "uprobe_ctx_destroy"),
    *_with_exit(("cuCtxCreate_v2",), "uprobe_ctx_create_v2", "uretprobe_ctx_made"),
    *_with_exit(("cuCtxCreate_v3",), "uprobe_ctx_create_v3", "uretprobe_ctx_made"),
    *_with_exit(("cuCtxCreate_v4",), "uprobe_ctx_create_v4", "uretprobe_ctx_made"),
    *_with_exit(("cuDevicePrimaryCtxRetain",), "uprobe_primary_ctx_retain", "uretprobe_ctx_made"),
    *_with_exit(("cuInit",), "uprobe_init", "uretprobe_call_exit"),
    *_with_exit(("cuModuleLoad", "cuModuleLoadData", "cuModuleLoadDataEx", "cuModuleLoadFatBinary",
                 "cuLibraryLoadData", "cuLibraryLoadFromFile"), "uprobe_module_load", "uretprobe_call_exit"),
    *(EntryPoint(symbol, "uprobe_launch_kernel") for symbol in DRIVER_KERNEL_LAUNCHES),
    *(EntryPoint(symbol, "uprobe_graph_launch") for symbol in _ptsz("cuGraphLaunch")),
    *_with_exit(_ptsz("cuStreamSynchronize"), "uprobe_sync_stream", "uretprobe_sync_exit"),
    *_with_exit(("cuCtxSynchronize",), "uprobe_sync_device", "uretprobe_sync_exit"),
    *_with_exit(("cuEventSynchronize",), "uprobe_sync_event", "uretprobe_sync_exit"),
    *_with_exit(ALLOCATION_SYMBOLS, "uprobe_mem_alloc", "uretprobe_mem_alloc"),
    *_with_exit((PITCH_ALLOCATION_SYMBOL,), "uprobe_mem_alloc_pitch", "uretprobe_mem_alloc"),
)

# What is probed in libcudart (shared, or linked into the executable).
RUNTIME_ENTRY_POINTS = (
    *_with_exit(RUNTIME_KERNEL_LAUNCHES, "uprobe_runtime_launch_kernel", "uretprobe_runtime_exit"),
    *_with_exit(_ptsz("cudaGraphLaunch"), "uprobe_runtime_graph_launch", "uretprobe_runtime_exit"),
    *_with_exit(("cudaSetDevice",), "uprobe_runtime_set_device", "uretprobe_runtime_set_device"),
    *_with_exit(_ptsz("cudaStreamSynchronize"), "uprobe_sync_stream", "uretprobe_sync_exit"),
    *_with_exit(("cudaDeviceSynchronize",), "uprobe_sync_device", "uretprobe_sync_exit"),
    *_with_exit(("cudaEventSynchronize",), "uprobe_sync_event", "uretprobe_sync_exit"),
)

# Per kind of library: what is probed, and the symbol that must be defined for it to be probed at all.
LIBRARY_KINDS = {
    DRIVER: (DRIVER_ENTRY_POINTS, "cuInit"),
    RUNTIME: (RUNTIME_ENTRY_POINTS, "cudaLaunchKernel"),
    STATIC_RUNTIME: (RUNTIME_ENTRY_POINTS, "cudaLaunchKernel"),
}
ENTRY_POINTS = DRIVER_ENTRY_POINTS + RUNTIME_ENTRY_POINTS
UPROBE_PROGRAMS = tuple(dict.fromkeys(entry.program for entry in ENTRY_POINTS))
_UPROBE_SPAN = ("libcuda.so and libcudart.so entry points (launches, graph launches, syncs, context changes, "
                "cold-start calls, allocations)")

# The programs that move a thread into or out of its process's synchronizations come twice (bpf/cuda.bpf.c,
# SYNC_PROGRAMS): with atomic fetch instructions, and as NAME_locked for kernels without them.
SYNC_PROGRAMS = frozenset({
    "uprobe_sync_stream", "uprobe_sync_device", "uprobe_sync_event", "uretprobe_sync_exit",
    *(f"{s.name}_sched_process_exit" for s in sched.STRATEGIES),
})
LOCKED = "_locked"


def without_fetch_atomics(strategy: Strategy) -> Strategy:
    """The strategy with the synchronization programs that need no atomic fetch instructions."""
    return replace(strategy, programs=tuple(f"{name}{LOCKED}" if name in SYNC_PROGRAMS else name
                                            for name in strategy.programs))


def loaded_program(obj: BpfObject, name: str) -> Program:
    """Program `name`, or its variant without atomic fetch instructions where that one is loaded."""
    variant: Program | None = obj.programs.get(f"{name}{LOCKED}")
    program: Program = variant if variant is not None and variant.autoload else obj.programs[name]
    return program


# The uprobes with each scheduler strategy in turn, then without a scheduler side at all.
STRATEGIES = (
    *(Strategy("uprobe", UPROBE_PROGRAMS + s.programs, ("uprobe", *s.features), _UPROBE_SPAN, part=s)
      for s in sched.STRATEGIES),
    Strategy("uprobe", UPROBE_PROGRAMS, ("uprobe",), _UPROBE_SPAN),
)


def strategies_with_scheduler(name: str | None) -> tuple[Strategy, ...]:
    """The chain, or the uprobes with only the scheduler strategy `name` (forced: `--strategy`,
    the config's `strategies.sched`)."""
    if name is None:
        return STRATEGIES
    [forced] = strategies_named(sched.PART, name)
    return tuple(s for s in STRATEGIES if s.part == forced)


def _cold_start(phase: str) -> Callable[[CudaProcess], float | None]:
    return lambda process: getattr(process.cold_start, phase) if process.cold_start else None


def _cold_start_gauge(phase: str, help_text: str) -> Family:
    return Family(f"aiprobe_cuda_cold_start_{phase}", "gauge", help_text, CudaProcess, _cold_start(phase),
                  (("pid", "pid"), *PROCESS_LABELS),
                  doc_note="Only for live processes started while the agent runs (the one family with pid).")


def _syncs(field_suffix: str) -> tuple[tuple[str, str], ...]:
    return tuple((kind, f"{kind}_sync{field_suffix}") for kind in ("stream", "device", "event"))


_GPU_LABELS = (("gpu", "gpu"),)
_ALLOCATION_LABELS = (*PROCESS_LABELS, ("error", "error"))

SPEC = ProbeSpec(
    name="cuda",
    description="CUDA driver and runtime calls per process: launches, graph launches, syncs, context changes, "
                "cold start; contexts sharing a GPU",
    strategies=(STRATEGIES[-1],),
    bpf_object="cuda",
    order=30,
    factory=lambda config: CudaProbe(strategies=strategies_with_scheduler(config.strategies.get("sched")),
                                     cpu_budget=config.settings(CudaSettings).cuda_cpu_budget or None,
                                     driver_roots=config.settings(CudaSettings).cuda_driver_roots,
                                     library_dirs=config.settings(CudaSettings).cuda_library_dirs),
    parts=(sched.PART,),
    settings=CudaSettings,
    command="aiprobe.probes.cuda.command:command",
    metrics=(
        Family("aiprobe_cuda_context_switches_total", "counter",
               "Times one of the process's threads changed its current CUDA context to a different one "
               "(cuCtxSetCurrent, push/pop, create, destroy, cudaSetDevice). Per thread: contexts "
               "time-sliced on a GPU are aiprobe_gpu_active_contexts.", CudaProcess,
               "context_switches", PROCESS_LABELS, per_identity=True),
        Family("aiprobe_cuda_kernel_launches_total", "counter",
               "CUDA kernel launches (cuLaunchKernel*, cuLaunchCooperativeKernel*, cudaLaunchKernel*, "
               "cudaLaunchKernelExC*, cudaLaunchCooperativeKernel*), each call once; while the launch probes "
               "are duty-cycled (aiprobe_cuda_launch_probe_duty_cycle < 1), partly estimated.", CudaProcess,
               "kernel_launches", PROCESS_LABELS, per_identity=True),
        Family("aiprobe_cuda_kernel_launches_estimated_total", "counter",
               "Of aiprobe_cuda_kernel_launches_total, the launches estimated rather than seen: those made "
               "while the duty-cycled launch probes were detached, extrapolated from the rate seen while "
               "attached.", CudaProcess, "estimated_launches", PROCESS_LABELS, per_identity=True),
        Family("aiprobe_cuda_launch_probe_duty_cycle", "gauge",
               "Fraction of the time the kernel-launch uprobes are attached (1: every launch is counted); "
               "the CPU budget (cuda_cpu_budget) lowers it while launches are many.", CudaSnapshot,
               "launch_duty_cycle"),
        Family("aiprobe_cuda_graph_launches_total", "counter",
               "CUDA graph launches (cuGraphLaunch*, cudaGraphLaunch*).", CudaProcess,
               "graph_launches", PROCESS_LABELS, per_identity=True),
        Family("aiprobe_cuda_runtime_launches_total", "counter",
               "Of kernel and graph launches, those counted at libcudart's entry points (the rest at "
               "libcuda's).", CudaProcess, "runtime_launches", PROCESS_LABELS, per_identity=True),
        Family("aiprobe_cuda_sync_duration_seconds", "histogram",
               "Duration of synchronize calls (stream, context/device, event).", CudaProcess, "sync_histogram",
               PROCESS_LABELS, sum_field="sync_seconds_sum", per_identity=True, buckets=FAST_BOUNDS),
        Family("aiprobe_cuda_syncs_total", "counter", "Synchronize calls by kind.", CudaProcess,
               labels=PROCESS_LABELS, per_identity=True, expand_label="kind", expand=_syncs("s")),
        Family("aiprobe_cuda_sync_seconds_total", "counter", "Time in synchronize calls by kind.", CudaProcess,
               labels=PROCESS_LABELS, per_identity=True, expand_label="kind", expand=_syncs("_seconds_sum")),
        _cold_start_gauge("to_init_seconds", "From the process's start to its first cuInit."),
        _cold_start_gauge("init_seconds", "Time in cuInit."),
        _cold_start_gauge("context_create_seconds", "Time creating or retaining contexts."),
        _cold_start_gauge("module_loads", "Module and library loads (cuModuleLoad*, cuLibraryLoad*)."),
        _cold_start_gauge("module_load_seconds", "Time loading modules and libraries."),
        _cold_start_gauge("to_first_launch_seconds", "From the process's start to its first kernel or graph launch."),
        Family("aiprobe_cuda_memory_allocation_failures_total", "counter",
               "Failed CUDA allocations (cuMemAlloc_v2, cuMemAllocAsync, cuMemAllocPitch_v2, cuMemAllocManaged, "
               "cuMemCreate) by the CUresult's name (error; `other` for codes aiprobe does not name).",
               AllocationFailures, "failures", _ALLOCATION_LABELS, per_identity=True),
        Family("aiprobe_cuda_memory_allocation_retried_total", "counter",
               "Of the failed CUDA allocations, those followed within 1 s by a success of the same size in the same "
               "process (retried, as a caching allocator does after freeing its cache); the rest failed for good.",
               AllocationFailures, "retried", _ALLOCATION_LABELS, per_identity=True),
        Family("aiprobe_cuda_memory_allocation_failed_bytes_total", "counter",
               "Bytes the failed CUDA allocations asked for (cuMemAllocPitch_v2: width x height).",
               AllocationFailures, "failed_bytes", _ALLOCATION_LABELS, per_identity=True),
        Family("aiprobe_gpu_active_contexts", "gauge",
               "CUDA contexts that launched work on the GPU since the previous refresh: two or more busy "
               "contexts are time-sliced by the GPU.", CudaGpu, "active_contexts", _GPU_LABELS),
        Family("aiprobe_gpu_context_launches_per_second", "gauge",
               "Kernel and graph launches per second into contexts on the GPU, by the process behind them.",
               CudaContext, "launches_per_second", (*_GPU_LABELS, *PROCESS_LABELS)),
    ),
    hooks=CudaHooks(),
    process_columns=PROCESS_COLUMNS,
    rules=(CUDA_CONTEXT_SWITCH_STORM, GPU_TIME_SLICED, CUDA_OUT_OF_MEMORY),
)


# ---- finding the libraries ----


@dataclass(frozen=True)
class MappedLibrary:
    """A CUDA library file (or a candidate executable) as one process maps it."""

    pid: int
    path: str  # as the process sees it (inside its container)
    dev: int
    inode: int
    address: str  # the mapping's range, which names /proc/PID/map_files/<range>
    kind: str = DRIVER  # DRIVER, RUNTIME or STATIC_RUNTIME (an executable that may define the runtime)

    @property
    def key(self) -> tuple[int, int]:
        return self.dev, self.inode

    @property
    def found(self) -> str:
        return FOUND_BY_PROCESS

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


def _library_kind(path: str) -> str | None:
    name = os.path.basename(path)
    if name.startswith(LIBRARY_PREFIX):
        return DRIVER
    if RUNTIME_LIBRARY.match(name):
        return RUNTIME
    return None


def _executable_key(pid: int, proc: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(proc / str(pid) / "exe")
    except OSError:  # gone, a kernel thread, or not ours to see
        return None
    return st.st_dev, st.st_ino


def mapped_cuda_libraries(pid: int, proc: Path = Path("/proc")) -> list[MappedLibrary]:
    """The CUDA library files process `pid` maps (one mapping each), and, when it maps libcuda but
    no libcudart, its executable as a STATIC_RUNTIME candidate (a runtime linked in statically)."""
    try:
        maps = (proc / str(pid) / "maps").read_bytes()
    except OSError:  # gone, or a kernel thread
        return []
    if b"libcud" not in maps:
        return []
    found: dict[tuple[int, int], MappedLibrary] = {}
    mappings: dict[tuple[int, int], tuple[str, str]] = {}
    for line in maps.decode(errors="replace").splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or not fields[5].startswith("/"):
            continue
        path = fields[5].removesuffix(" (deleted)")
        try:
            key = maps_key(fields[3], fields[4])
        except ValueError:  # not a line the kernel writes; the next one may do
            continue
        mappings.setdefault(key, (path, fields[0]))
        kind = _library_kind(path)
        if kind is not None and key not in found:
            found[key] = MappedLibrary(pid, path, *key, fields[0], kind)
    kinds = {library.kind for library in found.values()}
    if kinds == {DRIVER} and (exe := _executable_key(pid, proc)) in mappings:
        path, address = mappings[exe]
        found[exe] = MappedLibrary(pid, path, *exe, address, STATIC_RUNTIME)
    return list(found.values())


@dataclass
class _Watched:
    start: int  # start_ticks()
    due: float  # when to look at it again (monotonic seconds)
    libraries: set[tuple[int, int]] = field(default_factory=set)  # keys found so far
    has_driver: bool = False  # done: the runtime, if any, is loaded before the driver it loads


class LibraryScanner:
    """Which processes map CUDA libraries, without reading every process's maps at every scan.

    A pid not seen before has its maps read at once. After that a process is looked at again after
    as long as it has lived (at least `interval`, at most `revisit`): a driver is usually dlopen'ed
    early (when a framework initializes CUDA), so young processes are looked at often and old ones
    rarely. A look starts by reading the start time: the same process already known to map libcuda
    needs nothing more (libcudart, which loads it, is there by then); a reused pid is a new process.
    """

    def __init__(self, proc: Path = Path("/proc"), *, interval: float = RESCAN_INTERVAL,
                 revisit: float = REVISIT_INTERVAL, clock: Callable[[], float] = time.monotonic) -> None:
        self._proc = proc
        self._interval = interval
        self._revisit = revisit
        self._clock = clock
        self._watched: dict[int, _Watched] = {}

    def scan(self) -> list[MappedLibrary]:
        """The libraries processes were found mapping since the last scan."""
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
            if not watched.has_driver:
                found += self._new_libraries(pid, watched)
            age = uptime - start / CLOCK_TICKS
            watched.due = now + min(max(age, self._interval), self._revisit)
        return found

    def _new_libraries(self, pid: int, watched: _Watched) -> list[MappedLibrary]:
        new = [lib for lib in mapped_cuda_libraries(pid, self._proc) if lib.key not in watched.libraries]
        watched.libraries.update(lib.key for lib in new)
        watched.has_driver = watched.has_driver or any(lib.kind == DRIVER for lib in new)
        return new

@contextlib.contextmanager
def own_descriptor(path: str) -> Iterator[str]:
    """`path` opened by us, as /proc/self/fd/N. Without CAP_SYS_ADMIN the kernel refuses a uprobe
    on a path through another process's /proc/PID/root, but opening that path needs only what
    reading the file needs (CAP_SYS_PTRACE to follow it), and a uprobe on our own descriptor needs
    no more: the DaemonSet's capabilities suffice (deploy/kubernetes/README.md). The uprobe holds
    the inode, so the descriptor is closed once attached."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


class NotACudaLibrary(Exception):
    """The file does not define the anchor symbol of its kind of library."""


def attach_entry_points(obj: BpfObject, host_path: str, kind: str = DRIVER,
                        launches: LaunchProbes | None = None) -> list[str]:
    """Attach every entry point the library defines, at the offsets aiprobe.elf found (a file
    defines each symbol once, but two symbols may share an address: one probe each); the symbols
    probed. The kernel-launch entry points go to `launches` (which may duty-cycle them) when given.
    Raises NotACudaLibrary when the anchor symbol is missing, elf.ElfError for a file that is not
    an ELF object aiprobe reads."""
    entry_points, anchor = LIBRARY_KINDS[kind]
    with own_descriptor(host_path) as path:
        return _attach_at_offsets(obj, path, entry_points, anchor, launches)


def _attach_at_offsets(obj: BpfObject, path: str, entry_points: tuple[EntryPoint, ...], anchor: str,
                       launches: LaunchProbes | None) -> list[str]:
    offsets = elf.function_offsets(path, {entry.symbol for entry in entry_points})
    if anchor not in offsets:
        raise NotACudaLibrary(f"no {anchor}")
    probed, done, sites = [], set(), []
    for entry in entry_points:
        offset = offsets.get(entry.symbol)
        if offset is None or (offset, entry.program) in done:
            continue
        done.add((offset, entry.program))
        sites.append((entry, UprobeSite(path, offset, entry.program, entry.retprobe)))
        if not entry.retprobe:
            probed.append(entry.symbol)
    duty_cycled = [site for entry, site in sites if launches is not None and entry.symbol in KERNEL_LAUNCH_SYMBOLS]
    links = attach_sites(obj, [site for _, site in sites if site not in duty_cycled])
    try:
        if launches is not None:
            launches.add(path, duty_cycled)
    except BpfError:
        detach_links(obj, links)
        raise
    return probed


@dataclass(frozen=True)
class UprobeSite:
    path: str
    offset: int
    program: str
    retprobe: bool


def attach_sites(obj: BpfObject, sites: Sequence[UprobeSite]) -> list[Link]:
    """All or nothing: a retry must not count the same calls twice."""
    links: list[Link] = []
    try:
        for site in sites:
            links.append(loaded_program(obj, site.program).attach_uprobe(site.path, offset=site.offset,
                                                                         retprobe=site.retprobe))
    except BpfError:
        detach_links(obj, links)
        raise
    return links


def detach_links(obj: BpfObject, links: Sequence[Link]) -> None:
    """Detach in parallel: the kernel waits for RCU grace periods, one uprobe after another (~0.1 s
    each here), and the threads at least queue for it together."""
    if not links:
        return
    with ThreadPoolExecutor(max_workers=min(len(links), 32)) as pool:
        list(pool.map(obj.release, links))


# ---- the launch probes' duty cycle under the CPU budget ----

# What one probed kernel launch costs the launching thread, mostly the kernel's uprobe trap
# (benchmarks/bench_cuda.py: 5.4-9.4 us per cuLaunchKernel here; a runtime launch adds the trap of
# its uretprobe). Rounded up; the budget multiplies it by the launch rate.
LAUNCH_COST_NS = 10_000
# An allocation traps twice (its entry and its return probe). Those probes stay attached (a failure
# must not go unseen): their cost is charged to the budget first, and the launch probes get what is left.
ALLOCATION_COST_NS = 2 * LAUNCH_COST_NS
MAX_DUTY_EVERY = 64
# Attached 1/N of each period: long enough for detaching, ~0.1 s per uprobe (benchmarks/bench_cuda.py;
# 18 for one libcuda and one libcudart), and for a window of 1/64 of it (125 ms) to see a steady rate.
DUTY_PERIOD = 8.0


def launch_cpu_share(launches_per_second: float, every: int) -> float:
    """Estimated CPU (fraction of one CPU) of the launch probes, attached 1/`every` of the time."""
    return launches_per_second * LAUNCH_COST_NS / every / NS_PER_SECOND


def allocation_cpu_share(allocations_per_second: float) -> float:
    """Estimated CPU (fraction of one CPU) of the allocation probes, always attached."""
    return allocations_per_second * ALLOCATION_COST_NS / NS_PER_SECOND


class LaunchProbes:
    """The kernel-launch uprobes of every probed library. Without a budget, or while launches are
    few, they stay attached. Past the budget they are attached for 1/N of each period (N a power of
    two, see aiprobe.budget), and each process's launches while they were off are estimated from
    its rates in the windows around (`_account`).
    The programs count only while user space says so (bpf/cuda.bpf.c: launch_counting), so a
    window is exactly the time between two map writes, however long attaching the uprobes and
    detaching them (the kernel's RCU waits) take."""

    def __init__(self, obj: BpfObject, cpu_budget: float | None = None, period: float = DUTY_PERIOD) -> None:
        self._obj = obj
        self._budget = CpuBudget(cpu_budget, MAX_DUTY_EVERY, launch_cpu_share) if cpu_budget else None
        self.period = period
        self.every = 1
        self.scale = 1.0  # the last period's length over its window
        self._lock = threading.Lock()  # sites and links
        self._sites: list[UprobeSite] = []
        self._descriptors: list[int] = []  # the libraries, kept open to attach again
        self._links: list[Link] = []
        self._on = True  # the sites are attached
        self._epoch = 0
        self._seen: dict[int, int] = {}  # pid -> launches seen at the last period's end
        self._allocations = 0  # allocation calls of all processes at the last period's end
        self._estimated: dict[int, float] = {}  # pid -> launches estimated so far
        self._pending: dict[int, tuple[float, float]] = {}  # pid -> (launches/s in the last window, off after it)

    @property
    def budgeted(self) -> bool:
        return self._budget is not None

    @property
    def duty_cycle(self) -> float:
        return 1 / self.every

    def estimated(self, pid: int) -> int:
        return round(self._estimated.get(pid, 0.0))

    def add(self, path: str, sites: Sequence[UprobeSite]) -> None:
        """Sites in the library at `path` (reopened here, kept open until close())."""
        if not sites:
            return
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        sites = [replace(site, path=f"/proc/self/fd/{fd}") for site in sites]
        with self._lock:
            try:
                if self._on:
                    self._links += attach_sites(self._obj, sites)
            except BpfError:
                os.close(fd)
                raise
            self._sites += sites
            self._descriptors.append(fd)

    def run(self, stop: threading.Event, seen: Callable[[], dict[int, int]], allocations: Callable[[], int]) -> None:
        """Periods until `stop`; `seen()` reads each process's launches seen so far, `allocations()`
        the allocation calls of all processes."""
        self._seen, self._allocations = seen(), allocations()
        while not stop.is_set():
            start = time.monotonic()
            window = self._period(stop, start)
            elapsed = time.monotonic() - start
            self._account(seen(), elapsed, window, self._allocation_share(allocations(), elapsed))

    def _allocation_share(self, allocations: int, elapsed: float) -> float:
        """The allocation probes' CPU over the last period (processes gone take theirs away: none is negative)."""
        added, self._allocations = max(0, allocations - self._allocations), allocations
        return allocation_cpu_share(added / elapsed) if elapsed > 0 else 0.0

    def _period(self, stop: threading.Event, start: float) -> float | None:
        """One period; how long launches were counted, None: all of it."""
        if self.every == 1:
            with self._lock:
                if not self._on:
                    self._attach(counting=True)
            stop.wait(self.period)
            return None
        with self._lock:
            if not self._on:
                self._attach(counting=False)
            self._set_counting(True)
            on_since = time.monotonic()
        stop.wait(self.period / self.every)
        with self._lock:
            self._set_counting(False)
            window = time.monotonic() - on_since
            links, self._links, self._on = self._links, [], False
        detach_links(self._obj, links)  # seconds of RCU waits: rescans and reads go on meanwhile
        stop.wait(max(0.0, start + self.period - time.monotonic()))
        return window

    def _attach(self, counting: bool) -> None:
        """Attach every site, in a new epoch (bpf/cuda.bpf.c: launch_epoch)."""
        self._epoch += 1
        self._write_duty(launch_epoch=self._epoch, launch_counting=int(counting))
        self._links = attach_sites(self._obj, self._sites)
        self._on = True

    def _set_counting(self, counting: bool) -> None:
        self._write_duty(launch_epoch=self._epoch, launch_counting=int(counting))

    def _write_duty(self, **values: int) -> None:
        self._obj.set_data(".data.launch_duty", **values)

    def _account(self, seen: dict[int, int], elapsed: float, window: float | None, allocation_share: float) -> None:
        """Each process's launches in the time the probes were off: that time times the mean of its
        rates in the windows before and after it (so a change of rate between two windows is half
        in each, not all in one); added a period late, once the next window is known. Then N for
        the next period, from the rate seen in this window, within what the allocation probes left of the budget."""
        counted = elapsed if window is None else window
        off = 0.0 if window is None else elapsed - window
        rates = {pid: max(0, count - self._seen.get(pid, 0)) / counted for pid, count in seen.items()}
        for pid, rate in rates.items():
            last_rate, last_off = self._pending.get(pid, (rate, 0.0))
            if last_off:
                self._estimated[pid] = self._estimated.get(pid, 0.0) + last_off * (last_rate + rate) / 2
            self._pending[pid] = (rate, off)
        self._seen, self.scale = seen, elapsed / counted
        self._pending = {pid: pending for pid, pending in self._pending.items() if pid in seen}
        self._estimated = {pid: n for pid, n in self._estimated.items() if pid in seen}
        if self._budget is not None:
            self.every = self._budget.every(sum(rates.values()), self.every, allocation_share)

    def close(self) -> None:
        """The links go with the object; the libraries' descriptors here."""
        with self._lock:
            for fd in self._descriptors:
                os.close(fd)
            self._descriptors = []


# ---- records ----

SYNC_KINDS = ("stream", "device", "event")  # enum sync_kind
CALL_INIT, CALL_CTX_CREATE, CALL_MODULE_LOAD = range(3)  # enum timed_call
PRIMARY_CTX_TAG = 1 << 63


def counted_at(entry: dict[str, Any]) -> str:
    """The layers a process's launches were counted at."""
    runtime = entry["runtime_launches"]
    driver = entry["kernel_launches"] + entry["graph_launches"] - runtime
    return "+".join(layer for layer, count in (("runtime", runtime), ("driver", driver)) if count)


def _since_start(entry: dict[str, Any], field_name: str) -> float | None:
    at = entry[field_name]
    return (at - entry["start_ns"]) / NS_PER_SECOND if at and at >= entry["start_ns"] else None


def cold_start(entry: dict[str, Any]) -> ColdStart:
    count, ns = entry["call_count"], entry["call_ns"]
    return ColdStart(
        to_init_seconds=_since_start(entry, "init_ns"),
        init_seconds=ns[CALL_INIT] / NS_PER_SECOND,
        context_creates=count[CALL_CTX_CREATE],
        context_create_seconds=ns[CALL_CTX_CREATE] / NS_PER_SECOND,
        module_loads=count[CALL_MODULE_LOAD],
        module_load_seconds=ns[CALL_MODULE_LOAD] / NS_PER_SECOND,
        to_first_launch_seconds=_since_start(entry, "first_launch_ns"),
    )


def process_record(pid: int, entry: dict[str, Any], library: str, started: int = 0) -> CudaProcess:
    """One process from its entry in map `processes`."""
    sync, runqueue = entry["sync"], entry["runqueue"]
    sync_buckets, runqueue_buckets = kernel_buckets(sync["slots"]), kernel_buckets(runqueue["slots"])
    by_kind = dict(zip(SYNC_KINDS, zip(entry["sync_count"], entry["sync_ns"], strict=True), strict=True))
    return CudaProcess(
        pid=pid,
        comm=comm_text(entry["comm"]),
        library=library,
        context_switches=entry["thread_ctx_changes"],
        kernel_launches=entry["kernel_launches"],
        syncs=sync["count"],
        sync_seconds_sum=sync["sum_ns"] / NS_PER_SECOND,
        sync_p99_seconds=quantile(sync_buckets, 0.99),
        sync_histogram=exported_buckets(sync_buckets),
        runqueue_delay_seconds_sum=runqueue["sum_ns"] / NS_PER_SECOND,
        runqueue_delay_p99_seconds=quantile(runqueue_buckets, 0.99),
        runqueue_histogram=exported_buckets(runqueue_buckets),
        involuntary_preemptions=entry["involuntary_preemptions"],
        gpu_threads=entry["gpu_threads"],
        graph_launches=entry["graph_launches"],
        runtime_launches=entry["runtime_launches"],
        counted_at=counted_at(entry),
        start_ticks=started,
        **{f"{kind}_syncs": count for kind, (count, _) in by_kind.items()},
        **{f"{kind}_sync_seconds_sum": ns / NS_PER_SECOND for kind, (_, ns) in by_kind.items()},
    )


def context_name(ctx: int) -> str:
    if not ctx:
        return "unknown"
    return f"primary:{ctx & 0xFFFF}" if ctx & PRIMARY_CTX_TAG else hex(ctx)


def visible_devices(pid: int, proc: Path = Path("/proc")) -> list[str] | None:
    """The process's CUDA_VISIBLE_DEVICES as a list (None: unset or unreadable). Read as data:
    bounded, never evaluated."""
    try:
        with open(proc / str(pid) / "environ", "rb") as environ:
            raw = environ.read(1 << 20)
    except OSError:
        return None
    for variable in raw.split(b"\0"):
        if variable.startswith(b"CUDA_VISIBLE_DEVICES="):
            value = variable.split(b"=", 1)[1][:4096].decode("ascii", errors="replace")
            return [part.strip() for part in value.split(",") if part.strip()]
    return None


def physical_gpu(device: int, visible: list[str] | None) -> str:
    """The GPU a process's device ordinal names: its entry in CUDA_VISIBLE_DEVICES (an index or a
    UUID), else the ordinal itself; "unknown" when the ordinal is not known."""
    if device < 0 or (visible is not None and device >= len(visible)):
        return "unknown"
    return visible[device] if visible is not None else str(device)


def gpus_of(contexts: list[CudaContext]) -> list[CudaGpu]:
    """Per GPU, the contexts active since the previous read."""
    by_gpu: dict[str, list[CudaContext]] = {}
    for context in contexts:
        if context.active:
            by_gpu.setdefault(context.gpu, []).append(context)
    return [
        CudaGpu(gpu, len(active), [f"{c.pid}/{c.context}" for c in active], sorted({c.pid for c in active}),
                sum(c.launches_per_second for c in active))
        for gpu, active in sorted(by_gpu.items())
    ]


class _LaunchRates:
    """Launches per context since the previous read (a context that launched is active)."""

    def __init__(self) -> None:
        self._last: dict[tuple[int, int], int] = {}
        self._last_read = time.monotonic()

    def update(self, key: tuple[int, int], launches: int, now: float) -> tuple[int, float]:
        """(launches added, per second) since the previous read; a context seen for the first time
        launched all of its launches since then."""
        previous = self._last.get(key, 0)
        self._last[key] = launches
        added = launches - previous if launches >= previous else launches  # LRU-evicted and back
        return added, added / (now - self._last_read) if now > self._last_read else 0.0

    def read_done(self, keys: set[tuple[int, int]], now: float) -> None:
        self._last = {key: value for key, value in self._last.items() if key in keys}
        self._last_read = now


# ---- the probe ----


class CudaProbe(Probe):
    """CUDA uprobes on every libcuda and libcudart file in use, plus the scheduler side. Libraries are
    rescanned by a background thread (stopped by `close()`); `on_attach` hears of each new one.
    `strategies` defaults to tp_btf → raw_tp → tracepoint for the scheduler side, then none.
    `max_threads` overrides the capacity of map `threads` (live GPU-driving threads).
    `cpu_budget` (a fraction of one CPU) duty-cycles the kernel-launch probes past it, in periods
    of `duty_period` seconds (LaunchProbes). `sched_linger`: seconds the scheduler side stays
    attached once no process drives the GPU (sched.SchedulerLinks). The libraries installed under
    `driver_roots` and in `library_dirs` (host paths) are probed at start (discovery.py)."""

    spec = SPEC

    def __init__(
        self,
        *,
        proc: Path = Path("/proc"),
        rescan_interval: float = RESCAN_INTERVAL,
        on_attach: Callable[[AttachedLibrary], None] | None = None,
        strategies: Sequence[Strategy] = STRATEGIES,
        max_threads: int | None = None,
        cpu_budget: float | None = None,
        duty_period: float = DUTY_PERIOD,
        sched_linger: float = sched.LINGER_SECONDS,
        driver_roots: Sequence[str] = DRIVER_ROOTS,
        library_dirs: Sequence[str] = LIBRARY_DIRECTORIES,
    ) -> None:
        super().__init__()
        self._driver_roots = driver_roots
        self._library_dirs = library_dirs
        self._sched_linger = sched_linger
        self._sched_links: sched.SchedulerLinks | None = None
        self._cpu_budget = cpu_budget
        self._duty_period = duty_period
        self._launch_probes: LaunchProbes | None = None
        self._duty_thread: threading.Thread | None = None
        self._strategies = strategies
        self._proc = proc
        self._interval = rescan_interval
        self._on_attach = on_attach
        self._max_threads = max_threads
        self._lock = threading.Lock()  # the loaded object and what is known of processes
        self._scan_lock = threading.Lock()  # one scan at a time
        self._scanner = LibraryScanner(proc, interval=rescan_interval)
        self._libraries: dict[tuple[int, int], AttachedLibrary | None] = {}
        self._process_library: dict[int, str] = {}  # pid -> library path as the process sees it
        self._process_runtime: dict[int, AttachedLibrary] = {}  # pid -> its probed libcudart
        self._reported: set[int] = set()  # pids the last read reported
        self._starts = StartTimes(proc)
        self._started_ns = 0  # CLOCK_MONOTONIC, as the kernel's timestamps
        self._attached_ns: dict[tuple[int, int], int] = {}  # library file -> when its probes were attached
        self._watched_since: dict[int, int] = {}  # pid -> when its driver's probes were attached
        self._launches = _LaunchRates()
        self._stop = threading.Event()
        self._scan_thread: threading.Thread | None = None
        self._retry: dict[tuple[int, int], MappedLibrary] = {}  # libraries whose attach failed
        self._backoff = Backoff()

    @property
    def sched_strategy(self) -> str | None:
        """tp_btf, raw_tp or tracepoint; None when no scheduler program could attach."""
        part = self.loaded.strategy.part if self.loaded is not None else None
        return part.name if part is not None else None

    def parts(self) -> dict[str, Face]:
        return {sched.PART.name: sched.SchedProbe(self, self._sched_links)} if self.loaded is not None else {}

    def start(self) -> None:
        self._started_ns = time.monotonic_ns()
        self.loaded = self.loading().load(SPEC)
        self._launch_probes = LaunchProbes(self.loaded.obj, self._cpu_budget, self._duty_period)
        # Shared with streams (bpf/cuda_sync.h), the map may outlive an earlier cuda probe, whose open
        # synchronizations would never close: counts start anew.
        sync_time = self.loaded.obj.maps["cuda_sync_time"]
        sync_time.delete_keys(list(sync_time.keys()))
        self._probe_installed()
        self.rescan()
        self._stop.clear()
        self._scan_thread = SUPERVISOR.start_thread("cuda_scan", self._scan_loop, self._stop)
        if self._launch_probes.budgeted:
            self._duty_thread = SUPERVISOR.start_thread("cuda_duty_cycle", self._duty_loop, self._stop)

    def _duty_loop(self) -> None:
        assert self._launch_probes is not None  # set before the thread starts
        self._launch_probes.run(self._stop, self._launches_seen, self._allocations_seen)

    def _launches_seen(self) -> dict[int, int]:
        """Each process's kernel launches the probes saw."""
        with self._lock:
            if self.loaded is None:
                return {}
            return {key.value: value.kernel_launches for key, value in self.loaded.obj.maps["processes"].items()}

    def _allocations_seen(self) -> int:
        """The allocation calls of every process the maps hold."""
        with self._lock:
            if self.loaded is None:
                return 0
            return sum(value.alloc_calls for _, value in self.loaded.obj.maps["processes"].items())

    def loading(self) -> Loading:
        return Loading(self._kernel_strategies(), self._configure, self._attach_scheduler)

    def _kernel_strategies(self) -> tuple[Strategy, ...]:
        """The strategies, with the programs this kernel takes (atomic fetch instructions or not)."""
        return tuple(self._strategies) if fetch_atomics() else tuple(map(without_fetch_atomics, self._strategies))

    def _attach_scheduler(self, obj: BpfObject, strategy: Strategy) -> None:
        """Attach the strategy's scheduler programs, so a strategy that cannot attach gives way to the
        next; the first rescan detaches them while no process drives the GPU. Uprobes attach per
        library as they are found."""
        programs = [loaded_program(obj, name).name for name in strategy.part.programs] if strategy.part else []
        self._sched_links = sched.SchedulerLinks(obj, programs, self._sched_linger)
        self._sched_links.attach()

    def _gate_scheduler(self) -> None:
        """The scheduler side attached while a process drives the GPU (or lingering after), detached
        otherwise. Threads that exited while it was detached had no sched_process_exit to delete
        their entries: those go when it attaches again."""
        assert self.loaded is not None and self._sched_links is not None  # callers hold the lock and checked
        now = time.monotonic()
        if not self._drives_gpu():
            self._sched_links.unwanted(now)
        elif self._sched_links.want(now):
            threads = self.loaded.obj.maps["threads"]
            threads.delete_keys(key for key, thread in threads.items()
                                if not os.path.exists(f"{self._proc}/{thread.tgid}/task/{key.value}"))

    def _drives_gpu(self) -> bool:
        """A GPU-driving thread is in map `threads`, or a live process maps a probed CUDA library."""
        assert self.loaded is not None
        if next(iter(self.loaded.obj.maps["threads"].keys()), None) is not None:
            return True
        pids = self._process_library.keys() | self._process_runtime.keys()
        return any(os.path.exists(f"{self._proc}/{pid}") for pid in pids)

    def _configure(self, obj: BpfObject, _strategy: Strategy) -> None:
        if self._max_threads is not None:
            obj.maps["threads"].max_entries = self._max_threads

    def _scan_loop(self) -> None:
        while not self._stop.wait(self._interval):
            self.rescan()

    def rescan(self) -> list[AttachedLibrary]:
        """Probe the CUDA libraries mapped since the last scan, and again those that failed once their
        back-off is over; returns the newly probed ones. The scheduler side is attached before a
        process's library shows in `libraries`, and detached when no process drives the GPU."""
        with self._scan_lock:
            found = self._scanner.scan() + self._due_retries()
        new: list[AttachedLibrary] = []
        for mapped in found:
            with self._lock:
                if self.loaded is None:
                    return new
                library, is_new = self._library(mapped)
                self._note_process_library(mapped, library)
                self._gate_scheduler()
            if is_new and library is not None:
                new.append(library)
                if self._on_attach is not None:
                    self._on_attach(library)
        with self._lock:
            if self.loaded is not None:
                self._gate_scheduler()
        return new

    def _probe_installed(self) -> None:
        """Attach to the libraries installed on the host before any process maps them."""
        for installed in installed_libraries(_library_kind, self._driver_roots, self._library_dirs,
                                             host_root(self._proc)):
            with self._lock:
                library, is_new = self._library(installed)
            if is_new and library is not None and self._on_attach is not None:
                self._on_attach(library)

    def _library(self, mapped: MappedLibrary | InstalledLibrary) -> tuple[AttachedLibrary | None, bool]:
        """The file's probes, attached on first sight; None: not a CUDA library after all (an
        executable without a runtime in it, a file found at start that is none). Every outcome is
        remembered per file."""
        known = self._libraries.get(mapped.key)
        if mapped.key in self._libraries and (known is None or not known.error):
            return known, False
        assert self.loaded is not None  # callers hold the lock and checked
        library = AttachedLibrary(printable(mapped.path), mapped.host_path(self._proc), kind=mapped.kind,
                                  found=mapped.found)
        self._attached_ns[mapped.key] = time.monotonic_ns()
        candidate = mapped.kind == STATIC_RUNTIME
        try:
            library.symbols = attach_entry_points(self.loaded.obj, library.host_path, mapped.kind,
                                                  self._launch_probes)
        except BpfError as exc:  # e.g. a privilege or a busy kernel: worth another try later
            library.error = printable(str(exc))
            ATTACHMENTS.failed(SPEC.name, library.path, attach_reason(exc), library.error)
            if isinstance(mapped, MappedLibrary):  # one found at start: tried again once a process maps it
                self._backoff.failed(mapped.key, time.monotonic())
                self._retry[mapped.key] = mapped
        except (NotACudaLibrary, elf.ElfError, OSError) as exc:  # the file itself: not worth retrying
            library.error = printable(str(exc))
            candidate = candidate or isinstance(mapped, InstalledLibrary)
        else:
            ATTACHMENTS.succeeded(SPEC.name, library.path)
            if mapped.kind == DRIVER:
                library.missing = [symbol for symbol in ALLOCATION_ENTRY_POINTS if symbol not in library.symbols]
            self._backoff.forget(mapped.key)
            self._retry.pop(mapped.key, None)
        probed = None if candidate and library.error else library
        self._libraries[mapped.key] = probed
        return probed, True

    def _note_process_library(self, mapped: MappedLibrary, library: AttachedLibrary | None) -> None:
        if mapped.kind == DRIVER:
            self._process_library[mapped.pid] = printable(mapped.path)
            self._watched_since[mapped.pid] = self._attached_ns[mapped.key]
        elif library is not None and not library.error:
            self._process_runtime[mapped.pid] = library

    @property
    def libraries(self) -> list[AttachedLibrary]:
        with self._lock:
            return [library for library in self._libraries.values() if library is not None]

    def _due_retries(self) -> list[MappedLibrary]:
        """Libraries that failed to attach and may be tried again: by a process that still maps them."""
        now = time.monotonic()
        due = []
        for key, mapped in list(self._retry.items()):
            if not os.path.exists(f"{self._proc}/{mapped.pid}"):
                self._retry.pop(key)
                self._backoff.forget(key)
            elif self._backoff.due(key, now):
                due.append(mapped)
        return due

    def read(self) -> CudaSnapshot:
        """Every process with counts, every context with launches, the GPUs shared by busy contexts.
        A process gone before the maps are read has its final values here, so its entries are
        deleted right after (and it is not reported again)."""
        with self._lock:
            if self.loaded is None or self._launch_probes is None:
                return CudaSnapshot([], self.sched_strategy, [])
            gone = {pid for pid in self._reported | self._process_library.keys()
                    if not os.path.exists(f"{self._proc}/{pid}")}
            maps = self.loaded.obj.maps
            entries = {key.value: decode(value) for key, value in maps["processes"].items()}
            processes = [self._process(pid, entry) for pid, entry in sorted(entries.items())]
            self._starts.keep_only(set(entries))
            comms = {p.pid: p.comm for p in processes}
            contexts = self._contexts(maps["contexts"].items(), comms)
            failures = allocation_failures(maps["alloc_failures"].items(), comms,
                                           {p.pid: p.start_ticks for p in processes})
            expire_pending(maps["alloc_pending"])
            self._forget(maps, gone)
            self._reported = entries.keys() - gone
            duty_cycle = self._launch_probes.duty_cycle
        return CudaSnapshot(processes, self.sched_strategy, self.libraries, contexts, gpus_of(contexts), duty_cycle,
                            failures)

    def _process(self, pid: int, entry: dict[str, Any]) -> CudaProcess:
        process = process_record(pid, entry, self._process_library.get(pid, ""), self._starts.of(pid))
        assert self._launch_probes is not None  # read() checked
        process.estimated_launches = self._launch_probes.estimated(pid)
        process.kernel_launches += process.estimated_launches
        runtime = self._process_runtime.get(pid)
        if runtime is not None:
            process.runtime = "static" if runtime.kind == STATIC_RUNTIME else "shared"
            process.runtime_library = runtime.path
        if self._saw_start(pid, entry):
            process.cold_start = cold_start(entry)
        return process

    def _saw_start(self, pid: int, entry: dict[str, Any]) -> bool:
        """Whether the process's CUDA start-up was watched from its beginning: it started while the
        probe ran, and either its driver's probes were attached before it started, or its cuInit
        (the first call of every CUDA program) was seen."""
        start = entry["start_ns"]
        attached = self._watched_since.get(pid)
        return start >= self._started_ns and (bool(entry["init_ns"]) or (attached is not None and attached <= start))

    def _contexts(self, items: list[tuple[Any, Any]], comms: dict[int, str]) -> list[CudaContext]:
        """While the launch probes are duty-cycled, rates are scaled as launch counts are (an
        estimate; a context's counts are those seen)."""
        now = time.monotonic()
        scale = self._launch_probes.scale if self._launch_probes is not None else 1.0
        visible: dict[int, list[str] | None] = {}
        contexts, seen = [], set()
        for key, value in items:
            seen.add((key.tgid, key.ctx))
            pid, entry = key.tgid, decode(value)
            if pid not in visible:
                visible[pid] = visible_devices(pid, self._proc)
            launches = entry["kernel_launches"] + entry["graph_launches"]
            if not launches:  # known (created, retained) but never launched on
                continue
            added, rate = self._launches.update((pid, key.ctx), launches, now)
            contexts.append(CudaContext(pid, comms.get(pid, ""), context_name(key.ctx), entry["device"],
                                        physical_gpu(entry["device"], visible[pid]), entry["kernel_launches"],
                                        entry["graph_launches"], rate * scale, added > 0))
        self._launches.read_done(seen, now)
        return sorted(contexts, key=lambda c: (c.gpu, c.pid, c.context))

    def _forget(self, maps: dict[str, Map], pids: set[int]) -> None:
        """Delete the entries of processes that are gone. Their threads' entries normally went as
        each thread exited; without a scheduler side (no sched_process_exit) they go here."""
        maps["processes"].delete_keys(pids)
        maps["cuda_sync_time"].delete_keys(pids)
        maps["threads"].delete_keys(key for key, thread in maps["threads"].items() if thread.tgid in pids)
        for name in ("contexts", "alloc_failures", "alloc_pending"):
            maps[name].delete_keys(key for key in maps[name].keys() if key.tgid in pids)
        for pid in pids:
            self._process_library.pop(pid, None)
            self._process_runtime.pop(pid, None)
            self._watched_since.pop(pid, None)

    def map_usage(self) -> list[MapUsage]:
        with self._lock:
            if self.loaded is None:
                return []
            maps = [self.loaded.obj.maps[name] for name in _COUNTED_MAPS]
            return [MapUsage(m.name, sum(1 for _ in m.keys()), m.max_entries) for m in maps]

    def status(self) -> ProbeStatus:
        """As every probe's, and while over its CPU budget, how much of the time launches are counted."""
        status = super().status()
        if status.up and self._launch_probes is not None and self._launch_probes.every > 1:
            status.span += (f"; kernel launches counted 1/{self._launch_probes.every} of the time, launch counts "
                            "estimated (CPU budget)")
        return status

    def close(self) -> None:
        self._stop.set()
        for thread in (self._scan_thread, self._duty_thread):
            if thread is not None and thread is not threading.current_thread():
                thread.join()
        self._scan_thread = self._duty_thread = None
        with self._lock:
            if self.loaded is not None:  # in parallel: one after another, the uprobes' RCU waits take seconds
                detach_links(self.loaded.obj, self.loaded.obj.links)
            super().close()
            if self._launch_probes is not None:
                self._launch_probes.close()
