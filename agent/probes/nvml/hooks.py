"""The nvml probe in the agent's refresh: its processes' containers, the GPUs' rules (gpu_contended with the
streams part's figures; the failures: Xid errors, lost GPUs, memory errors; memory pressure with the cuda
probe's allocation failures), its columns of the process table, and the snapshot's `gpus` and `gpu_events`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ...model import Readings
from ...refresh import Hooks, ProcessRows, Refresh, Section
from ...rules import Signal
from ..cuda.records import AllocationFailures, CudaContext
from ..flows.records import InterfaceTotals
from ..sendlat.records import StreamEndpoint
from .contention import contention_signals
from .mps import attribute_mps
from .records import GpuEvent, GpuInfo, GpuSnapshot
from .signals import (
    context_switch_signals,
    failure_signals,
    memory_pressure_signals,
    utilization_signals,
    xid_signals,
)


class NvmlHooks(Hooks):
    sections = {"gpus": Section(GpuInfo), "gpu_events": Section(GpuEvent)}

    def join(self, reading: GpuSnapshot, readings: Readings, refresh: Refresh) -> Iterable[int]:
        attribute_mps(reading, readings.of(CudaContext))
        for proc in reading.processes:
            workload = refresh.workload_of_pid(proc.pid)
            workload.label(proc)
            proc.pod_uid = workload.pod_uid
        return {proc.pid for proc in reading.processes}

    def signals(self, reading: GpuSnapshot, readings: Readings, refresh: Refresh, now: float) -> list[Signal]:
        # Traffic as the flows probe counts it at the interfaces (none without it).
        ingress = sum(side.bytes_per_second for side in readings.of(InterfaceTotals) if side.direction == "ingress")
        return utilization_signals(reading.gpus, ingress, refresh.config.traffic_floor_bytes_per_second) + \
            context_switch_signals(reading.gpus) + \
            contention_signals(reading.processes, readings.of(StreamEndpoint), refresh, now) + \
            xid_signals(reading.event_counts, reading.processes, refresh, now) + \
            failure_signals(reading.gpus, reading.processes) + \
            memory_pressure_signals(reading.gpus, reading.processes, readings.of(AllocationFailures), refresh, now)

    def process_rows(self, reading: GpuSnapshot, rows: ProcessRows) -> None:
        for gpu in reading.processes:
            entry = rows.row(gpu)
            entry.gpus.append(gpu.gpu_index)
            entry.gpu_memory_used_bytes = (entry.gpu_memory_used_bytes or 0) + (gpu.used_memory_bytes or 0)
            if gpu.sm_utilization_ratio is not None:
                entry.gpu_utilization_ratio = (entry.gpu_utilization_ratio or 0) + gpu.sm_utilization_ratio

    def snapshot(self, reading: GpuSnapshot) -> dict[str, Any]:
        return {"gpus": reading.gpus, "gpu_events": reading.events}
