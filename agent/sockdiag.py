"""The kernel's sockets from sock_diag (NETLINK_SOCK_DIAG), as `ss` reads them, with no BPF: each with
its addresses, state, queues and inode, of this network namespace only (the agent's: the host's).

For a socket in LISTEN, idiag_rqueue is its accept queue's length (connections complete, waiting for
accept()) and idiag_wqueue the backlog in force (listen()'s, capped by somaxconn). Requests in SYN_RECV
are dumped one by one with the connected sockets (the half-open connections), since both make the
kernel walk its whole established hash. Connected sockets come with their struct tcp_info
(INET_DIAG_INFO) where asked: the smoothed RTT and the segments retransmitted, as `ss -ti` prints them.
A message that does not parse is skipped alone; a tcp_info missing or too short leaves that socket
without one.

A socket's owner is found through its inode in /proc/<pid>/fd: processes and descriptors come and go
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

from .names import ip_text

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
TCP_ESTABLISHED, TCP_SYN_RECV, TCP_TIME_WAIT, TCP_LISTEN, TCP_NEW_SYN_RECV = 1, 3, 6, 10, 12
# Full sockets past the handshake that may still send (and retransmit): ESTABLISHED, FIN_WAIT1, FIN_WAIT2,
# CLOSE_WAIT, LAST_ACK, CLOSING (TIME_WAIT ones have no tcp_info).
CONNECTED = (TCP_ESTABLISHED, 4, 5, 8, 9, 11)
ALL_STATES = range(32)  # a dump of every socket (a UDP socket is ESTABLISHED when connected, CLOSE when not)
INET_DIAG_INFO = 2  # the attribute holding struct tcp_info; requested as extension bit INET_DIAG_INFO - 1

_NLMSG = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, sequence, port id
_REQUEST = struct.Struct("=BBBxI48x")  # inet_diag_req_v2: family, protocol, extensions, states, an empty id
_ADDRESSES = struct.Struct(">HH16s16s")  # inet_diag_sockid: ports (network order), addresses
_TAIL = struct.Struct("=IIIIIIII")  # the id's interface and cookie, expires, rqueue, wqueue, uid, inode
DIAG_MESSAGE_SIZE = 4 + _ADDRESSES.size + _TAIL.size  # struct inet_diag_msg, 72 bytes
_ATTRIBUTE = struct.Struct("=HH")  # struct rtattr: length (header included), type
_U32 = struct.Struct("=I")
TCPI_RTT_OFFSET, TCPI_TOTAL_RETRANS_OFFSET = 68, 100  # in struct tcp_info (linux/tcp.h, stable ABI)
TCP_INFO_MIN_SIZE = TCPI_TOTAL_RETRANS_OFFSET + 4
_RECEIVE_BYTES = 1 << 16
DUMP_TIMEOUT_SECONDS = 5.0  # a dump the kernel never ends fails that read (TimeoutError), not the agent
FAMILIES: dict[int, str] = {int(socket.AF_INET): "ipv4", int(socket.AF_INET6): "ipv6"}


@dataclass(frozen=True)
class TcpInfo:
    """What the connections probe reads of a connection's struct tcp_info."""

    rtt_us: int  # tcpi_rtt: the smoothed RTT, 0 before the first sample
    total_retrans: int  # tcpi_total_retrans: segments retransmitted over the connection's life


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
    info: TcpInfo | None = None  # connected sockets dumped with INET_DIAG_INFO; None where absent or short
    remote_address: str = ""  # the peer; the wildcard and port 0 where there is none (LISTEN, unconnected UDP)
    remote_port: int = 0


def parse_message(family: int, data: bytes) -> DiagSocket | None:
    """A struct inet_diag_msg, or None when it is too short or names another family."""
    if len(data) < DIAG_MESSAGE_SIZE or data[0] != family:
        return None
    state = data[1]
    local_port, remote_port, local, remote = _ADDRESSES.unpack_from(data, 4)
    _ifindex, cookie_low, cookie_high, _expires, rqueue, wqueue, _uid, inode = \
        _TAIL.unpack_from(data, 4 + _ADDRESSES.size)
    ipv6 = family == socket.AF_INET6
    return DiagSocket(family, state, ip_text(local, ipv6), local_port, rqueue, wqueue, inode,
                      cookie_low | cookie_high << 32, tcp_info(data), ip_text(remote, ipv6), remote_port)


def tcp_info(data: bytes) -> TcpInfo | None:
    """The INET_DIAG_INFO attribute after a struct inet_diag_msg; None when absent, short or malformed."""
    offset = DIAG_MESSAGE_SIZE
    while offset + _ATTRIBUTE.size <= len(data):
        length, kind = _ATTRIBUTE.unpack_from(data, offset)
        if length < _ATTRIBUTE.size or offset + length > len(data):
            return None
        if kind == INET_DIAG_INFO:
            if length - _ATTRIBUTE.size < TCP_INFO_MIN_SIZE:
                return None
            start = offset + _ATTRIBUTE.size
            return TcpInfo(_U32.unpack_from(data, start + TCPI_RTT_OFFSET)[0],
                           _U32.unpack_from(data, start + TCPI_TOTAL_RETRANS_OFFSET)[0])
        offset += (length + 3) & ~3
    return None


def _request(family: int, protocol: int, states: int, sequence: int, extensions: int = 0) -> bytes:
    body = _REQUEST.pack(family, protocol, extensions, states)
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


def dump(family: int, states: Iterable[int], extensions: int = 0,
         protocol: int = socket.IPPROTO_TCP) -> list[DiagSocket]:
    """Every socket of `family` and `protocol` in one of `states` (with the attributes `extensions` asks
    for); OSError when the kernel refuses the dump (UDP's needs udp_diag, a module the kernel loads)."""
    mask = sum(1 << state for state in set(states))
    found: list[DiagSocket] = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_SOCK_DIAG) as sock:
        sock.settimeout(DUMP_TIMEOUT_SECONDS)
        sock.sendto(_request(family, protocol, mask, 1, extensions), (0, 0))
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
    """Listening sockets of every family: the kernel reads its listening hash only, a few µs."""
    return [s for family in families for s in dump(family, (TCP_LISTEN,))]


def connection_table(families: Iterable[int] = FAMILIES) -> list[DiagSocket]:
    """Half-open requests (SYN_RECV) and connected sockets (CONNECTED) of every family, the latter with
    their tcp_info where the kernel gave one. The kernel walks its whole established hash for any of
    these states, however few sockets it holds: ~2.6 ms a family on a 24 GiB host (262,144 buckets)."""
    return [s for family in families for s in dump(family, (TCP_SYN_RECV, *CONNECTED), 1 << (INET_DIAG_INFO - 1))]


def held(protocol: int, families: Iterable[int] = FAMILIES) -> list[DiagSocket]:
    """The sockets of `protocol` that a process can hold: TCP's in every state but TIME_WAIT and
    requests (which have no descriptor, and of which a busy server has thousands), UDP's in every one."""
    states = ALL_STATES if protocol == socket.IPPROTO_UDP else \
        set(ALL_STATES) - {TCP_SYN_RECV, TCP_TIME_WAIT, TCP_NEW_SYN_RECV}
    return [s for family in families for s in dump(family, states, protocol=protocol)]


def socket_inode(link: str) -> int | None:
    """The inode of a descriptor's link text, "socket:[12345]"; None for anything else."""
    if not (link.startswith("socket:[") and link.endswith("]")):
        return None
    digits = link[len("socket:["):-1]
    return int(digits) if digits.isdigit() else None


def owners(inodes: set[int], proc: Path = Path("/proc")) -> dict[int, int]:
    """inode -> the lowest pid holding that socket (a pre-forking server's parent), for those found.
    Processes are read in pid order and the scan stops once every inode has its owner. Paths are
    strings: a scan reads a link per descriptor of every process (~0.5 ms per 1,000)."""
    found: dict[int, int] = {}
    with contextlib.suppress(OSError):
        pids = sorted(int(name) for name in os.listdir(proc) if name.isdigit())
        for pid in pids:
            if len(found) == len(inodes):
                break
            for inode in _held(f"{proc}/{pid}/fd"):
                if inode in inodes:
                    found.setdefault(inode, pid)
    return found


def _held(fd_dir: str) -> Iterator[int]:
    """The socket inodes one process holds; nothing when it is gone or hidden from us."""
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return
    for name in names:
        with contextlib.suppress(OSError):
            inode = socket_inode(os.readlink(f"{fd_dir}/{name}"))
            if inode is not None:
                yield inode
