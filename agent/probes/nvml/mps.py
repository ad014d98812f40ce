"""MPS: NVML lists the MPS server, not its clients, on a GPU they share. The server's share of
the GPU goes to its clients in proportion to their kernel launches since the last refresh (the cuda
probe's contexts on that GPU), labelled `attribution="cuda_launches"` so nobody mistakes it for a
hardware counter."""

from __future__ import annotations

from ..cuda.records import CudaContext
from .records import GpuInfo, GpuProcess, GpuSnapshot

MPS_SERVER = "nvidia-cuda-mps-server"[:15]  # its comm: the kernel keeps 15 characters
BY_LAUNCHES = "cuda_launches"


def _sum(ratios: list[float | None]) -> float | None:
    known = [ratio for ratio in ratios if ratio is not None]
    return sum(known) if known else None


def _part(ratio: float | None, share: float) -> float | None:
    return None if ratio is None else ratio * share


def _launch_rates(info: GpuInfo, contexts: list[CudaContext], listed: set[int]) -> dict[tuple[int, str], float]:
    """(pid, comm) -> kernel and graph launches per second on this GPU of processes NVML does not list."""
    rates: dict[tuple[int, str], float] = {}
    for context in contexts:
        if context.active and context.gpu in info.keys() and context.pid not in listed:
            key = (context.pid, context.comm)
            rates[key] = rates.get(key, 0.0) + context.launches_per_second
    return rates


def attribute_mps(reading: GpuSnapshot, contexts: list[CudaContext]) -> None:
    """On each GPU where NVML lists an MPS server, its SM and memory shares move to the processes the
    cuda probe saw launch work there (its memory stays the server's: NVML counts it there)."""
    for info in reading.gpus:
        on_gpu = [proc for proc in reading.processes if proc.gpu_uuid == info.uuid]
        servers = [proc for proc in on_gpu if proc.comm == MPS_SERVER]
        rates = _launch_rates(info, contexts, {proc.pid for proc in on_gpu}) if servers else {}
        total = sum(rates.values())
        if not total:
            continue
        sm = _sum([server.sm_utilization_ratio for server in servers])
        memory = _sum([server.memory_utilization_ratio for server in servers])
        for (pid, comm), rate in rates.items():
            reading.processes.append(GpuProcess(
                pid, comm, info.index, info.uuid, None, _part(sm, rate / total), _part(memory, rate / total),
                info.gpu_instance_id, info.compute_instance_id, attribution=BY_LAUNCHES))
        for server in servers:
            server.sm_utilization_ratio = server.memory_utilization_ratio = None
