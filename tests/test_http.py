"""The agent's HTTP server on a hostile network: TLS and basic auth from an exporter-toolkit web
config, scraped by a real Prometheus; idle connection floods beside wrk scrapes; IPv6 listen; the
snapshot API kept to loopback clients; `top` refusing what is not an aiprobe agent."""

from __future__ import annotations

import base64
import os
import re
import socket
import ssl
import subprocess
import time
from pathlib import Path

import bcrypt
import pytest
from helpers import VethPair, free_port, run
from servers import AIPROBE, Agent, Prometheus, http_get

pytestmark = pytest.mark.bpf
# No BPF probe: these tests are about the server, and nvml stands down at once without a GPU.
NO_PROBES = 'probes = ["nvml"]\n'
PASSWORD = "s3cret-for-tests"


def make_certificates(directory: Path) -> Path:
    """A throwaway CA and a server certificate for 127.0.0.1 and ::1 signed by it; returns the CA."""
    ca_key, ca, key, csr, cert = (directory / n for n in ("ca.key", "ca.crt", "tls.key", "tls.csr", "tls.crt"))
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run(["openssl", "req", "-x509", *ec, "-keyout", str(ca_key), "-out", str(ca), "-subj", "/CN=aiprobe test CA",
         "-days", "2"])
    run(["openssl", "req", *ec, "-keyout", str(key), "-out", str(csr), "-subj", "/CN=127.0.0.1"])
    extensions = directory / "san.ext"
    extensions.write_text("subjectAltName=IP:127.0.0.1,IP:::1\n")
    run(["openssl", "x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
         "-out", str(cert), "-days", "2", "-extfile", str(extensions)])
    return ca


def web_config(directory: Path, *, tls: bool = True, users: bool = True) -> Path:
    lines = []
    if tls:
        lines += ["tls_server_config:", "  cert_file: tls.crt", "  key_file: tls.key"]
    if users:
        hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()
        lines += ["basic_auth_users:", f"  prometheus: '{hashed}'"]
    path = directory / "web.yml"
    path.write_text("\n".join(lines) + "\n")
    return path


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def test_prometheus_scrapes_through_tls_and_basic_auth(tmp_path: Path) -> None:
    ca = make_certificates(tmp_path)
    web = web_config(tmp_path)
    with Agent(tmp_path, NO_PROBES, https=True, args=("--web.config.file", str(web))) as agent:
        verified = ssl.create_default_context(cafile=str(ca))
        assert http_get(agent.url + "/healthz", context=verified)[0] == 200  # kubelet probes carry no password
        assert http_get(agent.url + "/metrics", context=verified)[0] == 401
        assert http_get(agent.url + "/metrics", context=verified, headers=basic("prometheus", "wrong"))[0] == 401
        assert http_get(agent.url + "/metrics", context=verified, headers=basic("nobody", PASSWORD))[0] == 401
        status, body = http_get(agent.url + "/metrics", context=verified, headers=basic("prometheus", PASSWORD))
        assert status == 200 and b"aiprobe_build_info" in body
        assert http_get(agent.url.replace("https:", "http:") + "/metrics")[0] == 0  # no plain HTTP beside TLS

        scrape = {"scheme": "https", "tls_config": {"ca_file": str(ca)},
                  "basic_auth": {"username": "prometheus", "password": PASSWORD}}
        with Prometheus(tmp_path, [agent.target], scrape_options=scrape) as prom:
            assert prom.wait_for_series('up{job="aiprobe"} == 1'), (tmp_path / "prometheus.log").read_text()[-2000:]
            assert prom.wait_for_series("aiprobe_build_info")

        env = {**os.environ, "AIPROBE_PASSWORD": PASSWORD}
        top = subprocess.run([AIPROBE, "top", "--batch", "--iterations", "1", "--json", "--connect", agent.url,
                              "--cacert", str(ca), "--user", "prometheus"], capture_output=True, text=True,
                             env=env, timeout=60)
        assert top.returncode == 0, top.stderr
        assert '"probes"' in top.stdout
        refused = subprocess.run([AIPROBE, "top", "--batch", "--iterations", "1", "--connect", agent.url,
                                  "--cacert", str(ca)], capture_output=True, text=True, timeout=60)
        assert refused.returncode == 1 and "401" in refused.stderr and "Traceback" not in refused.stderr
    assert agent.process.returncode == 0


def threads_of(pid: int) -> int:
    return int(re.search(r"Threads:\s+(\d+)", Path(f"/proc/{pid}/status").read_text()).group(1))


def test_idle_connection_flood_and_wrk_scrapes(tmp_path: Path) -> None:
    with Agent(tmp_path, NO_PROBES) as agent:
        baseline_threads = threads_of(agent.process.pid)
        idle = [socket.create_connection(("127.0.0.1", agent.port)) for _ in range(1000)]
        try:
            wrk = subprocess.Popen(["wrk", "-t2", "-c20", "-d4s", agent.url + "/metrics"], stdout=subprocess.PIPE,
                                   text=True)
            answered, most_threads = [], 0
            while wrk.poll() is None:
                started = time.monotonic()
                answered.append(http_get(agent.url + "/healthz", timeout=1.0)[0] == 200)
                most_threads = max(most_threads, threads_of(agent.process.pid))
                time.sleep(max(0.0, 0.25 - (time.monotonic() - started)))
            report = wrk.communicate()[0]
        finally:
            for conn in idle:
                conn.close()
        assert answered and all(answered), f"/healthz missed {answered.count(False)} of {len(answered)} under load"
        assert most_threads <= baseline_threads + 8, f"{baseline_threads} threads grew to {most_threads}"
        requests = int(re.search(r"(\d+) requests in", report).group(1))
        assert requests > 100, report
        assert "Non-2xx" not in report, report
    assert "Traceback" not in agent.log.read_text()
    assert agent.process.returncode == 0


def test_client_disconnects_are_no_news(tmp_path: Path) -> None:
    with Agent(tmp_path, NO_PROBES) as agent:
        port = agent.port
        for _ in range(50):
            with socket.create_connection(("127.0.0.1", port)) as conn:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")  # RST on close
                conn.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            with socket.create_connection(("127.0.0.1", port)) as conn:
                conn.sendall(b"\x16\x03\x01garbage that is no HTTP\r\n\r\n")
        assert http_get(agent.url + "/healthz")[0] == 200
    log = agent.log.read_text()
    assert "Traceback" not in log and "Connection reset" not in log, log[-2000:]


def test_ipv6_listen_serves_both_families_and_keeps_the_snapshot_local(tmp_path: Path, veth: VethPair) -> None:
    with Agent(tmp_path, NO_PROBES, listen_host="[::]") as agent:
        port = agent.port
        for host in ("127.0.0.1", "[::1]"):
            assert http_get(f"http://{host}:{port}/api/v1/snapshot")[0] == 200
        # From another network namespace, as from another machine: /metrics yes, the snapshot no.
        for address in (veth.host_ip4, f"[{veth.host_ip6}]"):
            fetch = ("import urllib.request, urllib.error, sys\n"
                     "def get(p):\n"
                     "    try: return urllib.request.urlopen(sys.argv[1] + p, timeout=5).status\n"
                     "    except urllib.error.HTTPError as e: return e.code\n"
                     "print(get('/metrics'), get('/api/v1/snapshot'))")
            out = veth.ns_run(["python3", "-c", fetch, f"http://{address}:{port}"]).stdout.split()
            assert out == ["200", "403"], (address, out)
    assert agent.process.returncode == 0


def test_snapshot_api_served_to_the_network_when_asked(tmp_path: Path, veth: VethPair) -> None:
    config = NO_PROBES + 'snapshot_api = "network"\n'
    with Agent(tmp_path, config, listen_host="0.0.0.0") as agent:
        port = agent.port
        fetch = "import urllib.request, sys; print(urllib.request.urlopen(sys.argv[1], timeout=5).status)"
        out = veth.ns_run(["python3", "-c", fetch, f"http://{veth.host_ip4}:{port}/api/v1/snapshot"]).stdout
        assert out.strip() == "200"


SQUATTER = """
import http.server, json, os, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"host": {"hostname": "\\x1b]0;owned\\x07"}, "probes": {}}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H)
os.setuid(65534)  # an unprivileged user got the port first
print("ready", flush=True)
server.serve_forever()
"""


def test_top_refuses_a_squatter(tmp_path: Path) -> None:
    port = free_port()
    squatter = subprocess.Popen(["python3", "-c", SQUATTER, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert squatter.stdout.readline().strip() == "ready"
        top = subprocess.run([AIPROBE, "top", "--batch", "--iterations", "1", "--connect", f"127.0.0.1:{port}"],
                             capture_output=True, text=True, timeout=60)
        assert top.returncode == 1
        assert f"served by pid {squatter.pid}" in top.stderr and "not an aiprobe agent" in top.stderr, top.stderr
        assert "\x1b" not in top.stdout + top.stderr
    finally:
        squatter.kill()
        squatter.wait()


def test_slow_clients_hold_no_worker_and_pipelined_requests_are_answered(tmp_path: Path) -> None:
    with Agent(tmp_path, NO_PROBES) as agent:
        slow = [socket.create_connection(("127.0.0.1", agent.port)) for _ in range(64)]
        try:
            for conn in slow:  # request heads that never end (slowloris)
                conn.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            for _ in range(3):
                for conn in slow:
                    conn.sendall(b"X-Slow: 1\r\n")
                assert http_get(agent.url + "/healthz", timeout=1.0)[0] == 200
                time.sleep(0.3)
            with socket.create_connection(("127.0.0.1", agent.port)) as conn:
                conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\nGET /healthz HTTP/1.1\r\nHost: x\r\n"
                             b"Connection: close\r\n\r\n")
                answers = b""
                while chunk := conn.recv(65536):
                    answers += chunk
            assert answers.count(b"HTTP/1.1 200") == 2, answers
        finally:
            for conn in slow:
                conn.close()
    assert agent.process.returncode == 0


def test_a_server_never_started_closes_at_once() -> None:
    from aiprobe.exporters.http import AgentHTTPServer

    server = AgentHTTPServer(("127.0.0.1", 0), bytes, dict, lambda: True)
    started = time.monotonic()
    server.close()  # the old server's shutdown() waited for a serve_forever() that never ran
    assert time.monotonic() - started < 5
