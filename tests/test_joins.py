"""The agent's joins without probes or root: records handed to a real (unstarted) Agent are joined to
the sockets, cgroups and processes of this very test process, as /proc and psutil show them."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from aiprobe.config import Config
from aiprobe.containers import cgroup2_root, cgroup_of_pid
from aiprobe.daemon import Agent
from aiprobe.histogram import kernel_buckets
from aiprobe.model import Readings
from aiprobe.probes.cuda.records import CudaProcess, CudaSnapshot
from aiprobe.probes.flows.records import FlowRecord, FlowsSnapshot, InterfaceTotals
from aiprobe.probes.nvml.records import GpuProcess, GpuSnapshot
from aiprobe.probes.sendlat.records import ProcessSendLatency, SendLatencySnapshot

COMM = Path("/proc/self/comm").read_text().strip()


def own_cgroup_id() -> int:
    return (cgroup2_root() / (cgroup_of_pid(os.getpid()) or "/").lstrip("/")).stat().st_ino


def test_a_flow_is_joined_to_the_process_owning_its_socket() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server, \
            socket.create_connection(server.getsockname()) as client:
        local, remote = client.getsockname(), client.getpeername()
        flow = FlowRecord("lo", "egress", "tcp", local[0], local[1], remote[0], remote[1], 1, 1, 0.0, 0.0, 0, 0.0, 0.0)
        readings = Readings(records={"flows": FlowsSnapshot(0.0, 1.0, [flow], [], 0, 0, 0, [])})
        Agent(Config())._join(readings)
    assert (flow.pid, flow.comm, flow.container) == (os.getpid(), COMM, "host")


def test_records_of_one_process_become_one_row_with_rates() -> None:
    pid, buckets = os.getpid(), kernel_buckets([0] * 10 + [4])
    send = ProcessSendLatency(pid, COMM, own_cgroup_id(), 4, 4000, 0.1, 1e-6, 2e-6, buckets, start_ticks=1)
    cuda = CudaProcess(pid, COMM, "libcuda.so.1", 10, 20, 2, 0.0, None, buckets)
    gpus = [GpuProcess(pid, COMM, index, f"GPU-{index}", 1 << 30, 0.25) for index in (0, 1)]
    ingress = InterfaceTotals("eth0", "ingress", 1000, 10)
    readings = Readings(records={
        "flows": FlowsSnapshot(0.0, 1.0, [], [ingress], 0, 0, 0, []),
        "sendlat": SendLatencySnapshot("tracepoint", "", [send]),
        "cuda": CudaSnapshot([cuda], "tp_btf", []),
        "nvml": GpuSnapshot(True, processes=gpus),
    })
    agent = Agent(Config())
    for now, sent in ((100.0, 4000), (102.0, 6000)):
        send.bytes = sent
        agent._join(readings)
        agent._add_rates(readings, now)
        agent._rates.end_round()
    assert (send.container, send.bytes_per_second) == ("host", 1000.0)
    assert cuda.context_switches_per_second == 0.0  # its counters did not move between the refreshes
    (row,) = agent._processes(readings)
    assert (row.pid, row.comm, row.container, row.send_bytes, row.send_bytes_per_second) == \
        (pid, COMM, "host", 6000, 1000.0)
    assert (row.gpus, row.gpu_memory_used_bytes, row.gpu_utilization_ratio) == ([0, 1], 2 << 30, 0.5)
