"""Exported counters against their independent truth, through the real agent and exporter: a real
process sends real TCP bytes while it is moved between two cgroups (cgroupfs writes), so the kernel
keeps one `procs` entry per (tgid, cgroup) — and `aiprobe_tcp_send_bytes_total` must grow by exactly
the bytes the process sent, however the entries alternate between refreshes."""

from __future__ import annotations

import contextlib
import secrets
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiprobe.config import load
from aiprobe.containers import cgroup2_root
from aiprobe.daemon import Agent
from aiprobe.exporters.prometheus import AgentCollector
from aiprobe.registry import catalog
from helpers import unique, wait_until

pytestmark = pytest.mark.bpf

SENDER = """
import socket, sys
open("/proc/self/comm", "w").write(sys.argv[2])
conn = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
print("ready", flush=True)
for line in sys.stdin:
    conn.sendall(b"x" * int(line))
    print("sent", flush=True)
"""


@contextlib.contextmanager
def sink() -> Iterator[int]:
    """A TCP server on 127.0.0.1 that reads everything; yields its port."""
    server = socket.create_server(("127.0.0.1", 0))

    def drain() -> None:
        with contextlib.suppress(OSError):
            conn, _ = server.accept()
            with conn:
                while conn.recv(1 << 16):
                    pass

    thread = threading.Thread(target=drain, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        server.close()


@contextlib.contextmanager
def cgroups(count: int) -> Iterator[list[Path]]:
    root = cgroup2_root()
    paths = [root / unique(f"aiprobe-mv{i}-") for i in range(count)]
    for path in paths:
        path.mkdir()
    try:
        yield paths
    finally:
        for path in paths:
            for pid in (path / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    (root / "cgroup.procs").write_text(pid)
            wait_until(lambda p=path: not (p / "cgroup.procs").read_text().strip())
            with contextlib.suppress(OSError):
                path.rmdir()


def send_bytes_total(collector: AgentCollector, comm: str) -> float:
    (family,) = [f for f in collector.collect() if f.name == "aiprobe_tcp_send_bytes"]
    return sum(sample.value for sample in family.samples
               if sample.name == "aiprobe_tcp_send_bytes_total" and sample.labels["process"] == comm)


def test_send_bytes_total_counts_exactly_through_cgroup_moves() -> None:
    comm = f"mv-{secrets.token_hex(3)}"
    config = load(None, catalog(), probes=["sendlat"])
    with sink() as port, cgroups(2) as (first, second), Agent(config) as agent:
        collector = AgentCollector(config, build_info={}, source=agent.scrape_readings)
        sender = subprocess.Popen([sys.executable, "-c", SENDER, str(port), comm], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert sender.stdout.readline().strip() == "ready"

            def refresh() -> float:
                agent.refresh()
                return send_bytes_total(collector, comm)

            sent = 0
            # Into a cgroup, out to the other, and back: the kernel keeps two entries for one process.
            for cgroup, nbytes in ((first, 300_000), (second, 200_000), (first, 100_000), (second, 50_000)):
                (cgroup / "cgroup.procs").write_text(str(sender.pid))
                sender.stdin.write(f"{nbytes}\n")
                sender.stdin.flush()
                assert sender.stdout.readline().strip() == "sent"
                sent += nbytes
                assert wait_until(lambda expected=sent: refresh() >= expected, timeout=10), (refresh(), sent)
            entries = {p.cgroup_id for p in agent.readings.records["sendlat"].processes if p.pid == sender.pid}
            assert entries == {first.stat().st_ino, second.stat().st_ino}
            for _ in range(3):  # more refreshes without sends: nothing is counted twice
                assert refresh() == sent
        finally:
            sender.kill()
            sender.wait()
