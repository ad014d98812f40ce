"""Listening TCP sockets and their queues from the kernel's sock_diag (NETLINK_SOCK_DIAG), as `ss -lnt`
reads them, with no BPF: for a socket in LISTEN, idiag_rqueue is its accept queue's length (connections
complete, waiting for accept()) and idiag_wqueue the backlog in force (listen()'s, capped by somaxconn);
requests in SYN_RECV are dumped one by one (the half-open connections). Sockets of this network
namespace only (the agent's: the host's). A message that does not parse is skipped alone.

Each socket's owner is found through its inode in /proc/<pid>/fd: processes and descriptors come and go
during the scan, and whatever vanishes leaves that socket without an owner, nothing more."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ...names import ip_text

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
TCP_SYN_RECV, TCP_LISTEN = 3, 10

_NLMSG = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, sequence, port id
_REQUEST = struct.Struct("=BBBxI48x")  # inet_diag_req_v2: family, protocol, extensions, states, an empty id
_ADDRESSES = struct.Struct(">HH16s16s")  # inet_diag_sockid: ports (network order), addresses
_TAIL = struct.Struct("=IIIIIIII")  # the id's interface and cookie, expires, rqueue, wqueue, uid, inode
DIAG_MESSAGE_SIZE = 4 + _ADDRESSES.size + _TAIL.size  # struct inet_diag_msg, 72 bytes
_RECEIVE_BYTES = 1 << 16
DUMP_TIMEOUT_SECONDS = 5.0  # a dump the kernel never ends fails that read (TimeoutError), not the agent
FAMILIES: dict[int, str] = {int(socket.AF_INET): "ipv4", int(socket.AF_INET6): "ipv6"}


@dataclass(frozen=True)
class DiagSocket:
    """One socket (or request) sock_diag reported."""

    family: int
    state: int
    local_address: str
    local_port: int
    receive_queue: int  # LISTEN: the accept queue's length
    send_queue: int  # LISTEN: the accept queue's capacity (the backlog in force)
    inode: int  # 0 for requests
    cookie: int


def parse_message(family: int, data: bytes) -> DiagSocket | None:
    """A struct inet_diag_msg, or None when it is too short or names another family."""
    if len(data) < DIAG_MESSAGE_SIZE or data[0] != family:
        return None
    state = data[1]
    local_port, _remote_port, local, _remote = _ADDRESSES.unpack_from(data, 4)
    _ifindex, cookie_low, cookie_high, _expires, rqueue, wqueue, _uid, inode = \
        _TAIL.unpack_from(data, 4 + _ADDRESSES.size)
    return DiagSocket(family, state, ip_text(local, family == socket.AF_INET6), local_port, rqueue, wqueue, inode,
                      cookie_low | cookie_high << 32)


def _request(family: int, states: int, sequence: int) -> bytes:
    body = _REQUEST.pack(family, socket.IPPROTO_TCP, 0, states)
    return _NLMSG.pack(_NLMSG.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, sequence, 0) + body


def _messages(buffer: bytes) -> Iterator[tuple[int, bytes]]:
    """(type, payload) of each netlink message in one datagram."""
    offset = 0
    while offset + _NLMSG.size <= len(buffer):
        length, kind, _flags, _sequence, _port = _NLMSG.unpack_from(buffer, offset)
        if length < _NLMSG.size:
            return
        yield kind, buffer[offset + _NLMSG.size:offset + length]
        offset += (length + 3) & ~3


def dump(family: int, states: Iterable[int]) -> list[DiagSocket]:
    """Every TCP socket of `family` in one of `states`; OSError when the kernel refuses the dump."""
    mask = sum(1 << state for state in set(states))
    found: list[DiagSocket] = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_SOCK_DIAG) as sock:
        sock.settimeout(DUMP_TIMEOUT_SECONDS)
        sock.sendto(_request(family, mask, 1), (0, 0))
        while True:
            for kind, payload in _messages(sock.recv(_RECEIVE_BYTES)):
                if kind == NLMSG_DONE:
                    return found
                if kind == NLMSG_ERROR:
                    code = -struct.unpack_from("=i", payload)[0] if len(payload) >= 4 else errno.EIO
                    raise OSError(code, f"sock_diag: {os.strerror(code)}")
                if kind == SOCK_DIAG_BY_FAMILY and (parsed := parse_message(family, payload)) is not None:
                    found.append(parsed)


def listening(families: Iterable[int] = FAMILIES) -> list[DiagSocket]:
    """Listening sockets and half-open requests (SYN_RECV) of every family."""
    return [s for family in families for s in dump(family, (TCP_LISTEN, TCP_SYN_RECV))]


def socket_inode(link: str) -> int | None:
    """The inode of a descriptor's link text, "socket:[12345]"; None for anything else."""
    if not (link.startswith("socket:[") and link.endswith("]")):
        return None
    digits = link[len("socket:["):-1]
    return int(digits) if digits.isdigit() else None


def owners(inodes: set[int], proc: Path = Path("/proc")) -> dict[int, int]:
    """inode -> the lowest pid holding that socket (a pre-forking server's parent), for those found.
    Processes are read in pid order and the scan stops once every inode has its owner."""
    found: dict[int, int] = {}
    with contextlib.suppress(OSError):
        pids = sorted(int(name) for name in os.listdir(proc) if name.isdigit())
        for pid in pids:
            if len(found) == len(inodes):
                break
            for inode in _held(proc / str(pid) / "fd"):
                if inode in inodes:
                    found.setdefault(inode, pid)
    return found


def _held(fd_dir: Path) -> Iterator[int]:
    """The socket inodes one process holds; nothing when it is gone or hidden from us."""
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return
    for name in names:
        with contextlib.suppress(OSError):
            inode = socket_inode(os.readlink(fd_dir / name))
            if inode is not None:
                yield inode
