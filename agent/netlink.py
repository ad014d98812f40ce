"""Network interfaces as they come and go: a netlink (rtnetlink) dump plus a background watcher.

Probes that attach per interface (flows) follow pod veths through RTM_NEWLINK / RTM_DELLINK
events instead of polling, so a new interface is seen within milliseconds.
"""

from __future__ import annotations

import errno
import logging
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pyroute2.netlink.rtnl.marshal import MarshalRtnl

from .names import printable
from .supervisor import SUPERVISOR

log = logging.getLogger(__name__)

IFF_UP = 0x1
IFF_LOOPBACK = 0x8
ARPHRD_ETHER = 1
ARPHRD_LOOPBACK = 772  # lo builds a (zeroed) Ethernet header too, so the same parsers apply
NETLINK_ROUTE = 0
RTMGRP_LINK = 0x1
_POLL_SECONDS = 0.2
_RECV_BYTES = 1 << 16
RTM_NEWLINK, RTM_GETLINK = 16, 18
NLMSG_ERROR, NLMSG_DONE = 2, 3
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
_REQUEST_BYTES = 32  # struct nlmsghdr + struct ifinfomsg
_DUMP_RECV_BYTES = 1 << 18  # a dump's datagrams hold many interfaces each
_REPLY_SECONDS = 5.0


@dataclass(frozen=True)
class LinkInfo:
    index: int
    name: str
    up: bool
    loopback: bool
    ethernet: bool  # frames start with an Ethernet header (what XDP and tc parsers expect)
    kind: str | None = None  # rtnetlink link kind of a virtual device ("veth", "bridge", ...); None for a NIC


def _link_info(msg: Any) -> LinkInfo:  # a pyroute2 ifinfmsg
    flags = msg["flags"]
    linkinfo = msg.get_attr("IFLA_LINKINFO")
    return LinkInfo(
        index=msg["index"],
        name=printable(msg.get_attr("IFLA_IFNAME") or ""),
        up=bool(flags & IFF_UP),
        loopback=bool(flags & IFF_LOOPBACK),
        ethernet=msg["ifi_type"] in (ARPHRD_ETHER, ARPHRD_LOOPBACK),
        kind=linkinfo.get_attr("IFLA_INFO_KIND") if linkinfo else None,
    )


def _get_links(index: int = 0) -> list[Any]:
    """RTM_GETLINK on a plain rtnetlink socket: every interface (index 0: a dump) or the one with
    this index (none if it is gone). Not pyroute2's IPRoute: it builds an asyncio loop per use,
    which prints a traceback to stderr when the process runs out of file descriptors."""
    flags = NLM_F_REQUEST | (0 if index else NLM_F_DUMP)
    request = struct.pack("=IHHII", _REQUEST_BYTES, RTM_GETLINK, flags, 1, 0) + \
        struct.pack("=BxHiII", socket.AF_UNSPEC, 0, index, 0, 0)  # struct ifinfomsg
    marshal, links = MarshalRtnl(), []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_ROUTE) as sock:
        sock.settimeout(_REPLY_SECONDS)
        sock.sendto(request, (0, 0))
        while True:
            for msg in marshal.parse(sock.recv(_DUMP_RECV_BYTES)):
                kind = msg["header"]["type"]
                if kind == NLMSG_ERROR and msg["header"].get("error") is not None:
                    if index and msg["header"]["error"].code == errno.ENODEV:
                        return []
                    raise OSError(msg["header"]["error"].code, f"RTM_GETLINK: {msg['header']['error']}")
                if kind == RTM_NEWLINK:
                    links.append(msg)
                if kind == NLMSG_DONE or (index and links):
                    return links


def current_links() -> list[LinkInfo]:
    return [_link_info(msg) for msg in _get_links()]


def xdp_program_id(index: int) -> int | None:
    """The id of the XDP program attached to an interface (by anyone), None if there is none."""
    links = _get_links(index)
    xdp = links[0].get_attr("IFLA_XDP") if links else None
    prog_id = xdp.get_attr("IFLA_XDP_PROG_ID") if xdp else None
    return prog_id or None


class LinkWatcher:
    """Calls `on_link` for every interface that appears or changes, `on_removed` with the index of
    one that vanished. Callbacks run on the watcher's thread, after `run_in_background`.

    Events come through a plain rtnetlink socket subscribed to RTMGRP_LINK (decoded by pyroute2's
    marshal): a blocking receive with a timeout, which stop() can always interrupt."""

    def __init__(self, on_link: Callable[[LinkInfo], None], on_removed: Callable[[int], None]) -> None:
        self._on_link = on_link
        self._on_removed = on_removed
        self._stop = threading.Event()
        self._socket: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._known: set[int] = set()
        self._runs = 0

    def start(self) -> list[LinkInfo]:
        """Subscribe, then list the current interfaces: subscribing first means no interface falls
        between the list and the first event (one listed and announced is handled twice, harmlessly)."""
        self._socket = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_ROUTE)
        self._socket.bind((0, RTMGRP_LINK))
        self._socket.settimeout(_POLL_SECONDS)
        links = current_links()
        self._known = {link.index for link in links}
        return links

    def run_in_background(self) -> None:
        self._thread = SUPERVISOR.start_thread("link_watcher", self._run, self._stop)

    def _run(self) -> None:
        assert self._socket is not None
        marshal = MarshalRtnl()
        if self._runs:  # run again after a failure: events may have been missed meanwhile
            self._resync()
        self._runs += 1
        while not self._stop.is_set():
            try:
                data = self._socket.recv(_RECV_BYTES)
            except TimeoutError:
                continue
            except OSError as exc:
                if exc.errno != errno.ENOBUFS:
                    raise
                self._resync()  # events were dropped: compare against a fresh list instead
                continue
            for msg in marshal.parse(data):
                self._dispatch(msg)

    def _dispatch(self, msg: Any) -> None:
        event = msg.get("event")
        try:
            if event == "RTM_NEWLINK":
                self._known.add(msg["index"])
                self._on_link(_link_info(msg))
            elif event == "RTM_DELLINK":
                self._known.discard(msg["index"])
                self._on_removed(msg["index"])
        except Exception:  # one bad interface must not stop the watcher
            log.exception("handling %s for ifindex %s", event, msg.get("index"))

    def _resync(self) -> None:
        links = current_links()
        for index in self._known - {link.index for link in links}:
            self._on_removed(index)
        self._known = {link.index for link in links}
        for link in links:
            self._on_link(link)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None
        sock, self._socket = self._socket, None
        if sock is not None:
            sock.close()
