"""Kernel TCP counters from /proc/net/netstat and /proc/net/snmp: listen-queue overflows and drops,
retransmitted and sent segments. Host-wide (the agent runs in the host network namespace), so the
probe always runs: one read of two small files per refresh."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ...loader import ProbeUnavailable, Strategy
from ...metrics import Family
from ...model import ProbeStatus
from ...registry import Probe, ProbeSpec
from .hooks import NetstatHooks
from .records import TcpCounters
from .rules import LISTEN_QUEUE_OVERFLOW, TCP_RETRANSMITS_HIGH

if TYPE_CHECKING:
    from ...config import Config

SPAN = "/proc/net/netstat and /proc/net/snmp at each read"


def parse(text: str) -> dict[tuple[str, str], int]:
    """Pairs of 'Prefix: names' / 'Prefix: values' lines -> {(prefix, name): value}."""
    lines = text.splitlines()
    values: dict[tuple[str, str], int] = {}
    for header, data in zip(lines[::2], lines[1::2], strict=False):
        prefix, names = header.split(":", 1)
        for name, value in zip(names.split(), data.split(":", 1)[1].split(), strict=False):
            values[(prefix, name)] = int(value)
    return values


def read_tcp_counters(proc_net: Path = Path("/proc/net")) -> TcpCounters:
    values = parse((proc_net / "netstat").read_text()) | parse((proc_net / "snmp").read_text())
    return TcpCounters(
        listen_overflows=values.get(("TcpExt", "ListenOverflows"), 0),
        listen_drops=values.get(("TcpExt", "ListenDrops"), 0),
        retransmitted_segments=values.get(("Tcp", "RetransSegs"), 0),
        sent_segments=values.get(("Tcp", "OutSegs"), 0),
    )


class NetstatProbe(Probe):
    """The counters, read from `proc_net` at each `read()`."""

    def __init__(self, proc_net: Path = Path("/proc/net")) -> None:
        super().__init__()
        self.proc_net = proc_net
        self.reason = "not started"

    def start(self) -> None:
        try:
            read_tcp_counters(self.proc_net)
        except (OSError, ValueError) as exc:
            self.reason = f"{self.proc_net}: {exc}"
            raise ProbeUnavailable("netstat", {"procfs": self.reason}) from None
        self.reason = ""

    def read(self) -> TcpCounters:
        return read_tcp_counters(self.proc_net)

    def status(self) -> ProbeStatus:
        return ProbeStatus(False, reason=self.reason) if self.reason else ProbeStatus(True, "procfs", SPAN)

    def close(self) -> None:
        self.reason = self.reason or "closed"


def _from_config(_config: Config) -> Probe:
    return NetstatProbe()


def _counter(name: str, field: str, help_text: str) -> Family:
    return Family(name, "counter", help_text, TcpCounters, field)


SPEC = ProbeSpec(
    name="netstat",
    description="host TCP counters: listen-queue overflows and drops, retransmitted and sent segments",
    strategies=(Strategy("procfs", span=SPAN),),
    order=60,
    factory=_from_config,
    always=True,
    metrics=(
        _counter("aiprobe_tcp_listen_overflows_total", "listen_overflows",
                 "Connections dropped because a listen queue was full (TcpExt ListenOverflows)."),
        _counter("aiprobe_tcp_listen_drops_total", "listen_drops",
                 "Connection requests dropped at listen sockets (TcpExt ListenDrops)."),
        _counter("aiprobe_tcp_retransmitted_segments_total", "retransmitted_segments",
                 "TCP segments retransmitted (Tcp RetransSegs)."),
        _counter("aiprobe_tcp_sent_segments_total", "sent_segments", "TCP segments sent (Tcp OutSegs)."),
    ),
    hooks=NetstatHooks(),
    rules=(LISTEN_QUEUE_OVERFLOW, TCP_RETRANSMITS_HIGH),
)
