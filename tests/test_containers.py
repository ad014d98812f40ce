"""Process and container correlation: cgroup paths of every runtime and driver, and the agent joining
a real process in a container-shaped cgroup to its flows and sends."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import psutil
import pytest
from aiprobe import containers
from aiprobe.containers import CgroupIndex, cgroup2_root, workload_of
from helpers import VethPair, wait_until
from servers import Agent
from test_kubelet import kubelet_tree

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
    print("sent", flush=True)
    time.sleep(600)  # a long-lived connection, as an inference client's, idle between requests
"""

SINK = """
import socket, sys
server = socket.create_server(("", 9100))
print("ready", flush=True)
conn, _ = server.accept()
while conn.recv(65536):
    pass
"""


@dataclass
class Sender:
    """SENDER in a container-shaped cgroup, connected to SINK in the veth's namespace."""

    process: subprocess.Popen
    container_id: str

    @property
    def container(self) -> str:
        """Its short id."""
        return self.container_id[:12]

    def owner(self) -> dict[str, object]:
        """Who the agent must say owns the sender's flows."""
        return {"pid": self.process.pid, "comm": psutil.Process(self.process.pid).name(), "container": self.container}


@contextlib.contextmanager
def sender_watched(tmp_path: Path, veth: VethPair, config: str,
                   before_sending: Callable[[str], object] = str) -> Iterator[tuple[Agent, Sender]]:
    """The agent (with `config`) watching the veth while SENDER, moved into a fresh container
    cgroup, sends to SINK through it and then holds its connection; `before_sending` gets the
    container id first."""
    sink = subprocess.Popen(veth.ns_cmd([sys.executable, "-c", SINK]), stdout=subprocess.PIPE, text=True)
    assert sink.stdout.readline().strip() == "ready"
    config = f'interfaces = ["{veth.host}"]\nexclude = []\n{config}'
    try:
        with container_cgroup() as (leaf, container_id), Agent(tmp_path, config) as agent:
            sender = subprocess.Popen([sys.executable, "-c", SENDER, veth.peer_ip4, "9100"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)
            try:
                (leaf / "cgroup.procs").write_text(str(sender.pid))
                before_sending(container_id)
                sender.stdin.write("go\n")
                sender.stdin.flush()
                yield agent, Sender(sender, container_id)
            finally:
                sender.kill()
                sender.wait()
    finally:
        sink.kill()


def sent_to_sink(snapshot: dict) -> list[dict]:
    """The snapshot's flows of SENDER's connection, egress."""
    return [f for f in snapshot["flows"] if f["direction"] == "egress" and f["remote_port"] == 9100]


def owner_of(flow: dict) -> dict[str, object]:
    return {name: flow[name] for name in ("pid", "comm", "container")}


@pytest.mark.bpf
def test_agent_joins_a_containers_sends_and_flows(tmp_path: Path, veth: VethPair) -> None:
    with sender_watched(tmp_path, veth, 'probes = ["flows", "sendlat"]\n') as (agent, sender):
        owner = sender.owner()

        def joined() -> bool:
            snapshot = agent.snapshot()
            process = [p for p in snapshot["processes"] if p["pid"] == sender.process.pid]
            flows = sent_to_sink(snapshot)
            return bool(process and process[0]["container"] == sender.container and process[0]["pod_uid"] == POD
                        and flows and owner_of(flows[0]) == owner)

        def seen() -> tuple:
            snapshot = agent.snapshot()
            return ([p for p in snapshot["processes"] if p["pid"] == sender.process.pid],
                    [(f["direction"], f["pid"], f["comm"], f["container"]) for f in snapshot["flows"]
                     if 9100 in (f["local_port"], f["remote_port"])], agent.log.read_text()[-1500:])

        assert wait_until(joined, timeout=20, interval=0.5), seen()
        time.sleep(1.5)  # a scrape after the next refresh
        sent = [line for line in agent.metrics().splitlines()
                if line.startswith("aiprobe_tcp_send_bytes_total{") and f'container="{sender.container}"' in line]
        assert sent and float(sent[0].rsplit(" ", 1)[1]) > 0, sent


@pytest.mark.bpf
def test_a_pods_metrics_and_snapshot_carry_its_namespace_pod_and_container_name(tmp_path: Path,
                                                                                   veth: VethPair) -> None:
    """The kubelet's log directories (a fake tree, written once the container exists and before it
    runs, as the kubelet does) name the sender's pod: its series and its process row carry them in
    place of its id."""
    logs = tmp_path / "kubelet"
    config = f'probes = ["sendlat"]\npod_logs = "{logs}/pods"\ncontainer_logs = "{logs}/containers"\n'
    in_pod = partial(kubelet_tree, logs, "inference", "llm-0", POD, "server")
    with sender_watched(tmp_path, veth, config, in_pod) as (agent, sender):
        labels = ('container="server"', 'namespace="inference"', 'pod="llm-0"', f'process="{sender.owner()["comm"]}"')

        def sent() -> list[str]:
            return [line for line in agent.metrics().splitlines()
                    if line.startswith("aiprobe_tcp_send_bytes_total{") and all(label in line for label in labels)]

        assert wait_until(lambda: sent() and float(sent()[0].rsplit(" ", 1)[1]) > 0, timeout=20, interval=0.5), \
            [line for line in agent.metrics().splitlines() if line.startswith("aiprobe_tcp_send_bytes_total{")]
        [row] = [p for p in agent.snapshot()["processes"] if p["pid"] == sender.process.pid]
        assert (row["container"], row["namespace"], row["pod"], row["pod_uid"]) == ("server", "inference", "llm-0", POD)


@pytest.mark.bpf
def test_an_idle_connection_stays_in_the_snapshot_with_its_owner(tmp_path: Path, veth: VethPair) -> None:
    """A long-lived connection between its requests sends nothing for refresh after refresh: its
    flow stays in the snapshot, at 0 bytes/s with its bytes as they were and joined to its process
    and container, until it expires, whenever its owner was found (the agent looks sockets up every
    few seconds, not at every refresh)."""
    refreshes = 5
    with sender_watched(tmp_path, veth, 'probes = ["flows"]\nflow_idle_seconds = 3600.0\n') as (agent, sender):
        assert sender.process.stdout.readline().strip() == "sent"
        owner = sender.owner()
        seen = [agent.snapshot()]

        def idle_and_joined() -> bool:
            seen[0] = agent.snapshot()
            flows = sent_to_sink(seen[0])
            return bool(flows) and flows[0]["bytes_per_second"] == 0 and owner_of(flows[0]) == owner

        assert wait_until(idle_and_joined), sent_to_sink(seen[0])
        while len(seen) <= refreshes:
            assert wait_until(lambda: agent.snapshot()["host"]["time"] > seen[-1]["host"]["time"])
            seen.append(agent.snapshot())
        idle = (sent_to_sink(seen[0])[0]["bytes"], 0, owner)
        for snapshot in seen:
            flows = sent_to_sink(snapshot)
            assert [(f["bytes"], f["bytes_per_second"], owner_of(f)) for f in flows] == [idle], \
                (snapshot["host"]["time"], flows)


def test_flow_owners_are_scanned_for_sockets_not_looked_for_yet(monkeypatch: pytest.MonkeyPatch) -> None:
    """A scan (every process's descriptors, the kernel's socket tables) runs for a socket asked for since
    the last one, the refresh interval after it; a connection found, or one a scan missed (another
    namespace's), costs none until the maximum age. The scans are the real ones (sock_diag, then
    /proc/PID/fd), counted."""
    clock, scans = [1000.0], []
    real = containers.sockdiag.owners
    monkeypatch.setattr(containers.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(containers.sockdiag, "owners", lambda inodes: scans.append(inodes) or real(inodes))
    owners = containers.SocketOwners(refresh_seconds=5, max_age_seconds=60)
    ghost = ("198.18.0.1", 1, "198.18.0.2", 2)  # nobody's here
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_connection(server.getsockname()) as client:
        assert owners.owner(*client.getsockname(), *client.getpeername()) == os.getpid()
        clock[0] += 10
        assert owners.owner(*client.getsockname(), *client.getpeername()) == os.getpid()
        assert len(scans) == 1
        assert owners.owner(*ghost) is None
        assert len(scans) == 2  # asked for since the last scan, which is 10 s old
        clock[0] += 10
        assert owners.owner(*ghost) is None
        assert len(scans) == 2  # the last scan missed it: no new one for it
        with socket.create_connection(server.getsockname()) as second:
            clock[0] += 1
            assert owners.owner(*second.getsockname(), *second.getpeername()) == os.getpid()
        assert len(scans) == 3
        clock[0] += 60
        assert owners.owner(*client.getsockname(), *client.getpeername()) == os.getpid()
        assert len(scans) == 4  # the maximum age


def test_flow_owners_are_found_for_tcp_udp_and_dual_stack_sockets() -> None:
    """Each kind of socket a flow comes from, by the addresses the flow carries: both ends of a TCP
    connection over IPv6, the accepted end of a dual-stack listener's IPv4 connection (flows carry the
    IPv4 address), a connected UDP socket, an unconnected one (by its local port, like a listener)."""
    owners = containers.SocketOwners(refresh_seconds=0)
    me = os.getpid()
    with contextlib.ExitStack() as stack:
        v6 = stack.enter_context(socket.create_server(("::1", 0), family=socket.AF_INET6))
        client6 = stack.enter_context(socket.create_connection(v6.getsockname()[:2]))
        dual = stack.enter_context(socket.create_server(("::", 0), family=socket.AF_INET6, dualstack_ipv6=True))
        client4 = stack.enter_context(socket.create_connection(("127.0.0.1", dual.getsockname()[1])))
        accepted, _ = dual.accept()
        stack.enter_context(accepted)
        bound = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
        bound.bind(("127.0.0.1", 0))
        connected = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
        connected.connect(bound.getsockname())
        assert owners.owner(*client6.getsockname()[:2], *client6.getpeername()[:2]) == me
        assert owners.owner(*client4.getpeername(), *client4.getsockname()) == me
        assert owners.owner(*connected.getsockname(), *connected.getpeername()) == me
        assert owners.owner(*bound.getsockname(), "127.0.0.1", 9) == me


def test_a_protocol_the_kernel_will_not_list_is_said_once_and_the_others_owners_still_found(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A kernel without udp_diag (a module) refuses UDP's dump: TCP's owners are still found, and the
    refusal is a warning once, not one per scan. A scan the kernel lists nothing for keeps the owners
    the previous one found."""
    real = containers.sockdiag.held
    refused = {socket.IPPROTO_UDP}

    def held(protocol: int) -> list[containers.sockdiag.DiagSocket]:
        if protocol in refused:
            raise OSError(errno.ENOENT, "sock_diag: No such file or directory")
        return real(protocol)

    monkeypatch.setattr(containers.sockdiag, "held", held)
    owners = containers.SocketOwners(refresh_seconds=0)
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_connection(server.getsockname()) as client, \
            caplog.at_level(logging.WARNING, logger=containers.log.name):
        for ghost_port in (1, 2, 3):  # each never asked before: a scan each
            assert owners.owner("198.18.0.1", ghost_port, "198.18.0.2", 2) is None
        assert owners.owner(*client.getsockname(), *client.getpeername()) == os.getpid()
        refused.add(socket.IPPROTO_TCP)
        assert owners.owner("198.18.0.1", 4, "198.18.0.2", 2) is None  # a scan listing nothing
        assert owners.owner(*client.getsockname(), *client.getpeername()) == os.getpid()
    assert [r.getMessage() for r in caplog.records] == [
        "cannot list UDP sockets to find flow owners: [Errno 2] sock_diag: No such file or directory",
        "cannot list TCP sockets to find flow owners: [Errno 2] sock_diag: No such file or directory"]
