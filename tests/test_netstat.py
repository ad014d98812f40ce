"""The TCP counters probe (/proc/net/netstat, /proc/net/snmp): its parser on a captured file, without
root, and the real files against the kernel's own view of them (`nstat`-style counters only grow)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from aiprobe.loader import ProbeUnavailable
from aiprobe.probes.netstat.probe import NetstatProbe, parse, read_tcp_counters

NETSTAT = """TcpExt: SyncookiesSent ListenOverflows ListenDrops
TcpExt: 0 7 9
"""
SNMP = """Ip: Forwarding DefaultTTL
Ip: 1 64
Tcp: RtoAlgorithm OutSegs RetransSegs
Tcp: 1 1000 12
"""


def test_parse_pairs_header_and_value_lines() -> None:
    assert parse(NETSTAT) == {("TcpExt", "SyncookiesSent"): 0, ("TcpExt", "ListenOverflows"): 7,
                              ("TcpExt", "ListenDrops"): 9}


def test_counters_from_captured_files(tmp_path: Path) -> None:
    (tmp_path / "netstat").write_text(NETSTAT)
    (tmp_path / "snmp").write_text(SNMP)
    probe = NetstatProbe(tmp_path)
    with probe:
        assert probe.status().to_dict() == {"up": True, "strategy": "procfs", "span": probe.status().span,
                                            "reason": "", "overflows": {}}
        assert probe.read().to_dict() == {"listen_overflows": 7, "listen_drops": 9, "retransmitted_segments": 12,
                                          "sent_segments": 1000}


def test_missing_files_make_the_probe_unavailable_with_a_reason(tmp_path: Path) -> None:
    probe = NetstatProbe(tmp_path)
    with pytest.raises(ProbeUnavailable):
        probe.start()
    status = probe.status()
    assert not status.up and "netstat" in status.reason


def test_real_counters_grow_with_real_segments() -> None:
    before = read_tcp_counters()
    server = socket.create_server(("127.0.0.1", 0))
    with socket.create_connection(server.getsockname()) as client, server.accept()[0] as peer:
        client.sendall(b"x" * 10)
        assert peer.recv(10)
    server.close()
    after = read_tcp_counters()
    assert after.sent_segments >= before.sent_segments + 3  # SYN, ACK, data at least
