"""Kernel values as people read them: IP addresses, host:port endpoints, task names. One place, so
flows, sendlat, cuda, the agent and `top` print them alike."""

from __future__ import annotations

import functools
import socket
from pathlib import Path
from typing import Any


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


# Characters that move a terminal's cursor, change its title or colours, or reorder text: C0 and C1
# controls, DEL, and Unicode's invisible direction overrides and isolates.
_UNPRINTABLE = {code: f"\\x{code:02x}" for code in (*range(0x20), *range(0x7f, 0xa0))} | {
    code: f"\\u{code:04x}" for code in (*range(0x200b, 0x2010), *range(0x202a, 0x202f), *range(0x2066, 0x206a))
}


def printable(text: str) -> str:
    """`text` from another process (a name, a path) safe to print: control characters escaped."""
    return text.translate(_UNPRINTABLE)


def printable_document(value: Any) -> Any:
    """A JSON document from elsewhere (an agent's snapshot) with every string made `printable`."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, list):
        return [printable_document(item) for item in value]
    if isinstance(value, dict):
        return {printable(str(key)): printable_document(item) for key, item in value.items()}
    return value


def text_of(raw: bytes) -> str:
    """Bytes another process chose (a name, a cgroup or library path) as printable text: invalid
    UTF-8 replaced, control characters escaped."""
    return printable(raw.decode(errors="replace"))


@functools.lru_cache(maxsize=4096)  # a refresh names every entry of every map: a few names, decoded once
def comm_text(raw: bytes) -> str:
    """A task's comm as the kernel stores it (NUL-padded bytes)."""
    return text_of(raw.split(b"\0", 1)[0])


def process_name(pid: int) -> str:
    """The kernel's name of a running process (its comm), or "" once it is gone."""
    try:
        return text_of(Path(f"/proc/{pid}/comm").read_bytes().removesuffix(b"\n"))
    except OSError:
        return ""
