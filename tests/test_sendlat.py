"""TCP send latency against the real kernel: real TCP connections over loopback and over a veth
into a namespace, sent by real processes (tests/fixtures/sendlat_peer.c), observed by the real
BPF programs. Other suites send TCP traffic on this host at the same time, so every assertion is
about the pids and ports these tests created."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import math
import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiprobe.btf import decode
from aiprobe.containers import cgroup2_root
from aiprobe.histogram import log2_buckets
from aiprobe.loader import ProbeUnavailable, Strategy
from aiprobe.sendlat import SPEC, ProcessSendLatency, SendLatencyProbe, SendLatencySnapshot
from conftest import unique, wait_until
from fixtures.sendlat_peer import build, send, sender_cmd, sink

BLOCK_MS = 300
SLOW_MS = 100  # the module's probe reports sends slower than this


@pytest.fixture(scope="module")
def peer(cbuild) -> str:
    return build(cbuild)


def strategy_named(name: str) -> Strategy:
    return next(s for s in SPEC.strategies if s.name == name)


# Every test that takes `probe` runs under each strategy of the chain, forced; one the kernel cannot
# load is skipped with the kernel's reason (make test-kernels runs each on a kernel that can).
@pytest.fixture(scope="module", params=[s.name for s in SPEC.strategies])
def probe(request) -> Iterator[SendLatencyProbe]:
    try:
        running = SendLatencyProbe(threshold_ms=SLOW_MS, strategies=[strategy_named(request.param)])
        running.start()
    except ProbeUnavailable as exc:
        pytest.skip(f"{request.param} cannot run on this kernel: {exc.reasons[request.param]}")
    with running:
        yield running


def records_of(snapshot: SendLatencySnapshot, pid: int) -> list[ProcessSendLatency]:
    return [p for p in snapshot.processes if p.pid == pid]


def start_tids(probe: SendLatencyProbe) -> set[int]:
    return {key.value for key in probe.loaded.obj.maps["starts"].keys()}


def same_address(a: str, b: str) -> bool:
    return ipaddress.ip_address(a) == ipaddress.ip_address(b)


# --- pure functions ---

def test_log2_buckets_are_cumulative_seconds_ending_in_inf() -> None:
    slots = [0] * 36
    slots[10], slots[28] = 3, 1  # ~1 us, ~0.3 s
    buckets = log2_buckets(slots)
    assert len(buckets) == 36
    assert buckets[10] == (2 ** 11 / 1e9, 3)
    assert buckets[27][1] == 3 and buckets[28] == (2 ** 29 / 1e9, 4)
    assert math.isinf(buckets[-1][0]) and buckets[-1][1] == 4


def test_process_document_has_every_bucket_and_inf_as_text() -> None:
    buckets = log2_buckets([0] * 35 + [1])
    record = ProcessSendLatency(1, "x", 2, 1, 10, 40.0, 34.0, 34.0, buckets)
    document = record.to_dict()
    assert [b["le_seconds"] for b in document["histogram"]][-1] == "+Inf"
    assert len(document["histogram"]) == 36
    json.dumps(document, allow_nan=False)


# --- real kernel ---

@pytest.mark.bpf
def test_falls_back_through_strategies_and_says_why() -> None:
    names = [s.name for s in SPEC.strategies]
    assert names == ["fentry", "kprobe", "tracepoint", "syscall"]
    with SendLatencyProbe() as probe:
        chosen = names.index(probe.strategy)
        assert list(probe.skipped) == names[:chosen]
        assert all(probe.skipped.values()), probe.skipped
        assert probe.read().span == SPEC.strategies[chosen].span
        assert {u.map for u in probe.map_usage()} == {"procs", "flows", "starts"}
    if Path("/sys/kernel/tracing/events/tcp/tcp_sendmsg_locked").exists():
        assert chosen <= names.index("tracepoint"), "the syscall strategy runs where tcp_sendmsg_locked exists"


@pytest.mark.bpf
@pytest.mark.parametrize("strategy", SPEC.strategies, ids=lambda s: s.name)
def test_each_strategy_counts_sends_where_the_kernel_allows(strategy, peer: str) -> None:
    try:
        single = SendLatencyProbe(strategies=[strategy])
        single.start()
    except ProbeUnavailable as exc:
        pytest.skip(f"{strategy.name} cannot run on this kernel: {exc.reasons[strategy.name]}")
    with single, sink(peer, "127.0.0.1") as to:
        sent = send(peer, to, 25, 200)
        [record] = records_of(single.read(), sent.pid)
    assert (record.count, record.bytes) == (25, 5000)


@pytest.mark.bpf
def test_blocked_send_lands_in_its_bucket_and_is_reported_slow(probe: SendLatencyProbe, peer: str) -> None:
    with sink(peer, "127.0.0.1", pause_ms=BLOCK_MS) as to:
        sent = send(peer, to, 1, 8_000_000)
        assert to.received() == 8_000_000
    snapshot = probe.read()
    assert sent.elapsed_seconds >= BLOCK_MS / 1e3 * 0.8, "the send did not block"

    [slow] = [s for s in snapshot.slow_sends if s.pid == sent.pid]
    assert slow.duration_seconds == pytest.approx(sent.elapsed_seconds, rel=0.10)
    assert (slow.tid, slow.comm, slow.bytes) == (sent.pid, "sendlat_peer", 8_000_000)
    assert same_address(slow.local_address, "127.0.0.1") and same_address(slow.remote_address, "127.0.0.1")
    assert slow.remote_port == to.port and slow.local_port > 0

    [record] = records_of(snapshot, sent.pid)
    assert record.count == 1
    index = next(i for i, (le, _) in enumerate(record.histogram) if le >= sent.elapsed_seconds)
    below = record.histogram[index - 1][1]
    assert record.histogram[index][1] - below == 1, "the blocked send is not in the bucket of its duration"


@pytest.mark.bpf
@pytest.mark.parametrize("family", [4, 6], ids=["ipv4", "ipv6"])
@pytest.mark.parametrize("path", ["loopback", "veth"])
def test_counts_every_tcp_send_exactly(probe: SendLatencyProbe, peer: str, request, path: str, family: int) -> None:
    veth = request.getfixturevalue("veth") if path == "veth" else None
    servers = (veth.peer_ip4, veth.peer_ip6) if veth else ("127.0.0.1", "::1")
    server = servers[0] if family == 4 else servers[1]
    with sink(peer, server, netns_cmd=veth.ns_cmd if veth else None) as to:
        for method, count in (("send", 31), ("sendmsg", 37), ("write", 41)):
            sent = send(peer, to, count, 100, method)
            assert to.received() == count * 100
            snapshot = probe.read()
            [record] = records_of(snapshot, sent.pid)
            assert (record.count, record.bytes) == (count, count * 100), method
            [flow] = [f for f in snapshot.flows if f.pid == sent.pid]
            assert (flow.count, flow.bytes, flow.remote_port) == (count, count * 100, to.port)
            assert same_address(flow.remote_address, server)
            assert same_address(flow.local_address, veth.host_ip4 if veth and family == 4
                                else veth.host_ip6 if veth else server)


@pytest.mark.bpf
def test_without_per_flow_counters_processes_and_slow_sends_stay_exact(peer: str) -> None:
    with SendLatencyProbe(threshold_ms=BLOCK_MS / 2, per_flow=False) as lean:
        with sink(peer, "127.0.0.1") as to:
            fast = send(peer, to, 20, 100)
        with sink(peer, "127.0.0.1", pause_ms=BLOCK_MS) as to:
            blocked = send(peer, to, 1, 8_000_000)
        snapshot = lean.read()
        assert len(lean.loaded.obj.maps["flows"].items()) == 0
    assert snapshot.flows == []
    assert [(r.count, r.bytes) for r in records_of(snapshot, fast.pid)] == [(20, 2000)]
    [slow] = [s for s in snapshot.slow_sends if s.pid == blocked.pid]
    assert slow.remote_port == to.port and same_address(slow.remote_address, "127.0.0.1")


@pytest.mark.bpf
def test_udp_and_unix_sends_are_not_counted(probe: SendLatencyProbe, peer: str) -> None:
    me = os.getpid()
    before = sum(r.count for r in records_of(probe.read(), me))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as rx, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as tx:
        rx.bind(("127.0.0.1", 0))
        for _ in range(20):
            tx.sendto(b"x" * 32, rx.getsockname())
    left, right = socket.socketpair()
    with left, right:
        for _ in range(20):
            left.send(b"y")
            os.write(left.fileno(), b"z")
    assert sum(r.count for r in records_of(probe.read(), me)) == before
    # The same process over TCP is counted: the filter is the socket type, not the process.
    with sink(peer, "127.0.0.1") as to, socket.create_connection(("127.0.0.1", to.port)) as tcp:
        for _ in range(3):
            tcp.send(b"t" * 10)
    assert sum(r.count for r in records_of(probe.read(), me)) == before + 3


@pytest.fixture
def child_cgroup() -> Iterator[Path]:
    path = cgroup2_root() / unique("aiprobe-sendlat-")
    path.mkdir()
    try:
        yield path
    finally:
        # The kernel frees a cgroup shortly after its last process is reaped.
        wait_until(lambda: not (path / "cgroup.procs").read_text().strip())
        with contextlib.suppress(OSError):
            path.rmdir()


@pytest.mark.bpf
def test_sends_are_attributed_to_the_senders_cgroup(probe: SendLatencyProbe, peer: str, child_cgroup: Path) -> None:
    with sink(peer, "127.0.0.1") as to:
        sender = subprocess.Popen(sender_cmd(peer, to, 12, 64, "write", wait=True),
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        (child_cgroup / "cgroup.procs").write_text(str(sender.pid))
        out, _ = sender.communicate("go\n", timeout=30)
        assert sender.returncode == 0, out
    [record] = records_of(probe.read(), sender.pid)
    assert record.cgroup_id == child_cgroup.stat().st_ino != 0
    assert record.count == 12


@pytest.mark.bpf
def test_survives_a_sender_killed_mid_send(probe: SendLatencyProbe, peer: str) -> None:
    with sink(peer, "127.0.0.1", pause_ms=10_000) as stalled:
        sender = subprocess.Popen(sender_cmd(peer, stalled, 1, 64_000_000),
                                  stdout=subprocess.DEVNULL)
        assert wait_until(lambda: sender.pid in start_tids(probe)), "the send never started"
        # Its send syscall started, and it sleeps: blocked on the full socket buffer.
        assert wait_until(lambda: Path(f"/proc/{sender.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "S")
        sender.kill()
        sender.wait()
        assert wait_until(lambda: sender.pid not in start_tids(probe)), "the killed thread's entry stayed"
    with sink(peer, "127.0.0.1") as to:
        sent = send(peer, to, 5, 10)
    [record] = records_of(probe.read(), sent.pid)
    assert record.count == 5


@pytest.mark.bpf
def test_hundred_short_lived_senders_leave_no_start_entries(probe: SendLatencyProbe, peer: str) -> None:
    with sink(peer, "127.0.0.1") as to:
        pids = [send(peer, to, 1, 64).pid for _ in range(100)]
    assert not set(pids) & start_tids(probe)
    snapshot = probe.read()
    assert {pid: sum(r.count for r in records_of(snapshot, pid)) for pid in pids} == dict.fromkeys(pids, 1)
    # Exited processes were reported once; their entries are gone from the next read on.
    assert not {decode(key)["tgid"] for key in probe.loaded.obj.maps["procs"].keys()} & set(pids)
    assert not any(records_of(probe.read(), pid) for pid in pids)
    starts = next(u for u in probe.map_usage() if u.map == "starts")
    assert starts.entries < starts.capacity
    assert probe.events_lost() == 0


@pytest.mark.bpf
def test_cli_json_document_for_one_pid(aiprobe_cli: list[str], peer: str) -> None:
    with sink(peer, "127.0.0.1") as to:
        sender = subprocess.Popen(sender_cmd(peer, to, 5, 1000, "sendmsg", wait=True),
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        cli = subprocess.Popen(
            [*aiprobe_cli, "sendlat", "--pid", str(sender.pid), "--threshold-ms", "0", "--duration", "2", "--json"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        assert cli.stderr.readline().startswith("Tracing TCP sends"), "the CLI did not attach"
        sender.communicate("go\n", timeout=30)
        out, err = cli.communicate(timeout=60)
    assert cli.returncode == 0, err
    document = json.loads(out)
    assert document["strategy"] in {s.name for s in SPEC.strategies} and document["lost_events"] == 0
    [process] = document["processes"]
    assert (process["pid"], process["count"], process["bytes"]) == (sender.pid, 5, 5000)
    assert process["histogram"][-1] == {"le_seconds": "+Inf", "count": 5}
    slow = document["slow_sends"]
    assert len(slow) == 5 and {s["pid"] for s in slow} == {sender.pid}
    assert {s["remote_port"] for s in slow} == {to.port} and {s["bytes"] for s in slow} == {1000}
    assert all(s["duration_seconds"] > 0 for s in slow)


@pytest.mark.bpf
def test_cli_rejects_a_missing_pid_in_one_line(aiprobe_cli: list[str]) -> None:
    result = subprocess.run([*aiprobe_cli, "sendlat", "--pid", "999999999", "--duration", "1"],
                            capture_output=True, text=True)
    assert result.returncode == 1
    assert result.stderr.strip() == "aiprobe: no process with pid 999999999"
