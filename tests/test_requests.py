"""Requests and errors from the wire against the real kernel: a FastAPI app (tests/fixtures/requests_app.py)
answers known numbers of 200, 429 and 503, some after a known delay, to httpx, served by uvicorn (HTTP/1.1)
and by hypercorn (HTTP/2 cleartext), observed by sendlat's programs with the streams and requests logic
on. The truth is the app's own account of each response it sent (status, method), the delays it was
asked for, the client's own clock and the bodies the client received.

HTTP/2: hypercorn's encoder (hpack) writes a `:status` it has no static entry for (429, 503) as a literal
with incremental indexing the first time on a connection and as a dynamic-table index after that: read
through the connection's record of the encoder's insertions (docs/requests.md). gRPC: grpcio's trailers
carry grpc-status likewise, a literal the first time a code is sent on a connection, an index after."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import grpc
import httpx
import pytest
from aiprobe.histogram import exported_buckets, hist_slots, kernel_buckets
from aiprobe.probes.sendlat.probe import SendLatencyProbe
from aiprobe.probes.sendlat.records import ClientRequests, HttpRequests, RequestEndpoint, RequestsSnapshot, RpcRequests
from aiprobe.probes.sendlat.requests import RequestsProbe
from exported_histograms import assert_histograms_consistent, rendered
from helpers import CLOCK_TOLERANCE, PATIENCE, free_port, wait_until
from prometheus_client.parser import text_string_to_metric_families
from servers import Agent

pytestmark = pytest.mark.bpf

FIXTURE = Path(__file__).parent / "fixtures" / "requests_app.py"
GRPC_FIXTURE = Path(__file__).parent / "fixtures" / "grpc_server.py"
ANSWERS = {200: 9, 429: 5, 503: 4}  # quick answers per status
DELAYED, DELAY_MS = 3, 300.0  # 503s after a delay, asked with PUT (their own method's entry)


def sample_reading() -> RequestsSnapshot:
    """A reading with every field filled, for tests/test_metrics_doc.py."""
    timed = exported_buckets(kernel_buckets([1] * hist_slots()))
    http = HttpRequests(1, "x", 0, 8000, "http", "GET", 200, 3, 0.3, timed, 0.1, 0.1, 0, 300, 900)
    rpc = RpcRequests(1, "x", 0, 50051, "grpc", "POST", 200, 1, 0.1, timed, 0.1, 0.1, 0, 20, 30)
    endpoint = RequestEndpoint(1, "x", 0, 8000, "http", 3, 0, 0, 0, 0, 0.1, 0.1, {"200": 3})
    client = ClientRequests(1, "x", 0, "10.0.0.2", 8000, "POST", 200, 3, 0.3, timed, 0.1, timed, 0.1, 0.1, 0.05)
    return RequestsSnapshot("tracepoint", "", [http], [rpc], [endpoint], clients=[client])


@pytest.fixture(scope="module")
def probe() -> Iterator[RequestsProbe]:
    with SendLatencyProbe(per_flow=False, stall_threshold_ms=250.0) as host:
        requests = host.parts()["requests"]
        assert isinstance(requests, RequestsProbe), requests.status().reason
        yield requests


@contextlib.contextmanager
def app(server: str) -> Iterator[subprocess.Popen]:
    """The app on a free port, once it accepts connections: as long as an agent may take to start (its
    imports, FastAPI's among them, took over 120 s in a guest twice as slow beside two others)."""
    port = free_port()
    process = subprocess.Popen([sys.executable, str(FIXTURE), str(port), "--server", server],
                               stdout=subprocess.PIPE, text=True)

    def listening() -> bool:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
        return process.poll() is not None

    try:
        assert wait_until(listening, timeout=2 * PATIENCE, interval=0.1) and process.poll() is None
        process.port = port  # type: ignore[attr-defined]
        yield process
    finally:
        process.terminate()
        process.wait(timeout=30)


class Asked(NamedTuple):
    statuses: list[int]  # the statuses the client received
    bodies: list[int]  # the body sizes the client got
    delayed_seconds: float  # the delayed requests by the client's clock, each from its send to its response


class Driven(NamedTuple):
    accounts: list[dict]  # the app's account of each response
    bodies: list[int]
    delayed_seconds: float


def ask(base_url: str, http2: bool = False) -> Asked:
    """The requests (delayed 503s asked with PUT), on one connection closed after them."""
    statuses, bodies = [], []
    delayed_seconds = 0.0
    with httpx.Client(http1=not http2, http2=http2, base_url=base_url, timeout=PATIENCE) as client:
        for status, count in ANSWERS.items():
            for _ in range(count):
                response = client.get(f"/answer/{status}")
                statuses.append(response.status_code)
                bodies.append(len(response.content))
        for _ in range(DELAYED):
            started = time.monotonic()
            response = client.put("/answer/503", params={"delay_ms": DELAY_MS})
            delayed_seconds += time.monotonic() - started
            statuses.append(response.status_code)
            bodies.append(len(response.content))
    return Asked(statuses, bodies, delayed_seconds)


def drive(process: subprocess.Popen, http2: bool) -> Driven:
    """The requests to the app, with its account of them."""
    asked = ask(f"http://127.0.0.1:{process.port}", http2)
    total = sum(ANSWERS.values()) + DELAYED
    accounts = [json.loads(process.stdout.readline()) for _ in range(total)]
    return Driven(accounts, asked.bodies, asked.delayed_seconds)


def served(probe: RequestsProbe, process: subprocess.Popen, total: int) -> RequestsSnapshot:
    """The read that has all the app's responses (the last one ends when its connection closes; the app's
    entries are reported this once after it exits), with only the app's records."""
    snapshot = RequestsSnapshot("", "")

    def counted() -> bool:
        nonlocal snapshot
        snapshot = probe.read()
        snapshot.http = [r for r in snapshot.http if r.pid == process.pid and r.port == process.port]
        snapshot.endpoints = [e for e in snapshot.endpoints if e.pid == process.pid and e.port == process.port]
        return sum(r.count for r in snapshot.http) >= total

    wait_until(counted, timeout=PATIENCE, interval=0.2)
    return snapshot


def by_status(records: list[HttpRequests]) -> Counter[int]:
    counts: Counter[int] = Counter()
    for record in records:
        counts[record.status_code] += record.count
    return counts


def assert_delayed(records: list[HttpRequests], driven: Driven, method: str) -> None:
    """The delayed responses' durations (their own entries) between the app's sleeps and the client's
    clock: the server's span, from the request's read to the response's write, holds the sleep and lies
    within the client's, from its send to the response's read. (The app's own clock is no bound: it
    stops after its last send returns, which a guest twice as slow delayed past the write by 12%.)"""
    delayed = [r for r in records if r.method == method]
    assert sum(r.count for r in delayed) == DELAYED and not any(r.durations_unknown for r in delayed)
    seconds = sum(r.duration_sum_seconds for r in delayed)
    slept = DELAYED * DELAY_MS / 1e3
    assert slept * (1 - CLOCK_TOLERANCE) <= seconds <= driven.delayed_seconds * (1 + CLOCK_TOLERANCE), \
        (slept, seconds, driven.delayed_seconds)


def exported_counts(records: list[HttpRequests]) -> dict[tuple[str, str], float]:
    """http_server_request_duration_seconds_count by (method, status) as /metrics renders the records."""
    counts = {}
    for family in text_string_to_metric_families(rendered(records)):
        for sample in family.samples:
            if sample.name == "http_server_request_duration_seconds_count":
                assert sample.labels["url_scheme"] == "http"
                counts[(sample.labels["http_request_method"], sample.labels["http_response_status_code"])] = \
                    sample.value
    return counts


def test_count_requests_off_leaves_the_part_out_and_streams_on() -> None:
    with SendLatencyProbe(per_flow=False, stall_threshold_ms=250.0, count_requests=False) as host:
        parts = host.parts()
        assert parts["streams"].status().up
        assert parts["requests"].status().reason == "off in the config (count_requests = false)"


def test_http1_statuses_methods_durations(probe: RequestsProbe) -> None:
    with app("uvicorn") as process:
        driven = drive(process, http2=False)
    accounts, bodies = driven.accounts, driven.bodies
    records = served(probe, process, len(accounts)).http
    assert by_status(records) == Counter(a["status"] for a in accounts)
    assert {(r.method, r.status_code): r.count for r in records} == \
        Counter((a["method"], a["status"]) for a in accounts)
    assert_delayed(records, driven, "PUT")
    # uvicorn writes the headers, then the body: the body writes are the bodies the client received.
    assert sum(r.response_bytes for r in records) == sum(bodies)
    assert all(r.request_bytes for r in records) and all(r.protocol == "http" for r in records)
    assert exported_counts(records) == {(m, str(s)): float(n) for (m, s), n in
                                        Counter((a["method"], a["status"]) for a in accounts).items()}
    assert_histograms_consistent(records, observed=["http_server_request_duration_seconds"])


def test_http2_status_from_hpack(probe: RequestsProbe) -> None:
    with app("hypercorn") as process:
        driven = drive(process, http2=True)
    accounts = driven.accounts
    records = served(probe, process, len(accounts)).http
    truth = Counter(a["status"] for a in accounts)
    counts = by_status(records)
    assert all(r.protocol == "http2" for r in records)
    # 200: static index 8; 429 and 503: a literal (Huffman-coded digits) the first time on the connection,
    # a dynamic index after.
    assert counts == truth
    assert {r.method for r in records if r.status_code == 200} == {"GET"}  # static index 2
    assert_delayed(records, driven, "_OTHER")  # PUT is a literal: not read


def test_http2_lost_table_reads_unknown(probe: RequestsProbe) -> None:
    """A header block the walk cannot finish (more fields than its 24) loses the connection's dynamic
    table: from then on dynamic indexes count as status unknown, never as a wrong status, while static
    indexes and literals stay readable (docs/requests.md)."""
    paths = ["/answer/429", "/answer/200?fillers=30", "/answer/429", "/answer/429", "/answer/503", "/answer/503",
             "/answer/200"]
    with app("hypercorn") as process, httpx.Client(http1=False, http2=True, timeout=PATIENCE,
                                                   base_url=f"http://127.0.0.1:{process.port}") as client:
        assert [client.get(path).status_code for path in paths] == [429, 200, 429, 429, 503, 503, 200]
    # 429 and 503 as literals the first time (read); as dynamic indexes after the lost block (unknown).
    assert by_status(served(probe, process, len(paths)).http) == Counter({200: 2, 429: 1, 503: 1, 0: 3})


@pytest.mark.slow_truth  # a read's summary of the records that test_http1_* checks
def test_endpoint_summary(probe: RequestsProbe) -> None:
    """One endpoint per server: its counts by status class, against the app's."""
    with app("uvicorn") as process:
        accounts = drive(process, http2=False).accounts
    endpoint, = served(probe, process, len(accounts)).endpoints
    statuses = Counter(a["status"] for a in accounts)
    assert (endpoint.count, endpoint.server_errors, endpoint.throttled, endpoint.client_errors) == \
        (len(accounts), statuses[503], statuses[429], statuses[429])
    assert endpoint.statuses == {str(s): n for s, n in sorted(statuses.items())}
    assert endpoint.p99_seconds is not None and endpoint.p99_seconds >= DELAY_MS / 1e3 * (1 - CLOCK_TOLERANCE)


@contextlib.contextmanager
def grpc_server() -> Iterator[subprocess.Popen]:
    """tests/fixtures/grpc_server.py on a free port, once it listens."""
    port = free_port()
    process = subprocess.Popen([sys.executable, str(GRPC_FIXTURE), str(port), "--events", "2", "--cadence-ms", "1",
                                "--prefill-ms", "1"], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "ready"
        process.port = port  # type: ignore[attr-defined]
        yield process
    finally:
        process.terminate()
        process.wait(timeout=30)


def rpc_served(probe: RequestsProbe, process: subprocess.Popen, calls: int) -> list[RpcRequests]:
    """The server's gRPC records, once all its calls are counted."""
    mine: list[RpcRequests] = []

    def counted() -> bool:
        nonlocal mine
        mine = [r for r in probe.read().rpc if r.pid == process.pid and r.port == process.port]
        return sum(r.count for r in mine) >= calls

    assert wait_until(counted, timeout=PATIENCE, interval=0.2)
    return mine


def exported_rpc_counts(records: list[RpcRequests]) -> dict[str, float]:
    """rpc_server_duration_seconds_count by rpc_grpc_status_code as /metrics renders the records."""
    return {s.labels["rpc_grpc_status_code"]: s.value for family in text_string_to_metric_families(rendered(records))
            for s in family.samples if s.name == "rpc_server_duration_seconds_count"}


def test_grpc_streaming_calls_counted_with_their_status(probe: RequestsProbe) -> None:
    """Server-streaming gRPC calls (grpcio) count in rpc_server_duration_seconds, each once, with the
    trailers' grpc-status: OK."""
    calls = 4
    with grpc_server() as process, grpc.insecure_channel(f"127.0.0.1:{process.port}") as channel:
        stream = channel.unary_stream("/tokens.Tokens/Stream")
        for _ in range(calls):
            assert len(list(stream(b"2"))) == 2
    mine = rpc_served(probe, process, calls)
    assert sum(r.count for r in mine) == calls and {r.protocol for r in mine} == {"grpc"}
    assert exported_rpc_counts(mine) == {"0": float(calls)}


GRPC_ANSWERS = {grpc.StatusCode.OK: 5, grpc.StatusCode.RESOURCE_EXHAUSTED: 4, grpc.StatusCode.UNAVAILABLE: 3}


def test_grpc_status_codes(probe: RequestsProbe) -> None:
    """A grpcio service answering OK, RESOURCE_EXHAUSTED and UNAVAILABLE (the errors as Trailers-Only
    responses), interleaved on one connection: counts per rpc_grpc_status_code exact, against the
    server's own account (grpc-core writes each code as a literal with incremental indexing the first
    time on the connection, as a dynamic-table index after)."""
    order = [code for _ in range(max(GRPC_ANSWERS.values())) for code, n in GRPC_ANSWERS.items() if n > _]
    with grpc_server() as process, grpc.insecure_channel(f"127.0.0.1:{process.port}") as channel:
        answer = channel.unary_unary("/tokens.Tokens/Answer")
        for code in order:
            try:
                answer(str(code.value[0]).encode())
                assert code == grpc.StatusCode.OK
            except grpc.RpcError as error:
                assert error.code() == code  # type: ignore[attr-defined]
        accounts = Counter(str(json.loads(process.stdout.readline())["grpc_status"]) for _ in order)
    mine = rpc_served(probe, process, len(order))
    assert accounts == {str(code.value[0]): n for code, n in GRPC_ANSWERS.items()}
    assert exported_rpc_counts(mine) == {status: float(n) for status, n in accounts.items()}


def alert_events(agent: Agent, rule: str, port: int) -> list[dict]:
    if not agent.alert_log.exists():
        return []
    events = [json.loads(line) for line in agent.alert_log.read_text().splitlines()]
    return [e for e in events if e["rule"] == rule and e["evidence"].get("port") == port]


@pytest.mark.slow_truth  # the agent and Prometheus' rules over the records test_http*_ check
def test_agent_exports_otel_metrics_and_fires_the_error_rules(tmp_path: Path) -> None:
    """Through a real agent: /metrics has the app's counts under OpenTelemetry's names, and 5xx and 429
    shares far above their thresholds fire http_server_errors and http_throttled, their evidence naming
    the port, the process and the status counts (since start: exact)."""
    with Agent(tmp_path, 'probes = ["sendlat"]\n') as agent, app("uvicorn") as process:
        assert wait_until(lambda: agent.snapshot()["probes"].get("requests", {}).get("up"), timeout=PATIENCE)
        accounts = drive(process, http2=False).accounts
        statuses = Counter(str(a["status"]) for a in accounts)
        for rule in ("http_server_errors", "http_throttled"):
            assert wait_until(lambda rule=rule: any(e["state"] == "firing" for e in alert_events(
                agent, rule, process.port)), timeout=PATIENCE), rule
            evidence = alert_events(agent, rule, process.port)[0]["evidence"]
            assert (evidence["process"], evidence["pid"], evidence["protocol"]) == ("python", process.pid, "http")
        assert wait_until(lambda: agent.snapshot()["requests"] and any(
            e["statuses"] == statuses for e in agent.snapshot()["requests"] if e["port"] == process.port),
            timeout=PATIENCE)
        metrics = agent.metrics()
    exported = Counter()
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            if sample.name == "http_server_request_duration_seconds_count" and \
                    sample.labels["server_port"] == str(process.port):
                exported[sample.labels["http_response_status_code"]] += int(sample.value)
    assert exported == statuses
