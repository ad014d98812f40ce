"""The GPUs' rules: saturated, idle while the network is busy, the GPU's own context-switch cost
(GPM), its failures: Xid errors, lost, memory errors, and its memory pressure (with the cuda probe's
allocation failures). Evidence helpers the cuda probe's time-slicing rule shares."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ...refresh import Refresh
from ...rules import Signal
from ..cuda.allocations import recent_out_of_memory
from ..cuda.records import AllocationFailures
from .events import XID, meaning
from .records import GpuEventCount, GpuInfo, GpuProcess


def _rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def switching_evidence(info: GpuInfo | None) -> dict[str, Any]:
    """The GPU's own measure of its context switches (GPM): share of time and mean time per switch."""
    if info is None:
        return {"context_switching_ratio": None, "context_switch_seconds": None}
    return {"context_switching_ratio": _rounded(info.context_switching_ratio, 4),
            "context_switch_seconds": _rounded(info.context_switch_seconds, 9)}


def share_evidence(info: GpuInfo | None, processes: list[GpuProcess]) -> list[dict[str, Any]]:
    """Each process's share of the GPU by NVML's per-process samples since the last refresh."""
    if info is None:
        return []
    return [{"pid": proc.pid, "process": f"{proc.comm or proc.pid}@{proc.container}",
             "sm_utilization_ratio": _rounded(proc.sm_utilization_ratio, 4),
             "memory_utilization_ratio": _rounded(proc.memory_utilization_ratio, 4), "attribution": proc.attribution}
            for proc in processes if proc.gpu_uuid == info.uuid]


def context_switch_signals(infos: list[GpuInfo]) -> list[Signal]:
    """gpu_context_switch_overhead: per GPU with GPM, the switching share of its busiest engine."""
    signals = []
    for info in infos:
        if info.context_switching_ratio is None:
            continue
        busiest = max(info.engines, key=lambda engine: engine.context_switching_ratio)
        signals.append(Signal("gpu_context_switch_overhead", f"gpu{info.index}", info.context_switching_ratio, {
            **switching_evidence(info), "engine": busiest.engine,
            "context_switches_per_second": _rounded(info.context_switches_per_second, 1),
            "active_contexts": info.cuda_active_contexts, "uuid": info.uuid}))
    return signals


def utilization_signals(infos: list[GpuInfo], ingress_bytes_per_second: float, traffic_floor: float) -> list[Signal]:
    """gpu_saturated per GPU, and gpu_idle_with_traffic while the host receives traffic."""
    signals = []
    for gpu in infos:
        util = gpu.utilization_gpu_ratio
        if util is None:
            continue
        target = f"gpu{gpu.index}"
        signals.append(Signal("gpu_saturated", target, util, {"utilization_ratio": util, "uuid": gpu.uuid}))
        if ingress_bytes_per_second >= traffic_floor:
            signals.append(Signal("gpu_idle_with_traffic", target, util, {
                "utilization_ratio": util, "ingress_bytes_per_second": round(ingress_bytes_per_second),
                "uuid": gpu.uuid}))
    return signals


def _with_memory(processes: Iterable[GpuProcess]) -> list[dict[str, Any]]:
    return [{"pid": proc.pid, "process": f"{proc.comm or proc.pid}@{proc.container}",
             "used_memory_bytes": proc.used_memory_bytes} for proc in processes]


def _processes(processes: list[GpuProcess], index: int, gpu_instance: int | None = None) -> list[dict[str, Any]]:
    """The processes on a GPU (on one of its MIG instances where given), with their memory."""
    return _with_memory(proc for proc in processes
                        if proc.gpu_index == index and gpu_instance in (None, proc.gpu_instance_id))


def _place(index: int, gpu_instance: int | None, profile: str) -> str:
    return f"gpu{index}" if gpu_instance is None else f"gpu{index} MIG {profile or gpu_instance}"


def xid_signals(counts: list[GpuEventCount], processes: list[GpuProcess], refresh: Refresh,
                now: float) -> list[Signal]:
    """gpu_xid_error: per GPU (or MIG instance) and Xid, the Xid errors of the last SIGNAL_WINDOW_SECONDS."""
    signals = []
    for counted in counts:
        if counted.event != XID or counted.xid is None:
            continue
        where = (counted.gpu_index, counted.uuid, counted.gpu_instance_id, counted.compute_instance_id, counted.xid)
        [added] = refresh.recent(("nvml_xid", *where), [counted.count], now)
        what, action = meaning(XID, counted.xid)
        signals.append(Signal(
            "gpu_xid_error", f"{_place(counted.gpu_index, counted.gpu_instance_id, counted.mig_profile)} xid "
            f"{counted.xid}", added,
            {"xid": counted.xid, "meaning": what, "action": action, "uuid": counted.uuid,
             "xid_errors": counted.count,
             "processes": _processes(processes, counted.gpu_index, counted.gpu_instance_id)}))
    return signals


def failure_signals(infos: list[GpuInfo], processes: list[GpuProcess]) -> list[Signal]:
    """gpu_lost and gpu_memory_errors per GPU (not its MIG instances: the GPU has them)."""
    signals = []
    for gpu in infos:
        if gpu.lost is None:
            continue
        on_gpu = _processes(processes, gpu.index)
        signals.append(Signal("gpu_lost", f"gpu{gpu.index}", float(gpu.lost), {
            "uuid": gpu.uuid, "last_xid": gpu.last_xid, "processes": on_gpu}))
        errors = [value for value in (gpu.ecc_uncorrected_volatile, gpu.row_remap_failure) if value is not None]
        if errors:
            signals.append(Signal("gpu_memory_errors", f"gpu{gpu.index}", float(max(errors)), {
                "uuid": gpu.uuid, "ecc_uncorrected_volatile": gpu.ecc_uncorrected_volatile,
                "ecc_uncorrected_aggregate": gpu.ecc_uncorrected_aggregate,
                "remapped_rows_uncorrected": gpu.remapped_rows_uncorrected,
                "row_remap_pending": gpu.row_remap_pending, "row_remap_failure": gpu.row_remap_failure,
                "processes": on_gpu}))
    return signals


def memory_pressure_signals(infos: list[GpuInfo], processes: list[GpuProcess], failures: list[AllocationFailures],
                            refresh: Refresh, now: float) -> list[Signal]:
    """gpu_memory_pressure: per GPU (or MIG instance) whose processes' CUDA allocations ran out of memory in the
    last SIGNAL_WINDOW_SECONDS, retried or not, its memory used over its total (no signal while none failed).
    A process is on the GPU (or instance) whose UUID NVML lists it under; failures are counted per process, so
    a process on two GPUs counts for both."""
    failed: dict[int, dict[str, int]] = {}
    for recent in recent_out_of_memory(failures, "gpu_memory_pressure", refresh, now):
        counts = failed.setdefault(recent.record.pid, {"out_of_memory_failures": 0, "retried": 0})
        counts["out_of_memory_failures"] += int(recent.failures)
        counts["retried"] += int(recent.retried)
    signals = []
    for gpu in infos:
        on_gpu = _with_memory(proc for proc in processes if proc.gpu_uuid == gpu.uuid)
        if not gpu.memory_total_bytes or gpu.memory_used_bytes is None or \
                not any(failed.get(proc["pid"], {}).get("out_of_memory_failures") for proc in on_gpu):
            continue
        signals.append(Signal(
            "gpu_memory_pressure", _place(gpu.index, gpu.gpu_instance_id, gpu.mig_profile),
            gpu.memory_used_bytes / gpu.memory_total_bytes,
            {"uuid": gpu.uuid, "memory_used_bytes": gpu.memory_used_bytes, "memory_total_bytes": gpu.memory_total_bytes,
             "processes": [{**proc, "out_of_memory_failures": 0, "retried": 0, **failed.get(proc["pid"], {})}
                           for proc in on_gpu]}))
    return signals
