"""CUDA uprobe overhead: a fixture program calls one entry point in a tight loop (cuLaunchKernel,
cuGraphLaunch, the runtime's cudaLaunchKernel), timed by its own clock, alternating within one run
between no probe, an empty uprobe program on the same symbol, and the full cuda probe. The empty
program separates the kernel's uprobe cost (breakpoint trap, probe lookup, running a BPF program at
all) from our program's own work (three hash lookups and atomic increments; for the runtime, also
the uretprobe that closes the call: a second trap); both are per call, independent of how many
processes or libraries are probed.

The difference of two trap-dominated timings is within the noise of a shared machine, so our
program's own time is also taken from the kernel's BPF run-time statistics (BPF_ENABLE_STATS,
held only while this benchmark runs): run_time_ns / run_cnt of each program, as fdinfo shows them.
The fixtures' entry points start with `push %rbp` (frame pointers), which the kernel emulates:
one trap per hit, as for most functions of a real library."""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks import Result, bpf_run_stats, bpf_stats

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the fake libcuda and its driver live with the test fixtures

from aiprobe import elf  # noqa: E402
from aiprobe.loader import BpfObject, Program  # noqa: E402
from aiprobe.probes.cuda.probe import DRIVER_KERNEL_LAUNCHES, CudaProbe, UprobeSite, attach_sites, detach_links  # noqa: E402
from fixtures.cuda_fake import DRIVER, RUNTIME_DRIVER, Driver, build  # noqa: E402
from helpers import FIXTURE_BUILD, CBuild  # noqa: E402

CALLS_DETACHED = 5_000_000
CALLS_ATTACHED = 200_000  # each probed call costs a trap: fewer calls for a similar run time
ROUNDS = 5
RATES = (10_000, 100_000)  # launches per second


def ns_per_run(program: Program) -> float:
    """The program's mean run time so far (run_time_ns / run_cnt)."""
    run_time_ns, runs = bpf_run_stats(program.fd)
    return run_time_ns / max(runs, 1)


@dataclass(frozen=True)
class Call:
    """One probed entry point, called in a tight loop by a fixture program's bench mode."""

    symbol: str
    program: str  # the uprobe of the cuda probe on it (for its run-time statistics)
    library: str  # file name in the fixture build directory
    command: tuple[str, ...]  # the program and its bench mode


CALLS = (
    Call("cuLaunchKernel", "uprobe_launch_kernel", "libcuda.so.1", (str(DRIVER), "bench")),
    Call("cuGraphLaunch", "uprobe_graph_launch", "libcuda.so.1", (str(DRIVER), "bench-graph")),
    # Counted at the runtime's entry with a uretprobe that closes the call: two probes per launch.
    Call("cudaLaunchKernel", "uprobe_runtime_launch_kernel", "libcudart.so.12", (str(RUNTIME_DRIVER), "bench")),
)


def _start(libdir: Path, call: Call, calls: int) -> Driver:
    return Driver(libdir, calls, program=call.command)


def _ns_per_call(libdir: Path, call: Call, calls: int) -> float:
    return float(_start(libdir, call, calls).go().split()[1])


def _empty(libdir: Path, call: Call) -> tuple[float, float]:
    """(ns per call, ns per program run) with an empty program on the entry point."""
    driver = _start(libdir, call, CALLS_ATTACHED)
    with BpfObject("cuda", programs=["uprobe_empty"]) as obj:
        obj.load()
        program = obj.programs["uprobe_empty"]
        program.attach_uprobe(str(libdir / call.library), call.symbol)
        return float(driver.go().split()[1]), ns_per_run(program)


def _probed(libdir: Path, call: Call) -> tuple[float, float]:
    """(ns per call, ns per program run) with the cuda probe."""
    library = str(libdir / call.library)
    with CudaProbe() as probe:
        driver = _start(libdir, call, CALLS_ATTACHED)
        while not any(lib.path == library for lib in probe.libraries):
            probe.rescan()
        return float(driver.go().split()[1]), ns_per_run(probe.loaded.obj.programs[call.program])


def _measure(libdir: Path, call: Call) -> list[Result]:
    _ns_per_call(libdir, call, CALLS_DETACHED)  # warm-up: page cache, CPU frequency
    cases = {
        "detached": lambda: (_ns_per_call(libdir, call, CALLS_DETACHED), 0.0),
        "empty uprobe": lambda: _empty(libdir, call),
        "cuda probe": lambda: _probed(libdir, call),
    }
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
    for round_ in range(ROUNDS):
        # Rotate the order so a drift in machine load does not favour one case.
        for name in list(cases)[round_ % len(cases):] + list(cases)[:round_ % len(cases)]:
            samples[name].append(cases[name]())
    # The fastest round of each: the one least disturbed by whatever else this shared machine runs.
    (detached, _), (empty, empty_run), (ours, ours_run) = (min(samples[name]) for name in cases)
    trap, added, own = empty - detached, ours - detached, ours_run - empty_run
    detail = f"best of {ROUNDS}; {CALLS_DETACHED:,} calls detached, {CALLS_ATTACHED:,} probed"
    name = call.symbol
    return [
        Result("cuda", f"{name} detached", detached, "ns/call", detail),
        Result("cuda", f"{name}, empty uprobe", empty, "ns/call", detail),
        Result("cuda", f"{name}, cuda probe", ours, "ns/call", detail),
        Result("cuda", f"{name}: added per call, cuda probe vs empty uprobe", added / trap, "x empty",
               f"{added:.0f} ns vs {trap:.0f} ns (the uprobe trap alone)"),
        Result("cuda", f"{name}: BPF program run, ours vs empty", ours_run / empty_run, "x empty",
               f"{ours_run:.0f} ns vs {empty_run:.0f} ns (kernel run-time stats, entry program)"),
        *(
            Result("cuda", f"{name}: cost at {rate // 1000}k calls/s", added * rate / 1e9 * 100, "% of one CPU",
                   f"of which {own * rate / 1e9 * 100:.3f} % our entry program")
            for rate in RATES
        ),
    ]


def duty_cycle_switching(libdir: Path) -> list[Result]:
    """What one duty cycle of the launch probes takes (agent/probes/cuda/probe.py LaunchProbes): attaching and
    detaching (in parallel) the kernel-launch uprobes of one libcuda."""
    library = str(libdir / "libcuda.so.1")
    offsets = elf.function_offsets(library, set(DRIVER_KERNEL_LAUNCHES))
    sites = [UprobeSite(library, offsets[symbol], "uprobe_launch_kernel", False) for symbol in DRIVER_KERNEL_LAUNCHES]
    attach, detach = [], []
    with BpfObject("cuda", programs=["uprobe_launch_kernel"]) as obj:
        obj.load()
        for _ in range(ROUNDS):
            began = time.perf_counter()
            links = attach_sites(obj, sites)
            attached = time.perf_counter()
            detach_links(obj, links)
            attach.append(attached - began)
            detach.append(time.perf_counter() - attached)
    detail = f"{len(sites)} uprobes; median of {ROUNDS}, range {min(detach) * 1e3:.0f}..{max(detach) * 1e3:.0f} ms"
    return [
        Result("cuda", "duty cycle: attaching one libcuda's launch uprobes", statistics.median(attach) * 1e3, "ms",
               f"{len(sites)} uprobes; median of {ROUNDS}"),
        Result("cuda", "duty cycle: detaching them (in parallel; RCU waits)", statistics.median(detach) * 1e3, "ms",
               detail),
    ]


def run() -> list[Result]:
    FIXTURE_BUILD.mkdir(parents=True, exist_ok=True)
    libdir = build(CBuild(FIXTURE_BUILD)).libdir
    with bpf_stats():
        results = [result for call in CALLS for result in _measure(libdir, call)]
    return results + duty_cycle_switching(libdir)
