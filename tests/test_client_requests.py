"""The client side of requests against the real kernel: HTTP/1.x requests the host sends on connections
it opened, counted per (process, server address and port, method, status). The truth is the server's own
account of each response (the FastAPI app of tests/test_requests.py, or a raw server of this module) and
the server side's view of the same requests: nginx (the Debian package) proxying to the app with keepalive
to its upstream, httpx and keep-alive connections calling the app directly, and raw sockets.

A request is counted when its response ends, while its connection stays open: at the read ending its
body (Content-Length, the last chunk), or, where the head does not tell, by the agent once the response
has had no read for IDLE_FLUSH_NS (or at the next request or the close, whichever comes first)."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import test_requests
from aiprobe.probes.sendlat.records import ClientRequests, HttpRequests
from aiprobe.probes.sendlat.requests import IDLE_FLUSH_NS, RequestsProbe
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
    upstream app {{ server 127.0.0.1:{upstream}; keepalive {keepalive}; }}
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
def nginx(tmp_path: Path, upstream: int, keepalive: int = 4) -> Iterator[subprocess.Popen]:
    """nginx in the foreground, one process (its own upstream client), proxying to 127.0.0.1:`upstream`."""
    port = free_port()
    conf = tmp_path / "nginx.conf"
    conf.write_text(NGINX_CONF.format(dir=tmp_path, upstream=upstream, port=port, keepalive=keepalive))
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


def counts_reached(probe: RequestsProbe, server: subprocess.Popen, client_pid: int,
                   truth: Counter[tuple[str, int]]) -> tuple[Counter, Counter]:
    """Both sides' counts by (method, status), polled until each equals `truth` (or PATIENCE passed)."""
    sides: list[Counter] = [Counter(), Counter()]

    def exact() -> bool:
        snapshot = probe.read()
        sides[0] = by_request([r for r in snapshot.http if r.pid == server.pid and r.port == server.port])
        sides[1] = by_request([r for r in snapshot.clients if r.pid == client_pid and r.server_port == server.port])
        return sides[0] == truth == sides[1]

    wait_until(exact, timeout=PATIENCE, interval=0.1)
    return sides[0], sides[1]


@pytest.mark.skipif(NGINX is None, reason="nginx is not installed (Makefile APT_PACKAGES: nginx-light)")
def test_nginx_counts_while_its_upstream_connections_stay_open(probe: RequestsProbe, tmp_path: Path) -> None:
    """nginx with keepalive to the app, 20 200s, 6 429s and 4 503s: both sides count each request when its
    response ends, so all 30 while nginx's upstream connections sit idle in its pool (before, the last one's
    request waited there for the connection's next use)."""
    asked = {200: 20, 429: 6, 503: 4}
    with app("uvicorn") as process, nginx(tmp_path, process.port) as proxy:
        with httpx.Client(base_url=f"http://127.0.0.1:{proxy.port}", timeout=PATIENCE) as client:
            statuses = [client.get(f"/answer/{status}").status_code
                        for status, count in asked.items() for _ in range(count)]
        answered = time.monotonic()
        truth = accounted(process, len(statuses))
        served, sent = counts_reached(probe, process, proxy.pid, truth)
        print(f"both sides exact {time.monotonic() - answered:.2f} s after the last response")
        assert proxy.poll() is None and process.poll() is None  # their connections still open
    assert Counter(statuses) == Counter(asked) == Counter(status for _, status in truth.elements())
    assert served == truth == sent


def test_keepalive_pool_counts_at_each_response(probe: RequestsProbe) -> None:
    """8 keep-alive connections taking a request in turn (a pool on a quiet endpoint): after each response,
    the client side's count is the app's own count, not that less the requests each idle connection's last
    one (before: up to 8)."""
    pool = 8
    with app("uvicorn") as process:
        connections = [http.client.HTTPConnection("127.0.0.1", process.port, timeout=PATIENCE) for _ in range(pool)]
        try:
            truth: Counter[tuple[str, int]] = Counter()
            for i in range(2 * pool):
                connections[i % pool].request("GET", f"/answer/{429 if i % 3 else 200}")
                connections[i % pool].getresponse().read()
                truth += accounted(process, 1)
                served, sent = counts_reached(probe, process, os.getpid(), truth)
                assert served == truth == sent, i
        finally:
            for connection in connections:
                connection.close()


class RawServer:
    """An HTTP/1.1 server on raw sockets, its connections kept open, answering GET /framed with a
    Content-Length, /unframed with a body whose end its head does not tell (no length, not chunked: a
    client reads it until it has what it expects), /events with an event stream of EVENTS chunks EVENT_GAP
    apart; its own log is the truth: each response's path, when it read the request, when it wrote last."""

    EVENTS, EVENT_GAP = 3, 1.5 * IDLE_FLUSH_NS / 1e9  # gaps longer than the idle flush's

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.log: list[tuple[str, float, float]] = []
        self.accepting = threading.Thread(target=self._accept, daemon=True)
        self.accepting.start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                threading.Thread(target=self._serve, args=(self.listener.accept()[0],), daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        with connection, contextlib.suppress(OSError):
            pending = b""
            while data := connection.recv(4096):
                pending += data
                while b"\r\n\r\n" in pending:
                    head, _, pending = pending.partition(b"\r\n\r\n")
                    path, received = head.split()[1].decode(), time.monotonic()
                    self._answer(connection, path)
                    self.log.append((path, received, time.monotonic()))

    def _answer(self, connection: socket.socket, path: str) -> None:
        if path == "/framed":
            connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")
        elif path == "/unframed":
            connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nhello")
        else:
            connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                               b"Transfer-Encoding: chunked\r\n\r\n")
            for i in range(self.EVENTS):
                time.sleep(self.EVENT_GAP)
                event = f"data: {i}\n\n".encode()
                connection.sendall(b"%x\r\n%s\r\n" % (len(event), event))
            connection.sendall(b"0\r\n\r\n")

    def close(self) -> None:
        self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (a close alone does not)
        self.listener.close()
        self.accepting.join()


def get(connection: socket.socket, path: str, until: bytes = b"hello") -> None:
    """GET `path`, read until the response's bytes end with `until`."""
    connection.sendall(f"GET {path} HTTP/1.1\r\nHost: test\r\n\r\n".encode())
    received = b""
    while not received.endswith(until):
        received += connection.recv(4096)


def client_count(probe: RequestsProbe, server: RawServer) -> int:
    return sum(r.count for r in probe.read().clients if r.pid == os.getpid() and r.server_port == server.port)


def counted(probe: RequestsProbe, server: RawServer, total: int) -> None:
    """Polled until the client side counts `total` requests to `server`; then it must not count more."""
    assert wait_until(lambda: client_count(probe, server) >= total and len(server.log) >= total, timeout=PATIENCE,
                      interval=0.1)
    assert client_count(probe, server) == total == len(server.log)


def test_requests_whose_end_is_unseen_count_once(probe: RequestsProbe) -> None:
    """Responses whose end the head does not tell, counted by the agent's idle flush or by the kernel at the
    connection's next request or close, whichever comes first, and never by both: each way in turn on one
    connection, then the counts stay exact past another idle flush."""
    server = RawServer()
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as connection:
            get(connection, "/unframed")
            counted(probe, server, 1)  # the idle flush: the connection is idle, open
            get(connection, "/unframed")  # the next request must not count the first again
            get(connection, "/framed")  # ends the second (the kernel, before the idle flush); counted at its read
            counted(probe, server, 3)
            get(connection, "/unframed")
        counted(probe, server, 4)  # the close, and the idle flush after it must not count it again
        with socket.create_connection(("127.0.0.1", server.port)) as connection:
            get(connection, "/unframed")
            counted(probe, server, 5)  # the idle flush, then the close must not count it again
        time.sleep(2 * IDLE_FLUSH_NS / 1e9)  # another idle flush's chance to count one twice
        counted(probe, server, 5)
    finally:
        server.close()


def test_event_stream_counts_once_at_its_end(probe: RequestsProbe) -> None:
    """An event stream (chunked, gaps longer than the idle flush) is counted at its last chunk's read, not
    before: none while it is open and idle; once after, its duration the stream's (between the server's span,
    its request's read to its last write, and the client's own clock)."""
    server = RawServer()
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as connection:
            sent = time.monotonic()
            connection.sendall(b"GET /events HTTP/1.1\r\nHost: test\r\n\r\n")
            received = b""
            while b"data: 1" not in received:
                received += connection.recv(4096)
            time.sleep(1.2 * IDLE_FLUSH_NS / 1e9)  # no read for longer than the idle flush waits, the stream open
            assert client_count(probe, server) == 0
            while not received.endswith(b"0\r\n\r\n"):
                received += connection.recv(4096)
            client_seconds = time.monotonic() - sent
            counted(probe, server, 1)
            [record] = [r for r in probe.read().clients if r.pid == os.getpid() and r.server_port == server.port]
    finally:
        server.close()
    _, received_at, written_at = server.log[0]
    stream_seconds = written_at - received_at
    assert stream_seconds >= RawServer.EVENTS * RawServer.EVENT_GAP
    duration = record.duration_sum_seconds
    assert stream_seconds * (1 - CLOCK_TOLERANCE) <= duration <= client_seconds * (1 + CLOCK_TOLERANCE)
