"""Scheduler side of GPU-driving threads: run-queue delay and involuntary preemptions.

The programs live in bpf/cuda.bpf.c next to the CUDA uprobes, because they share maps `threads`
and `processes`: a thread becomes GPU-driving when a uprobe first sees it call into libcuda, the
scheduler programs act on those threads only, and `sched_process_exit` removes a thread's entry
when it exits (its counts stay in its process's entry). `aiprobe.probes.cuda.probe.CudaProbe` loads them
together, trying the strategies below in order (tp_btf → raw_tp → tracepoint). `SchedProbe` is the
scheduler side's own face (`CudaProbe.parts`): its status (the strategy cuda chose for it, or why
none); its records are the runqueue fields of cuda's `CudaProcess` records.
"""

from __future__ import annotations

from ...loader import Strategy
from ...metrics import PROCESS_LABELS, Family
from ...model import MapUsage, ProbeStatus
from ...registry import Part, Probe
from .records import CudaProcess
from .rules import GPU_THREADS_STARVED
from .view import SCHED_PROCESS_COLUMNS

_SPAN = "sched_wakeup / preemption to sched_switch onto a CPU, GPU-driving threads only"
TRACEPOINTS = ("sched_wakeup", "sched_switch", "sched_process_exit")

STRATEGIES = tuple(
    Strategy(kind, programs=tuple(f"{kind}_{tp}" for tp in TRACEPOINTS), features=(kind,), span=_SPAN)
    for kind in ("tp_btf", "raw_tp", "tracepoint")
)
_NAMES = {strategy.name for strategy in STRATEGIES}


class SchedProbe:
    """The scheduler side's face (`CudaProbe.parts`): the strategy its programs were loaded with, or
    why none could be; its figures are in cuda's records."""

    def __init__(self, host: Probe) -> None:
        self._host = host

    def read(self) -> None:
        return None

    def status(self) -> ProbeStatus:
        part = self._host.loaded.strategy.part if self._host.loaded is not None else None
        if part is not None:
            return ProbeStatus(True, part.name, _SPAN)
        why = "; ".join(f"{name}: {reason}" for name, reason in self._host.skipped.items() if name in _NAMES)
        return ProbeStatus(False, reason=why or "scheduler tracepoints unavailable")

    def map_usage(self) -> list[MapUsage]:
        return []

    def events_lost(self) -> int:
        return 0


PART = Part(
    name="sched",
    description="run-queue delay and involuntary preemptions of GPU-driving threads",
    strategies=STRATEGIES,
    order=40,
    metrics=(
        Family("aiprobe_gpu_thread_runqueue_delay_seconds", "histogram",
               "Time GPU-driving threads waited runnable for a CPU (wakeup to on-CPU).", CudaProcess,
               "runqueue_histogram", PROCESS_LABELS, sum_field="runqueue_delay_seconds_sum", per_identity=True),
        Family("aiprobe_gpu_thread_involuntary_preemptions_total", "counter",
               "Times a GPU-driving thread was preempted while runnable.", CudaProcess, "involuntary_preemptions",
               PROCESS_LABELS, per_identity=True),
    ),
    process_columns=SCHED_PROCESS_COLUMNS,
    rules=(GPU_THREADS_STARVED,),
)
