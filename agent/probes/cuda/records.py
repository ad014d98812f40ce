"""The cuda probe's records: CUDA calls per process, context and GPU, cold starts."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...model import HISTOGRAM, JOINED, Histogram, Identity, Placed, Record


@dataclass
class ColdStart(Record):
    """Where a process started while aiprobe watched spent its CUDA start-up (seconds; null: the
    step has not happened). Measured from the process's start (its fork; exec follows at once for
    a spawned program)."""

    to_init_seconds: float | None  # start -> first cuInit
    init_seconds: float  # in cuInit
    context_creates: int  # cuCtxCreate*, cuDevicePrimaryCtxRetain
    context_create_seconds: float
    module_loads: int  # cuModuleLoad*, cuLibraryLoad*
    module_load_seconds: float
    to_first_launch_seconds: float | None  # start -> first kernel or graph launch


@dataclass
class CudaProcess(Placed):
    pid: int
    comm: str
    library: str
    # A thread's current context became a different one (cuCtxSetCurrent, push/pop, create,
    # destroy, cudaSetDevice): per thread, not the GPU time-slicing between contexts (CudaGpu).
    context_switches: int
    kernel_launches: int
    syncs: int
    sync_seconds_sum: float
    sync_p99_seconds: float | None
    sync_histogram: Histogram = field(metadata=HISTOGRAM)
    runqueue_delay_seconds_sum: float = 0.0
    runqueue_delay_p99_seconds: float | None = None
    runqueue_histogram: Histogram = field(default_factory=list, metadata=HISTOGRAM)
    involuntary_preemptions: int = 0
    gpu_threads: int = 0  # threads ever seen calling into libcuda / libcudart
    start_ticks: int = 0
    graph_launches: int = 0
    runtime_launches: int = 0  # of kernel and graph launches, those counted at libcudart's entry points
    # Of kernel_launches, those estimated (not seen) while the launch probes were duty-cycled (CPU budget).
    estimated_launches: int = 0
    counted_at: str = ""  # "runtime", "driver", "runtime+driver": the layers its launches were counted at
    runtime: str = ""  # "" (none seen), "shared" (a libcudart file) or "static" (linked into the executable)
    runtime_library: str = ""
    stream_syncs: int = 0
    device_syncs: int = 0
    event_syncs: int = 0
    stream_sync_seconds_sum: float = 0.0
    device_sync_seconds_sum: float = 0.0
    event_sync_seconds_sum: float = 0.0
    cold_start: ColdStart | None = None  # processes started while aiprobe watched
    context_switches_per_second: float = field(default=0.0, metadata=JOINED)
    kernel_launches_per_second: float = field(default=0.0, metadata=JOINED)
    graph_launches_per_second: float = field(default=0.0, metadata=JOINED)
    syncs_per_second: float = field(default=0.0, metadata=JOINED)
    pod_uid: str = field(default="", metadata=JOINED)

    def identity(self) -> Identity:
        return self.pid, self.start_ticks


@dataclass
class AllocationFailures(Placed):
    """A process's failed CUDA allocations (cuMemAlloc_v2, cuMemAllocAsync, cuMemAllocPitch_v2,
    cuMemAllocManaged, cuMemCreate) with one error."""

    pid: int
    comm: str
    error: str  # the CUresult's name (CUDA_ERROR_OUT_OF_MEMORY); "other" for a code aiprobe does not name
    failures: int
    failed_bytes: int  # what the failed calls asked for
    # Of failures, those followed within 1 s by a success of the same size in the process (retried); the
    # rest failed for good, or wait for a retry for up to 1 s.
    retried: int
    start_ticks: int = 0
    pod_uid: str = field(default="", metadata=JOINED)

    @property
    def final(self) -> int:
        """Failures not retried."""
        return self.failures - self.retried

    def identity(self) -> Identity:
        return self.pid, self.start_ticks, self.error


@dataclass
class CudaContext(Placed):
    """A context that launched work, in its process."""

    pid: int
    comm: str
    context: str  # the CUcontext value, "primary:N" (device N's primary context) or "unknown"
    device: int  # CUDA device ordinal in the process; -1: created before aiprobe watched
    gpu: str  # the physical GPU (index, or UUID), through the process's CUDA_VISIBLE_DEVICES
    kernel_launches: int
    graph_launches: int
    launches_per_second: float  # kernel + graph launches, since the previous read
    active: bool  # launched since the previous read
    pod_uid: str = field(default="", metadata=JOINED)


@dataclass
class CudaGpu(Record):
    """A GPU and the contexts that launched work on it since the previous read: two or more busy
    contexts are time-sliced by the GPU (each switch saves and restores the GPU's state)."""

    gpu: str
    active_contexts: int
    contexts: list[str]  # "pid/context"
    pids: list[int]
    launches_per_second: float


@dataclass
class AttachedLibrary(Record):
    """One probed library file: which entry points it defined, or why it could not be probed."""

    path: str
    host_path: str
    symbols: list[str] = field(default_factory=list)
    error: str = ""
    kind: str = "driver"  # "driver" (libcuda), "runtime" (libcudart) or "static runtime" (an executable)
    missing: list[str] = field(default_factory=list)  # allocation entry points a probed driver lacks (unseen)
    # How it was found: "process" (a process mapped it), or at start, installed: "ld.so.cache", "directory".
    found: str = "process"


@dataclass
class CudaSnapshot(Record):
    processes: list[CudaProcess]
    sched_strategy: str | None
    libraries: list[AttachedLibrary]
    contexts: list[CudaContext] = field(default_factory=list)
    gpus: list[CudaGpu] = field(default_factory=list)
    # Fraction of the time the kernel-launch probes are attached (1: every launch counted; less:
    # duty-cycled under the CPU budget, launch counts partly estimated).
    launch_duty_cycle: float = 1.0
    allocation_failures: list[AllocationFailures] = field(default_factory=list)
