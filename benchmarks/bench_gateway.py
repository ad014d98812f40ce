"""What the agent costs a busy server, per request (issue 26): CPU accounting, not throughput (which
swings by a third from round to round on these machines).

Four servers, each pinned to one CPU with its load generator pinned to another. The servers listen on
the root namespace's end of a veth pair, the gateway's NIC; the load generators run in the namespace at
its other end, so a request and its response cross the watched interface once each, as they cross a
gateway's NIC (over loopback every frame ran tc twice, as it left and as it came back in):
- nginx answering a small JSON body (wrk -t1 -c50);
- nginx proxying an SSE stream from an upstream (tests/fixtures/sse_server.py, on the server's CPU
  too, over loopback), unbuffered (wrk);
- uvicorn streaming SSE (the same server, loaded directly by wrk);
- a gRPC server-streaming service (tests/fixtures/grpc_server.py), loaded by a grpcio client.
A streamed request is one response of EVENTS events, sent as fast as the server can.

Configurations alternate round by round (the order reversed every other round): no agent, the
whole agent (`aiprobe agent`, default config, started afresh for each of its rounds), empty programs
on the hooks where the whole agent's programs run per request here (the floor: see EmptyPrograms), and
the whole agent without the requests part (`count_requests = false`: what counting requests adds); with
GATEWAY_BENCH_KNOCKOUTS=1, each probe alone too (`probes = [NAME]`; netstat always runs), which triples
the time a round takes. Per round: the server's CPU time (every process of the serving side: nginx's
master and worker, the upstream) and the agent's, over the load, each divided by the requests the load
generator completed. CPU time is each thread's sum_exec_runtime (/proc/PID/task/TID/schedstat): the
accounting /proc/PID/stat's utime+stime are scaled from, in ns rather than 10 ms ticks, which an
agent's few ms per round need.

The figures, per case and configuration (issue 43's measure):
- aiprobe's CPU per request, in ns: the server's CPU per request added against the same round's
  no-agent sample, plus the agent's own CPU per request; the median over the rounds, with the floor's
  beside it. What a small request is judged by (target: 600 ns for the whole agent).
- aiprobe's share of the server's CPU: that cost over the no-agent server CPU per request of the same
  round; the median over the rounds. What a stream is judged by (target: 0.03).
Each with its 90% interval: the interval of the rounds' median that holds whatever their distribution
(benchmarks.median_interval; with 5 rounds, their whole range). How noisy they are: on this 2-core
machine the no-agent rounds of nginx's small body spread about 5-13 us per request between quiet and
busy moments, the streams' about 6%, and configurations that run nothing per request read anywhere in
-0.04..+0.02 of a stream's CPU with 5 rounds. So rounds are added, after GATEWAY_BENCH_ROUNDS (5),
until the whole agent's share is known to +-0.01 (its interval within 0.01 of its median), up to
GATEWAY_BENCH_MAX_ROUNDS (30). Run it on a quiet machine: another job's load lands in the server's
CPU per request, in the rounds of whichever configuration it overlaps.

The load is a closed loop: the load generator's sends and receives run the same programs, so an agent
slows it too, and a server that finds fewer requests waiting at each wakeup spends more CPU on each.
That lands in "server added" (without an agent, a busy loop sharing wrk's CPU cut nginx's rate by ~40%
and raised its CPU per request by ~1.3 us), so each configuration's rate is printed beside its cost.

Then, in a pass of its own each (the kernel's BPF run-time statistics add two clock reads to every
program run), the programs of the floor, of the whole agent and of it without requests: runs per
request, ns per run, and run time per request, each from the programs' own counters, so each of ours
reads against the empty program on its hook under the same load. Those count every run on the host: the
load generator's sends and receives run the same programs (wrk's request is one of the two sends per
request of nginx's small body), and so does any other process's. A program's run time is not what it
costs the server: taken out, work the statistics put at ~200 ns per run saved nginx nothing measurable,
and other work put at ~170 ns saved it ~250 ns (cache misses move between a program and the stack around
it). The CPU figures are the measure; these are the breakdown.

Every agent watches the gateway's interface only (`interfaces = [its name]`; the default config
leaves loopback out, as it does here): an agent attached to every interface of a shared machine would
touch other people's interfaces (and their tests' "nothing left attached").

GATEWAY_BENCH_SECONDS and GATEWAY_BENCH_EVENTS override the defaults (2 s loads, each after 2 s of load
unmeasured; 20 events per streamed response). A round of the four configurations takes about 30 s: 5
rounds per case, 10 minutes in all; 30 rounds for each case, an hour. GATEWAY_BENCH_CASES
(comma-separated, e.g. "grpc" or "nginx,uvicorn") runs only the cases whose names contain one of its
words, case-insensitively.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from benchmarks import Result, alternate, attached, bpf_stats, median_interval, programs_of, spread

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from aiprobe.loader import BpfObject  # noqa: E402
from aiprobe.registry import selectable_names  # noqa: E402
from helpers import VethPair, bpftool_json, free_port, make_veth_pair, remove_veth_pair, wait_until  # noqa: E402

from benchmarks.bench_agent import _start_agent, _stop  # noqa: E402

ROUNDS = int(os.environ.get("GATEWAY_BENCH_ROUNDS", "5"))  # at least
MAX_ROUNDS = int(os.environ.get("GATEWAY_BENCH_MAX_ROUNDS", "30"))
KNOCKOUTS = os.environ.get("GATEWAY_BENCH_KNOCKOUTS", "") not in ("", "0")
SECONDS = int(os.environ.get("GATEWAY_BENCH_SECONDS", "2"))  # of load per round (wrk takes whole seconds)
EVENTS = int(os.environ.get("GATEWAY_BENCH_EVENTS", "20"))  # per streamed response
SELECTED = [word.strip().lower() for word in os.environ.get("GATEWAY_BENCH_CASES", "").split(",") if word.strip()]
CONNECTIONS = 50  # wrk's, as issue 26 measured
GRPC_STREAMS = 4  # the gRPC server's thread pool: more would only queue
TARGET_SHARE = 0.03  # of the server's CPU per request, for a stream (issue 43)
TARGET_NS = 600  # server CPU added and agent CPU per request, for a small request (issue 43)
PRECISION = 0.01  # the whole agent's share: rounds are added until its 90% interval is within this
FIXTURES = ROOT / "tests" / "fixtures"
NO_AGENT = "no agent"
FLOOR = "empty programs on the agent's hooks"
WHOLE = "whole agent"

# A grpcio client: GRPC_STREAMS connections, opened once; per line on stdin (seconds), each calls the
# streaming method again and again for that long; then it prints the responses read to the end.
GRPC_CLIENT = """
import sys, threading, time, grpc
target, streams, events = sys.argv[1], int(sys.argv[2]), sys.argv[3].encode()
channels = [grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
            for _ in range(streams)]
def call(channel, deadline, done):
    stream = channel.unary_stream("/tokens.Tokens/Stream")
    while time.monotonic() < deadline:
        for _ in stream(events):
            pass
        done.append(1)
for line in sys.stdin:
    deadline, done = time.monotonic() + float(line), []
    threads = [threading.Thread(target=call, args=(channel, deadline, done)) for channel in channels]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(len(done), flush=True)
"""


def _cpus() -> tuple[int, int]:
    """(the server's CPU, the load generator's)."""
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[0], cpus[-1]


def pinned(cpu: int, cmd: list[str]) -> list[str]:
    return ["taskset", "-c", str(cpu), *cmd]


def cpu_ns(pid: int) -> int:
    """CPU time of a process's live threads so far (schedstat's first field): a thread that exits
    within a round is missed, but the servers' threads and the agent's live as long as they do."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return 0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as schedstat:
                total += int(schedstat.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # the thread exited meanwhile
            pass
    return total


@dataclass
class Served:
    """A running server (its processes and their descendants) and its load: `load()` runs it for
    SECONDS and returns the requests it completed."""

    processes: list[subprocess.Popen[str]]
    load: Callable[[], int]

    def cpu_ns(self) -> int:
        pids = [p.pid for p in self.processes]
        pids += [child.pid for p in self.processes for child in psutil.Process(p.pid).children(recursive=True)]
        return sum(cpu_ns(pid) for pid in pids)


@dataclass
class Sample:
    requests: int
    server_ns: int
    agent_ns: int

    @property
    def server(self) -> float:
        return self.server_ns / self.requests

    @property
    def agent(self) -> float:
        return self.agent_ns / self.requests


@dataclass
class Gateway:
    """Where the cases run: a working folder, and a veth pair whose root-namespace end is the gateway's
    NIC (the servers listen on its address, the load generators run in its peer's namespace)."""

    workdir: str
    pair: VethPair

    @property
    def address(self) -> str:
        return self.pair.host_ip4

    def url(self, port: int, path: str = "/") -> str:
        return f"http://{self.address}:{port}{path}"

    def client(self, cmd: list[str]) -> list[str]:
        """`cmd` as a load generator: behind the NIC, pinned to the load generator's CPU."""
        return self.pair.ns_cmd(pinned(_cpus()[1], cmd))


@contextmanager
def gateway() -> Iterator[Gateway]:
    pair = make_veth_pair()
    try:
        with tempfile.TemporaryDirectory() as workdir:
            yield Gateway(workdir, pair)
    finally:
        remove_veth_pair(pair)


@dataclass
class Configuration:
    """The agent with `probes` (None: the whole default config), running only while attached; the
    no-agent configuration runs nothing."""

    name: str
    gateway: Gateway
    probes: list[str] | None = None
    settings: str = ""  # more lines of its config file
    agent: subprocess.Popen[str] | None = field(default=None, repr=False)

    def attach(self) -> None:
        if self.name == NO_AGENT:
            return
        probes = f"probes = {json.dumps(self.probes)}\n" if self.probes else ""
        interfaces = f"interfaces = {json.dumps([self.gateway.pair.host])}\n"
        self.agent = _start_agent(self.gateway.workdir, interfaces + probes + self.settings)

    def detach(self) -> None:
        if self.agent is not None:
            _stop(self.agent)
            self.agent = None

    def cpu_ns(self) -> int:
        return cpu_ns(self.agent.pid) if self.agent is not None else 0

    def holder(self) -> int:
        """The process that holds its programs open, while attached."""
        assert self.agent is not None
        return self.agent.pid


@dataclass
class EmptyPrograms(Configuration):
    """No agent: empty programs on the hooks where the whole agent's programs run per request on this
    host's kernel (sendlat's tracepoint strategy: a send's two tracepoints, a receive's; tc both ways
    on the gateway's interface, through TCX): what any program there costs, whatever it does."""

    objects: list[BpfObject] = field(default_factory=list, repr=False)

    def attach(self) -> None:
        empty = ["sendlat_empty_start", "sendlat_empty_end", "sendlat_empty_recv"]
        sends, frames = BpfObject("sendlat", programs=empty), BpfObject("flows", programs=["flows_tc_empty"])
        self.objects = [sends, frames]
        for obj in self.objects:
            obj.load()
        for name in empty:
            sends.programs[name].attach()
        ifindex = socket.if_nametoindex(self.gateway.pair.host)
        for direction in ("ingress", "egress"):
            frames.programs["flows_tc_empty"].attach_tcx(ifindex, direction)

    def detach(self) -> None:
        for obj in self.objects:
            obj.close()
        self.objects = []

    def holder(self) -> int:
        return os.getpid()


def _configurations(at: Gateway) -> list[Configuration]:
    knockouts = [Configuration(f"{name} alone", at, [name]) for name in selectable_names()] if KNOCKOUTS else []
    return [Configuration(NO_AGENT, at), EmptyPrograms(FLOOR, at), Configuration(WHOLE, at), _without_requests(at),
            *knockouts]


def _without_requests(at: Gateway) -> Configuration:
    """The whole agent but the requests part: what counting requests adds (issue 24's before and after)."""
    return Configuration(f"{WHOLE}, no requests", at, settings="count_requests = false\n")


def _sample(served: Served, configurations: list[Configuration]) -> Sample:
    """One round's load under whichever configuration is attached, after as long a load unmeasured: an
    agent's start-up under load (its first reads of a table, owner scans, caches) is no cost per request
    of one that runs for days."""
    served.load()
    server, agent = served.cpu_ns(), sum(c.cpu_ns() for c in configurations)
    requests = served.load()
    return Sample(requests, served.cpu_ns() - server, sum(c.cpu_ns() for c in configurations) - agent)


# --- the servers and their loads ---

def _drained(process: subprocess.Popen[str]) -> subprocess.Popen[str]:
    """A fixture server once it printed "ready"; its accounts of each response, not needed here, read
    and dropped so it never blocks on a full pipe."""
    if process.stdout is None or process.stdout.readline().strip() != "ready":
        raise RuntimeError(f"{process.args!r} did not start")
    threading.Thread(target=process.stdout.read, daemon=True).start()
    return process


def _python_server(script: str, address: str, port: int, *args: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, str(FIXTURES / script), str(port), "--host", address, "--events", str(EVENTS),
           "--cadence-ms", "0", "--prefill-ms", "0", *args]
    return _drained(subprocess.Popen(pinned(_cpus()[0], cmd), stdout=subprocess.PIPE, text=True))


def _listening(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=1).close()
        return True
    except OSError:
        return False


def _nginx(at: Gateway, port: int, http: str) -> subprocess.Popen[str]:
    """nginx, one worker pinned to the server's CPU, with `http` inside its http block."""
    workdir = at.workdir
    conf = Path(workdir) / "nginx.conf"
    conf.write_text(f"""
daemon off;
worker_processes 1;
worker_cpu_affinity {1 << _cpus()[0]:b};
pid {workdir}/nginx.pid;
error_log {workdir}/nginx-error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {workdir}/client_body;
    proxy_temp_path {workdir}/proxy;
    {http}
}}
""")
    nginx = subprocess.Popen(pinned(_cpus()[0], ["nginx", "-p", workdir, "-c", str(conf)]), text=True)
    if not wait_until(lambda: _listening(at.address, port), timeout=30):
        nginx.kill()
        raise RuntimeError(f"nginx did not listen: {(Path(workdir) / 'nginx-error.log').read_text()}")
    return nginx


def _wrk(at: Gateway, url: str) -> Callable[[], int]:
    def load() -> int:
        out = subprocess.run(at.client(["wrk", "-t1", f"-c{CONNECTIONS}", f"-d{SECONDS}s", url]),
                             capture_output=True, text=True, check=True).stdout
        if "Non-2xx" in out or "Socket errors" in out:
            raise RuntimeError(f"wrk {url}: {out}")
        return int(next(line.split()[0] for line in out.splitlines() if " requests in " in line))
    return load


class GrpcClient:
    """The grpcio client, started once (its start-up outside the rounds), loading for SECONDS when called."""

    def __init__(self, at: Gateway, port: int) -> None:
        cmd = [sys.executable, "-c", GRPC_CLIENT, f"{at.address}:{port}", str(GRPC_STREAMS), str(EVENTS)]
        self.process = subprocess.Popen(at.client(cmd), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def __call__(self) -> int:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(f"{SECONDS}\n")
        self.process.stdin.flush()
        return int(self.process.stdout.readline())


@contextmanager
def _stopping(processes: list[subprocess.Popen[str]]) -> Iterator[list[subprocess.Popen[str]]]:
    try:
        yield processes
    finally:
        for process in processes:
            _stop(process)


@contextmanager
def nginx_small_body(at: Gateway) -> Iterator[Served]:
    port = free_port()
    http = f"""server {{ listen {at.address}:{port};
        location / {{ default_type application/json; return 200 '{{"ok":true}}'; }} }}"""
    with _stopping([_nginx(at, port, http)]) as processes:
        yield Served(processes, _wrk(at, at.url(port)))


@contextmanager
def nginx_proxying_sse(at: Gateway) -> Iterator[Served]:
    """The upstream on loopback, as on a gateway host: not a watched interface."""
    port, upstream = free_port(), free_port()
    http = f"""upstream sse {{ server 127.0.0.1:{upstream}; keepalive 16; }}
    server {{ listen {at.address}:{port};
        location /stream {{ proxy_pass http://sse; proxy_http_version 1.1; proxy_set_header Connection "";
                           proxy_buffering off; }} }}"""
    with _stopping([_python_server("sse_server.py", "127.0.0.1", upstream)]) as processes:
        processes.append(_nginx(at, port, http))
        yield Served(processes, _wrk(at, at.url(port, "/stream")))


@contextmanager
def uvicorn_sse(at: Gateway) -> Iterator[Served]:
    port = free_port()
    with _stopping([_python_server("sse_server.py", at.address, port)]) as processes:
        yield Served(processes, _wrk(at, at.url(port, "/stream")))


@contextmanager
def grpc_streaming(at: Gateway) -> Iterator[Served]:
    port = free_port()
    with _stopping([_python_server("grpc_server.py", at.address, port)]) as processes:
        client = GrpcClient(at, port)
        with _stopping([client.process]):
            yield Served(processes, client)


CASES: dict[str, Callable[[Gateway], AbstractContextManager[Served]]] = {
    "nginx, small body": nginx_small_body,
    f"nginx proxying SSE ({EVENTS} events)": nginx_proxying_sse,
    f"uvicorn SSE ({EVENTS} events)": uvicorn_sse,
    f"gRPC streaming ({EVENTS} messages)": grpc_streaming,
}


# --- the figures ---

def _costs(samples: list[Sample], bare: list[Sample]) -> list[float]:
    """Per round, what aiprobe cost the server per request: its CPU added (against the round's no-agent
    sample) and the agent's own."""
    return [s.server - b.server + s.agent for s, b in zip(samples, bare, strict=True)]


def _shares_of(samples: list[Sample], bare: list[Sample]) -> list[float]:
    """Per round, that cost as a share of the server's CPU per request without the agent."""
    return [cost / b.server for cost, b in zip(_costs(samples, bare), bare, strict=True)]


def _precise(runs: dict[str, list[Sample]]) -> bool:
    """Whether the whole agent's share is known to within PRECISION (its median's 90% interval)."""
    shares = _shares_of(runs[WHOLE], runs[NO_AGENT])
    low, high = median_interval(shares)
    median = statistics.median(shares)
    return max(median - low, high - median) <= PRECISION


def _interval(values: list[float], unit: str = "") -> str:
    low, high = median_interval(values)
    digits = 0 if unit else 3
    return f"90% interval {low:.{digits}f}..{high:.{digits}f}{unit}"


def _rate(samples: list[Sample]) -> str:
    """The requests per second the load generator completed, the median over the rounds."""
    return f"{statistics.median(s.requests / SECONDS for s in samples):.0f}"


def _shares(case: str, runs: dict[str, list[Sample]]) -> tuple[list[Result], float]:
    """Each configuration's cost per request (ns) and share of the server's CPU against the no-agent
    rounds, each the median over the rounds of the figure within each round's pair, with its 90%
    interval; the floor's cost beside each. And the server's CPU per request without the agent."""
    bare = runs.pop(NO_AGENT)
    base = [s.server for s in bare]
    floor = statistics.median(_costs(runs[FLOOR], bare))
    results = [Result("gateway", f"{case}, {NO_AGENT}: server CPU per request", statistics.median(base), "ns",
                      f"{spread(base)}; {_rate(bare)} req/s")]
    for name, samples in runs.items():
        costs, shares = _costs(samples, bare), _shares_of(samples, bare)
        added = [s.server - b.server for s, b in zip(samples, bare, strict=True)]
        results += [
            Result("gateway", f"{case}, {name}: aiprobe's CPU per request", statistics.median(costs), "ns",
                   f"{_interval(costs, ' ns')}; server added {statistics.median(added):+.0f}, agent "
                   f"{statistics.median(s.agent for s in samples):.0f} ns/req; the floor (empty programs on the "
                   f"same hooks) {floor:+.0f} ns; {_rate(samples)} req/s; target <= {TARGET_NS} ns for a small "
                   "request (issue 43)"),
            Result("gateway", f"{case}, {name}: aiprobe's share of the server's CPU", statistics.median(shares),
                   "ratio", f"{_interval(shares)}, medians of {len(samples)} rounds; target <= {TARGET_SHARE} "
                   "for a stream (issue 43)")]
    return results, statistics.median(base)


def _run_times(case: str, served: Served, configuration: Configuration, server_ns: float) -> list[Result]:
    """The programs of a configuration (the whole agent, it without requests, or the floor's empty
    programs) under one load with bpf_stats on: the run time per request of each one that ran, with its
    runs per request and ns per run; and their total against the server's CPU per request without the
    agent. Each of ours reads against the empty program on its hook, under the same load."""
    case = f"{case}, {configuration.name}"
    with bpf_stats(), attached(configuration):
        holder = configuration.holder()
        before = programs_of(holder)
        requests = served.load()
        after = programs_of(holder)
        # bpftool names a program in full, from its BTF (the kernel keeps 15 characters)
        names = {p["id"]: p["name"] for p in bpftool_json("prog", "show") if p["id"] in after}
    ran = {names.get(prog_id, str(prog_id)): (run_time - before.get(prog_id, (0, 0))[0],
                                              runs - before.get(prog_id, (0, 0))[1])
           for prog_id, (run_time, runs) in after.items()}
    ran = {name: counts for name, counts in ran.items() if counts[1] > 0}
    results = [Result("gateway", f"{case}, BPF {name}: run time per request", run_time / requests, "ns",
                      f"{runs / requests:.2f} runs per request, {run_time / runs:.0f} ns per run")
               for name, (run_time, runs) in sorted(ran.items(), key=lambda item: -item[1][0])]
    total = sum(run_time for run_time, _ in ran.values()) / requests
    results.append(Result("gateway", f"{case}, BPF, every program: run time per request", total,
                          "ns", f"{len(ran)} of {len(after)} programs ran; {total / server_ns:.4f} of the server's "
                          "CPU per request without the agent (runs host-wide: the load generator's too)"))
    return results


def measure(case: str, serve: Callable[[Gateway], AbstractContextManager[Served]]) -> list[Result]:
    with gateway() as at, serve(at) as served:
        configurations = _configurations(at)
        served.load()  # warm-up: connections, caches, the CPU's frequency
        runs = alternate(configurations, ROUNDS, lambda: _sample(served, configurations), _precise, MAX_ROUNDS)
        results, server_ns = _shares(case, runs)
        for configuration in (EmptyPrograms(FLOOR, at), Configuration(WHOLE, at), _without_requests(at)):
            results += _run_times(case, served, configuration, server_ns)
        return results


def _selected(case: str) -> bool:
    return not SELECTED or any(word in case.lower() for word in SELECTED)


def run() -> list[Result]:
    return [result for case, serve in CASES.items() if _selected(case) for result in measure(case, serve)]
