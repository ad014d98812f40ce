"""The NVML collector through the real pynvml, loading a fake libnvidia-ml.so.1
(tests/fixtures/nvml_libnvidia_ml.c) by the normal dynamic loader (LD_LIBRARY_PATH)."""

from __future__ import annotations

import ctypes.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from aiprobe.loader import ProbeUnavailable
from aiprobe.probes.nvml.probe import NO_MIG_UTILIZATION, SPAN, NvmlProbe
from fixtures.cuda_fake import DRIVER as CUDA_DRIVER
from fixtures.cuda_fake import Driver, counters
from fixtures.cuda_fake import build as build_cuda
from helpers import FIXTURE_BUILD, NVML_OTHER_PID, CBuild, wait_until
from prometheus_client.parser import text_string_to_metric_families
from servers import AIPROBE, Agent

GIB = 1 << 30
SM_CLOCK_HZ = 1_980_000_000
# The fake's GPU 0 engines over 198e6 elapsed cycles: GR0 160 switches of 49500 cycles, GR1 40 of 99000.
FAKE_GPU0_ENGINES = [
    {"engine": 0, "context_switches_per_second": 160 * SM_CLOCK_HZ / 198e6, "context_switching_ratio": 0.04,
     "context_switch_seconds": 49500 / SM_CLOCK_HZ},
    {"engine": 1, "context_switches_per_second": 40 * SM_CLOCK_HZ / 198e6, "context_switching_ratio": 0.02,
     "context_switch_seconds": 99000 / SM_CLOCK_HZ},
]
FAKE_GPU0_SWITCHING = {
    "context_switches_per_second": 2000.0,  # 1600 + 400
    "context_switching_ratio": 0.04,  # the busiest engine's
    "context_switch_seconds": pytest.approx(3e-5),  # (1600 x 25 us + 400 x 50 us) / 2000
    "engines": FAKE_GPU0_ENGINES,
}
WHOLE_GPU = {"parent_uuid": "", "gpu_instance_id": None, "compute_instance_id": None, "mig_profile": "",
             "utilization_reason": ""}  # not a MIG instance


def _no_real_nvml() -> None:
    if ctypes.util.find_library("nvidia-ml"):
        pytest.skip("this host has a real NVML library")


def test_gpus_json_has_the_fake_values_in_base_units(nvml_env, aiprobe_cli) -> None:
    out = subprocess.run([*aiprobe_cli, "gpus", "--json"], env=nvml_env, capture_output=True, text=True, check=True)
    report = json.loads(out.stdout)
    h100, a100 = report["gpus"]
    assert h100 == {
        "index": 0, "uuid": "GPU-11111111-2222-3333-4444-555555555555", "name": "NVIDIA H100 80GB HBM3",
        "utilization_gpu_ratio": 0.87, "utilization_memory_ratio": 0.42,
        "memory_total_bytes": 80 * GIB, "memory_used_bytes": 32 * GIB, "memory_free_bytes": 48 * GIB,
        "power_watts": 312.5, "temperature_celsius": 71, "sm_clock_hz": 1_980_000_000,
        "memory_clock_hz": 2_619_000_000, "clock_event_reasons": ["sw_power_cap", "sw_thermal_slowdown"],
        "pcie_tx_bytes_per_second": 123456 * 1024, "pcie_rx_bytes_per_second": 654321 * 1024,
        "compute_mode": "exclusive_process", "lost": False, "last_xid": None,
        # The fake's memory error counts (nvml_libnvidia_ml.c: error_counts).
        "ecc_corrected_volatile": 7, "ecc_uncorrected_volatile": 0, "ecc_corrected_aggregate": 42,
        "ecc_uncorrected_aggregate": 1, "remapped_rows_corrected": 3, "remapped_rows_uncorrected": 1,
        "row_remap_pending": False, "row_remap_failure": False, "pcie_replays": 5, "memory_errors_reason": "",
        # GPM, between the two samples `aiprobe gpus` takes on a GPU that has it: engine 0's counters
        # as NVML gives them, then each engine's in base units (cycles at the 1980 MHz SM clock).
        "gpm_context_switch_requests": 160.0, "gpm_context_switch_cycles_per_request": 49500.0,
        "gpm_context_switch_active_ratio": 0.04,
        **FAKE_GPU0_SWITCHING,
        **WHOLE_GPU,
    }
    # GPU 1 answers NOT_SUPPORTED for power and PCIe throughput and has no GPM: None, not zero.
    assert (a100["index"], a100["name"], a100["memory_total_bytes"], a100["sm_clock_hz"]) == \
        (1, "NVIDIA A100-SXM4-40GB", 40 * GIB, 1_410_000_000)
    assert a100["power_watts"] is a100["pcie_tx_bytes_per_second"] is a100["gpm_context_switch_requests"] is None
    assert a100["context_switches_per_second"] is a100["context_switching_ratio"] is None
    assert a100["engines"] == []
    assert (a100["clock_event_reasons"], a100["compute_mode"]) == (["gpu_idle"], "default")
    # Processes are joined to the GPU that runs them, by host pid.
    mine, other = report["processes"]
    assert mine == {"pid": os.getpid(), "comm": Path("/proc/self/comm").read_text().strip(), "gpu_index": 0,
                    "gpu_uuid": h100["uuid"], "used_memory_bytes": GIB, "sm_utilization_ratio": 0.55,
                    "memory_utilization_ratio": 0.0, "gpu_instance_id": None, "compute_instance_id": None,
                    "attribution": "nvml"}
    assert (other["pid"], other["gpu_index"], other["gpu_uuid"], other["used_memory_bytes"]) == \
        (NVML_OTHER_PID, 1, a100["uuid"], 2 * GIB)
    assert other["sm_utilization_ratio"] is other["memory_utilization_ratio"] is None


def _samples_file(tmp_path: Path, lines: list[tuple[object, ...]]) -> Path:
    """The fake's FAKE_NVML_PROCESSES: one line per NVML sample (device pid memory_mib sm% memory%)."""
    path = tmp_path / "processes"
    path.write_text("".join(" ".join(map(str, line)) + "\n" for line in lines))
    return path


def _time_sliced(tmp_path: Path, other_pid: int) -> Path:
    """Two processes time-sliced on GPU 0: this one sampled twice (60/30 then 40/10 percent: means
    of 0.5 and 0.2), the other once (30/20)."""
    return _samples_file(tmp_path, [(0, os.getpid(), 1024, 60, 30), (0, other_pid, 2048, 30, 20),
                                    (0, os.getpid(), 1024, 40, 10)])


def test_each_process_on_a_time_sliced_gpu_has_its_share_of_nvmls_samples(nvml_env, aiprobe_cli, tmp_path,
                                                                          named_process) -> None:
    other = named_process("llm-b")
    env = {**nvml_env, "FAKE_NVML_PROCESSES": str(_time_sliced(tmp_path, other.pid))}
    report = json.loads(subprocess.run([*aiprobe_cli, "gpus", "--json"], env=env, capture_output=True, text=True,
                                       check=True).stdout)
    shares = {p["pid"]: (p["comm"], p["gpu_index"], p["used_memory_bytes"], p["sm_utilization_ratio"],
                         p["memory_utilization_ratio"]) for p in report["processes"]}
    assert shares == {os.getpid(): (Path("/proc/self/comm").read_text().strip(), 0, GIB, 0.5, 0.2),
                      other.pid: ("llm-b", 0, 2 * GIB, 0.3, 0.2)}


def _process_series(metrics: str, family: str) -> dict[str, float]:
    """process -> value of `family`'s series on /metrics."""
    return {sample.labels["process"]: sample.value for metric in text_string_to_metric_families(metrics)
            for sample in metric.samples if sample.name == family}


def test_agent_exports_each_processs_share(nvml_env, tmp_path, named_process) -> None:
    other = named_process("llm-b")
    env = {**nvml_env, "FAKE_NVML_PROCESSES": str(_time_sliced(tmp_path, other.pid))}
    me = Path("/proc/self/comm").read_text().strip()
    with Agent(tmp_path, 'probes = ["nvml"]\n', env=env) as agent:
        assert wait_until(lambda: _process_series(agent.metrics(), "aiprobe_gpu_process_sm_utilization_ratio"))
        metrics = agent.metrics()
    assert _process_series(metrics, "aiprobe_gpu_process_sm_utilization_ratio") == {me: 0.5, "llm-b": 0.3}
    assert _process_series(metrics, "aiprobe_gpu_process_memory_utilization_ratio") == {me: 0.2, "llm-b": 0.2}
    assert _process_series(metrics, "aiprobe_gpu_process_memory_used_bytes") == {me: GIB, "llm-b": 2 * GIB}


A100_UUID = "GPU-66666666-7777-8888-9999-000000000000"
# The fake's GPU 1 in MIG mode (FAKE_NVML_MIG): instance -> (uuid, profile, GPU instance, memory total, used),
# each running one process of the given memory.
MIG_INSTANCES = {"a": ("MIG-aaaaaaaa-1111-2222-3333-444444444444", "3g.20gb", 1, 20 * GIB, 2 * GIB, GIB),
                 "b": ("MIG-bbbbbbbb-1111-2222-3333-444444444444", "2g.10gb", 2, 10 * GIB, GIB // 2, GIB // 2)}


@pytest.fixture
def mig_env(nvml_env, named_process) -> tuple[dict[str, str], dict[str, int]]:
    """GPU 1 in MIG mode, a process on each of its two instances: (environment, instance -> pid)."""
    pids = {name: named_process(f"mig-{name}").pid for name in MIG_INSTANCES}
    return {**nvml_env, "FAKE_NVML_MIG": ",".join(map(str, pids.values()))}, pids


def test_each_mig_instance_is_a_gpu_with_its_own_processes(mig_env, aiprobe_cli) -> None:
    env, pids = mig_env
    report = json.loads(subprocess.run([*aiprobe_cli, "gpus", "--json"], env=env, capture_output=True, text=True,
                                       check=True).stdout)
    h100, a100, *instances = report["gpus"]
    assert (h100["utilization_gpu_ratio"], h100["utilization_reason"]) == (0.87, "")
    # Under MIG, NVML gives utilization neither for the GPU nor its instances: null, and why.
    assert (a100["uuid"], a100["utilization_gpu_ratio"], a100["utilization_reason"]) == \
        (A100_UUID, None, NO_MIG_UTILIZATION)
    assert a100["temperature_celsius"] == 45  # the GPU's own figures stay the GPU's
    assert [{k: gpu[k] for k in ("index", "uuid", "name", "parent_uuid", "gpu_instance_id", "compute_instance_id",
                                 "mig_profile", "memory_total_bytes", "memory_used_bytes", "utilization_gpu_ratio",
                                 "utilization_reason", "temperature_celsius", "engines")} for gpu in instances] == [
        {"index": 1, "uuid": uuid, "name": f"NVIDIA A100-SXM4-40GB MIG {profile}", "parent_uuid": A100_UUID,
         "gpu_instance_id": gi, "compute_instance_id": 0, "mig_profile": profile, "memory_total_bytes": total,
         "memory_used_bytes": used, "utilization_gpu_ratio": None, "utilization_reason": NO_MIG_UTILIZATION,
         "temperature_celsius": None, "engines": []}
        for uuid, profile, gi, total, used, _ in MIG_INSTANCES.values()]
    # Each process on the instance it runs on, once (NVML lists them under the GPU as well).
    on_gpu1 = [(p["pid"], p["comm"], p["gpu_index"], p["gpu_uuid"], p["gpu_instance_id"], p["compute_instance_id"],
                p["used_memory_bytes"]) for p in report["processes"] if p["gpu_index"] == 1]
    assert on_gpu1 == [(pids[name], f"mig-{name}", 1, uuid, gi, 0, memory)
                       for name, (uuid, _, gi, _, _, memory) in MIG_INSTANCES.items()]


def _samples(metrics: str, family: str) -> dict[frozenset[tuple[str, str]], float]:
    return {frozenset(sample.labels.items()): sample.value for metric in text_string_to_metric_families(metrics)
            for sample in metric.samples if sample.name == family}


def test_agent_labels_each_mig_instance_as_dcgm_does(mig_env, tmp_path) -> None:
    env, _pids = mig_env
    with Agent(tmp_path, 'probes = ["nvml"]\n', env=env) as agent:
        assert wait_until(lambda: _samples(agent.metrics(), "aiprobe_gpu_process_memory_used_bytes"))
        metrics = agent.metrics()
    whole = {"GPU_I_ID": "", "GPU_I_PROFILE": "", "GPU_CI_ID": ""}
    assert _samples(metrics, "aiprobe_gpu_memory_used_bytes") == {
        frozenset({"gpu": "0", "uuid": H100_UUID, **whole}.items()): 32 * GIB,
        frozenset({"gpu": "1", "uuid": A100_UUID, **whole}.items()): 2 * GIB,
        **{frozenset({"gpu": "1", "uuid": A100_UUID, "GPU_I_ID": str(gi), "GPU_I_PROFILE": profile,
                      "GPU_CI_ID": "0"}.items()): used
           for _, profile, gi, _, used, _ in MIG_INSTANCES.values()}}
    # No utilization series for GPU 1 or its instances: NVML gives none under MIG.
    assert [dict(labels)["gpu"] for labels in _samples(metrics, "aiprobe_gpu_utilization_ratio")] == ["0"]
    processes = {dict(labels)["process"]: (dict(labels)["gpu"], dict(labels)["GPU_I_ID"], dict(labels)["GPU_CI_ID"],
                                           value)
                 for labels, value in _samples(metrics, "aiprobe_gpu_process_memory_used_bytes").items()}
    assert {name: processes[f"mig-{name}"] for name in MIG_INSTANCES} == {
        name: ("1", str(gi), "0", memory) for name, (_, _, gi, _, _, memory) in MIG_INSTANCES.items()}


# The agent in a process of its own, started with the fake NVML on its library path: one refresh per
# line on stdin, then its nvml reading's processes (and whether the cuda probe has probed `library`).
MPS_AGENT = """
import json, sys
from aiprobe.config import Config
from aiprobe.daemon import Agent
from aiprobe.probes.cuda.settings import CudaSettings

# Every launch counted: no duty-cycling of the launch probes within the budget.
config = Config(probes=("nvml", "cuda"), sections=(CudaSettings(cuda_cpu_budget=64.0),))
with Agent(config) as agent:
    for _ in sys.stdin:
        agent.refresh()
        cuda = agent.readings.records.get("cuda")
        print(json.dumps({"attached": cuda is not None and sys.argv[1] in {lib.path for lib in cuda.libraries},
                          "processes": [proc.to_dict() for proc in agent.readings.records["nvml"].processes]}),
              flush=True)
"""
MPS_LAUNCHES = {"client-a": 3000, "client-b": 1000}  # 3:1
MPS_SERVER_SHARES = MPS_SERVER_SM, MPS_SERVER_MEMORY = 0.8, 0.4


@pytest.mark.bpf
def test_an_mps_servers_share_goes_to_its_clients_by_their_launches(nvml_env, cbuild, tmp_path,
                                                                    named_process) -> None:
    """NVML lists only the MPS server on GPU 1 (80% SM, 40% memory); two clients on GPU 1 launch
    3000 and 1000 kernels between two refreshes (the fake driver's own counts): they get 0.75 and
    0.25 of the server's shares, by the cuda probe's launch counts, labelled as such."""
    cuda = build_cuda(cbuild)
    server = named_process("nvidia-cuda-mps-server")
    samples = _samples_file(tmp_path, [(1, server.pid, 512, *(round(ratio * 100) for ratio in MPS_SERVER_SHARES))])
    for name in MPS_LAUNCHES:  # the driver program under each client's name
        shutil.copy(CUDA_DRIVER, tmp_path / name)
    clients = {name: Driver(cuda.libdir, "bursts", program=(str(tmp_path / name),), env={"CUDA_VISIBLE_DEVICES": "1"})
               for name in MPS_LAUNCHES}
    agent = subprocess.Popen([sys.executable, "-c", MPS_AGENT, str(cuda.libdir / "libcuda.so.1")], text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             env={**nvml_env, "FAKE_NVML_PROCESSES": str(samples)})

    def refresh() -> dict:
        agent.stdin.write("\n")
        agent.stdin.flush()
        return json.loads(agent.stdout.readline())

    def burst(launches: dict[str, int]) -> None:
        for name, count in launches.items():
            clients[name].say(str(count))
        for name in launches:
            clients[name].expect("launched")
    try:
        assert wait_until(lambda: refresh()["attached"]), "the cuda probe never probed the fake libcuda"
        for client in clients.values():
            client.say("go")
        burst(dict.fromkeys(MPS_LAUNCHES, 1))
        refresh()  # the launches since this refresh are the bursts alone
        burst(MPS_LAUNCHES)
        processes = {proc["comm"]: proc for proc in refresh()["processes"] if proc["gpu_index"] == 1}
        truth = {name: counters(_finish(client))["kernel_launches"]
                 for name, client in clients.items()}
    finally:
        agent.stdin.close()
        agent.wait(timeout=60)
        for client in clients.values():
            client.kill()
    assert truth == {name: count + 1 for name, count in MPS_LAUNCHES.items()}
    mps = processes.pop("nvidia-cuda-mps")  # comm keeps 15 characters
    # The server keeps its memory; its shares went to its clients.
    assert (mps["pid"], mps["used_memory_bytes"], mps["sm_utilization_ratio"], mps["attribution"]) == \
        (server.pid, 512 << 20, None, "nvml")
    total = sum(MPS_LAUNCHES.values())
    assert {name: proc["pid"] for name, proc in processes.items()} == {n: c.pid for n, c in clients.items()}
    for name, proc in processes.items():
        share = MPS_LAUNCHES[name] / total
        assert proc["attribution"] == "cuda_launches"
        assert proc["sm_utilization_ratio"] == pytest.approx(MPS_SERVER_SM * share, rel=0.05), name
        assert proc["memory_utilization_ratio"] == pytest.approx(MPS_SERVER_MEMORY * share, rel=0.05), name


def _finish(client: Driver) -> str:
    client.say("0")
    return client.finish()


def test_gpus_text_view(nvml_env, aiprobe_cli) -> None:
    out = subprocess.run([*aiprobe_cli, "gpus"], env=nvml_env, capture_output=True, text=True, check=True).stdout
    assert "GPU 0  NVIDIA H100 80GB HBM3" in out
    assert "power 312 W" in out  # units from aiprobe.formatting, as in top
    assert "power -" in out  # NOT_SUPPORTED on GPU 1


def test_not_supported_metric_is_disabled_for_that_gpu_only(nvml_env) -> None:
    script = """
import ctypes, json
from aiprobe.probes.nvml.probe import NvmlProbe
with NvmlProbe() as probe:
    powers = [[gpu.power_watts for gpu in probe.read().gpus] for _ in range(3)]
fake = ctypes.CDLL("libnvidia-ml.so.1")
calls = [fake.fake_nvml_calls(f"nvmlDeviceGetPowerUsage/{i}".encode()) for i in (0, 1)]
print(json.dumps({"powers": powers, "calls": calls}))
"""
    result = json.loads(subprocess.run([sys.executable, "-c", script], env=nvml_env, capture_output=True,
                                       text=True, check=True).stdout)
    assert result["powers"] == [[312.5, None]] * 3
    assert result["calls"] == [3, 1]  # GPU 1 was asked once, then never again


H100_UUID = "GPU-11111111-2222-3333-4444-555555555555"
A100_REFUSAL = "GPU 1 (NVIDIA A100-SXM4-40GB): no GPM (Hopper or newer), so no GPU context-switch metrics"
SWITCHING_FAMILIES = {"aiprobe_gpu_context_switches_per_second": "context_switches_per_second",
                      "aiprobe_gpu_context_switching_ratio": "context_switching_ratio",
                      "aiprobe_gpu_context_switch_seconds": "context_switch_seconds"}


def _switching_series(metrics: str) -> dict[tuple[str, str, str, str], float]:
    """(family, gpu, uuid, engine) -> value of every GPU context-switch series on /metrics."""
    return {(sample.name, sample.labels["gpu"], sample.labels["uuid"], sample.labels["engine"]): sample.value
            for metric in text_string_to_metric_families(metrics) for sample in metric.samples
            if sample.name.startswith("aiprobe_gpu_context_switch")}


def test_agent_exports_each_engines_switching_and_says_once_which_gpu_has_none(nvml_env, tmp_path) -> None:
    """/metrics has the fake's GPU 0 engines in base units, and nothing for GPU 1, which has no GPM:
    the probe's span and the agent's log say so, once. top --batch shows the GPU's switches and share."""
    expected = {(name, "0", H100_UUID, str(engine["engine"])): engine[field]
                for name, field in SWITCHING_FAMILIES.items() for engine in FAKE_GPU0_ENGINES}
    with Agent(tmp_path, 'probes = ["nvml"]\n', env=nvml_env) as agent:
        assert wait_until(lambda: _switching_series(agent.metrics()), timeout=15)
        assert _switching_series(agent.metrics()) == expected
        assert agent.snapshot()["probes"]["nvml"]["span"] == f"{SPAN}; {A100_REFUSAL}"
        top = subprocess.run([AIPROBE, "top", "--batch", "--iterations", "1", "--connect", agent.url],
                             capture_output=True, text=True, check=True).stdout
    gpus = top[top.index("\nGPUS\n") + 1:].splitlines()
    columns = gpus[2].split()  # after the title and the header
    # busy CUDA contexts: unknown, no cuda probe; no Xid, not lost
    assert [columns[0], *columns[-5:]] == ["0", "-", "2k/s", "4%", "-", "-"]
    assert [line for line in agent.log.read_text().splitlines() if "GPM" in line] == [f"aiprobe: nvml: {A100_REFUSAL}"]


@pytest.fixture(scope="module")
def nvml_without_gpm_env() -> dict[str, str]:
    """A fake NVML built without the GPM functions, as a driver from before GPM."""
    build = CBuild(FIXTURE_BUILD / "without-gpm")
    build.out.mkdir(parents=True, exist_ok=True)
    build("libnvidia-ml.so.1", "nvml_libnvidia_ml.c", shared=True, flags=("-DFAKE_NVML_WITHOUT_GPM",))
    return {**os.environ, "LD_LIBRARY_PATH": str(build.out)}


def test_a_driver_without_gpm_gives_no_switching_and_says_why(nvml_without_gpm_env, aiprobe_cli) -> None:
    report = json.loads(subprocess.run([*aiprobe_cli, "gpus", "--json"], env=nvml_without_gpm_env,
                                       capture_output=True, text=True, check=True).stdout)
    assert [(gpu["engines"], gpu["context_switching_ratio"], gpu["gpm_context_switch_requests"])
            for gpu in report["gpus"]] == [([], None, None)] * 2
    script = ("from aiprobe.probes.nvml.probe import NvmlProbe\n"
              "with NvmlProbe() as probe:\n    print(probe.status().span)\n")
    span = subprocess.run([sys.executable, "-c", script], env=nvml_without_gpm_env, capture_output=True, text=True,
                          check=True).stdout.strip()
    assert span == "; ".join([SPAN, *(f"GPU {i} ({name}): no GPM in this driver's NVML, so no GPU context-switch "
                                      "metrics" for i, name in enumerate(("NVIDIA H100 80GB HBM3",
                                                                          "NVIDIA A100-SXM4-40GB")))])


@pytest.mark.bpf
def test_check_names_each_gpu_without_gpm(nvml_env, aiprobe_cli) -> None:
    result = subprocess.run([*aiprobe_cli, "check", "--json"], env=nvml_env, capture_output=True, text=True,
                            check=True)
    assert json.loads(result.stdout)["probes"]["nvml"]["limitations"] == [A100_REFUSAL]


def test_without_nvml_gpus_exits_1_with_one_line(aiprobe_cli) -> None:
    _no_real_nvml()
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    result = subprocess.run([*aiprobe_cli, "gpus"], env=env, capture_output=True, text=True)
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        "aiprobe: NVML unavailable: libnvidia-ml.so.1 not found (no NVIDIA driver installed)"
    ]


def test_without_nvml_probe_is_unavailable_and_reads_empty() -> None:
    _no_real_nvml()
    probe = NvmlProbe()  # this process was started without the fake on its library path
    with pytest.raises(ProbeUnavailable):
        probe.start()
    assert not probe.available
    assert "libnvidia-ml.so.1 not found" in probe.reason
    assert probe.status().to_dict() == {"up": False, "strategy": None, "span": "", "reason": probe.reason,
                                        "overflows": {}}
    assert probe.read().to_dict() == {"available": False, "reason": probe.reason, "gpu_count": None, "gpus": [],
                                      "processes": [], "events": [], "event_counts": []}
    probe.close()
    probe.close()


@pytest.mark.bpf
def test_without_nvml_check_says_why_and_the_rest_runs(aiprobe_cli) -> None:
    _no_real_nvml()
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    result = subprocess.run([*aiprobe_cli, "check", "--json"], env=env, capture_output=True, text=True, check=True)
    probes = json.loads(result.stdout)["probes"]
    assert not probes["nvml"]["available"]
    assert "libnvidia-ml.so.1 not found" in probes["nvml"]["reason"]
    assert probes["cuda"]["available"]
    assert probes["sched"]["strategy"] == "tp_btf"
