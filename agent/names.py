"""Kernel values as people read them: IP addresses, host:port endpoints, task names. One place, so
flows, sendlat, cuda, the agent and `top` print them alike."""

from __future__ import annotations

import functools
import socket
from pathlib import Path


@functools.lru_cache(maxsize=65536)
def ip_text(packed: bytes, ipv6: bool) -> str:
    """An address from its 16-byte field (IPv4 in the first 4). Cached: a busy host's flows share
    few addresses, and the agent formats every flow every second."""
    return socket.inet_ntop(socket.AF_INET6, packed) if ipv6 else socket.inet_ntop(socket.AF_INET, packed[:4])


def endpoint(address: str | None, port: int | None) -> str | None:
    """`host:port`, `[v6]:port`, or the bare host when there is no port (ICMP)."""
    if address is None:
        return None
    host = f"[{address}]" if ":" in address else address
    return f"{host}:{port}" if port else host


def comm_text(raw: bytes) -> str:
    """A task's comm as the kernel stores it (NUL-padded bytes)."""
    return raw.split(b"\0", 1)[0].decode(errors="replace")


def process_name(pid: int) -> str:
    """The kernel's name of a running process (its comm), or "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""
