"""The agent's own cost as the flow table grows: CPU (user+sys seconds per wall second), RSS and the
time one /metrics scrape takes, with 0, 1k, 10k, 100k live UDP flows and the table full at its
default size (up to where the agent starts evicting) through a watched veth, each flow sent one
datagram a second (as a gateway's connections keep their flows live; the sender says how many
datagrams a second it managed). The windows span several of the agent's paced reads of the whole
table (MAX_READ_SECONDS apart at most).

One agent (flows probe only, default settings but the interface) runs through every level in
ascending order: each level's flows include the previous level's, so none sits idle waiting to
expire. The traffic comes from a namespace of this benchmark's own, into the host side of its veth.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import psutil
from aiprobe.probes.flows.probe import EVICT_ABOVE, MAX_READ_SECONDS
from aiprobe.probes.flows.settings import FlowsSettings

from benchmarks import Result
from benchmarks.bench_agent import _free_port, _start_agent, _stop
from benchmarks.bench_flows import HOST_IP, _veth_into_namespace

FULL = int(EVICT_ABOVE * FlowsSettings.max_flows) - 1_000  # room left for the ICMP errors' flows
LEVELS = (0, 1_000, 10_000, 100_000, FULL)
SETTLE_SECONDS = MAX_READ_SECONDS + 2  # the new flows' first reads over before measuring
WINDOW_SECONDS = 2 * MAX_READ_SECONDS
SCRAPES = 5

# Each second, one datagram per flow: flows differ by destination port (up to PORTS of them) and by
# source socket beyond that. Prints how many datagrams it sent per second, once stopped.
SENDER = """
import signal, socket, sys, time
host, flows, ports = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
sockets = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(-(-flows // ports))]
targets = [(sockets[i // ports], (host, 1024 + i % ports)) for i in range(flows)]
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
start = time.monotonic()
rounds = 0
try:
    while True:
        for sock, address in targets:
            sock.sendto(b"x", address)
        rounds += 1
        time.sleep(max(0.0, start + rounds - time.monotonic()))
finally:
    print(rounds * flows / (time.monotonic() - start), flush=True)
"""
PORTS = 50_000


def _scrape_seconds(port: int) -> float:
    started = time.perf_counter()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        response.read()
    return time.perf_counter() - started


def _level(agent: psutil.Process, port: int, ns: str, flows: int) -> list[Result]:
    sender = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", SENDER, HOST_IP, str(flows),
                               str(PORTS)], stdout=subprocess.PIPE, text=True) if flows else None
    try:
        time.sleep(SETTLE_SECONDS)
        before, started = agent.cpu_times(), time.monotonic()
        time.sleep(WINDOW_SECONDS)
        after, elapsed = agent.cpu_times(), time.monotonic() - started
        scrapes = [_scrape_seconds(port) for _ in range(SCRAPES)]
        rss = agent.memory_info().rss
    finally:
        sent = ""
        if sender is not None:
            sender.terminate()
            sent = f"; sender {float(sender.communicate()[0] or 0):.0f} datagrams/s"
    cpu = (after.user + after.system - before.user - before.system) / elapsed
    label = f"{flows} live flows" + (" (table full)" if flows == FULL else "")
    return [
        Result("flow table", f"{label}: agent CPU", cpu * 100, "% of one core", f"over {WINDOW_SECONDS:.0f} s{sent}"),
        Result("flow table", f"{label}: agent RSS", rss / 2**20, "MiB"),
        Result("flow table", f"{label}: scrape", statistics.median(scrapes) * 1e3, "ms",
               f"median of {SCRAPES}, max {max(scrapes) * 1e3:.0f} ms"),
    ]


def run() -> list[Result]:
    results = []
    with _veth_into_namespace() as (host, ns), tempfile.TemporaryDirectory() as workdir:
        port = _free_port()
        agent = _start_agent(workdir, f'interfaces = ["{host}"]\nexclude = []\nprobes = ["flows"]\n', port)
        try:
            for flows in LEVELS:
                results += _level(psutil.Process(agent.pid), port, ns, flows)
        finally:
            _stop(agent)
    return results
