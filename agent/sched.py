"""Scheduler side of GPU-driving threads: run-queue delay and preemptions (bpf/sched.bpf.c)."""

from .loader import Strategy
from .probes import ProbeSpec

SPEC = ProbeSpec(
    name="sched",
    description="run-queue delay and involuntary preemptions of GPU-driving threads",
    strategies=(
        Strategy("tp_btf", features=("tp_btf",), span="sched_wakeup to sched_switch"),
        Strategy("raw_tp", features=("raw_tp",), span="sched_wakeup to sched_switch"),
        Strategy("tracepoint", features=("tracepoint",), span="sched_wakeup to sched_switch"),
    ),
)
