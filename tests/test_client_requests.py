"""The client side of requests against the real kernel: HTTP/1.x requests the host sends on connections
it opened, counted per (process, server address and port, method, status). The truth is the server's own
account of each response (the FastAPI app of tests/test_requests.py) and the server side's view of the
same requests: nginx (the Debian package) proxying to the app with keepalive to its upstream, and httpx
calling the app directly."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import test_requests
from aiprobe.probes.sendlat.records import ClientRequests, HttpRequests
from aiprobe.probes.sendlat.requests import RequestsProbe
from exported_histograms import rendered
from helpers import CLOCK_TOLERANCE, PATIENCE, free_port, wait_until
from prometheus_client.parser import text_string_to_metric_families
from test_requests import ANSWERS, DELAY_MS, DELAYED, app, ask

# The client side runs in the programs whose server side tests/test_requests.py checks on every kernel.
pytestmark = [pytest.mark.bpf, pytest.mark.slow_truth]

probe = test_requests.probe  # its fixture: the host probe with the requests part

NGINX = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin")
NGINX_CONF = """daemon off; master_process off; worker_processes 1; pid {dir}/nginx.pid; error_log {dir}/error.log;
events {{ worker_connections 64; }}
http {{
    access_log off;
    client_body_temp_path {dir}/body; proxy_temp_path {dir}/proxy; fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi; scgi_temp_path {dir}/scgi;
    upstream app {{ server 127.0.0.1:{upstream}; keepalive 4; }}
    server {{
        listen 127.0.0.1:{port};
        location / {{ proxy_pass http://app; proxy_http_version 1.1; proxy_set_header Connection ""; }}
    }}
}}
"""


def views(probe: RequestsProbe, server: subprocess.Popen, client_pid: int,
          total: int) -> tuple[list[HttpRequests], list[ClientRequests]]:
    """The server's side (the app's records) and the client's (`client_pid`'s requests to the app), once both
    count `total`. Each entry as its latest read has it: an exited process's entries are read once more, then
    deleted, and the two sides may complete in different reads."""
    served: dict[tuple, HttpRequests] = {}
    sent: dict[tuple, ClientRequests] = {}

    def counted() -> bool:
        snapshot = probe.read()
        served.update((r.identity(), r) for r in snapshot.http if r.pid == server.pid and r.port == server.port)
        sent.update((r.identity(), r) for r in snapshot.clients
                    if r.pid == client_pid and r.server_port == server.port)
        return min(sum(r.count for r in served.values()), sum(r.count for r in sent.values())) >= total

    wait_until(counted, timeout=PATIENCE, interval=0.2)
    return list(served.values()), list(sent.values())


def by_request(records: list[ClientRequests] | list[HttpRequests]) -> Counter[tuple[str, int]]:
    counts: Counter[tuple[str, int]] = Counter()
    for record in records:
        counts[(record.method, record.status_code)] += record.count
    return counts


def accounted(process: subprocess.Popen, total: int) -> Counter[tuple[str, int]]:
    """The app's own account of the responses it sent."""
    accounts = [json.loads(process.stdout.readline()) for _ in range(total)]
    return Counter((a["method"], a["status"]) for a in accounts)


def delayed_seconds(records: list[ClientRequests] | list[HttpRequests]) -> float:
    return sum(r.duration_sum_seconds for r in records if r.method == "PUT")


@contextlib.contextmanager
def nginx(tmp_path: Path, upstream: int) -> Iterator[subprocess.Popen]:
    """nginx in the foreground, one process (its own upstream client), proxying to 127.0.0.1:`upstream`."""
    port = free_port()
    conf = tmp_path / "nginx.conf"
    conf.write_text(NGINX_CONF.format(dir=tmp_path, upstream=upstream, port=port))
    process = subprocess.Popen([str(NGINX), "-p", str(tmp_path), "-c", str(conf)])
    try:
        assert wait_until(lambda: (tmp_path / "nginx.pid").exists() or process.poll() is not None,
                          timeout=PATIENCE, interval=0.1) and process.poll() is None, (tmp_path / "error.log")
        process.port = port  # type: ignore[attr-defined]
        yield process
    finally:
        process.send_signal(signal.SIGQUIT)  # graceful: closes its upstream connections
        process.wait(timeout=30)


def test_httpx_client_matches_the_server(probe: RequestsProbe) -> None:
    """This process's requests to the app, client side, against the app's account and the server side."""
    total = sum(ANSWERS.values()) + DELAYED
    with app("uvicorn") as process:
        statuses = ask(f"http://127.0.0.1:{process.port}").statuses
        truth = accounted(process, total)
    server, client = views(probe, process, os.getpid(), total)
    assert Counter(statuses) == Counter(status for _, status in truth.elements())
    assert by_request(client) == truth == by_request(server)
    assert {r.server_address for r in client} == {"127.0.0.1"}
    # The client's span holds the server's: its send before the server's read, its last read after the last write.
    assert delayed_seconds(client) >= delayed_seconds(server) >= DELAYED * DELAY_MS / 1e3 * (1 - CLOCK_TOLERANCE)
    assert all(r.ttfb_sum_seconds <= r.duration_sum_seconds for r in client)


@pytest.mark.skipif(NGINX is None, reason="nginx is not installed (Makefile APT_PACKAGES: nginx-light)")
def test_nginx_upstream_view_matches_the_app(probe: RequestsProbe, tmp_path: Path) -> None:
    """nginx's client-side view of its upstream requests against the app's server-side view: counts exact,
    the delayed requests' durations between the server's and the end client's (nginx's span holds the
    server's and lies within its client's)."""
    total = sum(ANSWERS.values()) + DELAYED
    with app("uvicorn") as process:
        with nginx(tmp_path, process.port) as proxy:
            statuses, _, client_seconds = ask(f"http://127.0.0.1:{proxy.port}")
        truth = accounted(process, total)
    server, upstream = views(probe, process, proxy.pid, total)
    assert Counter(statuses) == Counter(status for _, status in truth.elements())
    assert by_request(upstream) == truth == by_request(server)
    assert {r.comm for r in upstream} == {"nginx"}
    assert delayed_seconds(server) <= delayed_seconds(upstream) <= client_seconds * (1 + CLOCK_TOLERANCE)
    exported = Counter()
    for family in text_string_to_metric_families(rendered(upstream)):
        for sample in family.samples:
            if sample.name == "http_client_request_duration_seconds_count":
                assert (sample.labels["server_address"], sample.labels["server_port"]) == \
                    ("127.0.0.1", str(process.port))
                exported[(sample.labels["http_request_method"], int(sample.labels["http_response_status_code"]))] \
                    += int(sample.value)
    assert exported == truth
