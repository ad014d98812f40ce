"""Kernel TCP counters from /proc/net/netstat and /proc/net/snmp: listen-queue overflows and drops,
retransmitted and sent segments. Host-wide (the agent runs in the host network namespace)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class TcpCounters:
    listen_overflows: int
    listen_drops: int
    retransmitted_segments: int
    sent_segments: int

    def to_dict(self) -> dict:
        return asdict(self)


def _parse(text: str) -> dict[tuple[str, str], int]:
    """Pairs of 'Prefix: names' / 'Prefix: values' lines -> {(prefix, name): value}."""
    lines = text.splitlines()
    values: dict[tuple[str, str], int] = {}
    for header, data in zip(lines[::2], lines[1::2], strict=False):
        prefix, names = header.split(":", 1)
        for name, value in zip(names.split(), data.split(":", 1)[1].split(), strict=False):
            values[(prefix, name)] = int(value)
    return values


def read_tcp_counters(proc_net: Path = Path("/proc/net")) -> TcpCounters:
    values = _parse((proc_net / "netstat").read_text()) | _parse((proc_net / "snmp").read_text())
    return TcpCounters(
        listen_overflows=values.get(("TcpExt", "ListenOverflows"), 0),
        listen_drops=values.get(("TcpExt", "ListenDrops"), 0),
        retransmitted_segments=values.get(("Tcp", "RetransSegs"), 0),
        sent_segments=values.get(("Tcp", "OutSegs"), 0),
    )
