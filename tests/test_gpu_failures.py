"""GPU failures through the real pynvml and the stand-in libnvidia-ml.so.1 (tests/fixtures/nvml_libnvidia_ml.c):
Xid and ECC events from NVML's event API, a GPU NVML answers GPU_IS_LOST for. The truth is the stand-in's own
record of the events it delivered (FAKE_NVML_EVENTS_DELIVERED). Memory pressure and the out-of-memory chain
through a small server (tests/fixtures/cuda_alloc_server.py) that allocates through the stand-in libcuda.so.1 and
answers 503 when that fails: the stand-in's own count of failed allocations and the server's account of its
responses are the truth."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from aiprobe.probes.nvml.events import XIDS
from fixtures import cuda_fake
from fixtures.cuda_fake import FakeCuda
from helpers import PATIENCE, free_port, wait_until
from prometheus_client.parser import text_string_to_metric_families
from servers import AIPROBE, Agent
from test_nvml import A100_UUID, H100_UUID

XID_EVENT, SINGLE_BIT_ECC, DOUBLE_BIT_ECC = 8, 1, 2  # nvmlEventType* bits
WHOLE = {"GPU_I_ID": "", "GPU_I_PROFILE": "", "GPU_CI_ID": ""}
UUIDS = {"0": H100_UUID, "1": A100_UUID}


class Events:
    """The stand-in's event file (what NVML will deliver) and its record of what it delivered."""

    def __init__(self, tmp_path: Path) -> None:
        self.source = tmp_path / "events"
        self.delivered = tmp_path / "delivered"
        self.source.write_text("")

    @property
    def env(self) -> dict[str, str]:
        return {"FAKE_NVML_EVENTS": str(self.source), "FAKE_NVML_EVENTS_DELIVERED": str(self.delivered)}

    def send(self, *events: tuple[int, ...]) -> None:
        """(device, nvmlEventType bit, Xid[, GPU instance, compute instance]) each."""
        with self.source.open("a") as out:
            out.write("".join(" ".join(map(str, event)) + "\n" for event in events))

    def delivered_xids(self) -> Counter[tuple[str, str]]:
        """(gpu, xid) -> Xid events the stand-in delivered."""
        lines = self.delivered.read_text().split("\n") if self.delivered.exists() else []
        return Counter((fields[0], fields[2]) for fields in map(str.split, lines)
                       if fields and int(fields[1]) == XID_EVENT)


@pytest.fixture
def events(tmp_path) -> Events:
    return Events(tmp_path)


def _series(metrics: str, family: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {tuple(sorted(sample.labels.items())): sample.value for metric in text_string_to_metric_families(metrics)
            for sample in metric.samples if sample.name == family}


def _alerts(agent: Agent, rule: str) -> dict[str, dict]:
    """target -> the agent's alert of `rule` (pending, firing, or resolved in the last 15 minutes)."""
    return {alert["target"]: alert for alert in agent.snapshot()["alerts"] if alert["rule"] == rule}


def _xid_counts(metrics: str) -> Counter[tuple[str, str]]:
    counts: Counter[tuple[str, str]] = Counter()
    for labels, value in _series(metrics, "aiprobe_gpu_xid_errors_total").items():
        named = dict(labels)
        assert (named["uuid"], {k: named[k] for k in WHOLE}) == (UUIDS[named["gpu"]], WHOLE)
        counts[(named["gpu"], named["xid"])] += int(value)
    return counts


SENT = [(0, XID_EVENT, 31), (0, XID_EVENT, 31), (1, XID_EVENT, 48), (0, XID_EVENT, 79)]


def test_xids_are_counted_by_xid_with_their_meaning_and_action(nvml_env, events, tmp_path) -> None:
    """Xids 31 (twice), 48 and 79 through the event API: counts by GPU and Xid equal to what the stand-in
    delivered; an ECC event of GPU 1, which gives only Xid events, is not delivered; the last events
    carry what each Xid means and NVIDIA's action, in the snapshot and in top. Each Xid fires gpu_xid_error,
    which resolves once no new one came for the agent's window, its meaning and action in the evidence."""
    env = {**nvml_env, **events.env}
    with Agent(tmp_path, 'probes = ["nvml"]\n', env=env, args=("--dcgm-compatible",)) as agent:
        events.send(*SENT, (0, SINGLE_BIT_ECC, 0), (1, DOUBLE_BIT_ECC, 0))
        assert wait_until(lambda: sum(_xid_counts(agent.metrics()).values()) == len(SENT))
        metrics = agent.metrics()
        snapshot = agent.snapshot()
        top = subprocess.run([AIPROBE, "top", "--batch", "--iterations", "1", "--connect", agent.url],
                             capture_output=True, text=True, check=True).stdout
        targets = {f"gpu{device} xid {xid}" for device, _, xid in SENT}
        assert wait_until(lambda: {target for target, alert in _alerts(agent, "gpu_xid_error").items()
                                   if alert["state"] == "resolved"} == targets)
        alerts = _alerts(agent, "gpu_xid_error")
    for device, _, xid in SENT:
        meaning, action = XIDS[xid]
        assert {k: alerts[f"gpu{device} xid {xid}"]["evidence"][k] for k in ("xid", "meaning", "action", "uuid")} == \
            {"xid": xid, "meaning": meaning, "action": action, "uuid": UUIDS[str(device)]}
    # This test's process is on GPU 0 (FAKE_NVML_PIDS): the evidence names it.
    assert [proc["pid"] for proc in alerts["gpu0 xid 31"]["evidence"]["processes"]] == [os.getpid()]
    truth = events.delivered_xids()
    assert truth == {("0", "31"): 2, ("1", "48"): 1, ("0", "79"): 1}
    assert _xid_counts(metrics) == truth
    assert _series(metrics, "aiprobe_gpu_ecc_error_events_total") == {
        tuple(sorted({"gpu": "0", "uuid": H100_UUID, **WHOLE, "type": "single_bit_ecc"}.items())): 1}
    last = {dict(labels)["gpu"]: value for labels, value in _series(metrics, "DCGM_FI_DEV_XID_ERRORS").items()}
    assert last == {"0": 79, "1": 48}
    recent = [(e["gpu_index"], e["event"], e["xid"], e["meaning"], e["action"]) for e in snapshot["gpu_events"]]
    assert recent == [(device, "xid", xid, *XIDS[xid]) for device, _, xid in SENT] + \
        [(0, "single_bit_ecc", None, "single-bit ECC error (corrected)", "none; watch the GPU's ECC counts")]
    assert [gpu["last_xid"] for gpu in snapshot["gpus"]] == [79, 48]
    shown = top[top.index("\nGPU EVENTS\n"):]
    assert "GPU has fallen off the bus" in shown and "restart the application" in shown


def test_an_xid_in_a_mig_instance_is_labelled_with_the_instance(nvml_env, events, tmp_path) -> None:
    """GPU 1 in MIG mode: NVML names the GPU and compute instance of an Xid there; the count carries them, and
    the instance's profile, as every GPU family labels an instance."""
    env = {**nvml_env, **events.env, "FAKE_NVML_MIG": f"{os.getpid()},{os.getpid()}"}
    with Agent(tmp_path, 'probes = ["nvml"]\n', env=env) as agent:
        assert wait_until(lambda: _series(agent.metrics(), "aiprobe_gpu_memory_used_bytes"))  # instances read
        events.send((1, XID_EVENT, 43, 2, 0))  # GPU instance 2 (2g.10gb), compute instance 0
        assert wait_until(lambda: _series(agent.metrics(), "aiprobe_gpu_xid_errors_total"))
        series = _series(agent.metrics(), "aiprobe_gpu_xid_errors_total")
    assert series == {tuple(sorted({"gpu": "1", "uuid": A100_UUID, "GPU_I_ID": "2", "GPU_I_PROFILE": "2g.10gb",
                                    "GPU_CI_ID": "0", "xid": "43"}.items())): 1}
    assert events.delivered.read_text() == "1 8 43 2 0\n"


def test_refused_registration_is_a_reason_in_the_status(nvml_env) -> None:
    script = ("from aiprobe.probes.nvml.probe import NvmlProbe\n"
              "with NvmlProbe() as probe:\n    print(probe.status().span)\n")
    span = subprocess.run([sys.executable, "-c", script], env={**nvml_env, "FAKE_NVML_REFUSE_EVENTS": "1"},
                          capture_output=True, text=True, check=True).stdout.strip()
    assert span.split("; ")[-2:] == [
        f"GPU {i} ({name}): NVML refused its events (Not Supported), so no Xid errors"
        for i, name in enumerate(("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB"))]


def test_a_lost_gpu_stays_in_the_metrics(nvml_env, events, tmp_path) -> None:
    """Xid 79, then GPU_IS_LOST on every call to GPU 0: it keeps its series, aiprobe_gpu_lost 1; the other GPU
    0; NVML still counts 2 GPUs. The agent stops cleanly, its event thread too."""
    lost = tmp_path / "lost"
    env = {**nvml_env, **events.env, "FAKE_NVML_LOST": str(lost)}
    with Agent(tmp_path, 'probes = ["nvml"]\n', env=env) as agent:
        assert wait_until(lambda: _series(agent.metrics(), "aiprobe_gpu_lost"))
        events.send((0, XID_EVENT, 79))
        lost.write_text("0\n")
        assert wait_until(lambda: 1 in _series(agent.metrics(), "aiprobe_gpu_lost").values())
        metrics = agent.metrics()
        assert wait_until(lambda: _alerts(agent, "gpu_lost").get("gpu0", {}).get("state") == "firing")
        assert _alerts(agent, "gpu_lost")["gpu0"]["evidence"]["last_xid"] == 79
        text = subprocess.run([AIPROBE, "gpus"], env=env, capture_output=True, text=True, check=True).stdout
    assert agent.process.returncode == 0
    assert "Traceback" not in agent.log.read_text()
    assert {dict(labels)["uuid"]: value for labels, value in _series(metrics, "aiprobe_gpu_lost").items()} == \
        {H100_UUID: 1, A100_UUID: 0}
    assert list(_series(metrics, "aiprobe_gpus").values()) == [2]
    assert _xid_counts(metrics) == events.delivered_xids() == {("0", "79"): 1}
    # Nothing else is known of it: its other series are gone; GPU 1's stay.
    assert [dict(labels)["gpu"] for labels in _series(metrics, "aiprobe_gpu_memory_used_bytes")] == ["1"]
    # A GPU lost before `aiprobe gpus` starts: listed, lost, its UUID unknown.
    assert "LOST: NVML answers GPU_IS_LOST" in text


# The stand-in's GPU 0 error counts (FAKE_NVML_ERRORS, in its order) and what each becomes on /metrics.
ERRORS = {"ecc_corrected_volatile": 11, "ecc_uncorrected_volatile": 2, "ecc_corrected_aggregate": 130,
          "ecc_uncorrected_aggregate": 4, "remapped_rows_corrected": 6, "remapped_rows_uncorrected": 2,
          "row_remap_pending": 1, "row_remap_failure": 0, "pcie_replays": 9}
SERIES = {("aiprobe_gpu_ecc_errors_total", "corrected"): "ecc_corrected_volatile",
          ("aiprobe_gpu_ecc_errors_total", "uncorrected"): "ecc_uncorrected_volatile",
          ("aiprobe_gpu_ecc_aggregate_errors_total", "corrected"): "ecc_corrected_aggregate",
          ("aiprobe_gpu_ecc_aggregate_errors_total", "uncorrected"): "ecc_uncorrected_aggregate",
          ("aiprobe_gpu_remapped_rows_total", "corrected"): "remapped_rows_corrected",
          ("aiprobe_gpu_remapped_rows_total", "uncorrected"): "remapped_rows_uncorrected",
          ("aiprobe_gpu_row_remap_pending", ""): "row_remap_pending",
          ("aiprobe_gpu_row_remap_failed", ""): "row_remap_failure",
          ("aiprobe_gpu_pcie_replays_total", ""): "pcie_replays",
          ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", ""): "ecc_corrected_volatile",
          ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", ""): "ecc_uncorrected_volatile",
          ("DCGM_FI_DEV_ECC_SBE_AGG_TOTAL", ""): "ecc_corrected_aggregate",
          ("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", ""): "ecc_uncorrected_aggregate",
          ("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", ""): "remapped_rows_corrected",
          ("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", ""): "remapped_rows_uncorrected",
          ("DCGM_FI_DEV_ROW_REMAP_PENDING", ""): "row_remap_pending",
          ("DCGM_FI_DEV_ROW_REMAP_FAILURE", ""): "row_remap_failure",
          ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", ""): "pcie_replays"}


def _error_series(metrics: str) -> dict[tuple[str, str, str], float]:
    """(family, gpu, error) -> value of every memory error series on /metrics."""
    families = {family for family, _ in SERIES}
    return {(sample.name, sample.labels["gpu"], sample.labels.get("error", "")): sample.value
            for metric in text_string_to_metric_families(metrics) for sample in metric.samples
            if sample.name in families}


def test_memory_errors_are_the_stand_ins_and_a_gpu_without_them_says_why(nvml_env, tmp_path) -> None:
    """GPU 0's ECC, row remapping and PCIe replay counts equal the stand-in's, under aiprobe's and dcgm-exporter's
    names; GPU 1 (ECC off, no row remapping) has only its replays, and the reason for the rest, not zeros.
    Its 2 uncorrected errors fire gpu_memory_errors, which resolves once the GPU's reset cleared them."""
    counts = tmp_path / "errors"
    counts.write_text(" ".join(map(str, ERRORS.values())) + "\n")
    env = {**nvml_env, "FAKE_NVML_ERRORS": str(counts)}
    with Agent(tmp_path, 'probes = ["nvml"]\n', env=env, args=("--dcgm-compatible",)) as agent:
        assert wait_until(lambda: _error_series(agent.metrics()))
        metrics, snapshot = agent.metrics(), agent.snapshot()
        assert wait_until(lambda: _alerts(agent, "gpu_memory_errors").get("gpu0", {}).get("state") == "firing")
        counts.write_text(" ".join(str(0 if field.endswith("_volatile") else count) for field, count in ERRORS.items()))
        assert wait_until(lambda: _alerts(agent, "gpu_memory_errors")["gpu0"]["state"] == "resolved")
    assert _error_series(metrics) == {
        **{(family, "0", error): ERRORS[field] for (family, error), field in SERIES.items()},
        ("aiprobe_gpu_pcie_replays_total", "1", ""): 3, ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "1", ""): 3}
    assert [gpu["memory_errors_reason"] for gpu in snapshot["gpus"]] == \
        ["", "ECC is off; no row remapping (Ampere or newer)"]


# --- running out of GPU memory: a server that allocates through the stand-in libcuda.so.1 per request ---

ALLOC_SERVER = Path(__file__).parent / "fixtures" / "cuda_alloc_server.py"
REQUEST_BYTES = 2 << 30  # what each request allocates
MIB = 1 << 20
FULL_MIB, HALF_MIB = 77824, 40960  # of GPU 0's 80 GiB: 95% (above gpu_memory_pressure's 0.9), 50% (below 0.85)
SERVER_MIB = 70000  # the server's memory on GPU 0, as NVML lists it


@pytest.fixture(scope="module")
def cuda_libs(cbuild) -> FakeCuda:
    return cuda_fake.build(cbuild)


class AllocServer:
    """The server on a free port; `generate()` sends one request and returns the server's account of it."""

    def __init__(self, proc: subprocess.Popen, port: int) -> None:
        self.proc, self.port, self.pid = proc, port, proc.pid
        self.accounts: list[dict] = []

    def generate(self) -> dict:
        with httpx.Client() as client:  # a connection of its own: the response ends with it
            client.get(f"http://127.0.0.1:{self.port}/generate", timeout=30)
        self.accounts.append(json.loads(self.proc.stdout.readline()))
        return self.accounts[-1]


@contextlib.contextmanager
def alloc_server(cuda: FakeCuda, failures: int) -> Iterator[AllocServer]:
    """Started before the agent, so that the cuda probe's first scan finds its libcuda.so.1 mapped and probes
    it before its first allocation; the stand-in fails its first `failures` allocations."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(ALLOC_SERVER), str(port), str(cuda.libdir / "libcuda.so.1"),
                             str(REQUEST_BYTES)], env={**os.environ, "FAKE_CUDA_ALLOC_FAILURES": str(failures)},
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        yield AllocServer(proc, port)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _transitions(agent: Agent, rule: str) -> list[dict]:
    """The alert log's transitions of `rule`, in order."""
    lines = agent.alert_log.read_text().splitlines() if agent.alert_log.exists() else []
    return [event for event in map(json.loads, lines) if event["rule"] == rule]


def _states(agent: Agent) -> list[str]:
    return [event["state"] for event in _transitions(agent, "gpu_memory_pressure") if event["target"] == "gpu0"]


def _failures_counted(agent: Agent, pid: int) -> float:
    """The agent's count of the process's out-of-memory allocation failures, as /metrics has it."""
    comm = Path(f"/proc/{pid}/comm").read_text().strip()
    return sum(value for labels, value in _series(agent.metrics(), "aiprobe_cuda_memory_allocation_failures_total")
               .items() if dict(labels)["process"] == comm and dict(labels)["error"] == "CUDA_ERROR_OUT_OF_MEMORY")


@pytest.mark.bpf
def test_gpu_memory_pressure_fires_while_a_full_gpus_process_runs_out_of_memory(nvml_env, cuda_libs,
                                                                               tmp_path) -> None:
    """GPU 0 95% used with the server on it: nothing while it only listens; its failed allocations fire
    gpu_memory_pressure, the GPU's processes with their memory and failures in the evidence. The memory falls to
    50% while it goes on failing: resolved; full again: fires again; its failures over: resolved once they left
    the agent's window. GPU 1 is never under pressure (nothing of it fails)."""
    memory, processes = tmp_path / "memory", tmp_path / "processes"
    memory.write_text(f"{FULL_MIB} 39000\n")  # GPU 1: 39000 of its 40 GiB, a process on it, no failure
    with alloc_server(cuda_libs, failures=1000) as server:
        processes.write_text(f"0 {server.pid} {SERVER_MIB} 50 20\n1 {os.getpid()} 30000 10 5\n")
        env = {**nvml_env, "FAKE_NVML_MEMORY": str(memory), "FAKE_NVML_PROCESSES": str(processes)}
        with Agent(tmp_path, 'probes = ["nvml", "cuda"]\n', env=env) as agent:
            assert wait_until(lambda: [g["memory_used_bytes"] for g in agent.snapshot()["gpus"]] ==
                              [FULL_MIB * MIB, 39000 * MIB])
            assert _alerts(agent, "gpu_memory_pressure") == {}  # full, but no allocation failed
            for _ in range(3):
                server.generate()
            assert wait_until(lambda: _alerts(agent, "gpu_memory_pressure").get("gpu0", {}).get("evidence", {})
                              .get("processes", [{}])[0].get("out_of_memory_failures") == 3)
            evidence = _alerts(agent, "gpu_memory_pressure")["gpu0"]["evidence"]
            memory.write_text(f"{HALF_MIB} 39000\n")
            assert wait_until(lambda: server.generate() and _states(agent) == ["pending", "firing", "resolved"],
                              timeout=PATIENCE, interval=0.5)
            memory.write_text(f"{FULL_MIB} 39000\n")
            assert wait_until(lambda: server.generate() and _states(agent)[-1:] == ["firing"],
                              timeout=PATIENCE, interval=0.5)
            assert wait_until(lambda: _states(agent)[-1:] == ["resolved"])  # no request since: no failure
            counted = _failures_counted(agent, server.pid)
            server_comm = Path(f"/proc/{server.pid}/comm").read_text().strip()
    assert [event["target"] for event in _transitions(agent, "gpu_memory_pressure")] == ["gpu0"] * 6
    assert (evidence["uuid"], evidence["memory_used_bytes"], evidence["memory_total_bytes"]) == \
        (H100_UUID, FULL_MIB * MIB, 80 << 30)
    [on_gpu] = evidence["processes"]
    assert {k: on_gpu[k] for k in ("pid", "used_memory_bytes", "out_of_memory_failures", "retried")} == \
        {"pid": server.pid, "used_memory_bytes": SERVER_MIB * MIB, "out_of_memory_failures": 3, "retried": 0}
    assert on_gpu["process"].startswith(f"{server_comm}@")
    # Every request failed its allocation and was answered 503: the agent counted each, as the stand-in did.
    assert {(a["status"], a["cuda"]) for a in server.accounts} == {(503, 2)}
    assert counted == server.accounts[-1]["alloc_failures"] == len(server.accounts)


@pytest.mark.bpf
def test_out_of_memory_evidence_has_the_5xx_share_of_the_same_process(cuda_libs, tmp_path) -> None:
    """The server fails its allocations for good and answers those requests 503: cuda_out_of_memory fires for it,
    and its evidence names the server's port and its 5xx share (the requests part's count), the chain from the
    failed allocations to the failed requests. Requests go on until the evidence has both (each refresh judges
    the last 10 s; a loaded host may count a response a refresh late)."""
    with alloc_server(cuda_libs, failures=1000) as server, \
            Agent(tmp_path, 'probes = ["cuda", "sendlat"]\n') as agent:
        assert wait_until(lambda: agent.snapshot()["probes"].get("requests", {}).get("up"), timeout=PATIENCE)

        def evidence() -> dict:
            server.generate()
            alerts = [a for a in agent.snapshot()["alerts"] if a["rule"] == "cuda_out_of_memory"]
            return next((p for a in alerts for p in a["evidence"]["processes"] if p["pid"] == server.pid), {})
        assert wait_until(lambda: evidence().get("server_errors"), interval=0.5), agent.log.read_text()
        joined = evidence()
        assert wait_until(lambda: any(e["state"] == "firing" for e in _transitions(agent, "cuda_out_of_memory")))
    assert {(a["status"], a["cuda"]) for a in server.accounts} == {(503, 2)}
    [erring] = joined["server_errors"]
    assert (erring["port"], erring["protocol"], erring["server_error_share"]) == (server.port, "http", 1.0)
    # In the window: some of the requests the server answered, every one a 5xx, each a failed allocation.
    assert 0 < erring["server_errors"] == erring["requests"] <= len(server.accounts)
    assert 0 < joined["final_failures"] <= joined["failures"] <= server.accounts[-1]["alloc_failures"]
    assert joined["retried"] == 0
