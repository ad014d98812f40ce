"""The agent under exactly the capabilities the DaemonSet grants (read from
deploy/kubernetes/base/daemonset.yaml, not from a second list), as uid 0 without any other
capability and without a way to gain one (setpriv), like the container: every probe comes up and
counts traffic, CUDA calls and GPUs that the test makes."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from aiprobe.system import TRACEFS
from aiprobe.uprobe_events import PERF_EVENT_PARANOID
from fixtures.cuda_fake import Driver
from fixtures.cuda_fake import build as build_cuda
from fixtures.sendlat_peer import build as build_peer
from fixtures.sendlat_peer import send, sink
from helpers import FIXTURE_BUILD, VethPair, wait_until
from prometheus_client.parser import text_string_to_metric_families
from servers import Agent

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = ROOT / "deploy/kubernetes/base/daemonset.yaml"
CAPABILITY_HEADER = Path("/usr/include/linux/capability.h")
LAUNCHES, SENDS, SEND_SIZE = 300, 40, 1000


def manifest_capabilities() -> list[str]:
    """The capabilities the aiprobe container adds, after dropping ALL."""
    daemonset = yaml.safe_load(MANIFEST.read_text())
    [container] = [c for c in daemonset["spec"]["template"]["spec"]["containers"] if c["name"] == "aiprobe"]
    context = container["securityContext"]
    assert context["capabilities"]["drop"] == ["ALL"] and context["runAsUser"] == 0
    assert context["allowPrivilegeEscalation"] is False
    return context["capabilities"]["add"]


def capability_mask(names: list[str]) -> int:
    """The kernel's bit mask of these capabilities, numbered by the kernel's own header."""
    numbers = dict(re.findall(r"#define CAP_(\w+)\s+(\d+)", CAPABILITY_HEADER.read_text()))
    return sum(1 << int(numbers[name]) for name in names)


def setpriv(capabilities: list[str]) -> list[str]:
    """uid 0 keeps only these capabilities across exec (inheritable and bounding sets) and may never
    regain others (no_new_privs: allowPrivilegeEscalation: false)."""
    caps = ",".join(["-all", *(f"+{name.lower()}" for name in capabilities)])
    return ["setpriv", "--reuid=0", "--regid=0", "--clear-groups", f"--inh-caps={caps}",
            f"--bounding-set={caps}", "--no-new-privs", "--"]


def samples(metrics: str) -> dict[tuple[str, frozenset], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(metrics) for s in family.samples}


def value(found: dict, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels`."""
    wanted = set(labels.items())
    return sum(v for (n, have), v in found.items() if n == name and wanted <= have)


@pytest.fixture
def documented_perf_paranoia() -> Iterator[None]:
    """kernel.perf_event_paranoid at most 2, as deploy/kubernetes/README.md asks of nodes (Debian's
    kernels default to 3, which allows perf_event_open only with CAP_SYS_ADMIN); restored after."""
    level = PERF_EVENT_PARANOID.read_text()
    if int(level) > 2:
        PERF_EVENT_PARANOID.write_text("2")
    try:
        yield
    finally:
        PERF_EVENT_PARANOID.write_text(level)


@pytest.mark.bpf
@pytest.mark.usefixtures("documented_perf_paranoia")
def test_agent_with_only_the_daemonsets_capabilities_runs_and_counts_every_probe(
        tmp_path: Path, veth: VethPair, cbuild) -> None:
    capabilities = manifest_capabilities()
    cuda_libdir = build_cuda(cbuild).libdir
    peer = build_peer(cbuild)
    cbuild("libnvidia-ml.so.1", "nvml_libnvidia_ml.c", shared=True)
    env = {**os.environ, "LD_LIBRARY_PATH": str(FIXTURE_BUILD), "FAKE_NVML_PIDS": str(os.getpid())}
    config = f'interfaces = ["{veth.host}"]\nexclude = []\nprobes = ["flows", "sendlat", "cuda", "nvml"]\n'
    with Agent(tmp_path, config, env=env, prefix=setpriv(capabilities)) as agent:
        status = Path(f"/proc/{agent.process.pid}/status").read_text()
        assert f"CapEff:\t{capability_mask(capabilities):016x}" in status, status
        assert "Uid:\t0\t0\t0\t0" in status

        with sink(peer, veth.peer_ip4, netns_cmd=veth.ns_cmd) as to:
            sent = send(peer, to, SENDS, SEND_SIZE)

        def events() -> list[str]:
            return [line for line in (TRACEFS / "uprobe_events").read_text().splitlines()
                    if f"aiprobe/p{agent.process.pid}_" in line]

        def launches() -> float:
            return value(samples(agent.metrics()), "aiprobe_cuda_kernel_launches_total", process="cuda_driver")

        def drive() -> bool:
            """One driver run; true once its launches are counted. It starts once the agent has
            defined the uprobe events of its libcuda (it scans for libcuda every second; those of the
            CUDA libraries installed on the host come at start), or after 10 s (kernels whose perf
            uprobe PMU still takes CAP_PERFMON define none; a library attached by a run before)."""
            defined = len(events())
            driver = Driver(cuda_libdir, 0, LAUNCHES, 0)
            try:
                wait_until(lambda: len(events()) > defined, timeout=10)
                assert driver.go().startswith("done")
            finally:
                driver.kill()
            return wait_until(lambda: launches() >= LAUNCHES, timeout=5, interval=0.5)

        assert wait_until(drive, timeout=60, interval=0), \
            f"no CUDA launch counted; its uprobe events: {events()}; log: {agent.log.read_text()[-3000:]}"

        def counted() -> dict:
            found = samples(agent.metrics())
            return {
                "up": {probe: value(found, "aiprobe_probe_up", probe=probe)
                       for probe in ("flows", "sendlat", "cuda", "sched", "nvml")},
                "cuda launches": value(found, "aiprobe_cuda_kernel_launches_total", process="cuda_driver"),
                "sendlat bytes": value(found, "aiprobe_tcp_send_bytes_total", process="sendlat_peer"),
                "flow bytes": value(found, "aiprobe_interface_bytes_total", interface=veth.host, direction="egress"),
                "gpus": value(found, "aiprobe_gpu_memory_total_bytes"),
            }

        def all_counted() -> bool:
            now = counted()
            return (set(now["up"].values()) == {1} and now["cuda launches"] >= LAUNCHES
                    and now["sendlat bytes"] >= sent.bytes and now["flow bytes"] >= sent.bytes and now["gpus"] > 0)

        assert wait_until(all_counted, timeout=30, interval=0.5), f"{counted()}\n{agent.log.read_text()[-3000:]}"
    # It stopped by itself (not killed), and the uprobe events it defined in tracefs went with it.
    assert agent.process.returncode == 0, agent.log.read_text()[-3000:]
    assert events() == [], agent.log.read_text()[-3000:]
