"""The GPUs' rules: saturated, idle while the network is busy, and the GPU's own context-switch cost
(GPM). Evidence helpers the cuda probe's time-slicing rule shares."""

from __future__ import annotations

from typing import Any

from ...rules import Signal
from .records import GpuInfo, GpuProcess


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
