"""The cuda probe in the agent's refresh: each process's call rates, the context-switch storm,
starved GPU threads, out-of-memory and time-slicing rules, each GPU's active contexts (into NVML's GPUs), and its
columns of the process table."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from ...histogram import quantile
from ...model import Readings
from ...refresh import Hooks, ProcessRows, Refresh, recent_buckets, target
from ...rules import Signal
from ..nvml.records import GpuInfo, GpuProcess
from ..nvml.signals import share_evidence, switching_evidence
from ..sendlat.records import RequestEndpoint
from .allocations import RecentFailures, recent_out_of_memory
from .records import AllocationFailures, CudaContext, CudaGpu, CudaProcess, CudaSnapshot


class CudaHooks(Hooks):
    def join(self, reading: CudaSnapshot, readings: Readings, refresh: Refresh) -> Iterable[int]:
        _join_active_contexts(readings.of(GpuInfo), reading.gpus)
        procs: list[CudaProcess | CudaContext | AllocationFailures] = [
            *reading.processes, *reading.contexts, *reading.allocation_failures]
        for proc in procs:
            workload = refresh.workload_of_pid(proc.pid)
            workload.label(proc)
            proc.pod_uid = workload.pod_uid
        return {proc.pid for proc in procs}

    def rates(self, reading: CudaSnapshot, refresh: Refresh, now: float) -> None:
        for cuda in reading.processes:
            counters = [cuda.context_switches, cuda.kernel_launches, cuda.syncs, cuda.graph_launches]
            (cuda.context_switches_per_second, cuda.kernel_launches_per_second, cuda.syncs_per_second,
             cuda.graph_launches_per_second) = refresh.rate(("cuda", cuda.identity()), counters, now)

    def signals(self, reading: CudaSnapshot, readings: Readings, refresh: Refresh, now: float) -> list[Signal]:
        signals = []
        for cuda in reading.processes:
            switches = cuda.context_switches_per_second
            signals.append(Signal("cuda_context_switch_storm", target(cuda), switches, {
                "context_switches_per_second": round(switches, 1), "pid": cuda.pid}))
            recent = recent_buckets(refresh, "runq", cuda.identity(), cuda.runqueue_histogram, now)
            p99 = quantile(recent, 0.99)
            if p99 is not None:
                signals.append(Signal("gpu_threads_starved", target(cuda), p99, {
                    "runqueue_delay_p99_seconds": round(p99, 6), "wakeups": int(recent[-1][1]),
                    "involuntary_preemptions": cuda.involuntary_preemptions, "pid": cuda.pid}))
        return signals + out_of_memory_signals(reading.allocation_failures, refresh, now,
                                               readings.of(RequestEndpoint)) + \
            time_slicing_signals(reading.gpus, reading.contexts, readings.of(GpuInfo), readings.of(GpuProcess))

    def process_rows(self, reading: CudaSnapshot, rows: ProcessRows) -> None:
        for cuda in reading.processes:
            entry = rows.row(cuda)
            entry.cuda_context_switches_per_second = cuda.context_switches_per_second
            entry.cuda_kernel_launches_per_second = cuda.kernel_launches_per_second
            entry.cuda_syncs_per_second = cuda.syncs_per_second
            entry.cuda_graph_launches_per_second = cuda.graph_launches_per_second
            entry.cuda_counted_at = cuda.counted_at or None
            entry.cuda_time_to_first_launch_seconds = cuda.cold_start.to_first_launch_seconds \
                if cuda.cold_start else None
            entry.runqueue_delay_p99_seconds = cuda.runqueue_delay_p99_seconds


def out_of_memory_signals(failures: list[AllocationFailures], refresh: Refresh, now: float,
                          endpoints: Sequence[RequestEndpoint] = ()) -> list[Signal]:
    """cuda_out_of_memory: per process name and container (as the rule file sums them), the out-of-memory
    failures of the last SIGNAL_WINDOW_SECONDS that were not retried; the evidence names the processes that
    had them, and of those that serve requests the servers answering more 5xx than http_server_errors'
    threshold allows in the same window (the chain from the failed allocations to the failed requests)."""
    recents = recent_out_of_memory(failures, "cuda_oom", refresh, now)
    erring = _erring_servers({recent.record.pid for recent in recents}, endpoints, refresh, now)
    by_target: dict[str, list[RecentFailures]] = {}
    for recent in recents:
        by_target.setdefault(target(recent.record), []).append(recent)
    return [Signal("cuda_out_of_memory", name, sum(recent.final for recent in group), {"processes": [
        {"pid": recent.record.pid, "final_failures": recent.final, "failures": recent.record.failures,
         "retried": recent.record.retried, "failed_bytes": recent.record.failed_bytes,
         **({"server_errors": erring[recent.record.pid]} if recent.record.pid in erring else {})}
        for recent in group if recent.final > 0]})
        for name, group in by_target.items()]


def _erring_servers(pids: set[int], endpoints: Sequence[RequestEndpoint], refresh: Refresh,
                    now: float) -> dict[int, list[dict[str, Any]]]:
    """pid -> its servers (listening port, protocol) whose 5xx share in the last SIGNAL_WINDOW_SECONDS is above
    http_server_errors' threshold, of the processes that ever ran out of memory (their windows kept every
    refresh from their first failure; an endpoint's first counts are recent)."""
    erring: dict[int, list[dict[str, Any]]] = {}
    for endpoint in endpoints:
        if endpoint.pid not in pids:
            continue
        requests, errors = refresh.recent(("oom_requests", endpoint.identity()),
                                          [endpoint.count, endpoint.server_errors], now)
        if requests and errors / requests > refresh.rule("http_server_errors").threshold:
            erring.setdefault(endpoint.pid, []).append({
                "port": endpoint.port, "protocol": endpoint.protocol, "requests": int(requests),
                "server_errors": int(errors), "server_error_share": round(errors / requests, 4)})
    return erring


def _join_active_contexts(infos: list[GpuInfo], gpus: list[CudaGpu]) -> None:
    """Each NVML GPU's active CUDA contexts (the cuda probe names a GPU by index or UUID)."""
    active = {gpu.gpu: gpu.active_contexts for gpu in gpus}
    for info in infos:
        info.cuda_active_contexts = next((active[key] for key in info.keys() if key in active), 0)


def time_slicing_signals(gpus: list[CudaGpu], contexts: list[CudaContext], infos: list[GpuInfo],
                         processes: list[GpuProcess] | None = None) -> list[Signal]:
    """gpu_time_sliced: per GPU, the contexts that launched work since the last refresh, with their
    processes, launch rates, and the GPU's utilization, each process's share of it and the GPU's own
    measure of its switching (NVML, matched by index or UUID) as evidence."""
    by_key = {key: info for info in infos for key in info.keys()}
    signals = []
    for gpu in gpus:
        active = [c for c in contexts if c.active and c.gpu == gpu.gpu]
        info = by_key.get(gpu.gpu)
        signals.append(Signal("gpu_time_sliced", f"gpu{gpu.gpu}", gpu.active_contexts, {
            "contexts": [{"pid": c.pid, "process": f"{c.comm or c.pid}@{c.container}", "context": c.context,
                          "launches_per_second": round(c.launches_per_second, 1)} for c in active],
            "utilization_ratio": None if info is None else info.utilization_gpu_ratio,
            "process_shares": share_evidence(info, processes or []),
            **switching_evidence(info)}))
    return signals
