"""Scheduler side of GPU-driving threads: run-queue delay and involuntary preemptions.

The programs live in bpf/cuda.bpf.c next to the CUDA uprobes, because they share maps `threads`
and `processes`: a thread becomes GPU-driving when a uprobe first sees it call into libcuda, the
scheduler programs act on those threads only, and `sched_process_exit` removes a thread's entry
when it exits (its counts stay in its process's entry). `aiprobe.probes.cuda.probe.CudaProbe` loads them
together, trying the strategies below in order (tp_btf → raw_tp → tracepoint). `SchedProbe` is the
scheduler side's own face (`CudaProbe.parts`): its status (the strategy cuda chose for it, or why
none); its records are the runqueue fields of cuda's `CudaProcess` records.

The programs run on every wakeup and context switch of the host, GPU or not, so their links exist
only while a process drives the GPU (`SchedulerLinks`): they are loaded, verified and attached once
at start (which chooses the strategy), then detached until cuda's rescan (about every second) finds
a process mapping a probed CUDA library, or a GPU-driving thread in map `threads`. A thread that
starts driving the GPU in a process the rescan has not seen yet is timed from the next rescan on:
its first second or so of wakeups and preemptions is not counted. Once none does, they stay
attached LINGER_SECONDS more. The status says which it is now.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...histogram import FAST_BOUNDS
from ...libbpf import BpfError
from ...loader import BpfObject, Link, Strategy
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

# How long the scheduler side stays attached once no process drives the GPU: CUDA processes that
# come and go do not attach and detach it each time.
LINGER_SECONDS = 10.0


class SchedulerLinks:
    """The links of the scheduler programs (`programs`, loaded in `obj`): made while they are wanted,
    gone once unwanted for `linger` seconds. sched_process_exit attaches first and detaches last, so
    a thread timed by the others has its entry removed when it exits. Callers serialize calls."""

    def __init__(self, obj: BpfObject, programs: Sequence[str], linger: float = LINGER_SECONDS) -> None:
        self._obj = obj
        self._programs = tuple(programs)
        self._linger = linger
        self._links: list[Link] = []
        self._wanted_at: float | None = None
        self.error = ""  # why the last attach failed, until one succeeds

    @property
    def attached(self) -> bool:
        return bool(self._links)

    def attach(self) -> None:
        """Attach every program, or none (raises BpfError)."""
        links: list[Link] = []
        try:
            for name in reversed(self._programs):
                links.append(self._obj.programs[name].attach())
        except BpfError:
            self._detach(links)
            raise
        self._links += links
        self.error = ""

    def want(self, now: float) -> bool:
        """Wanted at `now` (time.monotonic()): attach unless attached; whether this attached them."""
        self._wanted_at = now
        if self._links or not self._programs:
            return False
        try:
            self.attach()
        except BpfError as exc:  # e.g. a busy kernel: tried again at the next want
            self.error = str(exc)
            return False
        return True

    def unwanted(self, now: float) -> None:
        """Not wanted at `now`: detach once unwanted for the linger (at once if never wanted)."""
        if self._links and (self._wanted_at is None or now - self._wanted_at >= self._linger):
            links, self._links = self._links, []
            self._detach(links)

    def _detach(self, links: list[Link]) -> None:
        for link in reversed(links):
            self._obj.release(link)


class SchedProbe:
    """The scheduler side's face (`CudaProbe.parts`): the strategy its programs were loaded with, or
    why none could be; its figures are in cuda's records."""

    def __init__(self, host: Probe, links: SchedulerLinks | None) -> None:
        self._host = host
        self._links = links

    def read(self) -> None:
        return None

    def status(self) -> ProbeStatus:
        part = self._host.loaded.strategy.part if self._host.loaded is not None else None
        if part is not None:
            return ProbeStatus(True, part.name, f"{_SPAN}; {self._attachment()}")
        why = "; ".join(f"{name}: {reason}" for name, reason in self._host.skipped.items() if name in _NAMES)
        return ProbeStatus(False, reason=why or "scheduler tracepoints unavailable")

    def _attachment(self) -> str:
        if self._links is not None and self._links.attached:
            return "attached: a process drives the GPU"
        why = f" (attach failed: {self._links.error})" if self._links is not None and self._links.error else ""
        return (f"detached while no process drives the GPU{why}: attached at the rescan (about every second) "
                "that finds one")

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
               "runqueue_histogram", PROCESS_LABELS, sum_field="runqueue_delay_seconds_sum", per_identity=True,
               buckets=FAST_BOUNDS),
        Family("aiprobe_gpu_thread_involuntary_preemptions_total", "counter",
               "Times a GPU-driving thread was preempted while runnable.", CudaProcess, "involuntary_preemptions",
               PROCESS_LABELS, per_identity=True),
    ),
    process_columns=SCHED_PROCESS_COLUMNS,
    rules=(GPU_THREADS_STARVED,),
)
