"""Process and container correlation: cgroup paths of every runtime and driver, and the agent joining
a real process in a container-shaped cgroup to its flows and sends."""

from __future__ import annotations

import contextlib
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from aiprobe.containers import CgroupIndex, cgroup2_root, workload_of
from helpers import VethPair, wait_until
from servers import Agent

CID = "3f2a9c1d0e4b" + "a" * 52
POD = "1234abcd-1234-5678-9abc-def012345678"
POD_SYSTEMD = POD.replace("-", "_")


@pytest.mark.parametrize(("path", "container", "pod"), [
    # containerd, systemd driver
    (f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{POD_SYSTEMD}.slice/"
     f"cri-containerd-{CID}.scope", CID, POD),
    # CRI-O, systemd driver (and its conmon scope)
    (f"/kubepods.slice/kubepods-pod{POD_SYSTEMD}.slice/crio-{CID}.scope", CID, POD),
    (f"/kubepods.slice/kubepods-pod{POD_SYSTEMD}.slice/crio-conmon-{CID}.scope", CID, POD),
    # containerd or CRI-O, cgroupfs driver
    (f"/kubepods/besteffort/pod{POD}/{CID}", CID, POD),
    # Docker, systemd and cgroupfs drivers
    (f"/system.slice/docker-{CID}.scope", CID, ""),
    (f"/docker/{CID}", CID, ""),
    # plain host processes
    ("/user.slice/user-1000.slice/session-2.scope", "", ""),
    ("/", "", ""),
])
def test_cgroup_paths_name_container_and_pod(path: str, container: str, pod: str) -> None:
    workload = workload_of(path)
    assert (workload.container_id, workload.pod_uid) == (container, pod)
    assert workload.container == (container[:12] if container else "host")


@contextlib.contextmanager
def container_cgroup() -> Iterator[tuple[Path, str]]:
    """A cgroup laid out as containerd's systemd driver does, with a fresh container id."""
    container_id = secrets.token_hex(32)
    pod = cgroup2_root() / f"aiprobe-test-pod{POD_SYSTEMD}.slice"
    leaf = pod / f"cri-containerd-{container_id}.scope"
    leaf.mkdir(parents=True)
    try:
        yield leaf, container_id
    finally:
        for path in (leaf, pod):
            wait_until(lambda p=path: not (p / "cgroup.procs").read_text().strip(), timeout=5)
            with contextlib.suppress(OSError):
                path.rmdir()


def test_cgroup_index_maps_ids_to_paths() -> None:
    with container_cgroup() as (leaf, container_id):
        workload = CgroupIndex().workload(leaf.stat().st_ino)
        assert (workload.container_id, workload.pod_uid) == (container_id, POD)


SENDER = """
import socket, sys, time
sys.stdin.readline()  # moved into its cgroup by now
with socket.create_connection((sys.argv[1], int(sys.argv[2]))) as conn:
    for _ in range(50):
        conn.sendall(b"x" * 1000)
        time.sleep(0.01)
    time.sleep(30)  # a long-lived connection, as an inference client's: its owner is looked up at leisure
"""

SINK = """
import socket, sys
server = socket.create_server(("", 9100))
print("ready", flush=True)
conn, _ = server.accept()
while conn.recv(65536):
    pass
"""


@pytest.mark.bpf
def test_agent_joins_a_containers_sends_and_flows(tmp_path: Path, veth: VethPair) -> None:
    sink = subprocess.Popen(veth.ns_cmd([sys.executable, "-c", SINK]), stdout=subprocess.PIPE, text=True)
    assert sink.stdout.readline().strip() == "ready"
    config = f'interfaces = ["{veth.host}"]\nexclude = []\nprobes = ["flows", "sendlat"]\n'
    try:
        with container_cgroup() as (leaf, container_id), Agent(tmp_path, config) as agent:
            sender = subprocess.Popen([sys.executable, "-c", SENDER, veth.peer_ip4, "9100"], stdin=subprocess.PIPE,
                                      text=True)
            try:
                (leaf / "cgroup.procs").write_text(str(sender.pid))
                sender.stdin.write("go\n")
                sender.stdin.flush()
                short = container_id[:12]
                comm = psutil.Process(sender.pid).name()

                def joined() -> bool:
                    snapshot = agent.snapshot()
                    process = [p for p in snapshot["processes"] if p["pid"] == sender.pid]
                    flows = [f for f in snapshot["flows"] if f["direction"] == "egress" and f["remote_port"] == 9100]
                    return bool(process and process[0]["container"] == short and process[0]["pod_uid"] == POD
                                and flows and flows[0]["container"] == short and flows[0]["pid"] == sender.pid
                                and flows[0]["comm"] == comm)

                def seen() -> tuple:
                    snapshot = agent.snapshot()
                    return ([p for p in snapshot["processes"] if p["pid"] == sender.pid],
                            [(f["direction"], f["pid"], f["comm"], f["container"]) for f in snapshot["flows"]
                             if 9100 in (f["local_port"], f["remote_port"])], agent.log.read_text()[-1500:])

                assert wait_until(joined, timeout=20, interval=0.5), seen()
                time.sleep(1.5)  # a scrape after the next refresh
                sent = [line for line in agent.metrics().splitlines()
                        if line.startswith("aiprobe_tcp_send_bytes_total{") and f'container="{short}"' in line]
                assert sent and float(sent[0].rsplit(" ", 1)[1]) > 0, sent
            finally:
                sender.kill()
                sender.wait()
    finally:
        sink.kill()
