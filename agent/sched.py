"""Scheduler side of GPU-driving threads: run-queue delay and involuntary preemptions.

The programs live in bpf/cuda.bpf.c next to the CUDA uprobes, because they share maps `threads`
and `processes`: a thread becomes GPU-driving when a uprobe first sees it call into libcuda, the
scheduler programs act on those threads only, and `sched_process_exit` removes a thread's entry
when it exits (its counts stay in its process's entry). `aiprobe.cuda.CudaProbe` loads them
together, trying the strategies below in order (tp_btf → raw_tp → tracepoint) and reports the one
chosen as `sched_strategy`. This module declares the scheduler strategies so `aiprobe check` plans
them.
"""

from .loader import Strategy
from .probes import ProbeSpec

_SPAN = "sched_wakeup / preemption to sched_switch onto a CPU, GPU-driving threads only"
TRACEPOINTS = ("sched_wakeup", "sched_switch", "sched_process_exit")

STRATEGIES = tuple(
    Strategy(kind, programs=tuple(f"{kind}_{tp}" for tp in TRACEPOINTS), features=(kind,), span=_SPAN)
    for kind in ("tp_btf", "raw_tp", "tracepoint")
)

SPEC = ProbeSpec(
    name="sched",
    description="run-queue delay and involuntary preemptions of GPU-driving threads",
    strategies=STRATEGIES,
)
