"""Agent cost: CPU (user+sys seconds per wall second) and RSS of `aiprobe agent` running every probe,
idle and under a loopback HTTP load (wrk, 1000 connections against a local server).

Two configurations: the default one (the flows probe skips lo, as deployed), where the load reaches
the agent through sendlat; and one that also watches lo, where the same load is ~4000 live flows
(each connection's two sockets, seen at lo's egress and ingress) that the agent reads every second.

And what the agent costs the workload: the HTTP server's requests/s under wrk with the agent (every
probe, default config) running against nothing running, rounds alternating within one run (the
agent started afresh for each of its rounds)."""

from __future__ import annotations

import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

from benchmarks import Result, alternate, spread

WINDOW_SECONDS = 10.0
CONNECTIONS = 1000
RATIO_ROUNDS, RATIO_SECONDS, RATIO_CONNECTIONS = 6, 5, 100

# A keep-alive HTTP server on loopback for wrk to load: a stand-in for an inference endpoint.
HTTP_SERVER = """
import asyncio, sys
RESPONSE = b"HTTP/1.1 200 OK\\r\\nContent-Length: 2\\r\\nContent-Type: text/plain\\r\\n\\r\\nok"
async def handle(reader, writer):
    try:
        while await reader.readuntil(b"\\r\\n\\r\\n"):
            writer.write(RESPONSE)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
        pass
    writer.close()
async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", int(sys.argv[1]), backlog=4096)
    print("ready", flush=True)
    await server.serve_forever()
asyncio.run(main())
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_ready(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} never became ready")


def _cost(process: psutil.Process, seconds: float) -> tuple[float, float]:
    """(CPU seconds per wall second, RSS bytes at the end) of `process` over `seconds`."""
    before, started = process.cpu_times(), time.monotonic()
    time.sleep(seconds)
    after, elapsed = process.cpu_times(), time.monotonic() - started
    cpu = (after.user + after.system) - (before.user + before.system)
    return cpu / elapsed, process.memory_info().rss


def _start_agent(workdir: str, extra_config: str = "", port: int = 0) -> subprocess.Popen:
    """`aiprobe agent` with every probe (unless `extra_config` says otherwise), serving on loopback
    `port` (0: a free one); returns once it is ready."""
    port = port or _free_port()
    config = Path(workdir) / "aiprobe.toml"
    config.write_text(f'listen = "127.0.0.1:{port}"\n{extra_config}alert_log = "{workdir}/alerts.jsonl"\n')
    agent = subprocess.Popen([str(Path(sys.executable).parent / "aiprobe"), "agent", "--config", str(config)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_ready(f"http://127.0.0.1:{port}/healthz")
    except BaseException:
        agent.kill()
        agent.wait()
        raise
    return agent


def _stop(process: subprocess.Popen) -> None:
    process.terminate()
    process.wait(60)  # the agent detaches its uprobes one RCU wait (~0.1 s) after another


def _start_server(port: int) -> subprocess.Popen:
    server = subprocess.Popen([sys.executable, "-c", HTTP_SERVER, str(port)], stdout=subprocess.PIPE, text=True)
    server.stdout.readline()
    return server


def _requests_per_second(wrk_out: str) -> str:
    return next((line.split()[1] for line in wrk_out.splitlines() if line.startswith("Requests/sec")), "?")


def _measure(flows_on_lo: bool) -> dict[str, float | str]:
    http_port = _free_port()
    interfaces = 'interfaces = ["lo"]\nexclude = []\n' if flows_on_lo else ""
    with tempfile.TemporaryDirectory() as workdir:
        agent = _start_agent(workdir, interfaces)
        server = _start_server(http_port)
        try:
            process = psutil.Process(agent.pid)
            idle_cpu, idle_rss = _cost(process, WINDOW_SECONDS)
            wrk = subprocess.Popen(["wrk", "-t2", f"-c{CONNECTIONS}", f"-d{int(WINDOW_SECONDS) + 4}s",
                                    f"http://127.0.0.1:{http_port}/"], stdout=subprocess.PIPE, text=True)
            time.sleep(2)  # let the connections open
            load_cpu, load_rss = _cost(process, WINDOW_SECONDS)
            wrk_out = wrk.communicate()[0]
        finally:
            _stop(agent)
            _stop(server)
    requests = _requests_per_second(wrk_out)
    return {"idle_cpu": idle_cpu, "idle_rss": idle_rss, "load_cpu": load_cpu, "load_rss": load_rss,
            "requests": requests}


class AgentRunning:
    """The full agent, started for a round and stopped after it."""

    def __init__(self, workdir: str, name: str) -> None:
        self.name = name
        self._workdir = workdir
        self._agent: subprocess.Popen | None = None

    def attach(self) -> None:
        if self.name != "detached":
            self._agent = _start_agent(self._workdir)
            time.sleep(1)  # its start-up (loading, first scans) over before the load

    def detach(self) -> None:
        if self._agent is not None:
            _stop(self._agent)
            self._agent = None


def _wrk_requests_per_second(port: int) -> float:
    out = subprocess.run(["wrk", "-t2", f"-c{RATIO_CONNECTIONS}", f"-d{RATIO_SECONDS}s", f"http://127.0.0.1:{port}/"],
                         capture_output=True, text=True, check=True).stdout
    return float(_requests_per_second(out))


def throughput_ratio() -> list[Result]:
    """The HTTP server's requests/s under wrk, the full agent running against not."""
    http_port = _free_port()
    with tempfile.TemporaryDirectory() as workdir:
        server = _start_server(http_port)
        try:
            _wrk_requests_per_second(http_port)  # warm-up
            cases = [AgentRunning(workdir, "detached"), AgentRunning(workdir, "agent")]
            runs = alternate(cases, RATIO_ROUNDS, lambda: _wrk_requests_per_second(http_port))
        finally:
            _stop(server)
    ratios = [a / d for a, d in zip(runs["agent"], runs["detached"], strict=True)]
    return [
        Result("agent", f"HTTP server under wrk -c{RATIO_CONNECTIONS}, nothing running: requests/s",
               statistics.median(runs["detached"]), "req/s", spread(runs["detached"])),
        Result("agent", f"HTTP server under wrk -c{RATIO_CONNECTIONS}, full agent running: requests/s",
               statistics.median(runs["agent"]), "req/s", spread(runs["agent"])),
        Result("agent", "HTTP requests/s with / without the full agent", statistics.median(ratios), "ratio",
               f"median of {len(ratios)} per-round ratios, range {min(ratios):.3f}..{max(ratios):.3f}; "
               "1.0 = no slowdown"),
    ]


def run() -> list[Result]:
    results = throughput_ratio()
    for flows_on_lo, label in ((False, "default config"), (True, "flows also on lo")):
        m = _measure(flows_on_lo)
        results += [
            Result("agent", f"{label}: CPU idle", m["idle_cpu"] * 100, "% of one core", "target < 2%"),
            Result("agent", f"{label}: RSS idle", m["idle_rss"] / 2**20, "MiB", "target < 100 MB"),
            Result("agent", f"{label}: CPU under wrk -c{CONNECTIONS}", m["load_cpu"] * 100, "% of one core",
                   f"target < 5%; wrk {m['requests']} req/s"),
            Result("agent", f"{label}: RSS under wrk -c{CONNECTIONS}", m["load_rss"] / 2**20, "MiB",
                   "target < 100 MB"),
        ]
    return results
