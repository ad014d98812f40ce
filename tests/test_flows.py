"""Per-flow throughput against the real kernel: tc on a veth into a namespace, real UDP and TCP
traffic, raw VLAN frames, interface hotplug, clean detach after SIGTERM / SIGKILL, coexistence with
foreign programs, malformed frames through BPF_PROG_TEST_RUN, and a flow table run full.

Each figure against an independent truth: the datagrams and bytes the test sent, each namespace's
/proc/net/snmp segment counts and the interface counters (iperf3 with TSO/GSO on), iperf3's own
rate, `ethtool -k` for the offloads the probe must leave alone, and a real Prometheus scraping the
agent every second while flows churn and expire.

Every probe here watches only the test's own interfaces, so traffic of parallel tests never counts.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiprobe.btf import decode
from aiprobe.containers import cgroup2_root
from aiprobe.libbpf import BpfError
from aiprobe.loader import BpfObject, tc_clsact_detach
from aiprobe.probes.flows import probe as flows_probe
from aiprobe.probes.flows.hooks import SNAPSHOT_FLOWS
from aiprobe.probes.flows.kernel import KernelFlows
from aiprobe.probes.flows.probe import (
    DIRECTIONS,
    MIN_RATE_WINDOW_NS,
    SPEC,
    TC_HANDLES,
    TC_PRIORITY,
    XDP_PROGRAM,
    FlowsProbe,
    enable_xdp,
    xdp_multi_buffer,
)
from aiprobe.probes.flows.records import FlowRecord, FlowsSnapshot
from aiprobe.top_views import header_lines
from fixtures import flows_frames as frames
from helpers import PATIENCE, VethPair, programs_on, run, unique, wait_until

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
s.settimeout(float(sys.argv[6]))
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
            sock.settimeout(PATIENCE)
            peer = subprocess.Popen(veth.ns_cmd([sys.executable, "-c", PEER_UDP, family, host_ip, str(port),
                                                 str(COUNT), str(UDP_PAYLOAD), str(PATIENCE)]))
            for _ in range(COUNT):  # the peer is bound once its first datagram arrives
                sock.recvfrom(65536)
            for _ in range(COUNT):
                sock.sendto(bytes(UDP_PAYLOAD), (peer_ip, port))
            assert peer.wait(PATIENCE) == 0
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


@pytest.mark.host_only  # rates over the reads' own clock, in user space
def test_rates_cover_the_interval_since_the_previous_read_never_a_sliver(veth: VethPair) -> None:
    frame = 42 + UDP_PAYLOAD
    with FlowsProbe([veth.host]) as probe, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.sendto(bytes(UDP_PAYLOAD), (veth.peer_ip4, 9))
        port = sock.getsockname()[1]
        assert wait_until(lambda: any(f.local_port == port for f in probe.read().flows))
        time.sleep(MIN_RATE_WINDOW_NS / 1e9)
        probe.read()  # the baseline
        time.sleep(MIN_RATE_WINDOW_NS / 1e9)
        for _ in range(10):
            sock.sendto(bytes(UDP_PAYLOAD), (veth.peer_ip4, 9))
        snapshots = [probe.read(), probe.read()]  # the second comes a fraction of a millisecond later
    for snapshot in snapshots:
        flow = _flow(snapshot, "egress", "udp", port, 9)
        assert snapshot.interval_seconds >= MIN_RATE_WINDOW_NS / 1e9
        assert flow.bytes_per_second * snapshot.interval_seconds == pytest.approx(10 * frame)
        assert flow.packets_per_second * snapshot.interval_seconds == pytest.approx(10)


# --- the watched traffic keeps its offloads ---


def _offloads(veth: VethPair) -> dict[str, str]:
    out = veth.ns_run(["ethtool", "-k", veth.peer]).stdout
    return {name: state for line in out.splitlines() if ": " in line
            for name, state in [line.strip().split(": ", 1)]}


SEGMENTATION_OFFLOADS = ("tcp-segmentation-offload", "generic-segmentation-offload")


def test_veth_peer_keeps_tso_and_gso_while_attached_and_xdp_is_refused_on_veth(veth: VethPair, tc_kind: str) -> None:
    with FlowsProbe([veth.host], xdp_interfaces=["*"]) as probe:
        assert probe.loaded is not None and probe.loaded.obj.programs[XDP_PROGRAM].fd >= 0  # loaded where opted in
        (state,) = probe.attachments()
        assert (state.ingress, state.egress) == (tc_kind, tc_kind)
        assert state.xdp_refused.startswith("XDP refused on veth") and "TSO" in state.xdp_refused
        assert programs_on(veth.host) == OUR_TC_PROGRAMS
        offloads = _offloads(veth)
        assert [offloads[name] for name in SEGMENTATION_OFFLOADS] == ["on", "on"], offloads
    # What the refusal avoids: native XDP on the veth switches its peer's segmentation off.
    with BpfObject("flows", programs=["flows_xdp"]) as obj:
        obj.load()
        obj.programs["flows_xdp"].attach_xdp(veth.host_ifindex, "native")
        assert _offloads(veth)["tcp-segmentation-offload"].startswith("off")
    assert [_offloads(veth)[name] for name in SEGMENTATION_OFFLOADS] == ["on", "on"]


def test_xdp_refused_on_virtual_devices_with_a_reason() -> None:
    from aiprobe.netlink import LinkInfo
    from aiprobe.probes.flows.probe import xdp_refusal

    link = lambda kind, loopback=False: LinkInfo(7, "x", True, loopback, True, kind)  # noqa: E731
    assert xdp_refusal(link(None)) == ""
    assert "XDP refused on a virtual device (bridge)" in xdp_refusal(link("bridge"))
    assert "(loopback)" in xdp_refusal(link(None, loopback=True))


JUMBO_MTU = 9000  # a frame longer than a page: multi-buffer on a veth's XDP path


@pytest.mark.parametrize("mtu", [1500, JUMBO_MTU])
def test_xdp_program_attaches_and_counts_whole_frames_at_mtu(veth: VethPair, mtu: int) -> None:
    """Native XDP on a veth is what attaching to a NIC is, minus the NIC. At MTU 9000 the kernel
    refuses a single-buffer program (the refusal below): flows' takes multi-buffer frames, where
    the kernel has them."""
    if mtu == JUMBO_MTU and not xdp_multi_buffer():
        pytest.skip("this kernel lacks XDP multi-buffer (BPF_F_XDP_HAS_FRAGS, bpf_xdp_get_buff_len): "
                    "no XDP program attaches at an MTU above a page")
    run(["ip", "link", "set", veth.host, "mtu", str(mtu)])
    veth.ns_run(["ip", "link", "set", veth.peer, "mtu", str(mtu)])
    # Nothing but the test's datagrams may arrive: no IPv6 chatter, no ARP either way.
    veth.ns_run(["sysctl", "-qw", f"net.ipv6.conf.{veth.peer}.disable_ipv6=1"])
    host_mac = Path(f"/sys/class/net/{veth.host}/address").read_text().strip()
    peer_mac = veth.ns_run(["cat", f"/sys/class/net/{veth.peer}/address"]).stdout.strip()
    veth.ns_run(["ip", "neigh", "replace", veth.host_ip4, "lladdr", host_mac, "dev", veth.peer, "nud", "permanent"])
    run(["ip", "neigh", "replace", veth.peer_ip4, "lladdr", peer_mac, "dev", veth.host, "nud", "permanent"])
    if mtu == JUMBO_MTU:
        with BpfObject("features", programs=["probe_xdp"]) as single_buffer:
            single_buffer.load()
            with pytest.raises(BpfError):
                single_buffer.programs["probe_xdp"].attach_xdp(veth.host_ifindex, "native")
    payload = mtu - 100
    with BpfObject("flows", programs=[]) as obj:
        enable_xdp(obj)
        obj.load()
        obj.programs[XDP_PROGRAM].attach_xdp(veth.host_ifindex, "native")
        before = (_stat(veth.host, "rx_packets"), _stat(veth.host, "rx_bytes"))
        veth.ns_run([sys.executable, "-c", "import socket, sys\n"
                     "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                     "for _ in range(5): s.sendto(bytes(int(sys.argv[2])), (sys.argv[1], 9))",
                     veth.host_ip4, str(payload)])
        packets = _stat(veth.host, "rx_packets") - before[0]
        rx_bytes = _stat(veth.host, "rx_bytes") - before[1]
        ((_, counters),) = [(k, c) for k, c in KernelFlows(obj).items() if k.protocol == 17]
    frame = 14 + 20 + 8 + payload
    assert (counters.packets, counters.bytes) == (5, 5 * frame)
    # veth's XDP path counts received bytes after the Ethernet header was pulled: 14 bytes short per frame.
    assert packets == 5 and rx_bytes == 5 * (frame - 14)


def test_an_xdp_program_the_kernel_refuses_leaves_both_directions_at_tc(
        veth: VethPair, tc_kind: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """As a kernel without XDP multi-buffer refuses BPF_F_XDP_HAS_FRAGS: here a load flag no kernel
    knows, so every kernel refuses the XDP program for real."""
    def refused_xdp(obj: BpfObject) -> None:
        enable_xdp(obj)
        obj.programs[XDP_PROGRAM].flags |= 1 << 30

    monkeypatch.setattr(flows_probe, "enable_xdp", refused_xdp)
    with FlowsProbe([veth.host], xdp_interfaces=["*"]) as probe, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        (state,) = probe.attachments()
        assert (state.ingress, state.egress) == (tc_kind, tc_kind)
        assert state.xdp_refused.startswith("the XDP program did not load")
        assert programs_on(veth.host) == OUR_TC_PROGRAMS
        sock.sendto(bytes(UDP_PAYLOAD), (veth.peer_ip4, 9))
        assert wait_until(lambda: any(f.direction == "egress" and f.remote_port == 9 for f in probe.read().flows))
    assert "the XDP program did not load" in caplog.text


# --- wire segments: /proc/net/snmp and the interface counters, with TSO/GSO on ---

TCP_SEGMENT_HEADERS = 14 + 20 + 32  # Ethernet, IPv4, TCP with timestamps: what every data segment repeats
BULK = "256M"

PROBE_IN_NAMESPACE = """
import json, sys
from aiprobe.probes.flows.probe import FlowsProbe
with FlowsProbe([sys.argv[1]]) as probe:
    print("ready", flush=True)
    for _ in sys.stdin:
        print(json.dumps(probe.read().to_dict()), flush=True)
"""


@dataclass
class NamespacePair:
    """Namespaces `a` and `b` joined by a veth (veth-a in namespace a, veth-b in b), IPv4 only:
    each namespace's /proc/net/snmp counts exactly the traffic of the test."""

    a: str
    b: str
    ip_a: str = "198.19.250.1"
    ip_b: str = "198.19.250.2"

    def run(self, ns: str, cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        return run(["ip", "netns", "exec", ns, *cmd], **kwargs)

    def snmp(self, ns: str) -> dict[str, int]:
        """/proc/net/snmp of one namespace as {"Tcp.OutSegs": n, ...}."""
        lines = self.run(ns, ["cat", "/proc/net/snmp"]).stdout.splitlines()
        return {f"{names.split()[0][:-1]}.{name}": int(value)
                for names, values in zip(lines[::2], lines[1::2], strict=True)
                for name, value in zip(names.split()[1:], values.split()[1:], strict=True)}

    def link_stats(self) -> dict[str, int]:
        """veth-a's counters (sysfs of its own namespace)."""
        names = ("rx_packets", "rx_bytes", "tx_packets", "tx_bytes", "rx_dropped", "tx_dropped")
        out = self.run(self.a, ["cat", *(f"/sys/class/net/veth-a/statistics/{n}" for n in names)]).stdout
        return dict(zip(names, map(int, out.split()), strict=True))


@pytest.fixture
def namespaces() -> Iterator[NamespacePair]:
    pair = NamespacePair(unique("aipt-a-"), unique("aipt-b-"))
    try:
        for ns in (pair.a, pair.b):
            run(["ip", "netns", "add", ns])
            pair.run(ns, ["sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1",
                          "net.ipv6.conf.default.disable_ipv6=1"])
        run(["ip", "-n", pair.a, "link", "add", "name", "veth-a", "type", "veth", "peer", "name", "veth-b",
             "netns", pair.b])
        for ns, dev, ip in ((pair.a, "veth-a", pair.ip_a), (pair.b, "veth-b", pair.ip_b)):
            pair.run(ns, ["ip", "addr", "add", f"{ip}/24", "dev", dev])
            pair.run(ns, ["ip", "link", "set", dev, "up"])
        yield pair
    finally:
        for ns in (pair.a, pair.b):
            run(["ip", "netns", "del", ns], check=False)


def _tcp_totals(snapshot: dict, direction: str) -> tuple[int, int]:
    flows = [f for f in snapshot["flows"] if (f["direction"], f["protocol"]) == (direction, "tcp")]
    return sum(f["packets"] for f in flows), sum(f["bytes"] for f in flows)


def _sent_segments(before: dict[str, int], after: dict[str, int]) -> int:
    """Segments a namespace put on the wire: OutSegs leaves out retransmissions (RFC 4022 tcpOutSegs)."""
    return sum(after[k] - before[k] for k in ("Tcp.OutSegs", "Tcp.RetransSegs"))


@pytest.mark.slow_truth  # iperf3 through TSO/GSO: the exact counts of test_udp_datagrams_* cover each kernel
@pytest.mark.parametrize("data", ["egress", "ingress"])
def test_wire_segments_match_snmp_and_interface_counters(namespaces: NamespacePair, data: str) -> None:
    """iperf3 through a veth with TSO/GSO on: the probe (in namespace a, on veth-a) counts every
    TCP segment each namespace's /proc/net/snmp says it sent, and the interface counter (which counts
    a GSO skb as one packet) differs by exactly the headers of the extra segments."""
    ns = namespaces
    server = subprocess.Popen(["ip", "netns", "exec", ns.b, "iperf3", "-s", "-1", "-B", ns.ip_b],
                              stdout=subprocess.DEVNULL)
    probe = subprocess.Popen(["ip", "netns", "exec", ns.a, sys.executable, "-c", PROBE_IN_NAMESPACE, "veth-a"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert probe.stdout.readline().strip() == "ready"

        def sample() -> tuple[dict, dict, dict, dict]:
            probe.stdin.write("\n")
            probe.stdin.flush()
            return json.loads(probe.stdout.readline()), ns.snmp(ns.a), ns.snmp(ns.b), ns.link_stats()

        before = sample()
        assert wait_until(lambda: "LISTEN" in ns.run(ns.b, ["ss", "-tlnH"]).stdout)
        client = ns.run(ns.a, ["iperf3", "-c", ns.ip_b, "-n", BULK, "-J", *(["-R"] if data == "ingress" else [])])
        assert server.wait(PATIENCE) == 0
        after = sample()
    finally:
        probe.stdin.close()
        probe.wait(PATIENCE)
        server.kill()
    sent_by_a, sent_by_b = _sent_segments(before[1], after[1]), _sent_segments(before[2], after[2])
    egress, ingress = (tuple(x - y for x, y in zip(_tcp_totals(after[0], d), _tcp_totals(before[0], d), strict=True))
                       for d in ("egress", "ingress"))
    assert after[3]["rx_dropped"] == after[3]["tx_dropped"] == 0
    assert (egress[0], ingress[0]) == (sent_by_a, sent_by_b)
    data_segments, data_bytes = egress if data == "egress" else ingress
    side = "tx" if data == "egress" else "rx"
    assert data_segments > 2 * (after[3][f"{side}_packets"] - before[3][f"{side}_packets"])  # GSO at work
    assert data_bytes > json.loads(client.stdout)["end"]["sum_sent"]["bytes"]

    for direction, side in (("egress", "tx"), ("ingress", "rx")):
        (iface_before,) = [t for t in before[0]["interfaces"] if t["direction"] == direction]
        (iface_after,) = [t for t in after[0]["interfaces"] if t["direction"] == direction]
        wire_packets = iface_after["packets"] - iface_before["packets"]
        wire_bytes = iface_after["bytes"] - iface_before["bytes"]
        skbs = after[3][f"{side}_packets"] - before[3][f"{side}_packets"]
        skb_bytes = after[3][f"{side}_bytes"] - before[3][f"{side}_bytes"]
        # veth counts skb->len per skb, Ethernet header included: a GSO skb is one packet there.
        assert wire_bytes - skb_bytes == (wire_packets - skbs) * TCP_SEGMENT_HEADERS, direction


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
            assert wait_until(lambda: any(a.ingress and a.egress for a in probe.attachments()), timeout=2.0)
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


def test_a_flow_sending_between_reads_further_apart_than_its_idle_timeout_does_not_expire(veth: VethPair) -> None:
    """A frame stamps the clock the latest read wrote, not its own time (bpf/flows.bpf.c): reads paced
    further apart than the idle timeout must still not take that stamp for idleness."""
    with FlowsProbe([veth.host], idle_timeout=0.3) as probe, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.sendto(bytes(UDP_PAYLOAD), (veth.peer_ip4, 9))
        port = s.getsockname()[1]
        reads: list[FlowsSnapshot] = []

        def read() -> FlowsSnapshot:
            reads.append(probe.read())
            return reads[-1]
        # The frame leaves once the peer has answered ARP, which a loaded host may not have done yet.
        assert wait_until(lambda: any(f.local_port == port for f in read().flows))
        first = _flow(reads[-1], "egress", "udp", port, 9)
        for _ in range(20):  # a second of frames, 50 ms apart, then the next read at once
            time.sleep(0.05)
            s.sendto(bytes(UDP_PAYLOAD), (veth.peer_ip4, 9))
        later = _flow(probe.read(), "egress", "udp", port, 9)
    assert (later.first_seen, later.packets) == (first.first_seen, 21)


def test_an_idle_flow_keeps_its_record_at_rate_0_among_the_agents_top_flows(veth: VethPair) -> None:
    """The agent's probe records its `top` flows, the fastest then idle ones: a flow that stopped
    sending (a long-lived connection between its requests) keeps its record read after read, and in
    what a scrape reads, at rate 0 with its counts exact, until it expires."""
    frame = 42 + UDP_PAYLOAD
    with FlowsProbe([veth.host], top=SNAPSHOT_FLOWS) as probe, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _ in range(COUNT):
            s.sendto(bytes(UDP_PAYLOAD), (veth.peer_ip4, 9))
        port = s.getsockname()[1]
        assert wait_until(lambda: any(f.local_port == port and f.packets == COUNT for f in probe.read().flows))
        reads = []
        for _ in range(4):
            time.sleep(MIN_RATE_WINDOW_NS / 1e9)  # each read's rate is over a window in which the flow sent nothing
            reads += [probe.read(), probe.read_for_scrape()]
    for snapshot in reads:
        flow = _flow(snapshot, "egress", "udp", port, 9)
        assert (flow.packets, flow.bytes, flow.bytes_per_second) == (COUNT, COUNT * frame, 0.0)


def test_reads_between_paced_whole_reads_move_the_recorded_flows_and_their_interface_on(
        veth: VethPair, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a read_budget, a read before the whole table is due again reads the recorded flows only:
    the recorded flow's counts and its interface's totals move on by exactly what it sent, the other
    flow waits for the next whole read, and the rates stay those of the whole read."""
    monkeypatch.setattr(flows_probe, "MAX_READ_SECONDS", 3600.0)  # the next whole read: not in this test
    frame = 42 + UDP_PAYLOAD
    with FlowsProbe([veth.host], top=1, read_budget=1e-9) as probe, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as fast, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as slow:
        def send() -> None:
            for _ in range(COUNT):
                fast.sendto(bytes(UDP_PAYLOAD), (veth.peer_ip4, 9))
                fast.sendto(bytes(UDP_PAYLOAD), (veth.peer_ip4, 9))
                slow.sendto(bytes(UDP_PAYLOAD), (veth.peer_ip4, 9))
        send()
        port = fast.getsockname()[1]
        time.sleep(MIN_RATE_WINDOW_NS / 1e9)
        whole = probe.read()
        send()
        paced = probe.read()
    (before,), (after,) = whole.flows, paced.flows
    assert (before.local_port, before.packets) == (port, 2 * COUNT)
    assert (after.local_port, after.packets, after.bytes) == (port, 4 * COUNT, 4 * COUNT * frame)
    assert after.bytes_per_second == before.bytes_per_second > 0
    bytes_before, packets_before = _totals(whole, veth.host, "egress")
    assert _totals(paced, veth.host, "egress") == (bytes_before + 2 * COUNT * frame, packets_before + 2 * COUNT)


# --- detaching: SIGTERM, SIGKILL, foreign programs ---


OUR_TC_PROGRAMS = {"flows_ingress", "flows_egress"}


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
    assert programs_on(veth.host) == OUR_TC_PROGRAMS
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=10)
    if sig == signal.SIGTERM:
        assert proc.returncode == 0, err
        document = json.loads(out)  # the last snapshot, with the interface it was attached to
        assert [a["interface"] for a in document["attachments"]] == [veth.host]
    assert wait_until(lambda: not OUR_TC_PROGRAMS & programs_on(veth.host), timeout=3)


@pytest.mark.host_only  # command-line output: no kernel-specific path
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


@pytest.mark.realtime  # a rate over wall-clock intervals, against iperf3's
def test_cli_json_rate_is_the_last_intervals_rate_by_iperf3(veth: VethPair, aiprobe_cli: list[str]) -> None:
    """The final JSON read comes right after the last tick: its rate must still cover an interval
    (it read 0.0 when taken over the fraction of a millisecond since that tick)."""
    port, payload, rate = 5201 + secrets.randbelow(1000), 1000, 20_000_000
    server = subprocess.Popen(["iperf3", "-s", "-1", "-B", veth.host_ip4, "-p", str(port)], stdout=subprocess.DEVNULL)
    try:
        cli = _start_cli(aiprobe_cli, veth.host, "--json", "--duration", "3", "--interval", "1")
        client = veth.ns_run(["iperf3", "-c", veth.host_ip4, "-p", str(port), "-u", "-b", str(rate), "-l",
                              str(payload), "-t", "5", "-J"])
        out, err = cli.communicate(timeout=15)
        assert cli.returncode == 0, err
    finally:
        server.kill()
    sent = json.loads(client.stdout)["end"]["sum"]
    truth = sent["bytes"] / sent["seconds"] * (payload + 42) / payload  # on the wire: Ethernet, IPv4, UDP
    snapshot = json.loads(out)
    (flow,) = [f for f in snapshot["flows"] if (f["direction"], f["protocol"], f["local_port"]) ==
               ("ingress", "udp", port)]
    assert snapshot["interval_seconds"] >= 0.5
    assert flow["bytes_per_second"] == pytest.approx(truth, rel=0.15)


@pytest.mark.host_only  # command-line output: no kernel-specific path
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


def test_foreign_xdp_program_is_left_attached_and_tc_counts_both_ways(veth: VethPair, tc_kind: str) -> None:
    subprocess.run([sys.executable, "-c", FOREIGN_XDP, str(veth.host_ifindex)], check=True)
    assert programs_on(veth.host) == {"probe_xdp"}
    with FlowsProbe([veth.host]) as probe:
        (state,) = probe.attachments()
        assert (state.ingress, state.egress) == (tc_kind, tc_kind)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.bind((veth.host_ip4, 0))
            port = sock.getsockname()[1]
            veth.ns_run([sys.executable, "-c", f"import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM)"
                                               f".sendto(b'x', ('{veth.host_ip4}', {port}))"])
            sock.settimeout(5)
            sock.recvfrom(16)
            sock.sendto(bytes(UDP_PAYLOAD), (veth.peer_ip4, 9))
        snapshot = probe.read()
        assert _flow(snapshot, "egress", "udp", port, 9).packets == 1
        assert sum(f.packets for f in snapshot.flows if f.direction == "ingress" and f.local_port == port) == 1
    assert wait_until(lambda: programs_on(veth.host) == {"probe_xdp"})


# --- the clsact fallback: several aiprobes on one interface, leftovers of killed ones ---

CLSACT_INSTANCE = """
import json, sys
from aiprobe.probes.flows.probe import FlowsProbe
with FlowsProbe([sys.argv[1]], strategy="clsact") as probe:
    print(probe.attachments()[0].egress, flush=True)
    for _ in sys.stdin:  # each line: print the interface totals; end of input: detach and exit
        print(json.dumps({t.direction: [t.packets, t.bytes] for t in probe.read().interfaces}), flush=True)
"""


class ClsactInstance:
    """An aiprobe flows probe forced onto clsact, in a process of its own (its filter outlives a SIGKILL)."""

    def __init__(self, interface: str) -> None:
        self.interface = interface
        self.process = subprocess.Popen([sys.executable, "-c", CLSACT_INSTANCE, interface], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
        assert self.process.stdout.readline().strip() == "clsact"

    def counted_and_wire(self) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
        """(packets, bytes) per direction as this instance counted them and as the interface's own
        counters say, read with no frame in between."""
        while True:
            wire = _wire(self.interface)
            self.process.stdin.write("\n")
            self.process.stdin.flush()
            counted = json.loads(self.process.stdout.readline())
            if _wire(self.interface) == wire:
                return counted, wire

    def exit(self) -> None:
        self.process.stdin.close()
        assert self.process.wait(timeout=30) == 0

    def kill(self) -> None:
        """SIGKILL (nothing if it has exited already)."""
        self.process.kill()
        self.process.wait()


@contextmanager
def clsact_instances(interface: str) -> Iterator[Callable[[], ClsactInstance]]:
    """Starts instances on `interface` when called; SIGKILLs every one of them on the way out, so a
    failed test leaves no process behind (the test then checks what their exits left)."""
    started: list[ClsactInstance] = []

    def start() -> ClsactInstance:
        started.append(ClsactInstance(interface))
        return started[-1]

    try:
        yield start
    finally:
        for instance in started:
            instance.kill()


def _wire(interface: str) -> dict[str, list[int]]:
    return {"egress": [_stat(interface, "tx_packets"), _stat(interface, "tx_bytes")],
            "ingress": [_stat(interface, "rx_packets"), _stat(interface, "rx_bytes")]}


def _delta(after: dict[str, list[int]], before: dict[str, list[int]]) -> dict[str, list[int]]:
    return {d: [a - b for a, b in zip(after[d], before[d], strict=True)] for d in DIRECTIONS}


def _send_both_ways(veth: VethPair) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _ in range(COUNT):
            sock.sendto(bytes(UDP_PAYLOAD), (veth.peer_ip4, 9))
    send = "import socket, sys; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n" \
           f"for _ in range({COUNT}): s.sendto(bytes({UDP_PAYLOAD}), (sys.argv[1], 9))"
    veth.ns_run([sys.executable, "-c", send, veth.host_ip4])


def _assert_counts_the_wire(instances: list[ClsactInstance], veth: VethPair) -> None:
    """Each instance counts exactly what the interface counters count, both ways, while traffic flows."""
    before = [i.counted_and_wire() for i in instances]
    _send_both_ways(veth)
    for instance, (counted_before, wire_before) in zip(instances, before, strict=True):
        counted, wire = instance.counted_and_wire()
        moved = _delta(wire, wire_before)
        assert all(moved[d][0] >= COUNT for d in DIRECTIONS), moved
        assert _delta(counted, counted_before) == moved


def _filters(interface: str) -> str:
    return "".join(run(["tc", "filter", "show", "dev", interface, d]).stdout for d in DIRECTIONS)


def _our_handles(interface: str) -> list[str]:
    return sorted(h for h in re.findall(r"handle (0x[0-9a-f]+)", _filters(interface))
                  if int(h, 16) in TC_HANDLES)


@pytest.mark.slow_truth  # tc's netlink, alike on every kernel
def test_clsact_instances_side_by_side_each_keep_counting_and_leave_nothing(veth: VethPair) -> None:
    """Two aiprobes on one interface under clsact (a kernel without TCX, `aiprobe flows` beside the
    agent): each has its own filter, neither takes the other's for a leftover, and the one that
    stays keeps counting exactly what the interface counters count after the other exits."""
    with clsact_instances(veth.host) as start:
        first, second = start(), start()
        assert _our_handles(veth.host) == [hex(TC_HANDLES[0])] * 2 + [hex(TC_HANDLES[1])] * 2
        _assert_counts_the_wire([first, second], veth)
        first.exit()
        assert _our_handles(veth.host) == [hex(TC_HANDLES[1])] * 2
        _assert_counts_the_wire([second], veth)
        second.exit()
    assert _our_handles(veth.host) == [] and programs_on(veth.host) == set()


@pytest.mark.slow_truth  # tc's netlink, alike on every kernel
def test_clsact_leftover_of_a_killed_instance_is_removed_and_others_left_alone(veth: VethPair, caplog) -> None:
    """A SIGKILLed aiprobe leaves its clsact filters (netlink attachments outlive their process; bpf_links
    do not): the next start removes them and only them, not a live aiprobe's, not another tool's."""
    run(["tc", "qdisc", "add", "dev", veth.host, "clsact"])
    run(["tc", "filter", "add", "dev", veth.host, "egress", "prio", "7", "protocol", "all", "u32", "match",
         "u32", "0", "0"])
    with clsact_instances(veth.host) as start:
        live, killed = start(), start()
        killed.kill()
        assert _our_handles(veth.host) == [hex(TC_HANDLES[0])] * 2 + [hex(TC_HANDLES[1])] * 2
        with caplog.at_level(logging.WARNING, logger="aiprobe.probes.flows.probe"), \
                FlowsProbe([veth.host], strategy="clsact") as probe:
            removed = [r.getMessage() for r in caplog.records if "removed a stale aiprobe tc" in r.getMessage()]
            assert len(removed) == 2 and all(f"handle {hex(TC_HANDLES[1])}" in m for m in removed), removed
            assert _our_handles(veth.host) == [hex(TC_HANDLES[0])] * 2 + [hex(TC_HANDLES[1])] * 2
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                for _ in range(COUNT):
                    sock.sendto(bytes(UDP_PAYLOAD), (veth.peer_ip4, 9))
                port = sock.getsockname()[1]
            flow = _flow(probe.read(), "egress", "udp", port, 9)
            assert (flow.packets, flow.bytes) == (COUNT, COUNT * (42 + UDP_PAYLOAD))
            _assert_counts_the_wire([live], veth)
        live.exit()
    assert _our_handles(veth.host) == [] and programs_on(veth.host) == set()
    assert "pref 7 u32" in _filters(veth.host)


@pytest.mark.slow_truth  # tc's netlink, alike on every kernel
def test_clsact_exit_leaves_the_filter_of_another_instance_that_took_its_handle(veth: VethPair) -> None:
    """Someone removes an aiprobe's filters by hand and another aiprobe takes the freed handle: the
    first one's exit removes only filters that still run its own program."""
    with clsact_instances(veth.host) as start:
        first = start()
        for direction in DIRECTIONS:
            tc_clsact_detach(veth.host_ifindex, direction, handle=TC_HANDLES[0], priority=TC_PRIORITY)
        second = start()
        assert _our_handles(veth.host) == [hex(TC_HANDLES[0])] * 2
        first.exit()
        assert _our_handles(veth.host) == [hex(TC_HANDLES[0])] * 2
        _assert_counts_the_wire([second], veth)
        second.exit()
    assert _our_handles(veth.host) == [] and programs_on(veth.host) == set()


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
PASS_VERDICTS = {"flows_xdp": 2, "flows_ingress": 0xFFFFFFFF, "flows_egress": 0xFFFFFFFF}  # XDP_PASS, TC_ACT_UNSPEC


def _flow_entries(obj: BpfObject) -> list[dict]:
    return [decode(key) for key, _ in KernelFlows(obj).items()]


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


@pytest.mark.parametrize("ingress", ["flows_xdp", "flows_ingress"])
@pytest.mark.parametrize("case", sorted(WELL_FORMED))
def test_well_formed_frames_make_exactly_the_right_flow(case: str, ingress: str) -> None:
    import ipaddress

    frame, (family, protocol, src, dst, sport, dport) = WELL_FORMED[case]
    with BpfObject("flows", programs=[ingress, "flows_egress"]) as obj:
        obj.load()
        for program in (ingress, "flows_egress"):
            assert obj.programs[program].test_run(frame, repeat=3).retval == PASS_VERDICTS[program]
        keys = sorted(_flow_entries(obj), key=lambda k: k["direction"])
        values = [counters.packets for _, counters in KernelFlows(obj).items()]
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
        ((_, counters),) = KernelFlows(obj).items()
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
        usage, status = probe.map_usage()[0], probe.status()
    assert first.insert_failures > 0 and first.evictions > 0
    assert second.insert_failures > first.insert_failures and second.evictions > first.evictions
    assert len(second.flows) <= capacity
    # What was lost is said: the table's overflows, in the probe's status (the snapshot, top's header).
    assert (usage.map, usage.capacity) == ("flows", capacity)
    assert usage.overflows == second.insert_failures + second.evictions == status.overflows["flows"]
    assert "LOST" in header_lines({"probes": {"flows": status.to_dict()}})[-1]
    # Flows evicted or never inserted still count toward the interface.
    assert 2 * flows <= _totals(second, veth.host, "egress")[1] <= sent + 2


def test_a_socket_whose_flow_was_deleted_leaves_the_flow_that_took_its_slot_alone(veth: VethPair) -> None:
    """A socket's egress frames count through the slot it cached (bpf/flows.bpf.c). Once user space
    deletes its flow (as it expires idle ones) and the next new flow takes the slot, the socket's
    frames make a flow of their own: each flow counts exactly its own datagrams."""
    frame = 14 + 20 + 8 + UDP_PAYLOAD
    with FlowsProbe([veth.host]) as probe, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as old, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as new:
        flows = KernelFlows(probe.loaded.obj)

        def egress(port: int) -> list[tuple[Any, Any]]:
            return [(key, counters) for key, counters in flows.items()
                    if (key.direction, key.protocol, key.remote_port) == (1, 17, port)]

        for _ in range(3):
            old.sendto(bytes(UDP_PAYLOAD), (veth.peer_ip4, 9))
        ((key, counters),) = egress(9)
        freed = flows.slots.lookup(key).value
        assert counters.packets == 3 and flows.pop(key).packets == 3
        for _ in range(5):
            new.sendto(bytes(UDP_PAYLOAD), (veth.peer_ip4, 10))
        ((key, _),) = egress(10)
        assert flows.slots.lookup(key).value == freed  # the next new flow took the slot
        for _ in range(7):
            old.sendto(bytes(UDP_PAYLOAD), (veth.peer_ip4, 9))
        (_, old_counters), = egress(9)
        (_, new_counters), = egress(10)
    assert (old_counters.packets, old_counters.bytes) == (7, 7 * frame)
    assert (new_counters.packets, new_counters.bytes) == (5, 5 * frame)


PEER_CONNECTED_UDP = """
import socket, sys
host, port, count, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("0.0.0.0", port))
s.connect((host, port))  # a connected socket's datagrams carry its hash
s.settimeout(float(sys.argv[5]))
for _ in range(count):
    s.send(bytes(size))
for _ in range(count):
    s.recv(65536)
"""


def test_hints_that_point_at_another_flow_leave_it_alone(veth: VethPair) -> None:
    """A frame without a sending socket counts through the slot its hash's hint holds when that is its
    flow's (flow_hints, bpf/flows.bpf.c). With every hint pointing at one flow's slot, the frames of
    another flow count exactly as their own each way, and the inbound flow's hint ends up holding its
    slot (outbound frames have their socket's cache)."""
    frame, port = 14 + 20 + 8 + UDP_PAYLOAD, 40010
    with FlowsProbe([veth.host]) as probe, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as decoy, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        flows, hints = KernelFlows(probe.loaded.obj), probe.loaded.obj.maps["flow_hints"]
        for _ in range(3):
            decoy.sendto(bytes(UDP_PAYLOAD), (veth.peer_ip4, 9))
        (decoy_key,) = [key for key, _ in flows.items() if key.remote_port == 9]
        decoy_slot = flows.slots.lookup(decoy_key).value
        for index in range(hints.max_entries):
            hints.update(index, decoy_slot)
        sock.bind((veth.host_ip4, port))
        sock.connect((veth.peer_ip4, port))
        sock.settimeout(PATIENCE)
        peer = subprocess.Popen(veth.ns_cmd([sys.executable, "-c", PEER_CONNECTED_UDP, veth.host_ip4, str(port),
                                             str(COUNT), str(UDP_PAYLOAD), str(PATIENCE)]))
        for _ in range(COUNT):
            sock.recv(65536)
        for _ in range(COUNT):
            sock.send(bytes(UDP_PAYLOAD))
        assert peer.wait(PATIENCE) == 0
        counted = {(key.direction, key.remote_port): (counters.packets, counters.bytes)
                   for key, counters in flows.items() if key.protocol == socket.IPPROTO_UDP}
        (inbound,) = [key for key, _ in flows.items() if (key.direction, key.remote_port) == (0, port)]
        slot = flows.slots.lookup(inbound).value
        held = {hints.lookup(index).value for index in range(hints.max_entries)}
    assert counted == {(1, 9): (3, 3 * frame), (0, port): (COUNT, COUNT * frame), (1, port): (COUNT, COUNT * frame)}
    assert slot != decoy_slot and slot in held


def test_frames_no_table_can_hold_are_counted_as_lost() -> None:
    arp = frames.ethernet(frames.ETH_P_ARP, bytes(28))
    with BpfObject("flows", programs=list(OUR_TC_PROGRAMS)) as obj:
        obj.maps["unattributed"].max_entries = 1
        obj.load()
        obj.programs["flows_egress"].test_run(arp, repeat=3)  # takes the only entry
        obj.programs["flows_ingress"].test_run(arp, repeat=5)  # another direction: no room
        lost = [decode(per_cpu) for per_cpu in obj.maps["lost"].lookup(0)]
        assert _unattributed(obj)["packets"] == 3
    assert sum(x["packets"] for x in lost) == 5 and sum(x["bytes"] for x in lost) == 5 * len(arp)


def test_loopback_is_watched_when_asked(tc_kind: str) -> None:
    """lo frames carry a (zeroed) Ethernet header, so `--interfaces lo` counts them like any NIC's."""
    with FlowsProbe(interfaces=["lo"], exclude=[]) as probe, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        assert [(a.ingress, a.egress) for a in probe.attachments()] == [(tc_kind, tc_kind)]
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


# --- /metrics against a real Prometheus scraping every second, while flows churn and expire ---

CHURN_SENDER = """
import json, socket, sys, time
host, steady_port, churn_base, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
RATE, PAYLOAD = 400, bytes(1000)  # the steady flow: datagrams per second
# Each second a new set of churn flows starts at these fractions of the steady rate and stops a second later:
# the fastest outranks the steady flow, the others do not.
CHURN = (1.5, 0.8, 0.5)


def udp(port):  # unconnected: the host's port unreachable replies must not fail the next send
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    return lambda: s.sendto(PAYLOAD, (host, port))


steady, sent, start = udp(steady_port), 0, time.monotonic()
churn, period = [], -1
churn_sent = []
while (elapsed := time.monotonic() - start) < seconds:
    if int(elapsed) != period:
        period = int(elapsed)
        churn = [udp(churn_base + 10 * period + j) for j in range(len(CHURN))]
        churn_sent = [0] * len(CHURN)
    while sent < int(elapsed * RATE):
        steady()
        sent += 1
    for j, share in enumerate(CHURN):
        while churn_sent[j] < int((elapsed - period) * RATE * share):
            churn[j]()
            churn_sent[j] += 1
    time.sleep(0.002)
print(json.dumps({"datagrams": sent, "seconds": time.monotonic() - start}), flush=True)
"""
CHURN_SECONDS = 14


def _samples(prom: object, promql: str) -> dict[tuple, dict[float, float]]:
    """Raw samples of every series matching `promql`: {labels: {scrape timestamp: value}}."""
    return {tuple(sorted(series["metric"].items())): {float(t): float(v) for t, v in series["values"]}
            for series in prom.query(f"{promql}[{CHURN_SECONDS + 30}s]")}


@pytest.mark.host_only  # exporter bookkeeping, scraped by a real Prometheus
def test_flow_series_add_up_to_the_interface_at_every_scrape_while_flows_churn(
    tmp_path: Path, veth: VethPair
) -> None:
    from servers import Agent, Prometheus

    steady_port, churn_base = 7000, 20000
    config = (f'interfaces = ["{veth.host}"]\nexclude = []\nprobes = ["flows"]\ntop_flows = 2\n'
              "flow_idle_seconds = 2.0\n")
    with Agent(tmp_path, config) as agent, Prometheus(tmp_path, [agent.target]) as prom:
        prom.wait_for_series(f'aiprobe_interface_bytes_total{{interface="{veth.host}"}}')
        started = time.time()
        sender = veth.ns_run([sys.executable, "-c", CHURN_SENDER, veth.host_ip4, str(steady_port), str(churn_base),
                              str(CHURN_SECONDS)])
        stopped = time.time()
        time.sleep(3)  # two more scrapes, and the churn flows expire
        selector = f'{{interface="{veth.host}",direction="ingress"}}'
        flows = _samples(prom, f"aiprobe_flow_bytes_total{selector}")
        (interface,) = _samples(prom, f"aiprobe_interface_bytes_total{selector}").values()
    scrapes = sorted(interface)
    # Raw values at every scrape: the flow series (top K and "other") sum to the interface counter.
    for at in scrapes:
        assert sum(series.get(at, 0.0) for series in flows.values()) == interface[at], at
    # Counters: never down; with steady traffic, never flat from one 1 s scrape to the next.
    for series in [interface, *flows.values()]:
        values = [series[at] for at in sorted(series)]
        assert values == sorted(values)
    busy = [at for at in scrapes if started + 2 <= at <= stopped]  # the sender takes a moment to start
    assert len(busy) >= CHURN_SECONDS - 4
    assert all(interface[b] > interface[a] for a, b in itertools.pairwise(busy))
    # The steady flow stays in the top K once in (sticky), and its counter keeps its exact pace.
    (steady,) = [s for labels, s in flows.items() if ("local_port", str(steady_port)) in labels]
    held = sorted(steady)
    assert held == [at for at in scrapes if held[0] <= at <= held[-1]]
    assert set(busy) <= set(held)
    truth = json.loads(sender.stdout)
    frame_rate = truth["datagrams"] / truth["seconds"] * (1000 + 42)
    measured = (steady[busy[-1]] - steady[busy[0]]) / (busy[-1] - busy[0])
    assert measured == pytest.approx(frame_rate, rel=0.1)
