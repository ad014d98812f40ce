"""Real-GPU check: aiprobe's CUDA counts beside a program's own, on a host with an NVIDIA GPU.

    sudo .venv/bin/python -m benchmarks.gpu_check [--launches N] [--nodes M] [--replays K]

Starts the cuda probe, then a child process that drives the GPU through the driver API with ctypes:
cuInit, a context, a module from PTX text (an empty kernel), N launches, a graph of M launches
captured on a stream and replayed K times, stream / event / context synchronizations, and a second
context pushed over the first and popped (two context changes). The child counts its own calls and
times its start-up calls; this prints those beside what aiprobe counted, NVML's view of the GPU (on
Hopper and newer, GPM's context switches over the run: per second, share of time, time per switch,
per graphics engine) and `nvidia-smi`'s (`--query-gpu` with the SM clock those times are counted at,
and `dmon`'s own GPM context-switch columns), each process's share of its GPU or MIG instance as aiprobe
exports it (an MPS server's split by its clients' launches) beside `nvidia-smi pmon -c 1` and
`nvidia-smi mig -lgi`, the GPUs' memory error counters (ECC, row remapping, PCIe replays), lost state
and the Xid and ECC events NVML sent over the run beside `nvidia-smi -q -d ECC,ROW_REMAPPER`, and
exits 0 only when every count matches exactly. Takes seconds (the
limit for the whole run is under 3 minutes). Without an NVIDIA driver it says so and exits 2.

Not part of `make bench` (it needs a GPU); tests/test_cuda.py runs it against the fake libcuda.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from aiprobe import formatting
from aiprobe.probes.cuda.probe import STATIC_RUNTIME, CudaProbe, CudaProcess, mapped_cuda_libraries
from aiprobe.probes.cuda.records import CudaContext
from aiprobe.probes.nvml.command import event_line, failure_lines
from aiprobe.probes.nvml.mps import attribute_mps
from aiprobe.probes.nvml.probe import NvmlProbe, started_probe
from aiprobe.probes.nvml.records import GpuEngine, GpuInfo, GpuProcess, GpuSnapshot

ROOT = Path(__file__).resolve().parent.parent
NO_GPU_EXIT = 2
ATTACH_TIMEOUT = 30.0
WORKLOAD_TIMEOUT = 120.0
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 75, 76
CU_STREAM_CAPTURE_MODE_GLOBAL = 0
# The lowest PTX ISA version that can target each architecture (PTX ISA release notes).
PTX_ISA = {50: "4.0", 52: "4.1", 53: "4.2", 60: "5.0", 61: "5.0", 62: "5.0", 70: "6.0", 72: "6.1", 75: "6.3",
           80: "7.0", 86: "7.1", 87: "7.4", 89: "7.8", 90: "7.8", 100: "8.6", 101: "8.6", 103: "8.8",
           110: "9.0", 120: "8.7", 121: "8.8"}
FALLBACK_TARGETS = ((75, "6.3"), (52, "4.1"))
KERNEL = b"noop"
NVIDIA_SMI_FIELDS = "index,name,uuid,driver_version,utilization.gpu,memory.used,memory.total,clocks.sm"
# nvidia-smi dmon's GPM metrics: GR0's context-switch requests, cycles per request, active percentage.
NVIDIA_SMI_GPM_METRICS = "172,173,174"


class CudaCallFailed(RuntimeError):
    pass


# ---- the child: a tiny CUDA program that counts its own calls ----


def _ptx(arch: int, version: str) -> bytes:
    return (f".version {version}\n.target sm_{arch}\n.address_size 64\n\n"
            f".visible .entry {KERNEL.decode()}()\n{{\n\tret;\n}}\n").encode() + b"\0"


class Workload:
    """The CUDA program: every call checked, counted in `own` under the name aiprobe reports it by."""

    def __init__(self, cuda: ctypes.CDLL) -> None:
        self.cuda = cuda
        self.own: Counter[str] = Counter()
        self.seconds: dict[str, float] = {}

    def call(self, name: str, *args: object, count: str | None = None) -> None:
        rc = getattr(self.cuda, name)(*args)
        if count:
            self.own[count] += 1
        if rc:
            raise CudaCallFailed(f"{name} failed: CUresult {rc}")

    def timed(self, phase: str, name: str, *args: object, count: str | None = None) -> None:
        start = time.perf_counter()
        try:
            self.call(name, *args, count=count)
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def compute_capability(self, device: ctypes.c_int) -> int:
        major, minor = ctypes.c_int(), ctypes.c_int()
        self.call("cuDeviceGetAttribute", ctypes.byref(major), CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device)
        self.call("cuDeviceGetAttribute", ctypes.byref(minor), CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device)
        return major.value * 10 + minor.value

    def load_kernel(self, arch: int) -> ctypes.c_void_p:
        """The empty kernel, from PTX for this GPU's architecture or, failing that, an older one
        (the driver compiles PTX forward). Each attempt is a module load aiprobe counts."""
        module, function = ctypes.c_void_p(), ctypes.c_void_p()
        candidates = [(arch, PTX_ISA[arch])] if arch in PTX_ISA else []
        for target, version in (*candidates, *FALLBACK_TARGETS):
            try:
                self.timed("module_load", "cuModuleLoadData", ctypes.byref(module), _ptx(target, version),
                           count="module_loads")
                break
            except CudaCallFailed:
                continue
        else:
            raise CudaCallFailed("cuModuleLoadData failed for every PTX target tried")
        self.call("cuModuleGetFunction", ctypes.byref(function), module, KERNEL)
        return function

    def launch(self, function: ctypes.c_void_p, stream: ctypes.c_void_p) -> None:
        self.call("cuLaunchKernel", function, 1, 1, 1, 1, 1, 1, 0, stream, None, None, count="kernel_launches")

    def run(self, launches: int, nodes: int, replays: int) -> None:
        device, context, second = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p()
        stream, graph, graph_exec, event = (ctypes.c_void_p() for _ in range(4))
        self.timed("init", "cuInit", 0)
        self.call("cuDeviceGet", ctypes.byref(device), 0)
        self.timed("context_create", "cuCtxCreate_v2", ctypes.byref(context), 0, device, count="context_creates")
        function = self.load_kernel(self.compute_capability(device))
        self.call("cuStreamCreate", ctypes.byref(stream), 0)
        for _ in range(launches):
            self.launch(function, stream)
        self.call("cuStreamSynchronize", stream, count="stream_syncs")
        self.call("cuStreamBeginCapture_v2", stream, CU_STREAM_CAPTURE_MODE_GLOBAL)
        for _ in range(nodes):  # captured: recorded into the graph, each still a launch call
            self.launch(function, stream)
        self.call("cuStreamEndCapture", stream, ctypes.byref(graph))
        self.call("cuGraphInstantiateWithFlags", ctypes.byref(graph_exec), graph, ctypes.c_ulonglong(0))
        for _ in range(replays):
            self.call("cuGraphLaunch", graph_exec, stream, count="graph_launches")
        self.call("cuStreamSynchronize", stream, count="stream_syncs")
        self.call("cuEventCreate", ctypes.byref(event), 0)
        self.call("cuEventRecord", event, stream)
        self.call("cuEventSynchronize", event, count="event_syncs")
        self.call("cuCtxSynchronize", count="device_syncs")
        # A second context: created (pushed over the first: a change), popped (back: a change).
        self.timed("context_create", "cuCtxCreate_v2", ctypes.byref(second), 0, device, count="context_creates")
        self.own["context_switches"] += 1
        self.call("cuCtxPopCurrent_v2", ctypes.byref(ctypes.c_void_p()))
        self.own["context_switches"] += 1
        self.call("cuCtxDestroy_v2", second)


def run_workload(launches: int, nodes: int, replays: int) -> int:
    cuda = ctypes.CDLL("libcuda.so.1")  # mapped now, so the probe can attach before any call
    print("ready", flush=True)
    sys.stdin.readline()
    workload = Workload(cuda)
    try:
        workload.run(launches, nodes, replays)
    except CudaCallFailed as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        return 1
    print(json.dumps({"own": workload.own, "seconds": workload.seconds}), flush=True)
    return 0


# ---- the parent: the probe, the child, the comparison ----


def no_gpu_reason() -> str | None:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "no NVIDIA driver here (libcuda.so.1 not found): nothing to check on this host"
    return None


def nvidia_smi(*args: str) -> list[str]:
    if shutil.which("nvidia-smi") is None:
        return ["(nvidia-smi not found)"]
    result = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=30, check=False)
    return result.stdout.strip().splitlines() or [f"(nvidia-smi: {result.stderr.strip()})"]


def nvidia_smi_gpus() -> list[str]:
    return nvidia_smi(f"--query-gpu={NVIDIA_SMI_FIELDS}", "--format=csv,noheader")


def _switching(name: str, switching: GpuInfo | GpuEngine) -> str:
    """`gpu0: 2k/s, 4% of the time, 30.0 µs per switch` (a GPU or one of its engines)."""
    return (f"{name}: {formatting.field('context_switches_per_second', switching.context_switches_per_second)}, "
            f"{formatting.field('context_switching_ratio', switching.context_switching_ratio)} of the time, "
            f"{formatting.field('context_switch_seconds', switching.context_switch_seconds)} per switch")


def _device(process: GpuProcess) -> str:
    """`gpu0`, or `gpu1 GI 2 CI 0` for a MIG instance."""
    if process.gpu_instance_id is None:
        return f"gpu{process.gpu_index}"
    return f"gpu{process.gpu_index} GI {process.gpu_instance_id} CI {process.compute_instance_id}"


def sharing_lines(snapshot: GpuSnapshot) -> list[str]:
    """Each process's share of its GPU (or MIG instance) as aiprobe exports it, and each MIG instance."""
    field = formatting.field
    lines = [f"{_device(p)} pid {p.pid} ({p.comm}): SM {field('sm_utilization_ratio', p.sm_utilization_ratio)}, "
             f"memory {field('memory_utilization_ratio', p.memory_utilization_ratio)}, "
             f"{field('used_memory_bytes', p.used_memory_bytes)} used, attribution {p.attribution}"
             for p in snapshot.processes]
    return lines + [f"gpu{g.index} MIG GI {g.gpu_instance_id} CI {g.compute_instance_id} ({g.mig_profile}, {g.uuid}): "
                    f"{field('memory_used_bytes', g.memory_used_bytes)} used"
                    f"{'; ' + g.utilization_reason if g.utilization_reason else ''}"
                    for g in snapshot.gpus if g.parent_uuid]


def gpu_failure_lines(nvml: NvmlProbe, snapshot: GpuSnapshot) -> list[str]:
    """Each GPU's memory error counts and lost state, the Xid and ECC events NVML sent over the run, and
    the GPUs whose events NVML refused."""
    lines = [f"gpu{gpu.index}: " + "; ".join(failure_lines(gpu)) for gpu in snapshot.gpus if not gpu.parent_uuid]
    events = [event_line(event) for event in snapshot.events] or ["no Xid or ECC event over the run"]
    return lines + events + nvml.event_refusals


def nvml_lines(nvml: NvmlProbe, contexts: list[CudaContext]) -> tuple[list[str], list[str], list[str]]:
    """NVML's view of the GPUs and GPM's context switches since the read before the program ran; every
    process's share over the run (an MPS server's split by its clients' launches: `contexts`); and the
    GPUs' failures (gpu_failure_lines)."""
    if not nvml.available:
        return [f"({nvml.reason})"], [], []
    snapshot = nvml.read()
    attribute_mps(snapshot, contexts)
    lines = [f"gpu{g.index} {g.name}: utilization {g.utilization_gpu_ratio}, memory used {g.memory_used_bytes} B"
             for g in snapshot.gpus]
    for gpu in snapshot.gpus:
        if gpu.engines:
            lines.append("GPM context switches of " + _switching(f"gpu{gpu.index}", gpu) + " (" + ", ".join(
                _switching(f"engine {engine.engine}", engine) for engine in gpu.engines) + ")")
    return lines + nvml.gpm_refusals, sharing_lines(snapshot), gpu_failure_lines(nvml, snapshot)


def _start_child(args: argparse.Namespace) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-m", "benchmarks.gpu_check", "--workload", "--launches",
                              str(args.launches), "--nodes", str(args.nodes), "--replays", str(args.replays)],
                             cwd=ROOT, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    if child.stdout.readline().strip() != "ready":
        child.kill()
        raise SystemExit("gpu_check: the CUDA program did not start")
    return child


def _wait_attached(probe: CudaProbe, pid: int) -> None:
    paths = {lib.path for lib in mapped_cuda_libraries(pid) if lib.kind != STATIC_RUNTIME}  # python is none
    deadline = time.monotonic() + ATTACH_TIMEOUT
    while not paths <= {lib.path for lib in probe.libraries if not lib.error}:
        if time.monotonic() > deadline:
            raise SystemExit(f"gpu_check: aiprobe did not attach to {paths} within {ATTACH_TIMEOUT:.0f} s")
        time.sleep(0.1)


COMPARED = ("kernel_launches", "graph_launches", "stream_syncs", "device_syncs", "event_syncs", "context_switches")
COLD_COMPARED = (("init", "init_seconds"), ("context_create", "context_create_seconds"),
                 ("module_load", "module_load_seconds"))


def compare(own: dict, seconds: dict, process: CudaProcess) -> tuple[list[str], bool]:
    """Table lines, and whether every count matched."""
    cold = process.cold_start
    rows = [(name, own.get(name, 0), getattr(process, name)) for name in COMPARED]
    if cold is not None:
        rows += [("context_creates", own.get("context_creates", 0), cold.context_creates),
                 ("module_loads", own.get("module_loads", 0), cold.module_loads)]
    lines = [f"{'':<22}{'program':>12}{'aiprobe':>12}"]
    lines += [f"{name:<22}{mine:>12}{theirs:>12}{'' if mine == theirs else '   MISMATCH'}"
              for name, mine, theirs in rows]
    for phase, field in COLD_COMPARED:
        if cold is not None:
            lines.append(f"{phase + ' seconds':<22}{seconds.get(phase, 0.0):>12.6f}{getattr(cold, field):>12.6f}")
    if cold is not None:
        lines.append(f"{'to first launch s':<22}{'-':>12}{cold.to_first_launch_seconds or 0.0:>12.6f}")
    lines.append(f"counted at: {process.counted_at or '-'}; runtime: {process.runtime or 'none'}")
    return lines, all(mine == theirs for _, mine, theirs in rows) and cold is not None


def check(args: argparse.Namespace) -> int:
    reason = no_gpu_reason()
    if reason:
        print(f"gpu_check: {reason}", file=sys.stderr)
        return NO_GPU_EXIT
    if os.geteuid() != 0:
        print("gpu_check: needs root (it loads BPF programs)", file=sys.stderr)
        return NO_GPU_EXIT
    started = time.monotonic()
    smi_before = nvidia_smi_gpus()
    gpus = started_probe()
    if gpus.available:
        gpus.read()  # GPM's first sample: the next read measures the switches over the program's run
    with contextlib.closing(gpus), CudaProbe(rescan_interval=0.1) as probe:
        child = _start_child(args)
        try:
            _wait_attached(probe, child.pid)
            child.stdin.write("go\n")
            child.stdin.flush()
            report = json.loads(child.stdout.readline() or "{}")
            nvml, shares, failures = nvml_lines(gpus, probe.read().contexts)
            child.wait(timeout=WORKLOAD_TIMEOUT)
        finally:
            if child.poll() is None:
                child.kill()
        snapshot = probe.read()
    if "own" not in report:
        print(f"gpu_check: the CUDA program failed: {report.get('error', 'no report')}", file=sys.stderr)
        return 1
    [process] = [p for p in snapshot.processes if p.pid == child.pid] or [None]
    if process is None:
        print("gpu_check: aiprobe saw no CUDA calls from the program", file=sys.stderr)
        return 1
    lines, matched = compare(report["own"], report["seconds"], process)
    print(f"gpu_check: {args.launches} launches, a graph of {args.nodes} launches replayed {args.replays} times "
          f"({time.monotonic() - started:.1f} s)")
    print("\n".join(lines))
    contexts = [c for c in snapshot.contexts if c.pid == child.pid]
    print("contexts: " + ", ".join(f"{c.context} on gpu {c.gpu}: {c.kernel_launches} kernel + "
                                   f"{c.graph_launches} graph launches" for c in contexts))
    print("NVML: " + "; ".join(nvml))
    print("nvidia-smi before: " + " | ".join(smi_before))
    print("nvidia-smi after:  " + " | ".join(nvidia_smi_gpus()))
    print("GPU sharing, aiprobe (NVML's per-process samples over the run):\n  " + "\n  ".join(shares or ["-"]))
    print("nvidia-smi pmon -c 1:\n  " + "\n  ".join(nvidia_smi("pmon", "-c", "1")))
    print("nvidia-smi mig -lgi:\n  " + "\n  ".join(nvidia_smi("mig", "-lgi")))
    print("nvidia-smi dmon GPM (GR0 context-switch requests, cycles per request, active %): " + " | ".join(
        nvidia_smi("dmon", "--gpm-metrics", NVIDIA_SMI_GPM_METRICS, "--count", "1")))
    print("GPU failures, aiprobe (NVML's error counters, and its events over the run):\n  " + "\n  ".join(
        failures or ["-"]))
    print("nvidia-smi -q -d ECC,ROW_REMAPPER:\n  " + "\n  ".join(nvidia_smi("-q", "-d", "ECC,ROW_REMAPPER")))
    print("all counts match" if matched else "COUNTS DIFFER")
    return 0 if matched else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launches", type=int, default=20_000)
    parser.add_argument("--nodes", type=int, default=20)
    parser.add_argument("--replays", type=int, default=500)
    parser.add_argument("--workload", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.workload:
        return run_workload(args.launches, args.nodes, args.replays)
    return check(args)


if __name__ == "__main__":
    sys.exit(main())
