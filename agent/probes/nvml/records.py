"""The nvml probe's records: GPUs, their engines and processes, as NVML reports them."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...model import JOINED, Placed, Record


@dataclass
class GpuEngine(Record):
    """Context switches of one graphics engine of a GPU (GPM's GR0..GR7: GR0 alone without MIG, one or
    more per GPU instance under MIG), between this read and the previous one."""

    engine: int
    context_switches_per_second: float | None  # over the engine's elapsed cycles at the SM clock
    context_switching_ratio: float  # of the engine's time spent switching contexts
    context_switch_seconds: float | None  # mean time per switch: cycles per switch / SM clock; None without switches


@dataclass
class GpuInfo(Record):
    """A GPU, or a MIG instance of one: a GPU of its own, with its GPU's index."""

    index: int
    uuid: str
    name: str
    utilization_gpu_ratio: float | None = None
    utilization_memory_ratio: float | None = None
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None
    memory_free_bytes: int | None = None
    power_watts: float | None = None
    temperature_celsius: float | None = None
    sm_clock_hz: int | None = None
    memory_clock_hz: int | None = None
    clock_event_reasons: list[str] | None = None
    pcie_tx_bytes_per_second: int | None = None
    pcie_rx_bytes_per_second: int | None = None
    compute_mode: str | None = None
    # GPM, between this read and the previous one (None on the first read or without GPM).
    gpm_context_switch_requests: float | None = None
    gpm_context_switch_cycles_per_request: float | None = None
    gpm_context_switch_active_ratio: float | None = None
    # The same for every graphics engine in base units; the GPU's: switches per second and mean time
    # per switch over all its engines, the switching share of its busiest engine.
    context_switches_per_second: float | None = None
    context_switching_ratio: float | None = None
    context_switch_seconds: float | None = None
    engines: list[GpuEngine] = field(default_factory=list)
    parent_uuid: str = ""  # a MIG instance's GPU
    gpu_instance_id: int | None = None  # a MIG instance's GPU instance and compute instance
    compute_instance_id: int | None = None
    mig_profile: str = ""  # a MIG instance's profile (its name's last word: "3g.20gb")
    utilization_reason: str = ""  # why utilization is null where NVML never gives it (MIG)
    # A GPU: whether NVML answered GPU_IS_LOST for it (it fell off the bus: nothing else is known of it
    # until the driver is reloaded), and its last Xid since the agent started (NVML's events).
    lost: bool | None = None
    last_xid: int | None = None
    # A GPU's memory errors where it counts them: ECC errors since the driver loaded (volatile) and over
    # its life (aggregate), rows remapped for corrected and uncorrected errors, a remapping pending (a
    # reset applies it) or failed, PCIe replays; `memory_errors_reason` says which it does not count.
    ecc_corrected_volatile: int | None = None
    ecc_uncorrected_volatile: int | None = None
    ecc_corrected_aggregate: int | None = None
    ecc_uncorrected_aggregate: int | None = None
    remapped_rows_corrected: int | None = None
    remapped_rows_uncorrected: int | None = None
    row_remap_pending: bool | None = None
    row_remap_failure: bool | None = None
    pcie_replays: int | None = None
    memory_errors_reason: str = ""
    # CUDA contexts that launched work on this GPU in the last refresh (the cuda probe): 2 or more are time-sliced.
    cuda_active_contexts: int | None = field(default=None, metadata=JOINED)

    def keys(self) -> tuple[str, ...]:
        """What a CUDA process may call it (CUDA_VISIBLE_DEVICES): a GPU, its index or UUID; a MIG
        instance, its UUID."""
        return (self.uuid,) if self.parent_uuid else (str(self.index), self.uuid)


@dataclass
class GpuProcess(Placed):
    pid: int  # host pid namespace
    comm: str
    gpu_index: int
    gpu_uuid: str  # a MIG instance's own
    used_memory_bytes: int | None
    # NVML's samples of the process since the previous read, averaged (None: the GPU gives none).
    sm_utilization_ratio: float | None = None
    memory_utilization_ratio: float | None = None
    gpu_instance_id: int | None = None  # the MIG instance it runs on
    compute_instance_id: int | None = None
    # How its shares were measured: "nvml" (NVML's samples of it), or "cuda_launches" (an MPS client,
    # which NVML does not list: the MPS server's shares split by its kernel launches).
    attribution: str = "nvml"
    pod_uid: str = field(default="", metadata=JOINED)


@dataclass
class GpuEvent(Record):
    """One of NVML's events: a critical Xid error, or a single- or double-bit ECC error."""

    time: float  # unix seconds the agent received it
    gpu_index: int
    uuid: str  # its GPU's (a MIG instance's events too)
    gpu_instance_id: int | None  # the MIG instance it happened in, where NVML says
    mig_profile: str
    compute_instance_id: int | None
    event: str  # "xid", "single_bit_ecc", "double_bit_ecc"
    xid: int | None
    meaning: str
    action: str  # NVIDIA's recommended action


@dataclass
class GpuEventCount(Record):
    """Events of one kind (and Xid) on one GPU or MIG instance since the agent started."""

    gpu_index: int
    uuid: str
    gpu_instance_id: int | None
    mig_profile: str
    compute_instance_id: int | None
    event: str
    xid: int | None
    count: int


@dataclass
class GpuSnapshot(Record):
    available: bool
    reason: str = ""
    gpu_count: int | None = None  # GPUs NVML counts (nvmlDeviceGetCount) at this read
    gpus: list[GpuInfo] = field(default_factory=list)
    processes: list[GpuProcess] = field(default_factory=list)
    events: list[GpuEvent] = field(default_factory=list)  # the last few, oldest first
    event_counts: list[GpuEventCount] = field(default_factory=list)
