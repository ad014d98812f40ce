"""Agent cost: CPU (user+sys seconds per wall second) and RSS of `aiprobe agent` running every probe,
idle and under a loopback HTTP load (wrk, 1000 connections against a local server).

Two configurations: the default one (the flows probe skips lo, as deployed), where the load reaches
the agent through sendlat; and one that also watches lo, where the same load is ~4000 live flows
(each connection's two sockets, seen at lo's egress and ingress) that the agent reads every second."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

from benchmarks import Result

WINDOW_SECONDS = 10.0
CONNECTIONS = 1000

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


def _measure(flows_on_lo: bool) -> dict[str, float | str]:
    aiprobe = str(Path(sys.executable).parent / "aiprobe")
    port, http_port = _free_port(), _free_port()
    interfaces = 'interfaces = ["lo"]\nexclude = []\n' if flows_on_lo else ""
    with tempfile.TemporaryDirectory() as workdir:
        config = Path(workdir) / "aiprobe.toml"
        config.write_text(f'listen = "127.0.0.1:{port}"\n{interfaces}alert_log = "{workdir}/alerts.jsonl"\n')
        agent = subprocess.Popen([aiprobe, "agent", "--config", str(config)], stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
        server = subprocess.Popen([sys.executable, "-c", HTTP_SERVER, str(http_port)], stdout=subprocess.PIPE,
                                  text=True)
        try:
            _wait_ready(f"http://127.0.0.1:{port}/healthz")
            server.stdout.readline()
            process = psutil.Process(agent.pid)
            idle_cpu, idle_rss = _cost(process, WINDOW_SECONDS)
            wrk = subprocess.Popen(["wrk", "-t2", f"-c{CONNECTIONS}", f"-d{int(WINDOW_SECONDS) + 4}s",
                                    f"http://127.0.0.1:{http_port}/"], stdout=subprocess.PIPE, text=True)
            time.sleep(2)  # let the connections open
            load_cpu, load_rss = _cost(process, WINDOW_SECONDS)
            wrk_out = wrk.communicate()[0]
        finally:
            agent.terminate()
            server.terminate()
            agent.wait(10)
            server.wait(10)
    requests = next((line.split()[1] for line in wrk_out.splitlines() if line.startswith("Requests/sec")), "?")
    return {"idle_cpu": idle_cpu, "idle_rss": idle_rss, "load_cpu": load_cpu, "load_rss": load_rss,
            "requests": requests}


def run() -> list[Result]:
    results = []
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
