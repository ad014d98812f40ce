"""NVIDIA GPUs through NVML (pynvml): utilization, memory, power, clocks, PCIe, processes, and the
GPU's own context switches per graphics engine (GPM).

Every value is converted to base units (ratio 0..1, bytes, watts, hertz, celsius, bytes/s). A
metric that a GPU answers with NOT_SUPPORTED (or an old driver lacks) is disabled for that GPU
only and never asked again; other errors leave the value None for that read. Without a driver
the probe is simply unavailable (`reason` says why) and everything else keeps running.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from functools import partial
from statistics import mean
from typing import TYPE_CHECKING, Any, TypeVar

import pynvml

from ...loader import ProbeUnavailable, Strategy
from ...metrics import PROCESS_LABELS, Family, Getter, Series, value_of
from ...model import ProbeStatus
from ...names import process_name
from ...registry import Probe, ProbeSpec
from .events import ECC_EVENTS, XID, EventWatch
from .hooks import NvmlHooks
from .records import GpuEngine, GpuEventCount, GpuInfo, GpuProcess, GpuSnapshot
from .rules import (
    GPU_CONTENDED,
    GPU_CONTEXT_SWITCH_OVERHEAD,
    GPU_IDLE_WITH_TRAFFIC,
    GPU_LOST,
    GPU_MEMORY_ERRORS,
    GPU_MEMORY_PRESSURE,
    GPU_SATURATED,
    GPU_XID_ERROR,
)
from .settings import NvmlSettings
from .view import EVENTS_VIEW, PROCESS_COLUMNS, VIEW

T = TypeVar("T")
if TYPE_CHECKING:
    from ...config import Config

log = logging.getLogger("aiprobe.nvml")

PERCENT = 0.01
MILLIWATT = 0.001
MEGAHERTZ = 1_000_000
KIBIBYTE = 1024  # NVML's PCIe throughput is in KB/s of 1024 bytes
GPM_SAMPLE_GAP = 0.2  # seconds between the two GPM samples of a one-shot view (NVML wants >= 0.1)

_PERMANENT = (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
_HINTS = {
    pynvml.NVML_ERROR_LIBRARY_NOT_FOUND: "libnvidia-ml.so.1 not found (no NVIDIA driver installed)",
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED: "the NVIDIA kernel driver is not loaded",
    pynvml.NVML_ERROR_NO_PERMISSION: "no permission to open the NVIDIA device files",
}

CLOCK_EVENT_REASONS = {
    pynvml.nvmlClocksEventReasonGpuIdle: "gpu_idle",
    pynvml.nvmlClocksEventReasonApplicationsClocksSetting: "applications_clocks_setting",
    pynvml.nvmlClocksEventReasonSwPowerCap: "sw_power_cap",
    pynvml.nvmlClocksEventReasonHwSlowdown: "hw_slowdown",
    pynvml.nvmlClocksEventReasonSyncBoost: "sync_boost",
    pynvml.nvmlClocksEventReasonSwThermalSlowdown: "sw_thermal_slowdown",
    pynvml.nvmlClocksEventReasonHwThermalSlowdown: "hw_thermal_slowdown",
    pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown: "hw_power_brake_slowdown",
    pynvml.nvmlClocksEventReasonDisplayClockSetting: "display_clock_setting",
}
COMPUTE_MODES = {
    pynvml.NVML_COMPUTEMODE_DEFAULT: "default",
    pynvml.NVML_COMPUTEMODE_EXCLUSIVE_THREAD: "exclusive_thread",
    pynvml.NVML_COMPUTEMODE_PROHIBITED: "prohibited",
    pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS: "exclusive_process",
}
# GPM (Hopper and newer): the context-switch counters of each graphics engine GR0..GR7 (GR0 alone
# without MIG), as (engine, counter, metric id).
GR_ENGINES = 8
CTXSW_COUNTERS = ("CYCLES_ELAPSED", "CYCLES_ACTIVE", "REQUESTS", "CYCLES_PER_REQ", "ACTIVE_PCT")
GPM_METRICS = tuple((engine, counter, getattr(pynvml, f"NVML_GPM_METRIC_GR{engine}_CTXSW_{counter}"))
                    for engine in range(GR_ENGINES) for counter in CTXSW_COUNTERS)
NO_GPM = "no GPM (Hopper or newer)"


def _reason(exc: pynvml.NVMLError) -> str:
    return "NVML unavailable: " + _HINTS.get(exc.value, str(exc))


class _Gpu:
    """One device handle, a GPU or a MIG instance of one, with the metrics it has refused and its GPM
    state."""

    def __init__(self, index: int, handle: Any) -> None:
        self.index = index  # a MIG instance's: its GPU's
        self.handle = handle
        # NVML answered GPU_IS_LOST (None: at the start): it answers nothing more until the driver reloads.
        self.lost = handle is None
        self.uuid = "" if handle is None else pynvml.nvmlDeviceGetUUID(self.handle)
        self.name = "" if handle is None else pynvml.nvmlDeviceGetName(self.handle)
        self.disabled: set[str] = set()
        self.last_process_sample = 0  # NVML timestamp (us) of the newest per-process sample seen
        self.gpm_sample: Any = None
        self.no_gpm = ""  # why this GPU gives no GPM metrics; "" when it does
        self.parent_uuid = ""  # a MIG instance's GPU
        self.instance_ids: tuple[int | None, int | None] = (None, None)  # a MIG instance's GPU and compute instance
        self.instances: dict[str, _Gpu] = {}  # a GPU in MIG mode: its instances by UUID

    @classmethod
    def whole(cls, index: int) -> _Gpu:
        """GPU `index`, or a lost GPU where NVML says GPU_IS_LOST of it."""
        try:
            gpu = cls(index, pynvml.nvmlDeviceGetHandleByIndex(index))
            gpu.no_gpm = _gpm_refusal(gpu.handle)
        except pynvml.NVMLError as exc:
            if exc.value != pynvml.NVML_ERROR_GPU_IS_LOST:
                raise
            return cls(index, None)
        return gpu

    @classmethod
    def instance(cls, parent: _Gpu, handle: Any) -> _Gpu:
        gpu = cls(parent.index, handle)
        gpu.parent_uuid = parent.uuid
        gpu.instance_ids = (pynvml.nvmlDeviceGetGpuInstanceId(handle), pynvml.nvmlDeviceGetComputeInstanceId(handle))
        return gpu

    def query(self, metric: str, call: Callable[[], T]) -> T | None:
        """`call()`, or None when this GPU does not support `metric` (remembered), is lost or it failed."""
        if metric in self.disabled or self.lost:
            return None
        try:
            return call()
        except pynvml.NVMLError as exc:
            if exc.value in _PERMANENT:
                self.disabled.add(metric)
            self.lost = exc.value == pynvml.NVML_ERROR_GPU_IS_LOST
            return None

    def free_gpm(self) -> None:
        sample, self.gpm_sample = self.gpm_sample, None
        if sample is not None:
            pynvml.nvmlGpmSampleFree(sample)


def _gpm_refusal(handle: Any) -> str:
    """Why NVML gives no GPM metrics for this GPU, or "" when it does."""
    try:
        support = pynvml.nvmlGpmQueryDeviceSupport(handle)
    except pynvml.NVMLError as exc:
        if exc.value == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
            return "no GPM in this driver's NVML"
        if exc.value == pynvml.NVML_ERROR_GPU_IS_LOST:
            raise
        return NO_GPM if exc.value == pynvml.NVML_ERROR_NOT_SUPPORTED else f"GPM: {exc}"
    return "" if support.isSupportedDevice else NO_GPM


def _engine(engine: int, counters: dict[str, float], sm_clock_hz: int | None) -> GpuEngine:
    """One engine's switching in base units: cycles become seconds at the SM clock, and switches per
    second are over the cycles the engine counted, so that their product is the switching share."""
    ratio = counters["ACTIVE_PCT"] * PERCENT
    if not sm_clock_hz:
        return GpuEngine(engine, None, ratio, None)
    per_second = counters["REQUESTS"] * sm_clock_hz / counters["CYCLES_ELAPSED"]
    seconds = counters["CYCLES_PER_REQ"] / sm_clock_hz if counters["REQUESTS"] else None
    return GpuEngine(engine, per_second, ratio, seconds)


def _gpu_switching(engines: list[GpuEngine]) -> dict[str, Any]:
    """The GPU's switches per second and mean time per switch over all its engines, and the
    switching share of its busiest engine (what gpu_context_switch_overhead judges)."""
    timed = [e for e in engines if e.context_switches_per_second is not None]
    per_second = sum(e.context_switches_per_second or 0.0 for e in timed) if timed else None
    switching = sum((e.context_switches_per_second or 0.0) * (e.context_switch_seconds or 0.0) for e in timed)
    return {
        "context_switches_per_second": per_second,
        "context_switching_ratio": max((e.context_switching_ratio for e in engines), default=None),
        "context_switch_seconds": switching / per_second if per_second else None,
        "engines": engines,
    }


def _gr0_counters(counters: dict[str, float] | None) -> dict[str, Any]:
    """GR0's counters as NVML gives them (the snapshot's `gpm_*` fields)."""
    if counters is None:
        return dict.fromkeys(("gpm_context_switch_requests", "gpm_context_switch_cycles_per_request",
                              "gpm_context_switch_active_ratio"))
    return {"gpm_context_switch_requests": counters["REQUESTS"],
            "gpm_context_switch_cycles_per_request": counters["CYCLES_PER_REQ"],
            "gpm_context_switch_active_ratio": counters["ACTIVE_PCT"] * PERCENT}


def _scaled(value: float | None, scale: float, cast: Callable[[float], Any] = float) -> Any:
    """`value` in base units, or None where NVML gave none."""
    return None if value is None else cast(value * scale)


class NvmlProbe(Probe):
    """NVML's view of the GPUs. `start()` raises ProbeUnavailable (and `reason` says why) without a
    working driver; `read()` then reports the GPUs as unavailable."""

    def __init__(self) -> None:
        super().__init__()
        self.reason = "not started"
        self._gpus: list[_Gpu] = []
        self._initialized = False
        self._events = EventWatch()

    def start(self) -> None:
        try:
            pynvml.nvmlInit()
            self._initialized = True
            self._gpus = [_Gpu.whole(i) for i in range(pynvml.nvmlDeviceGetCount())]
            self._events = EventWatch()
            self._events.start([gpu for gpu in self._gpus if not gpu.lost])
            self.reason = ""
            for refusal in self.limitations:
                log.info("nvml: %s", refusal)
        except pynvml.NVMLError as exc:
            self.reason = _reason(exc)
            self.close()
            raise ProbeUnavailable("nvml", {"nvml": self.reason}) from None

    def status(self) -> ProbeStatus:
        if not self.available:
            return ProbeStatus(False, reason=self.reason)
        return ProbeStatus(True, "nvml", "; ".join([SPAN, *self.limitations]))

    @property
    def available(self) -> bool:
        return self._initialized

    @property
    def gpm_refusals(self) -> list[str]:
        """One line per GPU without GPM metrics (no context-switch families for it), saying why."""
        return [f"GPU {gpu.index} ({gpu.name}): {gpu.no_gpm}, so no GPU context-switch metrics"
                for gpu in self._gpus if gpu.no_gpm]

    @property
    def limitations(self) -> list[str]:
        """What the probe cannot measure here, a line each: GPUs without GPM or without events."""
        return [*self.gpm_refusals, *self.event_refusals]

    @property
    def event_refusals(self) -> list[str]:
        """One line per GPU whose events NVML refused (no Xid or ECC events from it), saying why."""
        return self._events.refusals

    @property
    def has_gpm(self) -> bool:
        """Whether a GPU takes GPM samples: its metrics need two reads, apart in time."""
        return any(gpu.gpm_sample is not None for gpu in self._gpus)

    def read(self) -> GpuSnapshot:
        if not self.available:
            return GpuSnapshot(False, self.reason)
        devices = [device for gpu in self._gpus for device in (gpu, *_instances(gpu))]
        return GpuSnapshot(
            True,
            gpu_count=_gpu_count(),
            gpus=[self._instance_info(d) if d.parent_uuid else self._gpu_info(d) for d in devices],
            # A GPU in MIG mode lists its instances' processes: each is taken from its instance.
            processes=[proc for device in devices if not device.instances for proc in self._processes(device)],
            events=self._events.recent(),
            event_counts=self._events.counts(),
        )

    @staticmethod
    def _instance_info(instance: _Gpu) -> GpuInfo:
        """A MIG instance: its memory and, where NVML gives it, utilization (its GPU has the rest)."""
        h = instance.handle
        utilization = instance.query("utilization", lambda: pynvml.nvmlDeviceGetUtilizationRates(h))
        memory = instance.query("memory", lambda: pynvml.nvmlDeviceGetMemoryInfo(h))
        return GpuInfo(
            index=instance.index, uuid=instance.uuid, name=instance.name, **_mig_fields(instance, utilization),
            utilization_gpu_ratio=None if utilization is None else utilization.gpu * PERCENT,
            utilization_memory_ratio=None if utilization is None else utilization.memory * PERCENT,
            memory_total_bytes=None if memory is None else memory.total,
            memory_used_bytes=None if memory is None else memory.used,
            memory_free_bytes=None if memory is None else memory.free,
        )

    def _gpu_info(self, gpu: _Gpu) -> GpuInfo:
        h = gpu.handle
        engines = self._gpm(gpu)
        utilization = gpu.query("utilization", lambda: pynvml.nvmlDeviceGetUtilizationRates(h))
        memory = gpu.query("memory", lambda: pynvml.nvmlDeviceGetMemoryInfo(h))
        reasons = gpu.query("clock_event_reasons", lambda: pynvml.nvmlDeviceGetCurrentClocksEventReasons(h))
        mode = gpu.query("compute_mode", lambda: pynvml.nvmlDeviceGetComputeMode(h))
        pcie = {
            name: _scaled(gpu.query(name, partial(pynvml.nvmlDeviceGetPcieThroughput, h, counter)), KIBIBYTE, int)
            for name, counter in (("pcie_tx", pynvml.NVML_PCIE_UTIL_TX_BYTES),
                                  ("pcie_rx", pynvml.NVML_PCIE_UTIL_RX_BYTES))
        }
        clocks = {
            name: _scaled(gpu.query(name, partial(pynvml.nvmlDeviceGetClockInfo, h, clock)), MEGAHERTZ, int)
            for name, clock in (("sm_clock", pynvml.NVML_CLOCK_SM), ("memory_clock", pynvml.NVML_CLOCK_MEM))
        }
        return GpuInfo(
            index=gpu.index,
            uuid=gpu.uuid,
            name=gpu.name,
            **_mig_fields(gpu, utilization),
            utilization_gpu_ratio=None if utilization is None else utilization.gpu * PERCENT,
            utilization_memory_ratio=None if utilization is None else utilization.memory * PERCENT,
            memory_total_bytes=None if memory is None else memory.total,
            memory_used_bytes=None if memory is None else memory.used,
            memory_free_bytes=None if memory is None else memory.free,
            power_watts=_scaled(gpu.query("power", lambda: pynvml.nvmlDeviceGetPowerUsage(h)), MILLIWATT),
            temperature_celsius=gpu.query(
                "temperature", lambda: pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)
            ),
            sm_clock_hz=clocks["sm_clock"],
            memory_clock_hz=clocks["memory_clock"],
            clock_event_reasons=None if reasons is None else [n for b, n in CLOCK_EVENT_REASONS.items() if reasons & b],
            pcie_tx_bytes_per_second=pcie["pcie_tx"],
            pcie_rx_bytes_per_second=pcie["pcie_rx"],
            compute_mode=None if mode is None else COMPUTE_MODES.get(mode, str(mode)),
            lost=gpu.lost,
            last_xid=self._events.last_xid(gpu.uuid),
            **_memory_errors(gpu),
            **_gr0_counters(engines.get(0)),
            **_gpu_switching([_engine(engine, counters, clocks["sm_clock"]) for engine, counters in engines.items()]),
            cuda_active_contexts=None,  # joined by the agent from the cuda probe
        )

    def _gpm(self, gpu: _Gpu) -> dict[int, dict[str, float]]:
        """engine -> its context-switch counters between the previous read's GPM sample and a new one:
        engines that NVML measured over some cycles (none the first time, or without GPM)."""
        if gpu.no_gpm:
            return {}
        sample = gpu.query("gpm", lambda: pynvml.nvmlGpmSampleGet(gpu.handle, pynvml.nvmlGpmSampleAlloc()))
        if sample is None:
            return {}
        previous, gpu.gpm_sample = gpu.gpm_sample, sample
        if previous is None:
            return {}
        request = pynvml.c_nvmlGpmMetricsGet_t()
        request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(GPM_METRICS)
        request.sample1, request.sample2 = previous, sample
        for slot, (_, _, metric_id) in zip(request.metrics, GPM_METRICS, strict=False):
            slot.metricId = metric_id
        engines: dict[int, dict[str, float]] = {}
        if gpu.query("gpm", lambda: pynvml.nvmlGpmMetricsGet(request)) is not None:
            for slot, (engine, counter, _) in zip(request.metrics, GPM_METRICS, strict=False):
                if slot.nvmlReturn == pynvml.NVML_SUCCESS:
                    engines.setdefault(engine, {})[counter] = slot.value
        pynvml.nvmlGpmSampleFree(previous)
        return {engine: counters for engine, counters in engines.items()
                if len(counters) == len(CTXSW_COUNTERS) and counters["CYCLES_ELAPSED"] > 0}

    def _processes(self, gpu: _Gpu) -> list[GpuProcess]:
        running = gpu.query("processes", lambda: pynvml.nvmlDeviceGetComputeRunningProcesses(gpu.handle)) or []
        shares = _shares(gpu)
        return [
            GpuProcess(p.pid, process_name(p.pid), gpu.index, gpu.uuid, p.usedGpuMemory, sm, memory, *gpu.instance_ids)
            for p in running
            for sm, memory in [shares.get(p.pid, IDLE) if shares is not None else (None, None)]
        ]

    def close(self) -> None:
        self._events.close()
        for gpu in self._gpus:
            gpu.free_gpm()
        self._gpus = []
        if self._initialized:
            self._initialized = False
            pynvml.nvmlShutdown()


ECC_ERRORS = (("corrected", pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
              ("uncorrected", pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED))
ECC_COUNTERS = (("volatile", pynvml.NVML_VOLATILE_ECC), ("aggregate", pynvml.NVML_AGGREGATE_ECC))


def _ecc(gpu: _Gpu) -> tuple[dict[str, int | None], str]:
    """The GPU's ECC counts (GpuInfo's `ecc_*`), and why it has none ("" where it has them)."""
    mode = gpu.query("ecc", lambda: pynvml.nvmlDeviceGetEccMode(gpu.handle))
    counts = {f"ecc_{error}_{counter}": gpu.query("ecc", partial(pynvml.nvmlDeviceGetTotalEccErrors, gpu.handle,
                                                                 error_type, counter_type))
              if mode and mode[0] else None
              for counter, counter_type in ECC_COUNTERS for error, error_type in ECC_ERRORS}
    if "ecc" in gpu.disabled:
        return counts, "no ECC"
    return counts, "ECC is off" if mode is not None and not mode[0] else ""


def _memory_errors(gpu: _Gpu) -> dict[str, Any]:
    """ECC counts, row remapping and PCIe replays where the GPU has them (GpuInfo's fields); the reason
    names those it has not (not zeros)."""
    ecc, ecc_reason = _ecc(gpu)
    rows = gpu.query("row_remapping", lambda: pynvml.nvmlDeviceGetRemappedRows(gpu.handle))
    replays = gpu.query("pcie_replays", lambda: pynvml.nvmlDeviceGetPcieReplayCounter(gpu.handle))
    reasons = [ecc_reason, "no row remapping (Ampere or newer)" if "row_remapping" in gpu.disabled else "",
               "no PCIe replay counter" if "pcie_replays" in gpu.disabled else ""]
    corrected, uncorrected, pending, failure = rows or (None,) * 4
    return {**ecc, "remapped_rows_corrected": corrected, "remapped_rows_uncorrected": uncorrected,
            "row_remap_pending": None if rows is None else bool(pending),
            "row_remap_failure": None if rows is None else bool(failure),
            "pcie_replays": replays, "memory_errors_reason": "; ".join(reason for reason in reasons if reason)}


def _gpu_count() -> int | None:
    try:
        return int(pynvml.nvmlDeviceGetCount())
    except pynvml.NVMLError:
        return None


NO_MIG_UTILIZATION = ("NVML gives no utilization for a MIG instance, nor for a GPU in MIG mode "
                      "(DCGM's profiling metrics measure instances)")


def _mig_fields(gpu: _Gpu, utilization: Any) -> dict[str, Any]:
    """A MIG instance's place in its GPU, and why NVML gives no utilization under MIG."""
    gpu_instance, compute_instance = gpu.instance_ids
    return {"parent_uuid": gpu.parent_uuid, "gpu_instance_id": gpu_instance, "compute_instance_id": compute_instance,
            "mig_profile": gpu.name.rpartition(" MIG ")[2] if gpu.parent_uuid else "",
            "utilization_reason": NO_MIG_UTILIZATION if utilization is None and (gpu.parent_uuid or gpu.instances)
            else ""}


def _mig_handle(handle: Any, index: int) -> Any:
    """The MIG device at `index` of a GPU, or None where no instance is (NOT_FOUND)."""
    try:
        return pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)
    except pynvml.NVMLError as exc:
        if exc.value == pynvml.NVML_ERROR_NOT_FOUND:
            return None
        raise


def _instances(gpu: _Gpu) -> list[_Gpu]:
    """The MIG instances of a GPU in MIG mode, found at every read (the GPU may be repartitioned);
    none for a GPU without MIG (asked once) or with MIG off."""
    mode = gpu.query("mig", lambda: pynvml.nvmlDeviceGetMigMode(gpu.handle))
    count = gpu.query("mig", lambda: pynvml.nvmlDeviceGetMaxMigDeviceCount(gpu.handle)) \
        if mode and mode[0] == pynvml.NVML_DEVICE_MIG_ENABLE else 0
    found: dict[str, _Gpu] = {}
    for index in range(count or 0):
        handle = gpu.query("mig", partial(_mig_handle, gpu.handle, index))
        uuid = None if handle is None else gpu.query("mig", partial(pynvml.nvmlDeviceGetUUID, handle))
        instance = None if uuid is None else \
            gpu.instances.get(uuid) or gpu.query("mig", partial(_Gpu.instance, gpu, handle))
        if instance is not None:
            instance.handle = handle  # NVML's handle of an instance need not stay the same
            found[instance.uuid] = instance
    gpu.instances = found
    return list(found.values())


IDLE = (0.0, 0.0)  # a process without a sample since the last read: NVML saw it use neither


def _samples_since(handle: Any, timestamp: int) -> list[Any]:
    """NVML's per-process samples newer than `timestamp` (NOT_FOUND: none were taken since)."""
    try:
        return list(pynvml.nvmlDeviceGetProcessUtilization(handle, timestamp))
    except pynvml.NVMLError as exc:
        if exc.value == pynvml.NVML_ERROR_NOT_FOUND:
            return []
        raise


def _shares(gpu: _Gpu) -> dict[int, tuple[float, float]] | None:
    """pid -> (SM, memory) utilization: the mean of NVML's samples of it since the last read (each
    sample covers one of NVML's sampling periods); None where the GPU gives no per-process samples."""
    samples = gpu.query("process_utilization", lambda: _samples_since(gpu.handle, gpu.last_process_sample))
    if samples is None:
        return None
    if samples:
        gpu.last_process_sample = max(sample.timeStamp for sample in samples)
    by_pid: dict[int, list[Any]] = {}
    for sample in samples:
        by_pid.setdefault(sample.pid, []).append(sample)
    return {pid: (mean(s.smUtil for s in taken) * PERCENT, mean(s.memUtil for s in taken) * PERCENT)
            for pid, taken in by_pid.items()}


def started_probe() -> NvmlProbe:
    """A probe started on this host's NVML, or not (its reason says why); the caller closes it."""
    probe = NvmlProbe()
    with contextlib.suppress(ProbeUnavailable):
        probe.start()
    return probe


def nvml_unavailable() -> str | None:
    """Why NVML cannot be used here, or None."""
    probe = started_probe()
    probe.close()
    return probe.reason or None


def limitations() -> list[str]:
    """What the probe cannot measure here: a line per GPU without GPM or events (`aiprobe check`)."""
    probe = started_probe()
    refusals = probe.limitations
    probe.close()
    return refusals


SPAN = "NVML samples at each read"


def _optional(name: str) -> Callable[[Any], str]:
    return lambda record: "" if (value := getattr(record, name)) is None else str(value)


def _gpu_uuid(gpu: GpuInfo) -> str:
    return gpu.parent_uuid or gpu.uuid


# A MIG instance is labelled as dcgm-exporter labels it: its GPU's index and UUID, GPU_I_ID and
# GPU_I_PROFILE, and (aiprobe's, in dcgm's style) GPU_CI_ID; all three empty for a whole GPU.
_INSTANCE_LABELS: tuple[tuple[str, Getter], ...] = (
    ("GPU_I_ID", _optional("gpu_instance_id")), ("GPU_I_PROFILE", "mig_profile"),
    ("GPU_CI_ID", _optional("compute_instance_id")))
_GPU_LABELS: tuple[tuple[str, Getter], ...] = (("gpu", "index"), ("uuid", _gpu_uuid), *_INSTANCE_LABELS)
_DCGM_LABELS: tuple[tuple[str, Getter], ...] = (("gpu", "index"), ("UUID", _gpu_uuid), ("modelName", "name"),
                                                *_INSTANCE_LABELS[:2])
_PROCESS_LABELS: tuple[tuple[str, Getter], ...] = (
    ("gpu", "gpu_index"), ("GPU_I_ID", _optional("gpu_instance_id")), ("GPU_CI_ID", _optional("compute_instance_id")),
    *PROCESS_LABELS, ("attribution", "attribution"))


def _gauge(name: str, value: Getter, help_text: str, labels: tuple[tuple[str, Any], ...] = _GPU_LABELS,
           scale: float = 1.0, option: Callable[[Config], bool] | None = None) -> Family:
    return Family(name, "gauge", help_text, GpuInfo, value, labels, scale=scale, option=option)


def _dcgm_compatible(config: Config) -> bool:
    return config.settings(NvmlSettings).dcgm_compatible_metrics


def _dcgm(name: str, value: Getter, help_text: str, scale: float = 1.0) -> Family:
    # dcgm-exporter's names and units, so dashboards built for it keep working (--dcgm-compatible).
    return _gauge(name, value, help_text, _DCGM_LABELS, scale, option=_dcgm_compatible)


def _engine_series(field: str) -> Callable[[Config], Callable[[list[GpuInfo]], list[Series]]]:
    """One series per graphics engine of each GPU: its engines are a list inside the GPU's record."""
    def series(gpus: list[GpuInfo]) -> list[Series]:
        return [((*(str(value_of(gpu, getter)) for _, getter in _GPU_LABELS), str(engine.engine)), [value])
                for gpu in gpus
                for engine in gpu.engines if (value := getattr(engine, field)) is not None]
    return lambda _config: series


def _engine_gauge(name: str, field: str, help_text: str) -> Family:
    """A gauge of each GPU's `engines`: `field` of every engine, labelled by its number."""
    return Family(name, "gauge", help_text, GpuInfo, "engines", (*_GPU_LABELS, ("engine", "engines")),
                  series=_engine_series(field), doc_note=ENGINE_NOTE)


def _process_gauge(name: str, value: str, help_text: str, doc_note: str = "") -> Family:
    return Family(name, "gauge", help_text, GpuProcess, value, _PROCESS_LABELS,
                  doc_note=doc_note)


PROCESS_SHARE_NOTE = ("The mean of NVML's per-process samples since the previous refresh "
                      "(`nvmlDeviceGetProcessUtilization`; 0 for a process with none); none where the GPU "
                      "gives no per-process samples. On a time-sliced GPU, each process's share. "
                      "`attribution`: `nvml` (NVML's samples of the process), or `cuda_launches` (an MPS client, "
                      "which NVML does not list: the MPS server's share split by the clients' kernel launches).")
MEMORY_ERRORS_NOTE = ("None for a GPU without it (the snapshot's `memory_errors_reason` says why), never zeros; "
                      "a GPU's only, not its MIG instances'.")
EVENT_NOTE = ("Counted since the agent started, from NVML's event set (nvmlEventSetWait); none for a GPU whose "
              "registration NVML refuses (the probe's status says so). The MIG labels are the instance's where "
              "NVML names one.")
ENGINE_NOTE = ("From GPM (Hopper and newer; none for a GPU without it), between two reads; `engine` is the "
               "graphics engine (GR0..GR7: 0 alone without MIG).")


def _whole_gpu(value: Callable[[GpuInfo], int]) -> Callable[[GpuInfo], int | None]:
    """`value` of a GPU; None for a MIG instance (its GPU has it)."""
    return lambda gpu: None if gpu.lost is None else value(gpu)


_EVENT_LABELS: tuple[tuple[str, Getter], ...] = (("gpu", "gpu_index"), ("uuid", "uuid"), *_INSTANCE_LABELS)


def _event_count(*events: str) -> Callable[[GpuEventCount], int | None]:
    return lambda counted: counted.count if counted.event in events else None


def _flag(name: str) -> Callable[[GpuInfo], int | None]:
    return lambda gpu: None if (value := getattr(gpu, name)) is None else int(value)


def _error_counter(name: str, counter: str, help_text: str) -> Family:
    """NVML's ECC counts of one kind (volatile or aggregate), by `error`."""
    return Family(name, "counter", help_text, GpuInfo, labels=_GPU_LABELS, expand_label="error",
                  expand=tuple((error, f"ecc_{error}_{counter}") for error, _ in ECC_ERRORS),
                  doc_note=MEMORY_ERRORS_NOTE)


def _reason_active(reason: str) -> Callable[[GpuInfo], int | None]:
    return lambda gpu: None if gpu.clock_event_reasons is None else int(reason in gpu.clock_event_reasons)


METRICS = (
    _gauge("aiprobe_gpu_utilization_ratio", "utilization_gpu_ratio", "Fraction of time a kernel ran on the GPU."),
    _gauge("aiprobe_gpu_memory_utilization_ratio", "utilization_memory_ratio",
           "Fraction of time device memory was read or written."),
    _gauge("aiprobe_gpu_memory_used_bytes", "memory_used_bytes", "GPU memory in use."),
    _gauge("aiprobe_gpu_memory_total_bytes", "memory_total_bytes", "GPU memory installed."),
    _gauge("aiprobe_gpu_power_watts", "power_watts", "GPU power draw."),
    _gauge("aiprobe_gpu_temperature_celsius", "temperature_celsius", "GPU temperature."),
    _gauge("aiprobe_gpu_sm_clock_hertz", "sm_clock_hz", "GPU SM clock."),
    _gauge("aiprobe_gpu_memory_clock_hertz", "memory_clock_hz", "GPU memory clock."),
    _gauge("aiprobe_gpu_pcie_tx_bytes_per_second", "pcie_tx_bytes_per_second", "PCIe transmit throughput."),
    _gauge("aiprobe_gpu_pcie_rx_bytes_per_second", "pcie_rx_bytes_per_second", "PCIe receive throughput."),
    Family("aiprobe_gpu_clock_event_reason_active", "gauge",
           "1 while NVML reports this reason for lowered clocks (throttling), else 0.", GpuInfo, labels=_GPU_LABELS,
           expand_label="reason", expand=tuple((reason, _reason_active(reason))
                                               for reason in CLOCK_EVENT_REASONS.values()),
           doc_note="Reasons: " + ", ".join(f"`{reason}`" for reason in CLOCK_EVENT_REASONS.values()) + "."),
    _engine_gauge("aiprobe_gpu_context_switches_per_second", "context_switches_per_second",
                  "Context switches of a GPU's graphics engine per second: the GPU saving one context's state "
                  "and restoring another's (time-slicing)."),
    _engine_gauge("aiprobe_gpu_context_switching_ratio", "context_switching_ratio",
                  "Fraction of time a GPU's graphics engine spent switching contexts."),
    _engine_gauge("aiprobe_gpu_context_switch_seconds", "context_switch_seconds",
                  "Mean time of one context switch of a GPU's graphics engine (cycles per switch at the SM clock)."),
    _gauge("aiprobe_gpu_lost", _whole_gpu(lambda gpu: int(bool(gpu.lost))),
           "1 once NVML answers GPU_IS_LOST for a GPU (it fell off the bus: Xid 79's sibling), else 0; the GPU "
           "stays in the metrics."),
    Family("aiprobe_gpus", "gauge", "GPUs NVML counts (nvmlDeviceGetCount), lost ones included while it counts them.",
           GpuSnapshot, "gpu_count"),
    Family("aiprobe_gpu_xid_errors_total", "counter", "Xid errors NVML reported (its critical Xid events), by Xid.",
           GpuEventCount, _event_count(XID), (*_EVENT_LABELS, ("xid", "xid")), doc_note=EVENT_NOTE),
    Family("aiprobe_gpu_ecc_error_events_total", "counter",
           "Single- and double-bit ECC errors NVML reported as events (`type`: single_bit_ecc, double_bit_ecc).",
           GpuEventCount, _event_count(*ECC_EVENTS), (*_EVENT_LABELS, ("type", "event")), doc_note=EVENT_NOTE),
    _error_counter("aiprobe_gpu_ecc_errors_total", "volatile",
                   "ECC errors of a GPU's memory since the driver loaded (NVML's volatile counts), by `error`: "
                   "corrected (single-bit) or uncorrected (double-bit)."),
    _error_counter("aiprobe_gpu_ecc_aggregate_errors_total", "aggregate",
                   "ECC errors of a GPU's memory over its life (NVML's aggregate counts), by `error`."),
    Family("aiprobe_gpu_remapped_rows_total", "counter",
           "Memory rows a GPU remapped to spare rows, by the `error` that caused it: corrected or uncorrected.",
           GpuInfo, labels=_GPU_LABELS, expand_label="error",
           expand=(("corrected", "remapped_rows_corrected"), ("uncorrected", "remapped_rows_uncorrected")),
           doc_note=MEMORY_ERRORS_NOTE),
    _gauge("aiprobe_gpu_row_remap_pending", _flag("row_remap_pending"),
           "1 while a row remapping waits for the GPU's reset to take effect."),
    _gauge("aiprobe_gpu_row_remap_failed", _flag("row_remap_failure"),
           "1 once a row remapping failed (no spare row left): the GPU needs replacing."),
    Family("aiprobe_gpu_pcie_replays_total", "counter",
           "PCIe transfers a GPU replayed after link errors (NVML's replay counter).", GpuInfo, "pcie_replays",
           _GPU_LABELS, doc_note=MEMORY_ERRORS_NOTE),
    _process_gauge("aiprobe_gpu_process_memory_used_bytes", "used_memory_bytes", "GPU memory used by processes."),
    _process_gauge("aiprobe_gpu_process_sm_utilization_ratio", "sm_utilization_ratio",
                   "Fraction of time a kernel of these processes ran on the GPU's SMs, between two refreshes.",
                   PROCESS_SHARE_NOTE),
    _process_gauge("aiprobe_gpu_process_memory_utilization_ratio", "memory_utilization_ratio",
                   "Fraction of time these processes read or wrote the GPU's memory, between two refreshes.",
                   PROCESS_SHARE_NOTE),
    _dcgm("DCGM_FI_DEV_GPU_UTIL", "utilization_gpu_ratio", "GPU utilization (in %).", scale=100),
    _dcgm("DCGM_FI_DEV_MEM_COPY_UTIL", "utilization_memory_ratio", "Memory utilization (in %).", scale=100),
    _dcgm("DCGM_FI_DEV_FB_USED", "memory_used_bytes", "Framebuffer memory used (in MiB).", scale=1 / 2**20),
    _dcgm("DCGM_FI_DEV_FB_FREE", "memory_free_bytes", "Framebuffer memory free (in MiB).", scale=1 / 2**20),
    _dcgm("DCGM_FI_DEV_POWER_USAGE", "power_watts", "Power draw (in W)."),
    _dcgm("DCGM_FI_DEV_GPU_TEMP", "temperature_celsius", "GPU temperature (in C)."),
    _dcgm("DCGM_FI_DEV_SM_CLOCK", "sm_clock_hz", "SM clock frequency (in MHz).", scale=1e-6),
    _dcgm("DCGM_FI_DEV_MEM_CLOCK", "memory_clock_hz", "Memory clock frequency (in MHz).", scale=1e-6),
    _dcgm("DCGM_FI_DEV_XID_ERRORS", _whole_gpu(lambda gpu: gpu.last_xid or 0),
          "Value of the last XID error encountered."),
    _dcgm("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "ecc_corrected_volatile", "Total number of single-bit volatile ECC errors."),
    _dcgm("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "ecc_uncorrected_volatile",
          "Total number of double-bit volatile ECC errors."),
    _dcgm("DCGM_FI_DEV_ECC_SBE_AGG_TOTAL", "ecc_corrected_aggregate",
          "Total number of single-bit persistent ECC errors."),
    _dcgm("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", "ecc_uncorrected_aggregate",
          "Total number of double-bit persistent ECC errors."),
    _dcgm("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "remapped_rows_corrected",
          "Number of remapped rows for correctable errors."),
    _dcgm("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "remapped_rows_uncorrected",
          "Number of remapped rows for uncorrectable errors."),
    _dcgm("DCGM_FI_DEV_ROW_REMAP_FAILURE", _flag("row_remap_failure"),
          "Whether remapping of rows has failed."),
    _dcgm("DCGM_FI_DEV_ROW_REMAP_PENDING", _flag("row_remap_pending"), "Whether remapping of rows is pending."),
    _dcgm("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "pcie_replays", "Total number of PCIe retries."),
)

SPEC = ProbeSpec(
    name="nvml",
    description="GPU utilization, memory, power, clocks and processes from NVML",
    strategies=(Strategy("nvml", span=SPAN),),
    order=50,
    factory=lambda _config: NvmlProbe(),
    requirement=nvml_unavailable,
    limitations=limitations,
    settings=NvmlSettings,
    command="aiprobe.probes.nvml.command:command",
    cli_name="gpus",
    metrics=METRICS,
    hooks=NvmlHooks(),
    process_columns=PROCESS_COLUMNS,
    views=(VIEW, EVENTS_VIEW),
    rules=(GPU_SATURATED, GPU_IDLE_WITH_TRAFFIC, GPU_CONTEXT_SWITCH_OVERHEAD, GPU_CONTENDED, GPU_XID_ERROR, GPU_LOST,
           GPU_MEMORY_ERRORS, GPU_MEMORY_PRESSURE),
)
