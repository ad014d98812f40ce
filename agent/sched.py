"""Scheduler side of GPU-driving threads: run-queue delay and involuntary preemptions.

The programs live in bpf/cuda.bpf.c next to the CUDA uprobes, because both use map `threads`:
a thread becomes GPU-driving when a uprobe first sees it call into libcuda, and the scheduler
programs act on those threads only. `aiprobe.cuda.CudaProbe` loads them together, trying the
strategies below in order (tp_btf → raw_tp → tracepoint) and reports the one chosen as
`sched_strategy`. This module declares the scheduler strategies so `aiprobe check` plans them.
"""

from .loader import Strategy
from .probes import ProbeSpec

_SPAN = "sched_wakeup / preemption to sched_switch onto a CPU, GPU-driving threads only"

STRATEGIES = tuple(
    Strategy(kind, programs=(f"{kind}_sched_wakeup", f"{kind}_sched_switch"), features=(kind,), span=_SPAN)
    for kind in ("tp_btf", "raw_tp", "tracepoint")
)

SPEC = ProbeSpec(
    name="sched",
    description="run-queue delay and involuntary preemptions of GPU-driving threads",
    strategies=STRATEGIES,
)
