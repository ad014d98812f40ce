"""The agent's own cost as the flow table grows: CPU (user+sys seconds per wall second), RSS, the
time one /metrics scrape takes and the series it serves (as text, and as Prometheus keeps them when it
scrapes native histograms), with 0, 1k, 10k, 100k live UDP flows and the table full at its default size
(up to where the agent starts evicting) through a watched veth, each flow sent one datagram a second
(as a gateway's connections keep their flows live) by flow_sender.c, built here
with cc; it says how many datagrams a second it managed. The windows span several of the agent's
paced reads of the whole table (MAX_READ_SECONDS apart at most).

One agent (flows probe only, default settings but the interface) runs through every level in
ascending order: each level's flows include the previous level's, so none sits idle waiting to
expire. The traffic comes from a namespace of this benchmark's own, into the host side of its veth.
Then a second agent (sendlat only: send latency, streams and requests) with 1k and 10k processes, each
sending a byte a second on a TCP connection over loopback (process_senders.c), then with 1k stream
endpoints, ports of one process each answering a request a second with an SSE write
(stream_endpoints.c). Last, a busy node, with a third agent at its defaults (every probe): 200
processes sending a byte a second under 40 names, and 30 stream endpoints, every fifth answering 503.
The agents run at their default refresh_budget: where a refresh costs more, refreshes come less often
(5 s apart at most), and the CPU figure says what that leaves.
"""

from __future__ import annotations

import http.client
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil
from aiprobe.probes.flows.probe import EVICT_ABOVE, MAX_READ_SECONDS
from aiprobe.probes.flows.settings import FlowsSettings

from benchmarks import Result
from benchmarks.bench_agent import _free_port, _start_agent, _stop
from benchmarks.bench_flows import HOST_IP, _veth_into_namespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from exported_histograms import HISTOGRAM, protobuf_families  # the tests' protobuf reader

PROTOBUF = "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited"
FULL = int(EVICT_ABOVE * FlowsSettings.max_flows) - 1_000  # room left for the ICMP errors' flows
FLOW_LEVELS = (0, 1_000, 10_000, 12_000, 100_000, FULL)  # 12k: issue 30's 2% bound
PROCESS_SENDERS = Path(__file__).with_name("process_senders.c")  # processes sending a byte a second
STREAM_ENDPOINTS = Path(__file__).with_name("stream_endpoints.c")  # ports answering a request a second
SENDLAT_LEVELS = (  # (program, its arguments, the level's label); the endpoints last: their series stay
    (PROCESS_SENDERS, ["1000"], "1000 processes sending (sendlat)"),  # idle_series_seconds
    (PROCESS_SENDERS, ["10000"], "10000 processes sending (sendlat)"),
    (STREAM_ENDPOINTS, ["1000"], "1000 stream endpoints (sendlat: streams, requests)"),
)
BUSY_NODE = ((PROCESS_SENDERS, ["200", "40"]), (STREAM_ENDPOINTS, ["30", "5"]))
SETTLE_SECONDS = MAX_READ_SECONDS + 2  # the new flows' first reads over before measuring
WINDOW_SECONDS = 2 * MAX_READ_SECONDS
SCRAPES = 5

FLOW_SENDER = Path(__file__).with_name("flow_sender.c")  # each second, one datagram per flow
PORTS = 50_000


def _scrape(port: int, accept: str = "text/plain") -> tuple[float, bytes]:
    """How long one scrape took, and what it served; NaN where the agent answered none (said in the
    table, not raised)."""
    started = time.perf_counter()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Accept": accept})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            text = response.read()
    except (OSError, http.client.HTTPException):
        return math.nan, b""
    return time.perf_counter() - started, text


def _build(workdir: str, source: Path) -> str:
    built = str(Path(workdir) / source.stem)
    subprocess.run([shutil.which("cc") or "gcc", "-O2", "-Wall", "-o", built, str(source)], check=True)
    return built


def _level(agent: psutil.Process, port: int, label: str, *senders: list[str]) -> list[Result]:
    """The agent's cost while `senders` run (programs that print "ready" once they are sending; the
    first may print its datagrams per second once stopped)."""
    processes = [subprocess.Popen(sender, stdout=subprocess.PIPE, text=True) for sender in senders]
    try:
        for process in processes:
            if process.stdout is not None:
                process.stdout.readline()
        time.sleep(SETTLE_SECONDS)
        before, started = agent.cpu_times(), time.monotonic()
        time.sleep(WINDOW_SECONDS)
        after, elapsed = agent.cpu_times(), time.monotonic() - started
        scrapes, served = zip(*(_scrape(port) for _ in range(SCRAPES)), strict=True)
        native = _scrape(port, PROTOBUF)[1]
        rss = agent.memory_info().rss
    finally:
        sent = ""
        for process in processes:
            process.terminate()
            if rate := process.communicate()[0].split():
                sent = f"; sender {float(rate[-1]):.0f} datagrams/s"
    cpu = (after.user + after.system - before.user - before.system) / elapsed
    answered = [seconds for seconds in scrapes if not math.isnan(seconds)]
    return [
        Result("flow table", f"{label}: agent CPU", cpu * 100, "% of one core", f"over {WINDOW_SECONDS:.0f} s{sent}"),
        Result("flow table", f"{label}: agent RSS", rss / 2**20, "MiB"),
        Result("flow table", f"{label}: scrape", statistics.median(answered or [math.nan]) * 1e3, "ms",
               f"median of {len(answered)}, max {max(answered or [math.nan]) * 1e3:.0f} ms"
               + (f"; {SCRAPES - len(answered)} of {SCRAPES} unanswered" if len(answered) < SCRAPES else "")),
        Result("flow table", f"{label}: series", float(_series(served[-1])), "series",
               f"{len(served[-1]) / 1e6:.1f} MB of text"),
        Result("flow table", f"{label}: series, native histograms", float(_native_series(native)), "series",
               f"scraped in protobuf, {len(native) / 1e6:.1f} MB"),
    ]


def _series(text: bytes) -> int:
    return sum(1 for line in text.splitlines() if line and not line.startswith(b"#"))


def _native_series(data: bytes) -> int:
    """The series Prometheus keeps of a protobuf scrape with native histograms on: one per native
    histogram, a histogram without one its classic series (its bounds, +Inf, _count and _sum)."""
    return sum(1 if kind != HISTOGRAM or value.schema is not None else len(value.buckets) + 3
               for kind, metrics in protobuf_families(data).values() for _, value in metrics)


def _flow_levels(workdir: str) -> list[Result]:
    results = []
    with _veth_into_namespace() as (host, ns):
        port, sender = _free_port(), _build(workdir, FLOW_SENDER)
        agent = _start_agent(workdir, f'interfaces = ["{host}"]\nexclude = []\nprobes = ["flows"]\n', port)
        try:
            for flows in FLOW_LEVELS:
                label = f"{flows} live flows" + (" (table full)" if flows == FULL else "")
                commands = [["ip", "netns", "exec", ns, sender, HOST_IP, str(flows), str(PORTS)]] if flows else []
                results += _level(psutil.Process(agent.pid), port, label, *commands)
        finally:
            _stop(agent)
    return results


def _sendlat_levels(workdir: str) -> list[Result]:
    results = []
    port = _free_port()
    agent = _start_agent(workdir, 'probes = ["sendlat"]\n', port)
    try:
        for source, arguments, label in SENDLAT_LEVELS:
            results += _level(psutil.Process(agent.pid), port, label, [_build(workdir, source), *arguments])
    finally:
        _stop(agent)
    return results


def _busy_node(workdir: str) -> list[Result]:
    port = _free_port()
    agent = _start_agent(workdir, "", port)
    try:
        return _level(psutil.Process(agent.pid), port, "busy node (every probe: 200 processes under 40 names, "
                      "30 stream endpoints, 1 in 5 answering 503)",
                      *([_build(workdir, source), *arguments] for source, arguments in BUSY_NODE))
    finally:
        _stop(agent)


def run() -> list[Result]:
    with tempfile.TemporaryDirectory() as workdir:
        return _flow_levels(workdir) + _sendlat_levels(workdir) + _busy_node(workdir)
