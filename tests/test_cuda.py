"""CUDA uprobes and the scheduler side against the real kernel, driven by a fake libcuda.so.1 and a
driver program (tests/fixtures/cuda_*.c) that make a known sequence of driver calls."""

from __future__ import annotations

import ctypes.util
import itertools
import json
import os
import queue
import re
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiprobe.budget import CpuBudget
from aiprobe.config import RuleConfig
from aiprobe.deltas import Window
from aiprobe.elf import ElfError, function_offsets
from aiprobe.histogram import EXPORTED_BOUNDS, hist_slots, kernel_buckets
from aiprobe.loader import Strategy
from aiprobe.names import printable
from aiprobe.probes.cuda.allocations import ALLOCATION_ENTRY_POINTS
from aiprobe.probes.cuda.hooks import out_of_memory_signals, time_slicing_signals
from aiprobe.probes.cuda.probe import (
    CLOCK_TICKS,
    DRIVER,
    MAX_DUTY_EVERY,
    RUNTIME,
    STATIC_RUNTIME,
    CudaProbe,
    LibraryScanner,
    allocation_cpu_share,
    gpus_of,
    launch_cpu_share,
    loaded_program,
    mapped_cuda_libraries,
    process_record,
)
from aiprobe.probes.cuda.probe import STRATEGIES as CUDA_STRATEGIES
from aiprobe.probes.cuda.records import CudaSnapshot
from aiprobe.probes.cuda.sched import STRATEGIES as SCHED_STRATEGIES
from aiprobe.refresh import SIGNAL_WINDOW_SECONDS
from aiprobe.registry import rules
from aiprobe.rules import RuleEngine
from aiprobe.top_views import header_lines
from exported_histograms import assert_histograms_consistent
from fixtures.cuda_fake import (
    DRIVER as DRIVER_PROGRAM,
)
from fixtures.cuda_fake import (
    RUNTIME_DRIVER,
    STATIC_RUNTIME_DRIVER,
    Driver,
    FakeCuda,
    LateLoader,
    build,
    counters,
)
from helpers import CLOCK_TOLERANCE, PATIENCE, ROOT, bpftool_json, fd_id, link_ids, wait_until

ALTERNATIONS, LAUNCHES, SYNCS = 1000, 500, 100
SYNC_US = 2500  # lands in the exported buckets between 2 and 4 ms
SYNC_RANGE = (0.002, 0.004)


@pytest.fixture(scope="module")
def cuda_libs(cbuild) -> FakeCuda:
    """The fake CUDA stack: libcuda.so.1 (two copies: two inodes), libcudart.so.12, the programs."""
    return build(cbuild)


@pytest.fixture
def drivers() -> Iterator[list[Driver]]:
    started: list[Driver] = []
    yield started
    for driver in started:
        driver.kill()


# Processes started later are picked up within 2 s: held where the test is `realtime` (emulation
# stretches it); elsewhere waiting for the attach is only synchronisation.
PICKUP_SECONDS = 2.5


def _wait_attached(probe: CudaProbe, *libraries: str, within: float = PATIENCE) -> None:
    assert wait_until(lambda: set(libraries) <= {lib.path for lib in probe.libraries}, timeout=within), \
        f"not attached within {within} s: {probe.libraries}"


def _thread_entries(probe: CudaProbe, pid: int) -> int:
    return sum(1 for _, thread in probe.loaded.obj.maps["threads"].items() if thread.tgid == pid)


def _recursion_misses(probe: CudaProbe, sched: Strategy) -> int:
    """Runs of the strategy's wakeup and switch programs the kernel skipped, host-wide, since they loaded."""
    ids = {fd_id(probe.loaded.obj.programs[name].fd, "prog_id") for name in sched.programs if "exit" not in name}
    return sum(prog.get("recursion_misses", 0) for prog in bpftool_json("prog", "show") if prog["id"] in ids)


def _bucket_counts(histogram: list[dict]) -> dict:
    """le -> observations in that bucket alone (from cumulative JSON buckets)."""
    counts, previous = {}, 0
    for bucket in histogram:
        counts[bucket["le_seconds"]] = bucket["count"] - previous
        previous = bucket["count"]
    return counts


# ---- acceptance ----


@pytest.mark.bpf
@pytest.mark.realtime  # syncs timed into their log2 bucket: emulation stretches the sleeps
def test_cli_counts_a_driver_started_after_it_exactly(cuda_libs, drivers, aiprobe_cli) -> None:
    cli = subprocess.Popen([*aiprobe_cli, "cuda", "--json", "--duration", "60"], text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in cli.stderr], daemon=True).start()

    def expect(text: str) -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if text in lines.get(timeout=0.5):
                    return
            except queue.Empty:
                assert cli.poll() is None, f"aiprobe cuda exited {cli.returncode}"
        pytest.fail(f"aiprobe cuda never said {text!r}")

    try:
        expect("watching for processes")
        driver = Driver(cuda_libs.libdir, ALTERNATIONS, LAUNCHES, SYNCS, sync_us=SYNC_US)
        drivers.append(driver)
        expect(f"probing driver {driver.library}")
        truth = counters(driver.go())
        cli.send_signal(signal.SIGINT)
        out, _ = cli.communicate(timeout=30)
    finally:
        if cli.poll() is None:
            cli.kill()
    assert cli.returncode == 0
    report = json.loads(out)
    assert report["sched_strategy"] == "tp_btf"
    [process] = [p for p in report["processes"] if p["pid"] == driver.pid]
    assert process["comm"] == "cuda_driver"
    assert process["library"] == driver.library
    # Every change the fake driver counted itself: the alternations, and the two made by creating
    # contexts (a created context is pushed over the current one) and making the first current.
    assert truth["ctx_changes"] == ALTERNATIONS + 2
    assert (process["context_switches"], process["kernel_launches"], process["syncs"]) == \
        (truth["ctx_changes"], LAUNCHES, SYNCS)
    assert [process[f"{kind}_syncs"] for kind in ("stream", "device", "event")] == \
        [truth[f"{kind}_syncs"] for kind in ("stream", "device", "event")]
    assert (process["graph_launches"], process["runtime_launches"], process["counted_at"]) == (0, 0, "driver")
    assert process["gpu_threads"] == 1
    # Every sync slept SYNC_US: none is shorter, nearly all take at most 4 ms.
    buckets = _bucket_counts(process["sync_histogram"])
    assert sum(n for le, n in buckets.items() if le != "+Inf" and le <= SYNC_RANGE[0]) == 0
    assert sum(n for le, n in buckets.items() if le != "+Inf" and SYNC_RANGE[0] < le <= SYNC_RANGE[1]) >= 0.9 * SYNCS
    assert process["sync_seconds_sum"] >= SYNCS * SYNC_US / 1e6
    assert process["sync_p99_seconds"] >= SYNC_US / 1e6


@pytest.mark.bpf
def test_two_copies_of_the_library_are_probed_and_counted_separately(cuda_libs, drivers) -> None:
    with CudaProbe(rescan_interval=0.2) as probe:
        first = Driver(cuda_libs.libdir, 10, 20, 3)
        drivers.append(first)
        second = Driver(cuda_libs.copy_dir, 30, 40, 5)
        drivers.append(second)
        _wait_attached(probe, first.library, second.library)
        truths = [counters(first.go()), counters(second.go())]
        by_pid = {p.pid: p for p in probe.read().processes}
        libraries = probe.libraries
    assert len({lib.host_path for lib in libraries if lib.path in (first.library, second.library)}) == 2
    for driver, truth, counts in ((first, truths[0], (12, 20, 3)), (second, truths[1], (32, 40, 5))):
        process = by_pid[driver.pid]
        assert truth["ctx_changes"] == counts[0]
        assert (process.context_switches, process.kernel_launches, process.syncs) == counts
        assert process.library == driver.library


@pytest.mark.bpf
@pytest.mark.parametrize("sched", SCHED_STRATEGIES, ids=lambda s: s.name)
def test_each_scheduler_strategy_times_wakeups_of_gpu_threads(cuda_libs, drivers, sched) -> None:
    [strategy] = [s for s in CUDA_STRATEGIES if s.part == sched]
    with CudaProbe(rescan_interval=0.2, strategies=[strategy]) as probe:
        assert probe.sched_strategy == sched.name
        driver = Driver(cuda_libs.libdir, 0, 0, 20, sync_us=500)
        drivers.append(driver)
        _wait_attached(probe, driver.library)
        driver.go()
        [process] = [p for p in probe.read().processes if p.pid == driver.pid]
        # The exited threads' entries went with them (sched_process_exit of this strategy).
        assert _thread_entries(probe, driver.pid) == 0
        missed = _recursion_misses(probe, sched)
    # Each sync sleeps, so each is followed by a wakeup and a switch back onto a CPU (a timer that
    # fires before the thread is off the CPU wakes nothing: allow a few). A scheduler program does
    # not run while it already runs on that CPU (an interrupt's wakeup in the middle of another's):
    # the kernel counts those runs as recursion misses, and a busy host has many.
    assert process.runqueue_histogram[-1][1] + missed >= 15, (process.runqueue_histogram[-1][1], missed)
    assert process.runqueue_delay_p99_seconds is not None
    assert_histograms_consistent([process], observed=["aiprobe_cuda_sync_duration_seconds",
                                                      "aiprobe_gpu_thread_runqueue_delay_seconds"])


def _runqueue_delay(probe: CudaProbe, cpu: int, libdir: Path, drivers: list[Driver]) -> tuple[float, int]:
    """Total run-queue delay of a CPU-bound launch loop pinned to `cpu`."""
    driver = Driver(libdir, 0, 20000, 0)
    drivers.append(driver)
    os.sched_setaffinity(driver.pid, {cpu})
    _wait_attached(probe, driver.library)
    driver.go()
    [process] = [p for p in probe.read().processes if p.pid == driver.pid]
    return process.runqueue_delay_seconds_sum, process.involuntary_preemptions


@pytest.mark.bpf
def test_cpu_hog_next_to_a_gpu_thread_raises_its_runqueue_delay(cuda_libs, drivers) -> None:
    cpu = max(os.sched_getaffinity(0))
    with CudaProbe(rescan_interval=0.2) as probe:
        alone, _ = _runqueue_delay(probe, cpu, cuda_libs.libdir, drivers)
        # Two busy loops on the same CPU leave the launch loop a third of it at most, so it waits
        # about twice as long as it runs, whatever else the machine is doing.
        # Each says so once it spins: an interpreter's start takes seconds in an emulated guest, where a
        # launch loop that finished before the hogs began read 0.19 s against 0.16 s alone.
        hogs = [subprocess.Popen([sys.executable, "-c", "print('spinning', flush=True)\nwhile True: pass"],
                                 stdout=subprocess.PIPE, text=True) for _ in range(2)]
        try:
            for hog in hogs:
                os.sched_setaffinity(hog.pid, {cpu})
                assert hog.stdout is not None and hog.stdout.readline().strip() == "spinning"
            contended, preemptions = _runqueue_delay(probe, cpu, cuda_libs.libdir, drivers)
        finally:
            for hog in hogs:
                hog.kill()
                hog.wait()
    # Measured here: 5-15x while other test suites load the machine.
    assert contended > 2 * alone, (alone, contended)
    assert preemptions > 0


@pytest.mark.bpf
def test_close_detaches_everything_and_stops_scanning(cuda_libs, drivers) -> None:
    probe = CudaProbe(rescan_interval=0.2)
    probe.start()
    driver = Driver(cuda_libs.libdir, 2, 2, 2)
    drivers.append(driver)
    _wait_attached(probe, driver.library)
    ours = _attached({fd_id(program.fd, "prog_id") for program in probe.loaded.obj.programs.values()
                      if program.fd >= 0})
    assert len(ours) > 2
    probe.close()
    probe.close()  # harmless twice
    assert not [t for t in threading.enumerate() if t.name == "aiprobe-cuda_scan"]
    assert wait_until(lambda: not _attached(ours))
    driver.go()


def _attached(programs: set[int]) -> set[int]:
    """Of these program ids, those the kernel lists attached: through a BPF link, or a perf event
    (kprobes, uprobes and tracepoints had no BPF link before 5.15: `bpftool perf` lists those)."""
    listed = bpftool_json("link", "show") + bpftool_json("perf", "show")
    return {entry["prog_id"] for entry in listed if entry.get("prog_id") in programs}


def _sched_links(probe: CudaProbe, sched: Strategy) -> int:
    """The strategy's scheduler programs (the variants this kernel loaded) the kernel lists attached."""
    return len(_attached({fd_id(loaded_program(probe.loaded.obj, name).fd, "prog_id") for name in sched.programs}))


@pytest.mark.bpf
@pytest.mark.parametrize("sched", SCHED_STRATEGIES, ids=lambda s: s.name)
def test_scheduler_programs_are_attached_only_while_a_process_drives_the_gpu(cuda_libs, drivers, sched) -> None:
    [strategy] = [s for s in CUDA_STRATEGIES if s.part == sched]
    with CudaProbe(rescan_interval=0.2, strategies=[strategy], sched_linger=0) as probe:
        assert probe.sched_strategy == sched.name  # chosen at start, attached to be sure it can be
        assert _sched_links(probe, sched) == 0
        assert "detached" in probe.parts()["sched"].status().span
        driver = Driver(cuda_libs.libdir, 0, 0, 3, sync_us=500)
        drivers.append(driver)
        _wait_attached(probe, driver.library)
        assert _sched_links(probe, sched) == len(sched.programs)
        assert "attached:" in probe.parts()["sched"].status().span
        driver.go()
        assert wait_until(lambda: _sched_links(probe, sched) == 0), "still attached after the GPU process exited"
        assert _thread_entries(probe, driver.pid) == 0  # sched_process_exit removed them while attached


@pytest.mark.bpf
def test_threads_that_exit_while_the_scheduler_side_is_detached_are_forgotten_when_it_attaches(
        cuda_libs, drivers) -> None:
    with CudaProbe(rescan_interval=3600, sched_linger=0) as probe:  # scans only when the test asks
        [sched] = [s for s in SCHED_STRATEGIES if s.name == probe.sched_strategy]
        first = Driver(cuda_libs.libdir, 0, 0, 1)
        drivers.append(first)
        probe.rescan()  # probes its library
        first.go()
        probe.rescan()
        assert _sched_links(probe, sched) == 0
        unseen = Driver(cuda_libs.libdir, 0, 0, 1)  # probed (same file), never scanned
        drivers.append(unseen)
        unseen.go()
        assert _thread_entries(probe, unseen.pid) == 1  # no sched_process_exit ran: detached
        probe.rescan()  # a GPU-driving thread is in the map: attach, and forget the exited one
        assert _thread_entries(probe, unseen.pid) == 0
        probe.rescan()
        assert _sched_links(probe, sched) == 0


# ---- every path, exact against the fake driver's own counts ----


def _run(probe: CudaProbe, drivers: list[Driver], driver: Driver, *libraries: str) -> tuple[dict, CudaSnapshot]:
    """Let an attached program run; (the fake driver's counts, a snapshot read after it exited)."""
    drivers.append(driver)
    _wait_attached(probe, driver.library, *libraries)
    truth = counters(driver.go())
    return truth, probe.read()


def _process(snapshot: CudaSnapshot, pid: int):
    [process] = [p for p in snapshot.processes if p.pid == pid]
    return process


def _syncs(process) -> dict[str, int]:
    return {f"{kind}_syncs": getattr(process, f"{kind}_syncs") for kind in ("stream", "device", "event")}


GRAPH_NODES, GRAPH_REPLAYS = 7, 40


@pytest.mark.bpf
def test_graph_launches_are_their_own_counter(cuda_libs, drivers) -> None:
    with CudaProbe(rescan_interval=0.2) as probe:
        driver = Driver(cuda_libs.libdir, "graphs", GRAPH_NODES, GRAPH_REPLAYS)
        truth, snapshot = _run(probe, drivers, driver)
    process = _process(snapshot, driver.pid)
    assert (truth["kernel_launches"], truth["graph_launches"]) == (GRAPH_NODES, GRAPH_REPLAYS)
    # The launches made while capturing are calls too (the graph's nodes); each replay is one graph launch.
    assert (process.kernel_launches, process.graph_launches) == (GRAPH_NODES, GRAPH_REPLAYS)
    assert process.counted_at == "driver"


ROUNDS = 5


@pytest.mark.bpf
def test_implicit_context_changes_are_counted_exactly(cuda_libs, drivers) -> None:
    with CudaProbe(rescan_interval=0.2) as probe:
        driver = Driver(cuda_libs.libdir, "contexts", ROUNDS)
        truth, snapshot = _run(probe, drivers, driver)
    process = _process(snapshot, driver.pid)
    # Per round: create (pushed), destroy of the current (popped), the retained primary context
    # made current, push, pop, cuCtxSetCurrent; plus the two of making contexts a and b.
    assert truth["ctx_changes"] == 2 + 6 * ROUNDS
    assert process.context_switches == truth["ctx_changes"]
    assert process.kernel_launches == truth["kernel_launches"] == 2 * ROUNDS
    by_device = {}
    for context in snapshot.contexts:
        if context.pid == driver.pid:
            by_device[context.device] = by_device.get(context.device, 0) + context.kernel_launches
    # One launch per round in a fresh context on device 1, one in device 0's primary context.
    assert by_device == {1: ROUNDS, 0: ROUNDS}
    assert sum(c.context == "primary:0" for c in snapshot.contexts if c.pid == driver.pid) == 1


RT_LAUNCHES, RT_NODES, RT_REPLAYS, RT_SYNCS, RT_DRIVER_LAUNCHES = 60, 5, 10, 8, 7


@pytest.mark.bpf
@pytest.mark.parametrize("proc_address", ["internal", "exported"])
@pytest.mark.parametrize("linked", ["shared", pytest.param("static", marks=pytest.mark.host_only)])
def test_runtime_calls_are_counted_once_whichever_layers_fire(cuda_libs, drivers, proc_address, linked) -> None:
    """The fake libcudart reaches the driver only through cuGetProcAddress pointers: internal
    functions, which no driver probe sees, or (exported) the probed entry points themselves."""
    program = RUNTIME_DRIVER if linked == "shared" else STATIC_RUNTIME_DRIVER
    runtime = str(cuda_libs.libdir / "libcudart.so.12") if linked == "shared" else str(program)
    with CudaProbe(rescan_interval=0.2) as probe:
        driver = Driver(cuda_libs.libdir, RT_LAUNCHES, RT_NODES, RT_REPLAYS, RT_SYNCS, RT_DRIVER_LAUNCHES,
                        program=(str(program),), env={"FAKE_CUDA_PROC_ADDRESS": proc_address})
        truth, snapshot = _run(probe, drivers, driver, runtime)
        kinds = {lib.path: lib.kind for lib in probe.libraries}
    process = _process(snapshot, driver.pid)
    assert kinds[runtime] == (RUNTIME if linked == "shared" else STATIC_RUNTIME)
    assert (process.runtime, process.runtime_library) == (linked, runtime)
    runtime_kernels = RT_LAUNCHES + RT_NODES + 1  # + the one on device 1
    assert (truth["kernel_launches"], truth["graph_launches"]) == (runtime_kernels + RT_DRIVER_LAUNCHES, RT_REPLAYS)
    assert (process.kernel_launches, process.graph_launches) == (truth["kernel_launches"], truth["graph_launches"])
    assert process.runtime_launches == runtime_kernels + RT_REPLAYS
    assert process.counted_at == "runtime+driver"
    # Device 0's primary context -> device 1's (cudaSetDevice) -> back: the driver saw 2 as well.
    assert process.context_switches == truth["ctx_changes"] == 2
    assert process.syncs == RT_SYNCS
    assert _syncs(process) == {kind: truth[kind] for kind in ("stream_syncs", "device_syncs", "event_syncs")}
    launches = {c.context: c.kernel_launches + c.graph_launches for c in snapshot.contexts if c.pid == driver.pid}
    assert launches == {"primary:0": runtime_kernels - 1 + RT_DRIVER_LAUNCHES + RT_REPLAYS, "primary:1": 1}


def _ours(snapshot: CudaSnapshot, pid: int) -> CudaSnapshot:
    """The snapshot as if `pid` were the only CUDA process (other test suites may run fake drivers
    on the same fake GPU meanwhile)."""
    contexts = [c for c in snapshot.contexts if c.pid == pid]
    return CudaSnapshot([p for p in snapshot.processes if p.pid == pid], snapshot.sched_strategy, [], contexts,
                        gpus_of(contexts))


@pytest.mark.realtime  # the rule holds its condition for wall-clock windows
@pytest.mark.bpf
def test_two_threads_on_two_contexts_share_one_gpu_and_the_rule_fires_and_resolves(cuda_libs, drivers) -> None:
    engine = RuleEngine(rules(), {"gpu_time_sliced": RuleConfig(threshold=1.5, clear=1.5, for_seconds=0.5)})
    transitions: list[str] = []
    readings: list[CudaSnapshot] = []

    def read(probe: CudaProbe) -> CudaSnapshot:
        snapshot = _ours(probe.read(), driver.pid)
        readings.append(snapshot)
        alerts = engine.evaluate(time_slicing_signals(snapshot.gpus, snapshot.contexts, []), time.monotonic())
        transitions.extend(alert.state for alert in alerts)
        return snapshot

    with CudaProbe(rescan_interval=0.2) as probe:
        driver = Driver(cuda_libs.libdir, "shared")
        drivers.append(driver)
        _wait_attached(probe, driver.library)
        driver.say("go")
        driver.expect("launching")
        deadline = time.monotonic() + 15
        while "firing" not in transitions and time.monotonic() < deadline:
            read(probe)
            time.sleep(0.3)
        driver.say("stop")
        truth = counters(driver.finish())
        while "resolved" not in transitions and time.monotonic() < deadline + 10:
            read(probe)  # nothing launched since the previous read: no active context
            time.sleep(0.3)
    busy = [s for s in readings if s.gpus]
    assert busy, "never saw the GPU busy"
    [gpu] = busy[-1].gpus
    assert (gpu.gpu, gpu.active_contexts, gpu.pids) == ("0", 2, [driver.pid])
    assert gpu.launches_per_second > 0
    assert transitions == ["pending", "firing", "resolved"]
    [alert] = engine.resolved
    assert (alert.target, alert.value) == ("gpu0", 2)
    assert {c["pid"] for c in alert.evidence["contexts"]} == {driver.pid}
    assert all(c["launches_per_second"] > 0 for c in alert.evidence["contexts"])
    # No thread changed its current context while launching: the per-thread counter says so.
    [final] = [p for s in readings for p in s.processes][-1:]
    assert final.context_switches == truth["ctx_changes"] == 2
    assert final.kernel_launches == truth["kernel_launches"]


ALLOC_SIZE = 3 << 20


@pytest.mark.bpf
def test_allocation_failures_per_process_and_error_tell_retried_from_final_and_oom_fires_for_final_only(
        cuda_libs, drivers, tmp_path) -> None:
    """One process fails 5 allocations, then succeeds at the same size (retried); another fails 3 for good."""
    (tmp_path / "oom_retrying").symlink_to(DRIVER_PROGRAM)  # two names: two targets, as the rule file's
    (tmp_path / "oom_giving_up").symlink_to(DRIVER_PROGRAM)
    with CudaProbe(rescan_interval=0.2) as probe:
        retrying, giving_up = (
            Driver(cuda_libs.libdir, "alloc", calls, ALLOC_SIZE, program=(str(tmp_path / name),),
                   env={"FAKE_CUDA_ALLOC_FAILURES": str(failures)})
            for name, calls, failures in (("oom_retrying", 10, 5), ("oom_giving_up", 3, 3)))
        drivers += [retrying, giving_up]
        _wait_attached(probe, retrying.library)
        truths = {driver.pid: counters(driver.go()) for driver in (retrying, giving_up)}
        calls = {key.value: value.alloc_calls for key, value in probe.loaded.obj.maps["processes"].items()
                 if key.value in truths}  # what the CPU budget charges
        snapshot = probe.read()
        [library] = [lib for lib in probe.libraries if lib.path == retrying.library]
    assert {pid: (t["alloc_failures"], t["allocs"]) for pid, t in truths.items()} == {
        retrying.pid: (5, 1), giving_up.pid: (3, 0)}
    assert calls == {retrying.pid: 6, giving_up.pid: 3}
    assert set(ALLOCATION_ENTRY_POINTS) <= set(library.symbols) and library.missing == []
    ours = [f for f in snapshot.allocation_failures if f.pid in truths]
    assert {(f.pid, f.comm, f.error): (f.failures, f.failed_bytes, f.retried) for f in ours} == {
        (retrying.pid, "oom_retrying", "CUDA_ERROR_OUT_OF_MEMORY"): (5, 5 * ALLOC_SIZE, 5),
        (giving_up.pid, "oom_giving_up", "CUDA_ERROR_OUT_OF_MEMORY"): (3, 3 * ALLOC_SIZE, 0)}
    # The rule over the agent's window of recent counts, on its own clock: the final failures fire, then
    # resolve once the window has passed them.
    engine = RuleEngine(rules(), {})
    window = Window(SIGNAL_WINDOW_SECONDS)
    states = [(a.target, a.state) for now in (0, 3, 5, 3 + SIGNAL_WINDOW_SECONDS)
              for a in engine.evaluate(out_of_memory_signals(ours, window, now), now)]
    target = "oom_giving_up@host"
    assert states == [(target, "pending"), (target, "firing"), (target, "resolved")]
    [alert] = engine.resolved
    assert alert.evidence == {"processes": [{"pid": giving_up.pid, "final_failures": 3, "failures": 3,
                                             "retried": 0, "failed_bytes": 3 * ALLOC_SIZE}]}


@pytest.mark.bpf
def test_a_driver_without_the_allocation_entry_points_is_probed_for_the_rest_and_says_what_it_lacks(
        cuda_libs, drivers) -> None:
    with CudaProbe(rescan_interval=0.2) as probe:
        driver = Driver(cuda_libs.old_dir, "graphs", GRAPH_NODES, GRAPH_REPLAYS)
        truth, snapshot = _run(probe, drivers, driver)
        [library] = [lib for lib in probe.libraries if lib.path == driver.library]
    assert (library.error, library.missing) == ("", list(ALLOCATION_ENTRY_POINTS))
    process = _process(snapshot, driver.pid)
    assert (process.kernel_launches, process.graph_launches) == (truth["kernel_launches"], truth["graph_launches"])


def test_allocation_probes_are_charged_to_the_launch_budget_first() -> None:
    """They stay attached: the launch probes are duty-cycled within what they leave of the budget."""
    budget = CpuBudget(0.05, MAX_DUTY_EVERY, launch_cpu_share)
    launches = 0.04 / launch_cpu_share(1.0, 1)  # counting every launch costs 0.04 CPU: within the budget
    assert budget.every(launches, 1) == 1
    assert allocation_cpu_share(1400) == pytest.approx(0.028)  # two traps of 10 us each per call
    assert budget.every(launches, 1, allocation_cpu_share(1400)) == 2  # 0.02 + 0.028
    assert budget.every(launches, 1, allocation_cpu_share(1e6)) == MAX_DUTY_EVERY  # over budget alone


COLD = {"before_init_ms": 1000, "init_ms": 200, "ctx_ms": 150, "module_ms": 60, "modules": 3, "before_launch_ms": 100}
COLD_ENV = {"FAKE_CUDA_INIT_MS": str(COLD["init_ms"]), "FAKE_CUDA_CTX_MS": str(COLD["ctx_ms"]),
            "FAKE_CUDA_MODULE_MS": str(COLD["module_ms"])}


@pytest.mark.realtime  # phases against the process's own clock
@pytest.mark.bpf
def test_cold_start_phases_of_a_process_started_while_watching(cuda_libs, drivers) -> None:
    with CudaProbe(rescan_interval=0.1) as probe:
        driver = Driver(cuda_libs.libdir, "coldstart", COLD["before_init_ms"], COLD["before_launch_ms"],
                        COLD["modules"], handshake=False, env=COLD_ENV)
        drivers.append(driver)
        _wait_attached(probe, driver.library, within=PICKUP_SECONDS)  # well before its cuInit
        truth = counters(driver.finish())
        _assert_cold_start(_process(probe.read(), driver.pid).cold_start, truth)


def _assert_cold_start(cold, truth: dict[str, int]) -> None:
    assert (truth["inits"], truth["ctx_creates"], truth["module_loads"]) == (1, 1, COLD["modules"])
    assert (cold.context_creates, cold.module_loads) == (1, COLD["modules"])
    # The fake's own clock, not the sleeps it was asked for: a loaded host oversleeps. Its start is
    # when the library was loaded, a little after the kernel's (the fork): at most the tolerance.
    for measured, truth_ns in ((cold.to_init_seconds, truth["to_init_ns"]), (cold.init_seconds, truth["init_ns"]),
                               (cold.context_create_seconds, truth["ctx_create_ns"]),
                               (cold.module_load_seconds, truth["module_load_ns"]),
                               (cold.to_first_launch_seconds, truth["to_first_launch_ns"])):
        assert measured == pytest.approx(truth_ns / 1e9, rel=CLOCK_TOLERANCE), (measured, truth_ns)


def _installed_driver(cuda_libs: FakeCuda, root: Path, found: str) -> tuple[dict[str, tuple[str, ...]], Path]:
    """A copy of the fake libcuda (a new file) installed as a driver package does, a versioned file that
    ldconfig links libcuda.so.1 to, under driver root `root`; the search that finds it there (through the
    root's loader cache, or a configured directory) and the directory the process loads it from."""
    libdir = root / "opt/fakecuda"
    libdir.mkdir(parents=True)
    shutil.copy(cuda_libs.libdir / "libcuda.so.1", libdir / "libcuda.so.550.54")
    (root / "etc").mkdir()
    (root / "etc/ld.so.conf").write_text("/opt/fakecuda\n")
    subprocess.run(["ldconfig", "-r", root, "-C", "/etc/ld.so.cache", "-f", "/etc/ld.so.conf"], check=True)
    if found == "ld.so.cache":
        return {"driver_roots": (str(root),), "library_dirs": ()}, libdir
    return {"driver_roots": (), "library_dirs": (str(libdir),)}, libdir


@pytest.mark.realtime  # phases against the process's own clock
@pytest.mark.bpf
@pytest.mark.parametrize("found", ["ld.so.cache", "directory"])
def test_the_first_process_to_map_an_installed_driver_has_its_cold_start(cuda_libs, drivers, tmp_path,
                                                                         found) -> None:
    search, libdir = _installed_driver(cuda_libs, tmp_path, found)
    # No rescan after start's (the process starts later): only the search at start can have found the library.
    with CudaProbe(rescan_interval=3600, **search) as probe:
        [library] = [lib for lib in probe.libraries if lib.path.startswith(str(tmp_path))]
        assert (library.path, library.found, library.error) == (str(libdir / "libcuda.so.550.54"), found, "")
        driver = Driver(libdir, "coldstart", COLD["before_init_ms"], COLD["before_launch_ms"], COLD["modules"],
                        handshake=False, env=COLD_ENV)
        drivers.append(driver)
        truth = counters(driver.finish())
        _assert_cold_start(_process(probe.read(), driver.pid).cold_start, truth)


@pytest.mark.host_only  # /proc's start times, in user space
@pytest.mark.bpf
def test_a_process_started_before_the_probe_has_no_cold_start(cuda_libs, drivers) -> None:
    driver = Driver(cuda_libs.libdir, 2, 6, 1)
    drivers.append(driver)
    time.sleep(0.05)
    with CudaProbe(rescan_interval=0.2) as probe:
        _, snapshot = _run(probe, drivers, driver)
    assert _process(snapshot, driver.pid).cold_start is None


@pytest.mark.host_only  # /proc's start times, in user space
@pytest.mark.bpf
def test_a_process_whose_start_up_was_missed_has_no_cold_start(cuda_libs, drivers) -> None:
    with CudaProbe(rescan_interval=0.2) as probe:
        loader = LateLoader(cuda_libs.copy_dir, 10)
        drivers.append(loader)
        loader.load()  # cuInit and a context, before the probe can have attached to this library
        assert wait_until(lambda: loader.library in {lib.path for lib in probe.libraries})
        loader.go()
        process = _process(probe.read(), loader.pid)
    assert (process.kernel_launches, process.cold_start) == (10, None)


# ---- hostile libraries ----

MAPPER = """
import mmap, sys
files = [open(path, "rb") for path in sys.argv[1:]]
maps = [mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) for f in files]
print("ready", flush=True)
sys.stdin.readline()
"""


@pytest.mark.host_only  # reading files in user space
@pytest.mark.bpf
def test_files_named_libcuda_that_are_not_the_driver_are_read_safely_and_not_probed(cuda_libs, drivers,
                                                                                   tmp_path) -> None:
    odd = tmp_path / "a dir \x1b[31m with\tcontrol characters"
    paths = {"text": odd / "text" / "libcuda.so.1", "runtime": odd / "runtime" / "libcuda.so.1",
             "truncated": odd / "truncated" / "libcuda.so.1"}
    for path in paths.values():
        path.parent.mkdir(parents=True)
    paths["text"].write_text("not a library\n" * 100)
    shutil.copy(cuda_libs.libdir / "libcudart.so.12", paths["runtime"])  # an ELF file without cuInit
    paths["truncated"].write_bytes((cuda_libs.libdir / "libcuda.so.1").read_bytes()[:3000])
    with CudaProbe(rescan_interval=0.2) as probe:
        mapper = Driver(cuda_libs.libdir, program=(sys.executable, "-c", MAPPER, *map(str, paths.values())))
        drivers.append(mapper)
        # Paths are data from another process: records carry them with control characters escaped.
        shown = {name: printable(str(path)) for name, path in paths.items()}
        assert wait_until(lambda: len({lib.path for lib in probe.libraries} & set(shown.values())) == 3)
        by_path = {lib.path: lib for lib in probe.libraries}
        # The agent goes on probing real drivers.
        driver = Driver(cuda_libs.libdir, 0, 12, 0)
        truth, snapshot = _run(probe, drivers, driver)
    assert _process(snapshot, driver.pid).kernel_launches == truth["kernel_launches"] == 12
    errors = {name: by_path[path].error for name, path in shown.items()}
    assert errors == {"text": "not an ELF file", "runtime": "no cuInit",
                      "truncated": "section headers lies outside the file"}
    assert not any(by_path[path].symbols for path in shown.values())
    mapper.kill()


def _patched(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    return data[:offset] + struct.pack(fmt, value) + data[offset + struct.calcsize(fmt):]


def test_elf_reader_checks_headers_and_bounds_before_reading(cuda_libs, tmp_path) -> None:
    library = (cuda_libs.libdir / "libcuda.so.1").read_bytes()
    shoff = struct.unpack_from("<Q", library, 0x28)[0]
    cases = {
        b"": "shorter than an ELF header",
        b"#!/bin/sh\n" * 10: "not an ELF file",
        _patched(library, 4, "<B", 1): "not a 64-bit little-endian ELF file",
        _patched(library, 0x10, "<H", 1): "neither a shared object nor an executable",
        _patched(library, 0x3C, "<H", 60000): "unexpected section header table",
        _patched(library, 0x28, "<Q", len(library)): "section headers lies outside the file",
        _patched(library, 0x38, "<H", 1000): "unexpected program header table",
    }
    # Every symbol table claims more bytes than the file has.
    huge_tables = library
    for index in range(struct.unpack_from("<H", library, 0x3C)[0]):
        header = shoff + index * 64
        if struct.unpack_from("<I", library, header + 4)[0] in (2, 11):
            huge_tables = _patched(huge_tables, header + 32, "<Q", 24 * 10**5)
    cases[huge_tables] = "symbol table lies outside the file"
    for index, (data, reason) in enumerate(cases.items()):
        path = tmp_path / f"case{index}"
        path.write_bytes(data)
        with pytest.raises(ElfError, match=re.escape(reason)):
            function_offsets(str(path), ["cuInit"])
    offsets = function_offsets(str(cuda_libs.libdir / "libcuda.so.1"), ["cuInit", "cuLaunchKernel", "nothing"])
    assert set(offsets) == {"cuInit", "cuLaunchKernel"}


# ---- benchmarks/gpu_check.py ----


def _gpu_check(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180)


@pytest.mark.skipif(ctypes.util.find_library("cuda") is not None, reason="this host has a CUDA driver")
def test_gpu_check_says_clearly_when_there_is_no_gpu() -> None:
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    result = _gpu_check(env)
    assert result.returncode == 2
    assert result.stderr.strip() == \
        "gpu_check: no NVIDIA driver here (libcuda.so.1 not found): nothing to check on this host"
    assert result.stdout == ""


@pytest.mark.host_only  # the command's output; each count's path is the other tests'
@pytest.mark.bpf
def test_gpu_check_matches_every_count_on_the_fake_driver(cuda_libs, cbuild, tmp_path) -> None:
    """The real-GPU check's own logic, end to end, with the fake libcuda and libnvidia-ml standing in
    for the GPU: GPM's context switches over the run beside the counts, and why GPU 1 has none; the GPUs'
    memory error counts and an Xid NVML sends over the run."""
    nvml = cbuild("libnvidia-ml.so.1", "nvml_libnvidia_ml.c", shared=True)
    events = tmp_path / "events"
    events.write_text("0 8 31\n")  # an Xid 31 on GPU 0 (nvmlEventTypeXidCriticalError)
    result = _gpu_check({**os.environ, "LD_LIBRARY_PATH": f"{cuda_libs.libdir}:{nvml.parent}",
                         "FAKE_NVML_EVENTS": str(events)},
                        "--launches", "300", "--nodes", "5", "--replays", "40")
    assert result.returncode == 0, result.stdout + result.stderr
    table = dict(line.split()[:3:2] for line in result.stdout.splitlines() if line.split()[:1] in (
        ["kernel_launches"], ["graph_launches"], ["context_switches"]))
    assert table == {"kernel_launches": "305", "graph_launches": "40", "context_switches": "2"}
    assert "GPM context switches of gpu0: 2k/s, 4% of the time, 30.0 µs per switch (engine 0: 1.60k/s, 4% of " \
           "the time, 25 µs per switch, engine 1: 400/s, 2% of the time, 50 µs per switch)" in result.stdout
    assert "GPU 1 (NVIDIA A100-SXM4-40GB): no GPM (Hopper or newer)" in result.stdout
    # Each process's share as aiprobe exports it (the fake's GPU 0 process at 55% SM), beside nvidia-smi's.
    sharing = result.stdout[result.stdout.index("GPU sharing, aiprobe"):result.stdout.index("nvidia-smi pmon -c 1:")]
    assert "gpu0 pid 4242 (): SM 55%, memory 0%, 1 GiB used, attribution nvml" in sharing
    assert "nvidia-smi mig -lgi:" in result.stdout
    failures = result.stdout[result.stdout.index("GPU failures, aiprobe"):result.stdout.index("nvidia-smi -q -d")]
    assert "gpu0: ecc corrected 7  uncorrected 0  remapped rows 3  uncorrected 1  remap pending no  failed no  " \
           "pcie replays 5" in failures
    assert "gpu1: ecc corrected -" in failures and "not counted: ECC is off; no row remapping" in failures
    assert "GPU 0 xid 31: GPU memory page fault; restart the application" in failures
    assert "all counts match" in result.stdout


# ---- bounded maps, exact and monotonic counts ----

WAVES, WIDTH, THREAD_LAUNCHES = 50, 4, 10
MAX_THREADS = 16  # far fewer than the WAVES * WIDTH threads the driver starts


def _counters(process) -> tuple[int, ...]:
    return (process.context_switches, process.kernel_launches, process.syncs, process.gpu_threads,
            process.involuntary_preemptions, *(count for _, count in process.sync_histogram),
            *(count for _, count in process.runqueue_histogram))


@pytest.mark.bpf
def test_threads_that_exit_leave_exact_monotonic_counts_in_bounded_maps(cuda_libs, drivers) -> None:
    with CudaProbe(rescan_interval=0.2, max_threads=MAX_THREADS) as probe:
        assert probe.loaded.obj.maps["threads"].max_entries == MAX_THREADS
        driver = Driver(cuda_libs.libdir, "threads", WAVES, WIDTH, THREAD_LAUNCHES, sync_us=3000)
        drivers.append(driver)
        _wait_attached(probe, driver.library)
        runner = threading.Thread(target=driver.go)
        runner.start()
        readings = []
        while True:  # read while threads come and go, until the exited process is forgotten
            reading = [_counters(p) for p in probe.read().processes if p.pid == driver.pid]
            if not reading and not runner.is_alive():
                break
            readings += reading
        runner.join()
        entries = probe.loaded.obj.maps["processes"].lookup(driver.pid), _thread_entries(probe, driver.pid)
    threads = WAVES * WIDTH
    # The last read that reported the process had its final values.
    # Each thread changes a -> b once; the main thread twice (creating b over a, then making a current).
    assert readings[-1][:4] == (threads + 2, threads * THREAD_LAUNCHES, threads, threads + 1)  # + the main thread
    assert entries == (None, 0)
    assert len(readings) >= 3
    for earlier, later in itertools.pairwise(readings):
        assert all(b >= a for a, b in zip(earlier, later, strict=True)), (earlier, later)


SYNC_WAVES, SYNC_WIDTH, WAVE_SYNC_US = 5, 8, 40_000


@pytest.mark.bpf
def test_a_process_sync_time_for_streams_is_the_union_of_its_threads_syncs(cuda_libs, drivers) -> None:
    """Map cuda_sync_time, which streams reads, holds the time at least one of the process's threads was
    inside a synchronization. Each wave's threads sync at once: about one sync per wave, far less than
    their sum. Kernels without atomic fetch instructions count under a lock, with the same truths."""
    with CudaProbe(rescan_interval=0.2) as probe:
        driver = Driver(cuda_libs.libdir, "threads", SYNC_WAVES, SYNC_WIDTH, 0, sync_us=WAVE_SYNC_US)
        drivers.append(driver)
        _wait_attached(probe, driver.library)
        started = time.monotonic()
        driver.go()
        elapsed = time.monotonic() - started
        union = probe.loaded.obj.maps["cuda_sync_time"].lookup(driver.pid)
        [process] = [p for p in probe.read().processes if p.pid == driver.pid]
    assert (union.inside, union.since_ns) == (0, 0)  # every thread left: no interval open
    assert process.syncs == SYNC_WAVES * SYNC_WIDTH
    assert SYNC_WAVES * WAVE_SYNC_US / 1e6 <= union.total_ns / 1e9 <= elapsed
    assert union.total_ns / 1e9 < process.sync_seconds_sum / 2


@pytest.mark.host_only  # the rescan of mapped files, in user space
@pytest.mark.bpf
def test_a_library_dlopened_later_is_found(cuda_libs, drivers) -> None:
    with CudaProbe(rescan_interval=0.2) as probe:
        loader = LateLoader(cuda_libs.copy_dir, 300)
        drivers.append(loader)
        time.sleep(1.0)  # scanned several times without libcuda
        assert loader.library not in {lib.path for lib in probe.libraries}
        loader.load()
        # Looked at again after as long as it has lived: about 1-2 s here (30 s at most).
        assert wait_until(lambda: loader.library in {lib.path for lib in probe.libraries})
        loader.go()
        [process] = [p for p in probe.read().processes if p.pid == loader.pid]
    assert process.kernel_launches == 300
    assert process.library == loader.library


# ---- user-space pieces (no kernel needed) ----


class FakeProc:
    """A /proc tree with `uptime` and per-pid `stat` and `maps`, read through the real parsers."""

    def __init__(self, root: Path, uptime: float) -> None:
        self.root = root
        (root / "uptime").write_text(f"{uptime:.2f} 0.00\n")
        self.uptime = uptime

    def process(self, pid: int, age: float, *, libcuda: bool) -> None:
        start = int((self.uptime - age) * CLOCK_TICKS)
        directory = self.root / str(pid)
        directory.mkdir(exist_ok=True)
        (directory / "stat").write_text(f"{pid} (some (app)) S {' '.join(['0'] * 18)} {start} 0 0\n")
        line = "7f0000000000-7f0000001000 r-xp 00000000 08:01 42 /usr/lib/libcuda.so.1\n" if libcuda else ""
        (directory / "maps").write_text(f"5600000000-5600001000 r-xp 00000000 08:01 7 /usr/bin/app\n{line}")


def test_scanner_reads_new_pids_at_once_and_known_ones_after_their_age(tmp_path) -> None:
    proc, now = FakeProc(tmp_path, uptime=10_000), [0.0]
    scanner = LibraryScanner(tmp_path, interval=1.0, revisit=30.0, clock=lambda: now[0])
    proc.process(100, age=5000, libcuda=False)  # old
    proc.process(101, age=4, libcuda=False)  # young
    assert scanner.scan() == []
    proc.process(100, age=5000, libcuda=True)  # both dlopen the driver
    proc.process(101, age=4, libcuda=True)
    proc.process(102, age=0, libcuda=True)  # a new process: found at once
    assert [lib.pid for lib in scanner.scan()] == [102]
    now[0] = 4.0
    assert [lib.pid for lib in scanner.scan()] == [101]  # looked at again after its age
    now[0] = 29.0
    assert scanner.scan() == []
    now[0] = 30.0
    assert [lib.pid for lib in scanner.scan()] == [100]  # and an old one after `revisit`
    now[0] = 60.0
    assert scanner.scan() == []  # known to map libcuda: the start time says it is the same process
    now[0] = 61.0
    proc.process(102, age=-50, libcuda=True)  # pid 102 reused by a process started later
    assert [lib.pid for lib in scanner.scan()] == [102]


def test_process_entry_becomes_a_record() -> None:
    slots = [0] * hist_slots()
    slots[0], slots[-2] = 2, 2  # below 61 ns; above the last exported bound (under 65.5 s)
    hist = {"slots": slots, "count": 4, "sum_ns": 2 * 60 + 2 * 60 * 10**9}
    entry = {"comm": b"python\0\0", "gpu_threads": 2, "thread_ctx_changes": 7, "kernel_launches": 2,
             "graph_launches": 3, "runtime_launches": 4, "involuntary_preemptions": 0, "sync": hist,
             "runqueue": hist, "sync_count": [1, 2, 1], "sync_ns": [10**9, 2, 3]}
    process = process_record(9, entry, "/lib/libcuda.so.1")
    assert (process.comm, process.context_switches, process.kernel_launches, process.gpu_threads) == \
        ("python", 7, 2, 2)
    assert (process.graph_launches, process.counted_at, process.stream_sync_seconds_sum) == (3, "runtime+driver", 1.0)
    assert (process.stream_syncs, process.device_syncs, process.event_syncs) == (1, 2, 1)
    assert process.syncs == 4
    assert process.sync_histogram[0] == (EXPORTED_BOUNDS[0], 2)
    assert process.sync_histogram[-2] == (EXPORTED_BOUNDS[-1], 2)
    assert process.sync_histogram[-1] == (float("inf"), 4)
    assert process.to_dict()["sync_histogram"][-1] == {"le_seconds": "+Inf", "count": 4}
    assert kernel_buckets([1, 0, 2])[-1] == (float("inf"), 3)


def _maps_line(path: Path, address: str) -> str:
    st = path.stat()
    return f"{address} r-xp 00000000 {os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x} {st.st_ino} {path}\n"


def test_maps_parsing_finds_the_driver_and_runtimes_wherever_they_are(tmp_path) -> None:
    files = {
        "driver": tmp_path / "usr/lib/libcuda.so.535.104.05",
        "wheel": tmp_path / "site-packages/nvidia/cuda_runtime/lib/libcudart.so.12",
        "torch": tmp_path / "site-packages/torch/lib/libcudart-9335f6a2.so.12",
        "other": tmp_path / "usr/lib/libcudnn.so.9",
    }
    for path in files.values():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")
    maps = tmp_path / "77" / "maps"
    maps.parent.mkdir()
    lines = (_maps_line(path, f"7f00000{i}0000-7f00000{i}1000") for i, path in enumerate(files.values()))
    maps.write_text("".join(lines))
    found = {lib.path: lib.kind for lib in mapped_cuda_libraries(77, tmp_path)}
    assert found == {str(files["driver"]): DRIVER, str(files["wheel"]): RUNTIME, str(files["torch"]): RUNTIME}
    [driver] = [lib for lib in mapped_cuda_libraries(77, tmp_path) if lib.kind == DRIVER]
    assert driver.key == (files["driver"].stat().st_dev, files["driver"].stat().st_ino)
    # The process's root does not lead to that inode here: the path through it, unless the mapping
    # itself may be followed (CAP_SYS_ADMIN; here: it exists).
    assert driver.host_path(tmp_path) == f"{tmp_path}/77/root{files['driver']}"
    (tmp_path / "77" / "map_files").mkdir()
    (tmp_path / "77" / "map_files" / driver.address).write_bytes(b"")
    assert driver.host_path(tmp_path) == f"{tmp_path}/77/map_files/{driver.address}"
    assert mapped_cuda_libraries(78, tmp_path) == []


def test_an_executable_mapping_libcuda_without_libcudart_is_a_static_runtime_candidate(tmp_path) -> None:
    exe, driver = tmp_path / "server", tmp_path / "libcuda.so.1"
    for path in (exe, driver):
        path.write_bytes(b"")
    (tmp_path / "5").mkdir()
    (tmp_path / "5" / "exe").symlink_to(exe)
    (tmp_path / "5" / "maps").write_text(_maps_line(exe, "5600-5700") + _maps_line(driver, "7f00-7f10"))
    assert {(lib.path, lib.kind) for lib in mapped_cuda_libraries(5, tmp_path)} == \
        {(str(exe), STATIC_RUNTIME), (str(driver), DRIVER)}


# ---- the launch probes under the CPU budget ----

# Per second, paced by the driver's clock. Slow enough that the driver keeps its pace while probed on
# this busy machine: a thread the traps starve during the windows catches up while detached, unseen.
FAST_LAUNCHES, SLOW_LAUNCHES = 5_000, 200
# Full counting at FAST_LAUNCHES would cost 0.05 of a CPU (LAUNCH_COST_NS): duty-cycled to 1/2 (at 1/4
# the estimate's error reached 11% here, with the load average at 9 on 2 CPUs).
LAUNCH_BUDGET, DUTY_PERIOD_S = 0.03, 2.0


def _launches(probe: CudaProbe, pid: int):
    return _process(probe.read(), pid)


@pytest.mark.realtime  # an estimate over wall-clock periods, of a driver paced by its own clock
@pytest.mark.bpf
def test_launch_probes_are_duty_cycled_past_the_budget_estimate_within_10_percent_and_count_all_again(
        cuda_libs, drivers) -> None:
    with CudaProbe(rescan_interval=0.2, cpu_budget=LAUNCH_BUDGET, duty_period=DUTY_PERIOD_S) as probe:
        driver = Driver(cuda_libs.libdir, "rates", FAST_LAUNCHES, SLOW_LAUNCHES)
        drivers.append(driver)
        _wait_attached(probe, driver.library)
        driver.say("go")
        driver.expect("fast")
        assert wait_until(lambda: probe.read().launch_duty_cycle < 1), "the duty cycle never engaged"
        assert "launch counts estimated" in probe.status().span
        assert header_lines({"probes": {"cuda": probe.status().to_dict()}})[-1].startswith(
            "CPU budget: cuda: kernel launches counted 1/")
        time.sleep(8 * DUTY_PERIOD_S)  # duty-cycled periods: the estimate lags a change of rate by one
        assert _launches(probe, driver.pid).estimated_launches > 0
        driver.say("slow")
        assert driver.proc.stdout.readline().startswith("slow ")
        assert wait_until(lambda: probe.read().launch_duty_cycle == 1), "full counting never returned"
        time.sleep(2 * DUTY_PERIOD_S)  # the last time off is estimated once the next period is over
        estimated = _launches(probe, driver.pid).estimated_launches
        time.sleep(2 * DUTY_PERIOD_S)
        truth = counters(driver.go())["kernel_launches"]
        process = _process(probe.read(), driver.pid)
        # Every period's links were closed: the kernel holds no launch link that the probe does not.
        launch_program = fd_id(probe.loaded.obj.programs["uprobe_launch_kernel"].fd, "prog_id")
        held = {fd_id(link.fd, "link_id") for link in probe.loaded.obj.links}
        assert {link["id"] for link in bpftool_json("link", "show") if link.get("prog_id") == launch_program} <= held
    assert wait_until(lambda: not held & link_ids())
    assert process.estimated_launches == estimated  # every launch counted since
    assert abs(process.kernel_launches - truth) <= 0.1 * truth, (process.kernel_launches, truth)
