"""What any unprivileged process on the node can do to the agent (issue 13), done for real against a
real agent: names and paths that are not UTF-8 or carry terminal escapes, a squatted port, bad
configuration. The agent must stay up, keep refreshing, answer /healthz within 1 s and exit 0 on
SIGTERM with nothing left attached. (The HTTP floods are in tests/test_http.py.)"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from aiprobe.containers import cgroup2_root
from fixtures.cuda_fake import build
from helpers import VethPair, accepting, free_port, programs_on, run, unique, wait_until
from servers import AIPROBE, Agent, http_get
from test_agent import tcp_sink

pytestmark = pytest.mark.bpf

# Not UTF-8, and a terminal escape that clears the screen and retitles the window.
HOSTILE_NAME = b"\xff\xfe\x1b[2J\x1b]0;x\x07"

HOSTILE_PROCESS = r"""
import ctypes, os, socket, sys, time
cgroup, library = bytes.fromhex(sys.argv[1]), bytes.fromhex(sys.argv[2])
host, port, name = sys.argv[3], int(sys.argv[4]), bytes.fromhex(sys.argv[5])
with open(os.path.join(cgroup, b"cgroup.procs"), "wb") as procs:
    procs.write(str(os.getpid()).encode())
ctypes.CDLL(None).prctl(15, ctypes.c_char_p(name), 0, 0, 0)  # PR_SET_NAME: the comm every probe reports
ctypes.CDLL(library)  # maps libcuda.so.1 from a directory whose name is not UTF-8
print("ready", flush=True)
while True:
    with socket.create_connection((host, port)) as conn:
        conn.sendall(b"x" * 65536)
    time.sleep(0.1)
"""


@pytest.fixture
def hostile_places(cbuild, tmp_path: Path) -> Iterator[tuple[bytes, bytes]]:
    """A cgroup and a libcuda.so.1 whose paths are not UTF-8 and hold escapes: (cgroup, library)."""
    libdir = build(cbuild).libdir
    odd = b"aipt-" + secrets.token_hex(3).encode() + b"-\xff\x1b[31m"
    library_dir = os.fsencode(tmp_path) + b"/" + odd
    os.mkdir(library_dir)
    shutil.copy(libdir / "libcuda.so.1", library_dir + b"/libcuda.so.1")
    cgroup = os.fsencode(cgroup2_root()) + b"/" + odd
    os.mkdir(cgroup)
    try:
        yield cgroup, library_dir + b"/libcuda.so.1"
    finally:
        wait_until(lambda: not Path(os.fsdecode(cgroup + b"/cgroup.procs")).read_text().strip(), timeout=5)
        with contextlib.suppress(OSError):
            os.rmdir(cgroup)


def start_hostile(places: tuple[bytes, bytes], veth: VethPair, port: int) -> subprocess.Popen:
    cgroup, library = places
    process = subprocess.Popen([sys.executable, "-c", HOSTILE_PROCESS, cgroup.hex(), library.hex(), veth.peer_ip4,
                                str(port), HOSTILE_NAME.hex()], stdout=subprocess.PIPE)
    assert process.stdout.readline().strip() == b"ready"
    return process


def healthz_within_1s(agent: Agent) -> bool:
    return http_get(agent.url + "/healthz", timeout=1.0)[0] == 200


def send_bytes(agent: Agent, pid: int) -> float:
    """What sendlat counted for `pid` so far (the snapshot's per-process send bytes)."""
    rows = [p for p in agent.snapshot().get("processes", []) if p["pid"] == pid]
    return (rows[0].get("send_bytes") or 0) if rows else 0


def test_non_utf8_and_escape_names_degrade_one_record_not_the_agent(tmp_path: Path, veth: VethPair,
                                                                    hostile_places: tuple[bytes, bytes]) -> None:
    sink = tcp_sink(veth, 9000)
    config = f'interfaces = ["{veth.host}"]\nexclude = []\nprobes = ["flows", "sendlat", "cuda"]\n'
    before = start_hostile(hostile_places, veth, 9000)  # already running when the agent starts
    after = None
    try:
        with Agent(tmp_path, config) as agent:
            after = start_hostile(hostile_places, veth, 9000)
            for pid in (before.pid, after.pid):
                assert wait_until(lambda p=pid: send_bytes(agent, p) > 0, timeout=20), agent.log.read_text()[-2000:]
            first, series = send_bytes(agent, after.pid), series_not_per_process(agent.metrics())
            rss = rss_bytes(agent.process.pid)
            assert wait_until(lambda: send_bytes(agent, after.pid) > first + 10 * 65536, timeout=20)  # refreshing
            metrics = agent.metrics()
            assert series_not_per_process(metrics) <= series + 10 and rss_bytes(agent.process.pid) <= rss + (16 << 20)
            # Both hostile processes share one name: one label value, one series per family (buckets aside).
            hostile = [line for line in metrics.splitlines() if "\\\\x1b[2J" in line and "_bucket{" not in line]
            assert len(hostile) <= 60, hostile
            assert healthz_within_1s(agent)
            names = {p["comm"] for p in agent.snapshot()["processes"] if p["pid"] in (before.pid, after.pid)}
            assert names == {"\ufffd\ufffd\\x1b[2J\\x1b]0;x\\x07"}, names
            metrics = agent.metrics()
            assert "\x1b" not in metrics and "\\\\x1b[2J" in metrics
            top = subprocess.run([AIPROBE, "top", "--batch", "--iterations", "1", "--connect", agent.url],
                                 capture_output=True, timeout=60)
            assert top.returncode == 0, top.stderr
            assert b"\\x1b[2J" in top.stdout and b"\x1b" not in top.stdout + top.stderr
            agent.stop()
            assert agent.process.returncode == 0
        log = agent.log.read_text(errors="replace")
        assert "Traceback" not in log and "UnicodeDecodeError" not in log, log[-3000:]
        assert programs_on(veth.host) == set()
    finally:
        for process in (before, after, sink):
            if process is not None:
                process.kill()
                process.wait()


# --- bad configuration: one line, exit 2, never a traceback ---

def _write(tmp_path: Path, name: str, data: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


def _fifo(tmp_path: Path) -> str:
    os.mkfifo(tmp_path / "fifo.toml")
    return str(tmp_path / "fifo.toml")


BAD_CONFIGS = {
    "binary": lambda t: ["--config", _write(t, "c.toml", bytes(range(256)) * 8)],
    "latin-1": lambda t: ["--config", _write(t, "c.toml", 'alert_log = "caf\xe9"\n'.encode("latin-1"))],
    "deeply nested": lambda t: ["--config", _write(t, "c.toml", b"a = " + b"[" * 50_000 + b"]" * 50_000)],
    "interval nan": lambda t: ["--config", _write(t, "c.toml", b"interval_seconds = nan\n")],
    "interval inf": lambda t: ["--config", _write(t, "c.toml", b"interval_seconds = inf\n")],
    "interval 1e308": lambda t: ["--config", _write(t, "c.toml", b"interval_seconds = 1e308\n")],
    "flow idle inf": lambda t: ["--config", _write(t, "c.toml", b"flow_idle_seconds = inf\n")],
    "flow idle nan": lambda t: ["--config", _write(t, "c.toml", b"flow_idle_seconds = nan\n")],
    "rule for -inf": lambda t: ["--config", _write(t, "c.toml", b"[rules.gpu_saturated]\nfor_seconds = -inf\n")],
    "huge integer": lambda t: ["--config", _write(t, "c.toml", b"top_flows = 1" + b"0" * 400 + b"\n")],
    "/dev/zero": lambda t: ["--config", "/dev/zero"],
    "fifo": lambda t: ["--config", _fifo(t)],
    "directory": lambda t: ["--config", str(t)],
    "over 1 MiB": lambda t: ["--config", _write(t, "c.toml", b"# padding\n" * 120_000)],
    "interfaces []": lambda t: ["--config", _write(t, "c.toml", b"interfaces = []\n")],
    "--interfaces ,": lambda t: ["--interfaces", ","],
    "escape in a glob": lambda t: ["--config", _write(t, "c.toml", b'interfaces = ["eth\\u001b[2J"]\n')],
    "alertmanager without port number": lambda t: ["--alertmanager", "http://h:notaport"],
    "alertmanager without scheme": lambda t: ["--alertmanager", "alertmanager:9093"],
    "alertmanager without host": lambda t: ["--alertmanager", "http://:9093"],
    "alert_log in a missing directory": lambda t: ["--config", _write(t, "c.toml", b'alert_log = "/nonexistent/a"\n')],
    "alert_log a directory": lambda t: ["--config", _write(t, "c.toml", f'alert_log = "{t}"\n'.encode())],
    "listen on a name": lambda t: ["--listen", "localhost:9645"],
    "web config /dev/zero": lambda t: ["--web.config.file", "/dev/zero"],
    "web config not YAML": lambda t: ["--web.config.file", _write(t, "web.yml", b"tls_server_config: [\n")],
    "web config plain password": lambda t: ["--web.config.file",
                                            _write(t, "web.yml", b"basic_auth_users:\n  admin: hunter2\n")],
    "web config missing key file": lambda t: ["--web.config.file", _write(
        t, "web.yml", b"tls_server_config:\n  cert_file: none.crt\n  key_file: none.key\n")],
}


@pytest.mark.parametrize("make_args", BAD_CONFIGS.values(), ids=BAD_CONFIGS.keys())
def test_bad_configuration_is_one_line_and_exit_2(tmp_path: Path, make_args) -> None:
    result = subprocess.run([AIPROBE, "agent", "--listen", "127.0.0.1:1", *make_args(tmp_path)],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith("aiprobe: config: ")


# --- what the agent meets at run time ---

def metric(text: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels` (0 when there are none)."""
    total = 0.0
    for line in text.splitlines():
        named = line.startswith((name + "{", name + " "))
        if named and all(f'{key}="{value}"' in line for key, value in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def series_count(text: str) -> int:
    """Series in /metrics, but for the token-stream families: every HTTP server on this shared host
    (other tests' agents) adds a label set of some 200 series there while a test runs."""
    return sum(1 for line in text.splitlines() if line and not line.startswith(("#", "aiprobe_stream")))


def series_not_per_process(text: str) -> int:
    """Series without a `process` label nor a flow's: what the agent exports of itself and of the
    test's own interfaces, not what every process on this shared host adds, nor the top K flows
    (bounded by top_flows: test_agent.py)."""
    return sum(1 for line in text.splitlines()
               if line and not line.startswith("#") and 'process="' not in line and 'remote_address="' not in line)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise LookupError("no VmRSS")


GARBAGE_SERVER = """
import socket, sys
server = socket.create_server(("127.0.0.1", 0))
print(server.getsockname()[1], flush=True)
while True:
    conn, _ = server.accept()
    conn.recv(65536)
    conn.sendall(b"\\x00\\xffnot HTTP at all\\r\\n\\r\\n")  # http.client raises BadStatusLine
    conn.close()
"""

# Any TCP send fires this at once: the agent's own HTTP answers are enough.
FIRING_RULE = "[rules.network_send_stall]\nthreshold = 1e-9\nclear = 0\nfor_seconds = 0\n"


def test_alert_log_on_a_full_disk_and_a_broken_alertmanager_are_counted_not_fatal(tmp_path: Path) -> None:
    garbage = subprocess.Popen([sys.executable, "-c", GARBAGE_SERVER], stdout=subprocess.PIPE, text=True)
    try:
        port = int(garbage.stdout.readline())
        config = f'probes = ["sendlat"]\nalertmanager_url = "http://127.0.0.1:{port}"\n' + FIRING_RULE
        with Agent(tmp_path, config, alert_log="/dev/full") as agent:
            assert wait_until(lambda: metric(agent.metrics(), "aiprobe_alert_log_errors_total") > 0, timeout=20)
            failed = "aiprobe_alertmanager_notifications_total"
            assert wait_until(lambda: metric(agent.metrics(), failed, result="failure") > 0, timeout=20)
            first = metric(agent.metrics(), failed, result="failure")
            # The pusher lives on: it keeps trying on its resend interval.
            assert wait_until(lambda: metric(agent.metrics(), failed, result="failure") > first, timeout=20)
            assert metric(agent.metrics(), failed, result="success") == 0
            sent = metric(agent.metrics(), "aiprobe_tcp_send_bytes_total")
            assert wait_until(lambda: metric(agent.metrics(), "aiprobe_tcp_send_bytes_total") > sent, timeout=10)
            assert healthz_within_1s(agent)
            agent.stop()
        assert agent.process.returncode == 0
        log = agent.log.read_text()
        assert "Traceback" not in log and "No space left on device" in log, log[-2000:]
        assert log.count("No space left on device") == 1  # logged once, counted after
    finally:
        garbage.kill()
        garbage.wait()


SQUATTER = """
import os, socket, sys
server = socket.create_server(("127.0.0.1", int(sys.argv[1])))
os.setuid(65534)
print("ready", flush=True)
sys.stdin.readline()
"""


def test_a_squatted_listen_port_is_retried_until_free(tmp_path: Path) -> None:
    port = free_port()
    squatter = subprocess.Popen([sys.executable, "-c", SQUATTER, str(port)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
    assert squatter.stdout.readline().strip() == "ready"
    config = tmp_path / "squat.toml"
    config.write_text(f'listen = "127.0.0.1:{port}"\nprobes = ["sendlat"]\nalert_log = "{tmp_path}/a.jsonl"\n')
    log = tmp_path / "agent.log"
    with log.open("wb") as out:
        agent = subprocess.Popen([AIPROBE, "agent", "--config", str(config)], stdout=out, stderr=subprocess.STDOUT)
    try:
        assert wait_until(lambda: "in use" in log.read_text(), timeout=20), log.read_text()
        assert wait_until(lambda: "thread http failed" in log.read_text(), timeout=20), log.read_text()  # a retry
        assert agent.poll() is None  # up, refreshing, waiting for the port
        squatter.stdin.close()
        squatter.wait(timeout=10)
        url = f"http://127.0.0.1:{port}"
        assert wait_until(lambda: http_get(url + "/healthz", timeout=1.0)[0] == 200, timeout=30), log.read_text()
        assert b"aiprobe_build_info" in http_get(url + "/metrics")[1]
        assert wait_until(lambda: metric(http_get(url + "/metrics")[1].decode(), "aiprobe_thread_restarts_total",
                                         thread="http") >= 1, timeout=10)  # the next refresh has it
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=30) == 0
    finally:
        for process in (agent, squatter):
            if process.poll() is None:
                process.kill()
                process.wait()
    assert "Traceback" not in log.read_text()


def run_churn(cbuild, port: int, first: int, count: int) -> None:
    churn = cbuild("churn_senders", "churn_senders.c")
    subprocess.run([str(churn), str(first), str(count), str(port)], check=True, timeout=120)


def test_five_thousand_short_lived_senders_keep_series_and_memory_flat(tmp_path: Path, cbuild) -> None:
    sink = socket.create_server(("127.0.0.1", 0), backlog=4096)
    limit, idle = 50, 20  # idle outlasts the churn on a slow host, so the last batches still have series
    config = f'probes = ["sendlat"]\nmax_process_labels = {limit}\nidle_series_seconds = {idle}\n'
    with sink, accepting(sink, socket.socket.close), Agent(tmp_path, config) as agent:
        port = sink.getsockname()[1]
        run_churn(cbuild, port, 0, 200)  # warm up: caches, first series, allocator arenas
        time.sleep(2)
        baseline_rss, baseline_series = rss_bytes(agent.process.pid), series_count(agent.metrics())
        for batch in range(10):
            run_churn(cbuild, port, 200 + batch * 500, 500)
            time.sleep(0.5)  # a few refreshes see each batch
        time.sleep(2)
        metrics = agent.metrics()
        processes = {re.search(r'process="([^"]*)"', line).group(1) for line in metrics.splitlines()
                     if line.startswith("aiprobe_tcp_send_bytes_total{")}
        assert len(processes) <= limit + 1 and "other" in processes, sorted(processes)[:10]
        assert metric(metrics, "aiprobe_process_labels_folded_total") > 0
        peak_series = series_count(metrics)
        assert peak_series <= baseline_series + 20 * (limit + 1), (baseline_series, peak_series)
        assert rss_bytes(agent.process.pid) <= baseline_rss + (24 << 20), (baseline_rss, rss_bytes(agent.process.pid))
        # Idle label sets go: the churned processes' series leave /metrics.
        assert wait_until(lambda: "churn" not in agent.metrics(), timeout=idle + 15)
        assert healthz_within_1s(agent)
        agent.stop()
    assert agent.process.returncode == 0


XDP_HOLDER = """
import sys
from aiprobe.loader import BpfObject
obj = BpfObject("features", programs=["probe_xdp"])
obj.load()
obj.programs["probe_xdp"].attach_xdp(int(sys.argv[1]), None)  # a bpf_link: gone with this process
print("holding", flush=True)
sys.stdin.readline()
"""


SEND_THREE = "import socket, sys; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n" \
             "for _ in range(3): s.sendto(b'x' * 1000, (sys.argv[1], 9))"


def assert_ingress_counts_the_wire(agent: Agent, veth: VethPair) -> None:
    """Datagrams sent into the host end move the agent's ingress counter by what the interface's
    own rx counter says."""
    def refreshed_after(moment: float) -> Callable[[], bool]:
        return lambda: agent.snapshot()["host"]["time"] > moment

    def counted_and_wire() -> tuple[float, int]:
        """Read until two reads with a refresh of the agent between them agree (a scrape serves the
        latest refresh with only the flows it recorded read again, so a new flow waits for the next
        refresh, and a slow refresh can outlast any fixed pause)."""
        last = None
        while True:
            metrics = agent.metrics()
            now = (metric(metrics, "aiprobe_interface_bytes_total", interface=veth.host, direction="ingress"),
                   int(Path(f"/sys/class/net/{veth.host}/statistics/rx_bytes").read_text()))
            if now == last and f'interface="{veth.host}"' in metrics:
                return now
            last = now
            assert wait_until(refreshed_after(time.time())), "the agent stopped refreshing"

    counted_before, wire_before = counted_and_wire()
    veth.ns_run(["python3", "-c", SEND_THREE, veth.host_ip4])
    counted, wire = counted_and_wire()
    assert wire - wire_before >= 3 * 1000
    assert counted - counted_before == wire - wire_before


def test_a_foreign_xdp_holder_is_reported_and_left_alone_while_tc_counts(tmp_path: Path, veth: VethPair) -> None:
    """Flows counts ingress at tc (XDP is opt-in, and refused on a veth): another program's XDP hook
    costs nothing, stays where it is, and `check` still names it."""
    holder = subprocess.Popen([sys.executable, "-c", XDP_HOLDER, str(veth.host_ifindex)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "holding"
    config = f'interfaces = ["{veth.host}"]\nexclude = []\nprobes = ["flows"]\n'
    try:
        with Agent(tmp_path, config) as agent:
            ours = {"flows_ingress", "flows_egress"}
            assert wait_until(lambda: ours <= programs_on(veth.host), timeout=10), agent.log.read_text()
            assert programs_on(veth.host) == {*ours, "probe_xdp"}
            assert metric(agent.metrics(), "aiprobe_attach_errors_total", probe="flows", target=veth.host) == 0
            check = subprocess.run([AIPROBE, "check", "--json"], capture_output=True, text=True, timeout=120)
            assert any(held.startswith(f"{veth.host}: 'probe_xdp'")
                       for held in json.loads(check.stdout)["xdp_held_by_others"]), check.stdout[-2000:]
            # Native XDP on a veth moves its receive path to NAPI, which counts rx_bytes its own way:
            # no exact truth while the holder stays, only that our counter moves.
            before = metric(agent.metrics(), "aiprobe_interface_bytes_total", interface=veth.host, direction="ingress")
            veth.ns_run(["python3", "-c", SEND_THREE, veth.host_ip4])
            assert wait_until(lambda: metric(agent.metrics(), "aiprobe_interface_bytes_total", interface=veth.host,
                                             direction="ingress") >= before + 3 * 1000, timeout=10)
            # The holder leaves: ours stay, keep counting, and `check` no longer names a holder.
            holder.stdin.close()
            assert holder.wait(timeout=10) == 0
            assert wait_until(lambda: programs_on(veth.host) == ours, timeout=10)
            assert_ingress_counts_the_wire(agent, veth)
            check = subprocess.run([AIPROBE, "check", "--json"], capture_output=True, text=True, timeout=120)
            assert not any(held.startswith(f"{veth.host}:") for held in json.loads(check.stdout)["xdp_held_by_others"])
            assert metric(agent.metrics(), "aiprobe_probe_up", probe="flows") == 1
            assert healthz_within_1s(agent)
            agent.stop()
        assert agent.process.returncode == 0
        assert programs_on(veth.host) == set()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


@pytest.mark.parametrize("strategy", ["tcx", "clsact"])
def test_aiprobe_flows_beside_the_agent_leaves_the_agent_counting(tmp_path: Path, veth: VethPair,
                                                                  strategy: str) -> None:
    """A second aiprobe on the same interface (an engineer's `aiprobe flows` next to the DaemonSet)
    adds its own programs beside the agent's and takes only its own away when it exits: TCX links,
    and clsact filters (kernels without TCX), where neither takes the other's for a leftover."""
    config = f'interfaces = ["{veth.host}"]\nexclude = []\nprobes = ["flows"]\n[strategies]\nflows = "{strategy}"\n'
    with Agent(tmp_path, config) as agent:
        ours = {"flows_ingress", "flows_egress"}
        assert wait_until(lambda: ours <= programs_on(veth.host), timeout=10), agent.log.read_text()

        beside = subprocess.Popen([AIPROBE, "flows", "--interfaces", veth.host, "--strategy", strategy,
                                   "--duration", "4", "--json"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert_ingress_counts_the_wire(agent, veth)
        out, err = beside.communicate(timeout=60)
        assert beside.returncode == 0, err
        assert json.loads(out)["interfaces"], out[-2000:]
        assert f"attached ({strategy})" in err and "stale" not in agent.log.read_text() + err
        assert ours <= programs_on(veth.host)  # the agent's programs survive the other run's exit
        assert_ingress_counts_the_wire(agent, veth)
        assert healthz_within_1s(agent)
        agent.stop()
    assert agent.process.returncode == 0
    assert programs_on(veth.host) == set()


def test_an_idle_connection_flood_under_a_low_file_limit_leaves_the_agent_measuring(tmp_path: Path,
                                                                                     veth: VethPair) -> None:
    """1,000 idle connections and wrk scrapes against an agent whose `nofile` limit is 256: the server
    keeps a quarter of the descriptors at most, so /healthz answers, the probes keep counting (exactly
    what the interface counts), the CUDA scan and link watcher never fail (a new interface is attached),
    and threads, RSS and series stay bounded."""
    config = f'interfaces = ["{veth.host}*"]\nexclude = []\nprobes = ["flows", "cuda"]\n'
    added, added_peer = veth.host + "n", veth.peer + "n"
    with Agent(tmp_path, config, prefix=["prlimit", "--nofile=256:256", "--"]) as agent:
        ours = {"flows_ingress", "flows_egress"}
        assert wait_until(lambda: ours <= programs_on(veth.host), timeout=10), agent.log.read_text()
        assert_ingress_counts_the_wire(agent, veth)
        baseline_rss, baseline_series = rss_bytes(agent.process.pid), series_not_per_process(agent.metrics())
        listening = subprocess.run(["ss", "-Hltn", f"sport = :{agent.port}"], capture_output=True, text=True).stdout
        assert int(listening.split()[2]) >= 128, listening  # Send-Q of a listener: its backlog
        idle = [socket.create_connection(("127.0.0.1", agent.port)) for _ in range(1000)]
        wrk = subprocess.Popen(["wrk", "-t2", "-c20", "-d8s", agent.url + "/metrics"], stdout=subprocess.PIPE,
                               text=True)
        try:
            answered = []
            run(["ip", "link", "add", added, "type", "veth", "peer", "name", added_peer])
            run(["ip", "link", "set", added, "up"])
            assert wait_until(lambda: programs_on(added) == ours, timeout=10), agent.log.read_text()[-2000:]
            while wrk.poll() is None:
                started = time.monotonic()
                answered.append(healthz_within_1s(agent))
                time.sleep(max(0.0, 0.25 - (time.monotonic() - started)))
            report = wrk.communicate()[0]
            assert answered and all(answered), f"/healthz missed {answered.count(False)} of {len(answered)}"
            assert int(re.search(r"(\d+) requests in", report).group(1)) > 100, report
            assert_ingress_counts_the_wire(agent, veth)
            metrics = agent.metrics()
            assert metric(metrics, "aiprobe_thread_restarts_total") == 0, metrics
            assert metric(metrics, "aiprobe_collector_errors_total") == 0, metrics
            series = series_not_per_process(metrics)
            assert series <= baseline_series + 30, (baseline_series, series)  # 30: the new interface's
            rss = rss_bytes(agent.process.pid)
            assert rss <= baseline_rss + (32 << 20), (baseline_rss, rss)
        finally:
            for conn in idle:
                conn.close()
            if wrk.poll() is None:
                wrk.kill()
                wrk.wait()
            subprocess.run(["ip", "link", "del", added], capture_output=True)
        agent.stop()
    assert agent.process.returncode == 0
    assert programs_on(veth.host) == set(), agent.log.read_text()[-3000:]
    log = agent.log.read_text()
    assert "Traceback" not in log and "Too many open files" not in log, log[-2000:]


def open_files_limit(pid: int, soft: int | str) -> None:
    subprocess.run(["prlimit", "--pid", str(pid), f"--nofile={soft}:"], check=True)


def test_running_out_of_file_descriptors_fails_healthz_is_counted_and_heals(tmp_path: Path, veth: VethPair) -> None:
    """The agent's open-files limit cut below what it holds, at run time: an interface that appears then
    cannot be attached (logged once with its reason, retried with back-off), the flows collector and
    the CUDA scan thread fail and /healthz says 503 on a connection opened before; with the limit back,
    the scan thread runs again, the retry attaches, the failures stay counted in /metrics, /healthz is
    200 again and nothing in the log is a traceback."""
    config = f'interfaces = ["{veth.host}*"]\nexclude = []\nprobes = ["flows", "cuda"]\n'
    added, added_peer = veth.host + "n", veth.peer + "n"
    ours = {"flows_ingress", "flows_egress"}
    with Agent(tmp_path, config) as agent:
        assert wait_until(lambda: ours <= programs_on(veth.host), timeout=10), agent.log.read_text()
        kept = http.client.HTTPConnection("127.0.0.1", agent.port, timeout=5)  # accepted while descriptors last

        def healthz_kept() -> int:
            kept.request("GET", "/healthz")
            response = kept.getresponse()
            response.read()
            return response.status

        try:
            assert healthz_kept() == 200
            # Below every descriptor but the standard streams: a limit of what it holds (their count) left
            # a hole when a transient one (a /proc read) closed, and the new interface attached there.
            open_files_limit(agent.process.pid, 3)
            run(["ip", "link", "add", added, "type", "veth", "peer", "name", added_peer])
            run(["ip", "link", "set", added, "up"])
            assert wait_until(lambda: healthz_kept() == 503, timeout=30, interval=0.5), agent.log.read_text()[-2000:]
            assert programs_on(added) == set()
            open_files_limit(agent.process.pid, 4096)
            assert wait_until(lambda: programs_on(added) == ours, timeout=90, interval=0.5), agent.log.read_text()
            assert wait_until(lambda: healthz_within_1s(agent), timeout=30)
            metrics = agent.metrics()
            assert metric(metrics, "aiprobe_attach_errors_total", probe="flows", target=added, reason="resources") >= 1
            assert metric(metrics, "aiprobe_collector_errors_total", collector="flows") >= 1
            assert metric(metrics, "aiprobe_thread_restarts_total", thread="cuda_scan") >= 1  # rescans every 1 s
            assert metric(metrics, "aiprobe_probe_up", probe="flows") == 1
            assert_ingress_counts_the_wire(agent, veth)
        finally:
            kept.close()
            subprocess.run(["ip", "link", "del", added], capture_output=True)
        agent.stop()
    assert agent.process.returncode == 0
    assert programs_on(veth.host) == set()
    log = agent.log.read_text()
    assert "Traceback" not in log, log[-3000:]
    assert log.count(f"cannot attach to {added} (resources)") == 1, log[-3000:]


@pytest.mark.parametrize("nofile", [8, 16, 64])
def test_check_out_of_file_descriptors_reports_what_it_could_not_try(nofile: int) -> None:
    """`aiprobe check` with almost no descriptors: every probe load, the netns thread and the mounts
    fail for real; the report says so, one JSON document, never a traceback."""
    result = subprocess.run(["prlimit", f"--nofile={nofile}:{nofile}", AIPROBE, "check", "--json"],
                            capture_output=True, text=True, timeout=120)
    assert "Traceback" not in result.stdout + result.stderr, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert {"features", "probes"} <= report.keys()


def test_flows_attached_nowhere_is_down_with_its_reason_until_an_interface_comes(tmp_path: Path,
                                                                                 veth: VethPair) -> None:
    """The only interface flows may watch carries no Ethernet header (a tun device): aiprobe_probe_up
    says 0 and `top` says why, not 1 over an empty table; the interface it wants coming up heals it."""
    tun = unique("aipu")
    run(["ip", "tuntap", "add", "dev", tun, "mode", "tun"])
    try:
        run(["ip", "link", "set", tun, "up"])
        run(["ip", "link", "set", veth.host, "down"])
        config = f'interfaces = ["{tun}", "{veth.host}"]\nexclude = []\nprobes = ["flows"]\n'
        with Agent(tmp_path, config) as agent:
            up = 'aiprobe_probe_up{probe="flows"'
            assert wait_until(lambda: up in agent.metrics(), timeout=10)
            assert metric(agent.metrics(), "aiprobe_probe_up", probe="flows") == 0
            top = subprocess.run([AIPROBE, "top", "--batch", "--iterations", "1", "--connect", agent.url],
                                 capture_output=True, text=True, timeout=60)
            assert top.returncode == 0, top.stderr
            assert f"flows probe down: attached to no interface ({tun}: not an Ethernet interface" in top.stdout, \
                top.stdout[-2000:]
            run(["ip", "link", "set", veth.host, "up"])
            assert wait_until(lambda: metric(agent.metrics(), "aiprobe_probe_up", probe="flows") == 1, timeout=10)
            assert_ingress_counts_the_wire(agent, veth)
            agent.stop()
        assert agent.process.returncode == 0
        assert programs_on(veth.host) == set()
    finally:
        subprocess.run(["ip", "link", "del", tun], capture_output=True)
