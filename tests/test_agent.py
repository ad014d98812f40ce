"""`aiprobe agent` end to end: a real agent process with real probes, scraped by a real Prometheus,
pushing to a real Alertmanager, on traffic the test makes over a veth pair and loopback."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from datetime import datetime
from pathlib import Path

import pytest
from aiprobe import __version__
from aiprobe.budget import MAX_PACED_SECONDS
from aiprobe.refresh import SIGNAL_WINDOW_SECONDS
from exported_histograms import assert_exposition_consistent
from helpers import VethPair, programs_on, wait_until
from servers import Agent, Alertmanager, Prometheus, http_get

pytestmark = pytest.mark.bpf
ROOT = Path(__file__).resolve().parent.parent

TCP_SINK = """
import socket, sys
server = socket.create_server(("", int(sys.argv[1])), family=socket.AF_INET6, dualstack_ipv6=True)
print("ready", flush=True)
while True:
    conn, _ = server.accept()
    while conn.recv(1 << 16):
        pass
    conn.close()
"""


def tcp_sink(veth: VethPair, port: int) -> subprocess.Popen:
    sink = subprocess.Popen(veth.ns_cmd(["python3", "-c", TCP_SINK, str(port)]), stdout=subprocess.PIPE, text=True)
    assert sink.stdout.readline().strip() == "ready"
    return sink


def send_tcp(address: str, port: int, nbytes: int) -> None:
    with socket.create_connection((address, port), timeout=10) as conn:
        conn.sendall(b"x" * nbytes)


def agent_config(veth: VethPair, extra: str = "") -> str:
    return f'interfaces = ["{veth.host}"]\nexclude = []\nprobes = ["flows", "sendlat"]\n' + extra


def test_prometheus_scrapes_the_agent(tmp_path: Path, veth: VethPair) -> None:
    sink = tcp_sink(veth, 9000)
    try:
        with Agent(tmp_path, agent_config(veth)) as agent, \
                Prometheus(tmp_path, [agent.target], [ROOT / "deploy/prometheus/aiprobe-rules.yml"]) as prom:
            deadline = time.monotonic() + 30
            series: dict[str, list] = {}
            wanted = [
                f'aiprobe_flow_bytes_total{{interface="{veth.host}",remote_port="9000"}}',
                f'aiprobe_flow_packets_total{{interface="{veth.host}"}}',
                f'aiprobe_interface_bytes_total{{interface="{veth.host}",direction="egress"}}',
                'aiprobe_tcp_sendmsg_duration_seconds_bucket{le="+Inf"}',
                "aiprobe_tcp_send_bytes_total", "aiprobe_build_info", 'aiprobe_probe_up{probe="flows"}',
                'aiprobe_bpf_map_entries', 'aiprobe_bpf_map_capacity', 'aiprobe_collector_duration_seconds',
                "aiprobe_tcp_sent_segments_total",
            ]
            while time.monotonic() < deadline and len(series) < len(wanted):
                send_tcp(veth.peer_ip4, 9000, 200_000)
                for promql in wanted:
                    if promql not in series and (result := prom.query(promql)):
                        series[promql] = result
                time.sleep(1)
            assert set(wanted) - set(series) == set(), f"no series in Prometheus for {set(wanted) - set(series)}"
            up = prom.query('up{job="aiprobe"}')
            assert up and up[0]["value"][1] == "1"
            (build,) = series["aiprobe_build_info"]
            assert (build["metric"]["kernel"], build["metric"]["version"]) == (os.uname().release, __version__)
            check = subprocess.run(["promtool", "check", "metrics"], input=agent.metrics(), capture_output=True,
                                   text=True)
            assert check.returncode == 0, check.stdout + check.stderr
            assert_exposition_consistent(agent.metrics(), observed=["aiprobe_tcp_sendmsg_duration_seconds"])
    finally:
        sink.kill()


def test_shipped_rules_pass_promtool() -> None:
    """Every unit test file of tests/promtool/: the engine's rules, the agent's, the fleet's (replica skew)."""
    tests = sorted(path.name for path in (ROOT / "tests/promtool").glob("*.test.yml"))
    assert "replica-skew.test.yml" in tests
    result = subprocess.run(["promtool", "test", "rules", *tests], cwd=ROOT / "tests/promtool",
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_ten_thousand_flows_stay_within_top_k_series(tmp_path: Path, veth: VethPair) -> None:
    top_k = 50
    with Agent(tmp_path, agent_config(veth, f"top_flows = {top_k}\n")) as agent:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            for port in range(20000, 30000):
                sock.sendto(b"x", (veth.peer_ip4, port))

        def flow_series() -> list[str]:
            return [line for line in agent.metrics().splitlines() if line.startswith("aiprobe_flow_bytes_total{")]

        assert wait_until(lambda: len(agent.snapshot()["flows"]) > top_k, timeout=15)
        series = flow_series()
        # top K flows, plus one "other" series per interface and direction
        assert len(series) <= top_k + 2, len(series)
        other = sum(float(line.rsplit(" ", 1)[1]) for line in series if 'remote_address="other"' in line)
        assert other > 0
        # What a scrape costs at this size is the benchmarks' to print: timings fail on a loaded host.
        assert all(http_get(agent.url + "/metrics")[0] == 200 for _ in range(3))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_stops_within_5s_with_status_0_and_detaches(tmp_path: Path, veth: VethPair, sig: int) -> None:
    with Agent(tmp_path, agent_config(veth)) as agent:
        assert programs_on(veth.host) == {"flows_ingress", "flows_egress"}
        started = time.monotonic()
        agent.process.send_signal(sig)
        assert agent.process.wait(timeout=5) == 0
        assert time.monotonic() - started < 5
    assert programs_on(veth.host) == set()


BLOCKED_SENDER = """
import socket, sys, threading, time
stall = float(sys.argv[1])
server = socket.create_server(("127.0.0.1", 0))
server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)

def reader():
    conn, _ = server.accept()
    time.sleep(stall)
    while conn.recv(1 << 16):
        pass

threading.Thread(target=reader, daemon=True).start()
with socket.create_connection(server.getsockname()) as conn:
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    conn.sendall(b"x" * (4 << 20))
print("sent", flush=True)
time.sleep(60)  # stay alive so the agent keeps attributing the stall to this pid
"""


def blocked_sender(stall: float) -> subprocess.Popen:
    """A process whose one TCP send blocks `stall` seconds because its peer stops reading.
    Its own pid, so the test's HTTP polling never dilutes its latency histogram."""
    sender = subprocess.Popen(["python3", "-c", BLOCKED_SENDER, str(stall)], stdout=subprocess.PIPE, text=True)
    assert sender.stdout.readline().strip() == "sent"
    return sender


def _stall_alerts(am: Alertmanager, pid: int) -> list[dict]:
    return [a for a in am.alerts() if a["labels"].get("rule") == "network_send_stall"
            and json.loads(a["annotations"]["evidence"]).get("pid") == pid]


STALL_RULES = """
[rules.network_send_stall]
threshold = 0.2
clear = 0.1
for_seconds = 0
"""


def test_bottleneck_reaches_alertmanager_with_evidence_and_resolves(tmp_path: Path, veth: VethPair) -> None:
    with Alertmanager(tmp_path) as am:
        config = agent_config(veth, f'alertmanager_url = "{am.url}"\n' + STALL_RULES)
        with Agent(tmp_path, config) as agent:
            sender = blocked_sender(stall=0.6)
            try:
                assert wait_until(lambda: _stall_alerts(am, sender.pid), timeout=20, interval=0.5)
                alert = _stall_alerts(am, sender.pid)[0]
                assert alert["labels"]["alertname"] == "AiprobeNetworkSendStall"
                assert alert["labels"]["severity"] == "warning"
                assert alert["labels"]["target"].startswith("python3@")
                evidence = json.loads(alert["annotations"]["evidence"])
                assert evidence["send_p99_seconds"] > 0.2
                assert "sends block or sockets stay unwritable" in alert["annotations"]["summary"]
                # The 10 s window passes without slow sends: the alert resolves.
                assert wait_until(lambda: not _stall_alerts(am, sender.pid), timeout=30, interval=0.5)
            finally:
                sender.kill()
            states = [json.loads(line)["state"] for line in agent.alert_log.read_text().splitlines()
                      if json.loads(line)["evidence"].get("pid") == sender.pid]
            assert states == ["pending", "firing", "resolved"], states


def test_paced_refreshes_keep_the_rules_window(tmp_path: Path, veth: VethPair) -> None:
    """Refreshes paced to their longest (a refresh_budget no refresh fits: MAX_PACED_SECONDS apart):
    a send stall still turns the rule pending at the first refresh after it, and the rule resolves once
    the rules' window has passed the stall, never sooner and at most one paced wait later. Times are
    the agent's own (its alert log's), against the sender's return."""
    config = agent_config(veth, "refresh_budget = 0.000001\n" + STALL_RULES)
    with Agent(tmp_path, config) as agent:
        assert wait_until(lambda: agent.snapshot()["host"]["interval_seconds"] == MAX_PACED_SECONDS, timeout=30)
        sender = blocked_sender(stall=0.6)
        sent = time.time()
        try:
            assert wait_until(lambda: "resolved" in _stall_states(agent, sender.pid), timeout=60, interval=0.5)
        finally:
            sender.kill()
        at = {state: datetime.fromisoformat(time_text).timestamp()
              for state, time_text in _stall_states(agent, sender.pid).items()}
    assert list(at) == ["pending", "firing", "resolved"], at
    slack = 5.0  # a refresh's own duration and the loop's wake-up on a busy machine
    assert at["pending"] - sent <= MAX_PACED_SECONDS + slack, at
    assert SIGNAL_WINDOW_SECONDS <= at["resolved"] - at["pending"] <= SIGNAL_WINDOW_SECONDS + MAX_PACED_SECONDS + slack


def _stall_states(agent: Agent, pid: int) -> dict[str, str]:
    """The network_send_stall transitions of `pid` in the alert log: state -> its time, in order."""
    events = [json.loads(line) for line in agent.alert_log.read_text().splitlines()] if agent.alert_log.exists() \
        else []
    return {e["state"]: e["time"] for e in events
            if e["rule"] == "network_send_stall" and e["evidence"].get("pid") == pid}


def test_transition_made_while_alertmanager_is_down_still_arrives(tmp_path: Path, veth: VethPair) -> None:
    am = Alertmanager(tmp_path)
    port = am.port
    config = agent_config(veth, f'alertmanager_url = "{am.url}"\n' + STALL_RULES)
    with Agent(tmp_path, config):
        am.stop()
        sender = blocked_sender(stall=0.6)
        try:
            time.sleep(3)  # the alert fires while Alertmanager is down
            with Alertmanager(tmp_path, port=port) as restarted:
                assert wait_until(lambda: _stall_alerts(restarted, sender.pid), timeout=20, interval=0.5)
        finally:
            sender.kill()
