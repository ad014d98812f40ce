"""Per-flow throughput against the real kernel: XDP and tc on a veth into a namespace, real UDP and
TCP traffic, raw VLAN frames, interface hotplug, clean detach after SIGTERM / SIGKILL, coexistence
with foreign programs, malformed frames through BPF_PROG_TEST_RUN, and a flow table run full.

Every probe here watches only the test's own interfaces, so traffic of parallel tests never counts.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from aiprobe.btf import decode
from aiprobe.containers import cgroup2_root
from aiprobe.flows import SPEC, TC_HANDLE, FlowRecord, FlowsProbe, FlowsSnapshot
from aiprobe.loader import BpfObject
from conftest import VethPair, programs_on, run, unique, wait_until
from fixtures import flows_frames as frames

pytestmark = pytest.mark.bpf

UDP_PAYLOAD = 300
COUNT = 25


@pytest.fixture(params=[s.name for s in SPEC.strategies])
def strategy(request, kernel_features: dict) -> str:
    """The exactness tests run under every strategy of the chain; one the kernel cannot run is
    skipped, naming the hook it lacks."""
    [chosen] = [s for s in SPEC.strategies if s.name == request.param]
    missing = [name for name in chosen.features if not kernel_features[name].available]
    if missing:
        pytest.skip(f"{chosen.name}: this kernel lacks {', '.join(missing)}")
    return chosen.name


def _flow(snapshot: FlowsSnapshot, direction: str, protocol: str, local_port: int, remote_port: int) -> FlowRecord:
    matches = [
        f for f in snapshot.flows
        if (f.direction, f.protocol, f.local_port, f.remote_port) == (direction, protocol, local_port, remote_port)
    ]
    assert len(matches) == 1, f"expected one {direction} {protocol} {local_port}->{remote_port} flow: {matches}"
    return matches[0]


def _totals(snapshot: FlowsSnapshot, interface: str, direction: str) -> tuple[int, int]:
    (total,) = [t for t in snapshot.interfaces if (t.interface, t.direction) == (interface, direction)]
    return total.bytes, total.packets


def _stat(interface: str, name: str) -> int:
    return int(Path(f"/sys/class/net/{interface}/statistics/{name}").read_text())


def _own_cgroup_id() -> int:
    path = next(line[3:] for line in Path("/proc/self/cgroup").read_text().splitlines() if line.startswith("0::"))
    return os.stat(f"{cgroup2_root()}{path}").st_ino


# --- exact UDP counts ---

PEER_UDP = """
import socket, sys
family, host, port, count, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
s = socket.socket(socket.AF_INET6 if family == "6" else socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("::" if family == "6" else "0.0.0.0", port))
s.settimeout(5)
for _ in range(count):
    s.sendto(bytes(size), (host, port))
for _ in range(count):
    s.recvfrom(65536)
"""


@pytest.mark.parametrize("family", ["4", "6"])
def test_udp_datagrams_counted_exactly_each_way(veth: VethPair, family: str, strategy: str) -> None:
    port = 40000 + int(family)
    host_ip, peer_ip = (veth.host_ip6, veth.peer_ip6) if family == "6" else (veth.host_ip4, veth.peer_ip4)
    frame_len = 14 + (40 if family == "6" else 20) + 8 + UDP_PAYLOAD
    with FlowsProbe([veth.host], strategy=strategy) as probe:
        with socket.socket(socket.AF_INET6 if family == "6" else socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.bind((host_ip, port))
            sock.settimeout(5)
            peer = subprocess.Popen(veth.ns_cmd([sys.executable, "-c", PEER_UDP, family, host_ip, str(port),
                                                 str(COUNT), str(UDP_PAYLOAD)]))
            for _ in range(COUNT):  # the peer is bound once its first datagram arrives
                sock.recvfrom(65536)
            for _ in range(COUNT):
                sock.sendto(bytes(UDP_PAYLOAD), (peer_ip, port))
            assert peer.wait(10) == 0
        snapshot = probe.read()
    for direction in ("ingress", "egress"):
        flow = _flow(snapshot, direction, "udp", port, port)
        assert (flow.packets, flow.bytes) == (COUNT, COUNT * frame_len), direction
        assert (flow.local_address, flow.remote_address) == (host_ip, peer_ip)
        assert flow.interface == veth.host
        assert flow.first_seen <= flow.last_seen <= time.time() + 1
    assert _flow(snapshot, "egress", "udp", port, port).cgroup_id == _own_cgroup_id()
    assert _flow(snapshot, "ingress", "udp", port, port).cgroup_id == 0


PEER_RAW = """
import socket, sys
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
s.bind((sys.argv[1], 0))
for _ in range(int(sys.argv[3])):
    s.send(bytes.fromhex(sys.argv[2]))
"""


@pytest.mark.parametrize("vlans", [(42,), (100, 42)], ids=["802.1Q", "802.1ad+802.1Q"])
def test_vlan_tagged_frames_counted_exactly_each_way(veth: VethPair, vlans: tuple[int, ...], strategy: str) -> None:
    # The kernel here has no VLAN devices, so tagged frames go out through packet sockets: every
    # byte on the wire is known. The receiving side drops them after the hooks have counted.
    inbound = frames.udp4_frame(veth.peer_ip4, veth.host_ip4, 5353, 6363, UDP_PAYLOAD, vlans)
    outbound = frames.udp4_frame(veth.host_ip4, veth.peer_ip4, 6363, 5353, UDP_PAYLOAD, vlans)
    with FlowsProbe([veth.host], strategy=strategy) as probe:
        veth.ns_run([sys.executable, "-c", PEER_RAW, veth.peer, inbound.hex(), str(COUNT)])
        with socket.socket(socket.AF_PACKET, socket.SOCK_RAW) as raw:
            raw.bind((veth.host, 0))
            for _ in range(COUNT):
                raw.send(outbound)
        snapshot = probe.read()
    for direction, frame in (("ingress", inbound), ("egress", outbound)):
        flow = _flow(snapshot, direction, "udp", 6363, 5353)
        assert (flow.packets, flow.bytes) == (COUNT, COUNT * len(frame)), direction
        assert (flow.local_address, flow.remote_address) == (veth.host_ip4, veth.peer_ip4)


def test_rates_cover_the_interval_since_the_previous_read(veth: VethPair) -> None:
    with FlowsProbe([veth.host]) as probe, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.sendto(bytes(UDP_PAYLOAD), (veth.peer_ip4, 9))
        wait_until(lambda: any(f.direction == "egress" and f.protocol == "udp" for f in probe.read().flows))
        port = sock.getsockname()[1]
        before = _flow(probe.read(), "egress", "udp", port, 9)
        for _ in range(10):
            sock.sendto(bytes(UDP_PAYLOAD), (veth.peer_ip4, 9))
        snapshot = probe.read()
        flow = _flow(snapshot, "egress", "udp", port, 9)
    assert flow.packets - before.packets == 10
    assert flow.bytes_per_second * snapshot.interval_seconds == pytest.approx(10 * (42 + UDP_PAYLOAD))
    assert flow.packets_per_second * snapshot.interval_seconds == pytest.approx(10)


# --- TCP bulk transfer vs interface and socket counters ---

BULK_BYTES = 32 << 20
TCP_HEADERS = 14 + 20 + 32  # Ethernet, IPv4, TCP with timestamps

PEER_TCP = """
import socket, sys
role, host, port, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if role == "send":
    s = socket.create_connection((host, port), timeout=10)
    s.sendall(bytes(size))
    s.shutdown(socket.SHUT_WR)
    s.recv(1)
else:
    server = socket.create_server(("0.0.0.0", port))
    print("ready", flush=True)
    s, _ = server.accept()
    while s.recv(1 << 20):
        pass
s.close()
"""


def _ss_counter(port: int, field: str) -> int:
    out = run(["ss", "-tinH", "state", "all", f"( sport = :{port} or dport = :{port} )"]).stdout
    found = re.search(rf"\b{field}:(\d+)", out)
    return int(found.group(1)) if found else 0


def _interface_bytes(interface: str, side: str) -> int:
    """The interface's byte counter as L2 frame lengths. veth with native XDP counts received bytes
    after the Ethernet header was pulled (veth_xdp_rcv adds skb->len after eth_type_trans), unlike
    its own transmit side and unlike NIC drivers; add the header back for received frames."""
    header = 14 if side == "rx" else 0
    return _stat(interface, f"{side}_bytes") + header * _stat(interface, f"{side}_packets")


@pytest.mark.parametrize("direction", ["egress", "ingress"])
def test_tcp_bulk_transfer_matches_interface_and_socket_counters(veth: VethPair, direction: str,
                                                                 strategy: str) -> None:
    port = 41000
    counter = "tx" if direction == "egress" else "rx"
    with FlowsProbe([veth.host], strategy=strategy) as probe:
        before = _interface_bytes(veth.host, counter)
        if direction == "egress":  # we send, the peer receives
            peer = subprocess.Popen(veth.ns_cmd([sys.executable, "-c", PEER_TCP, "recv", "", str(port), "0"]),
                                    stdout=subprocess.PIPE, text=True)
            assert peer.stdout.readline().strip() == "ready"
            sock = socket.create_connection((veth.peer_ip4, port), timeout=10)
            sock.sendall(bytes(BULK_BYTES))
            # Read the socket's counters while it is established (TIME-WAIT sockets have none).
            assert wait_until(lambda: _ss_counter(port, "bytes_acked") >= BULK_BYTES)
            socket_bytes = _ss_counter(port, "bytes_acked")
            sock.shutdown(socket.SHUT_WR)
            assert sock.recv(1) == b""  # the peer read everything and closed
        else:
            with socket.create_server((veth.host_ip4, port)) as server:
                peer = subprocess.Popen(veth.ns_cmd([sys.executable, "-c", PEER_TCP, "send", veth.host_ip4,
                                                     str(port), str(BULK_BYTES)]))
                sock, _ = server.accept()
            received = 0
            while chunk := sock.recv(1 << 20):
                received += len(chunk)
            assert received == BULK_BYTES
            socket_bytes = _ss_counter(port, "bytes_received")
        sock.close()
        assert peer.wait(10) == 0
        time.sleep(0.2)  # the last FIN / ACK
        interface_delta = _interface_bytes(veth.host, counter) - before
        snapshot = probe.read()
    (flow,) = [f for f in snapshot.flows if f.direction == direction and port in (f.local_port, f.remote_port)]
    assert socket_bytes >= BULK_BYTES
    assert flow.bytes == pytest.approx(interface_delta, rel=0.005)
    assert flow.bytes == pytest.approx(socket_bytes + flow.packets * TCP_HEADERS, rel=0.02)
    assert flow.tcp_syn == 1 and flow.tcp_fin == 1 and flow.tcp_rst == 0


# --- interfaces that come and go ---


@pytest.mark.realtime
def test_interface_created_after_start_is_attached_within_two_seconds_and_removal_is_quiet(
    veth: VethPair,
) -> None:
    host, peer = unique("aiph"), unique("aipq")
    with FlowsProbe([host]) as probe:
        assert probe.attachments() == []
        run(["ip", "link", "add", host, "type", "veth", "peer", "name", peer, "netns", veth.ns])
        try:
            run(["ip", "addr", "add", "198.19.7.1/24", "dev", host])
            run(["ip", "link", "set", host, "up"])
            veth.ns_run(["ip", "addr", "add", "198.19.7.2/24", "dev", peer])
            veth.ns_run(["ip", "link", "set", peer, "up"])
            up = time.monotonic()
            assert wait_until(lambda: any(a.tc and a.xdp for a in probe.attachments()), timeout=2.0)
            assert time.monotonic() - up < 2.0
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                for _ in range(3):
                    sock.sendto(bytes(UDP_PAYLOAD), ("198.19.7.2", 9))
                port = sock.getsockname()[1]
                assert _flow(probe.read(), "egress", "udp", port, 9).packets == 3
        finally:
            run(["ip", "link", "del", host], check=False)
        assert wait_until(lambda: probe.attachments() == [], timeout=2.0)
        snapshot = probe.read()
        assert snapshot.flows == [] and snapshot.interfaces == []


def test_idle_flows_expire_and_interface_totals_keep_them(veth: VethPair) -> None:
    with FlowsProbe([veth.host], idle_timeout=0.3) as probe, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _ in range(5):
            s.sendto(bytes(UDP_PAYLOAD), (veth.peer_ip4, 9))
        port = s.getsockname()[1]
        first = probe.read()
        assert _flow(first, "egress", "udp", port, 9).packets == 5
        time.sleep(0.8)
        later = probe.read()
    assert not [f for f in later.flows if f.local_port == port]
    assert _totals(later, veth.host, "egress") >= _totals(first, veth.host, "egress")
    assert _totals(later, veth.host, "egress")[1] >= 5


# --- detaching: SIGTERM, SIGKILL, foreign programs ---


def _start_cli(aiprobe_cli: list[str], interface: str, *extra: str) -> subprocess.Popen:
    proc = subprocess.Popen([*aiprobe_cli, "flows", "--interfaces", interface, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stderr.readline()
    assert "attached" in line, line + proc.stderr.read()
    return proc


@pytest.mark.realtime
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_cli_leaves_no_program_attached_after_signal(veth: VethPair, aiprobe_cli: list[str], sig: int) -> None:
    proc = _start_cli(aiprobe_cli, veth.host, "--json")
    assert {"flows_xdp", "flows_tc"} <= programs_on(veth.host)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=10)
    if sig == signal.SIGTERM:
        assert proc.returncode == 0, err
        assert isinstance(json.loads(out)["flows"], list)
    assert wait_until(lambda: not {"flows_xdp", "flows_tc"} & programs_on(veth.host), timeout=3)


def test_cli_json_after_duration(veth: VethPair, aiprobe_cli: list[str]) -> None:
    proc = _start_cli(aiprobe_cli, veth.host, "--json", "--duration", "1.5", "--interval", "0.5")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _ in range(4):
            sock.sendto(bytes(UDP_PAYLOAD), (veth.peer_ip4, 9))
        port = sock.getsockname()[1]
    out, err = proc.communicate(timeout=15)
    assert proc.returncode == 0, err
    (flow,) = [f for f in json.loads(out)["flows"] if f["direction"] == "egress" and f["local_port"] == port]
    assert (flow["packets"], flow["bytes"], flow["protocol"]) == (4, 4 * (42 + UDP_PAYLOAD), "udp")
    assert set(flow) == set(FlowRecord(*[0] * 14).to_dict())  # the probe's own fields, no joins


def test_cli_bad_input_is_one_line(aiprobe_cli: list[str]) -> None:
    result = subprocess.run([*aiprobe_cli, "flows", "--interval", "0"], capture_output=True, text=True)
    assert result.returncode != 0 and "Traceback" not in result.stderr


FOREIGN_XDP = """
import ctypes, sys
from aiprobe.loader import BpfObject
obj = BpfObject("features", programs=["probe_xdp"])
obj.load()
# A netlink attachment (as ip link / xdp-loader make): it outlives this process.
rc = ctypes.CDLL("libbpf.so.1").bpf_xdp_attach(int(sys.argv[1]), obj.programs["probe_xdp"].fd, 2, None)
sys.exit(-rc)
"""


def test_foreign_xdp_program_is_reported_and_left_attached(veth: VethPair, tc_kind: str) -> None:
    subprocess.run([sys.executable, "-c", FOREIGN_XDP, str(veth.host_ifindex)], check=True)
    assert programs_on(veth.host) == {"probe_xdp"}
    with FlowsProbe([veth.host]) as probe:
        (state,) = probe.attachments()
        assert state.xdp is None and "another XDP program" in state.xdp_error and "probe_xdp" in state.xdp_error
        assert state.tc == tc_kind
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.sendto(bytes(UDP_PAYLOAD), (veth.peer_ip4, 9))
            port = sock.getsockname()[1]
        assert _flow(probe.read(), "egress", "udp", port, 9).packets == 1
    assert wait_until(lambda: programs_on(veth.host) == {"probe_xdp"})


# --- the clsact fallback ---

KILLED_CLSACT = """
import sys, time
from aiprobe.flows import FlowsProbe
probe = FlowsProbe([sys.argv[1]], strategy="xdp+clsact")
probe.start()
print(probe.attachments()[0].tc, flush=True)
time.sleep(60)
"""


def _egress_filters(interface: str) -> str:
    return run(["tc", "filter", "show", "dev", interface, "egress"]).stdout


def test_clsact_fallback_counts_and_removes_stale_filters_only(veth: VethPair, caplog) -> None:
    # A filter that is not ours, on the same clsact qdisc: it must survive everything below.
    run(["tc", "qdisc", "add", "dev", veth.host, "clsact"])
    run(["tc", "filter", "add", "dev", veth.host, "egress", "prio", "7", "protocol", "all", "u32", "match",
         "u32", "0", "0"])
    killed = subprocess.Popen([sys.executable, "-c", KILLED_CLSACT, veth.host], stdout=subprocess.PIPE, text=True)
    assert killed.stdout.readline().strip() == "clsact"
    killed.kill()
    killed.wait()
    ours = f"handle 0x{TC_HANDLE:x}"
    assert ours in _egress_filters(veth.host)  # netlink attachments outlive a SIGKILL ...
    assert wait_until(lambda: programs_on(veth.host) == {"flows_tc"}, timeout=3)  # ... bpf_links do not

    with caplog.at_level(logging.WARNING, logger="aiprobe.flows"), \
            FlowsProbe([veth.host], strategy="xdp+clsact") as probe:
        assert "removed a stale aiprobe tc filter" in caplog.text
        assert _egress_filters(veth.host).count(ours) == 1
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            for _ in range(COUNT):
                sock.sendto(bytes(UDP_PAYLOAD), (veth.peer_ip4, 9))
            port = sock.getsockname()[1]
        flow = _flow(probe.read(), "egress", "udp", port, 9)
        assert (flow.packets, flow.bytes) == (COUNT, COUNT * (42 + UDP_PAYLOAD))
    filters = _egress_filters(veth.host)
    assert ours not in filters and "pref 7 u32" in filters


# --- malformed frames through BPF_PROG_TEST_RUN ---

V4A, V4B = "198.18.200.1", "198.18.200.2"
V6A, V6B = "2001:db8:c8::1", "2001:db8:c8::2"
_udp = frames.udp(1111, 2222, b"payload")
_ip4 = frames.ipv4(V4A, V4B, frames.UDP, _udp)
_ip6 = frames.ipv6(V6A, V6B, frames.UDP, _udp)

MALFORMED = {
    "ethertype only": frames.ethernet(frames.ETH_P_IP, b""),
    "vlan tag cut": frames.ethernet(frames.ETH_P_8021Q, b"\x00"),
    "ipv4 header cut": frames.ethernet(frames.ETH_P_IP, _ip4[:19]),
    "ipv4 ihl below 5": frames.ethernet(frames.ETH_P_IP, bytes([0x44]) + _ip4[1:]),
    "ipv4 wrong version": frames.ethernet(frames.ETH_P_IP, bytes([0x65]) + _ip4[1:]),
    "ipv4 options beyond frame": frames.ethernet(frames.ETH_P_IP, bytes([0x4F]) + _ip4[1:28]),
    "udp header cut": frames.ethernet(frames.ETH_P_IP, _ip4[:24]),
    "tcp header cut": frames.ethernet(frames.ETH_P_IP, frames.ipv4(V4A, V4B, frames.TCP, bytes(19))),
    "ipv6 header cut": frames.ethernet(frames.ETH_P_IPV6, _ip6[:39]),
    "ipv6 extension header cut": frames.ethernet(frames.ETH_P_IPV6, frames.ipv6(V6A, V6B, 0, b"\x11")),
    "ipv6 fragment header cut": frames.ethernet(frames.ETH_P_IPV6, frames.ipv6(V6A, V6B, 44, bytes(6))),
    "ipv6 udp cut after options": frames.ethernet(
        frames.ETH_P_IPV6, frames.ipv6(V6A, V6B, 0, frames.ipv6_option_header(frames.UDP, bytes(4)))),
}

# frame -> the one flow it must produce: (family, protocol, src, dst, sport, dport)
WELL_FORMED = {
    "ipv4 udp": (frames.ethernet(frames.ETH_P_IP, _ip4), (4, 17, V4A, V4B, 1111, 2222)),
    "ipv4 later fragment": (
        frames.ethernet(frames.ETH_P_IP, frames.ipv4(V4A, V4B, frames.UDP, bytes(16), frag_offset=185)),
        (4, 17, V4A, V4B, 0, 0)),
    "ipv4 with options": (frames.ethernet(frames.ETH_P_IP, frames.ipv4(V4A, V4B, frames.UDP, _udp, ihl=7)),
                          (4, 17, V4A, V4B, 1111, 2222)),
    "ipv4 gre": (frames.ethernet(frames.ETH_P_IP, frames.ipv4(V4A, V4B, 47, bytes(8))), (4, 47, V4A, V4B, 0, 0)),
    "double vlan ipv6": (frames.ethernet(frames.ETH_P_IPV6, _ip6, vlans=(7, 8)), (6, 17, V6A, V6B, 1111, 2222)),
    "ipv6 hop-by-hop + fragment": (
        frames.ethernet(frames.ETH_P_IPV6, frames.ipv6(V6A, V6B, 0, frames.ipv6_option_header(
            44, frames.ipv6_fragment_header(frames.UDP, _udp, more=True)))),
        (6, 17, V6A, V6B, 1111, 2222)),
    "ipv6 later fragment": (
        frames.ethernet(frames.ETH_P_IPV6, frames.ipv6(V6A, V6B, 44, frames.ipv6_fragment_header(
            frames.UDP, bytes(16), offset=100))),
        (6, 17, V6A, V6B, 0, 0)),
    "tcp syn": (frames.ethernet(frames.ETH_P_IP, frames.ipv4(V4A, V4B, frames.TCP, frames.tcp(80, 443, 0x02))),
                (4, 6, V4A, V4B, 80, 443)),
}
PASS_VERDICTS = {"flows_xdp": 2, "flows_tc": 0xFFFFFFFF}  # XDP_PASS, TC_ACT_UNSPEC (next / continue)


def _flow_entries(obj: BpfObject) -> list[dict]:
    return [decode(key) for key, _ in obj.maps["flows"].items()]


def _unattributed(obj: BpfObject) -> dict[str, int]:
    totals: dict[str, int] = {}
    for _, per_cpu in obj.maps["unattributed"].items():
        for value in per_cpu:
            for name, count in decode(value).items():
                totals[name] = totals.get(name, 0) + count
    return totals


# BPF_PROG_TEST_RUN itself refuses to build an skb whose IP header is shorter than the ethertype
# promises (bpf_prog_test_run_skb), so these reach only the XDP program.
SKB_REFUSED = {"ethertype only", "ipv4 header cut", "ipv6 header cut"}


@pytest.mark.parametrize("program", sorted(PASS_VERDICTS))
def test_malformed_frames_pass_and_make_no_flow(program: str) -> None:
    cases = {n: f for n, f in MALFORMED.items() if program == "flows_xdp" or n not in SKB_REFUSED}
    with BpfObject("flows", programs=[program]) as obj:
        obj.load()
        for name, frame in cases.items():
            assert obj.programs[program].test_run(frame).retval == PASS_VERDICTS[program], name
        assert _flow_entries(obj) == []
        counted = _unattributed(obj)
        assert counted["malformed"] == counted["packets"] == len(cases)
        assert counted["bytes"] == sum(map(len, cases.values()))
        arp = frames.ethernet(frames.ETH_P_ARP, bytes(28))
        assert obj.programs[program].test_run(arp).retval == PASS_VERDICTS[program]
        assert _unattributed(obj)["malformed"] == len(cases)  # not IP is not malformed
        assert _flow_entries(obj) == []


@pytest.mark.parametrize("case", sorted(WELL_FORMED))
def test_well_formed_frames_make_exactly_the_right_flow(case: str) -> None:
    import ipaddress

    frame, (family, protocol, src, dst, sport, dport) = WELL_FORMED[case]
    with BpfObject("flows", programs=list(PASS_VERDICTS)) as obj:
        obj.load()
        for program, verdict in PASS_VERDICTS.items():
            assert obj.programs[program].test_run(frame, repeat=3).retval == verdict
        keys = sorted(_flow_entries(obj), key=lambda k: k["direction"])
        values = [counters.packets for _, counters in obj.maps["flows"].items()]
    pack = lambda a: ipaddress.ip_address(a).packed.ljust(16, b"\0")  # noqa: E731
    assert len(keys) == 2 and values == [3, 3]
    ingress, egress = keys
    assert ingress["direction"] == 0 and egress["direction"] == 1
    for key, local, remote, lport, rport in ((ingress, dst, src, dport, sport), (egress, src, dst, sport, dport)):
        fields = (key["family"], key["protocol"], key["local_port"], key["remote_port"])
        assert fields == (family, protocol, lport, rport)
        assert key["local_addr"] == pack(local) and key["remote_addr"] == pack(remote)
        assert key["pad"] == 0


def test_tcp_flags_are_counted() -> None:
    with BpfObject("flows", programs=["flows_xdp"]) as obj:
        obj.load()
        for flags in (0x02, 0x12, 0x10, 0x11, 0x04, 0x14):  # SYN, SYN-ACK, ACK, FIN-ACK, RST, RST-ACK
            obj.programs["flows_xdp"].test_run(
                frames.ethernet(frames.ETH_P_IP, frames.ipv4(V4A, V4B, frames.TCP, frames.tcp(80, 443, flags))))
        ((_, counters),) = obj.maps["flows"].items()
    assert [getattr(counters, f) for f in ("packets", "tcp_syn", "tcp_fin", "tcp_rst")] == [6, 2, 1, 2]


# --- a flow table run full ---


def test_more_flows_than_the_table_holds_are_counted_not_lost(veth: VethPair) -> None:
    capacity, flows = 32, 120
    with FlowsProbe([veth.host], max_flows=capacity) as probe, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        before = _stat(veth.host, "tx_packets")
        for port in range(20000, 20000 + flows):
            s.sendto(bytes(UDP_PAYLOAD), (veth.peer_ip4, port))
        first = probe.read()
        for port in range(30000, 30000 + flows):
            s.sendto(bytes(UDP_PAYLOAD), (veth.peer_ip4, port))
        second = probe.read()
        sent = _stat(veth.host, "tx_packets") - before
    assert first.insert_failures > 0 and first.evictions > 0
    assert second.insert_failures > first.insert_failures and second.evictions > first.evictions
    assert len(second.flows) <= capacity
    assert probe.map_usage()[0].capacity == capacity
    # Flows evicted or never inserted still count toward the interface.
    assert 2 * flows <= _totals(second, veth.host, "egress")[1] <= sent + 2


def test_loopback_is_watched_when_asked(tc_kind: str) -> None:
    """lo frames carry a (zeroed) Ethernet header, so `--interfaces lo` counts them like any NIC's."""
    with FlowsProbe(interfaces=["lo"], exclude=[]) as probe, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        assert [(a.xdp, a.tc) for a in probe.attachments()] == [("generic", tc_kind)]
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        for _ in range(COUNT):
            sock.sendto(b"x" * UDP_PAYLOAD, ("127.0.0.1", port))
        frame = 14 + 20 + 8 + UDP_PAYLOAD
        assert wait_until(lambda: any(f.direction == "ingress" and f.local_port == port and f.packets == COUNT
                                      for f in probe.read().flows))
        snapshot = probe.read()
        for direction in ("ingress", "egress"):
            flow = _flow(snapshot, direction, "udp", port, port)
            assert (flow.packets, flow.bytes) == (COUNT, COUNT * frame)
