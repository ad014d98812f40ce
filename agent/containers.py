"""Who is behind a pid or a cgroup id: the process name, its container and its pod.

BPF programs record `bpf_get_current_cgroup_id()` / `bpf_skb_cgroup_id()`: on cgroup v2 that is the
inode number of the cgroup's directory, so a walk of /sys/fs/cgroup maps ids back to paths. The path
names the container runtime's scope: containerd, CRI-O and Docker, under both the systemd and the
cgroupfs drivers, and plain host processes (no container).
"""

from __future__ import annotations

import functools
import logging
import os
import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from . import sockdiag
from .model import Placed
from .names import text_of

log = logging.getLogger("aiprobe.containers")


def cgroup2_root(mounts: Path = Path("/proc/self/mounts")) -> Path:
    """Where the cgroup v2 hierarchy is mounted: /sys/fs/cgroup, or /sys/fs/cgroup/unified on
    hybrid hosts."""
    for line in mounts.read_text().splitlines():
        fields = line.split()
        if len(fields) > 2 and fields[2] == "cgroup2":
            return Path(fields[1])
    return Path("/sys/fs/cgroup")

_CONTAINER_ID = r"([0-9a-f]{64})"
# Leaf names of a container's cgroup, by runtime and driver.
_CONTAINER_PATTERNS = (
    re.compile(rf"cri-containerd-{_CONTAINER_ID}\.scope$"),  # containerd, systemd driver
    re.compile(rf"crio-(?:conmon-)?{_CONTAINER_ID}\.scope$"),  # CRI-O, systemd driver
    re.compile(rf"docker-{_CONTAINER_ID}\.scope$"),  # Docker, systemd driver
    re.compile(rf"^{_CONTAINER_ID}$"),  # cgroupfs driver: the bare id under kubepods/... or docker/
)
# systemd: kubepods-burstable-pod<uid with _>.slice; cgroupfs: pod<uid with ->
_POD_UID = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})(?:\.slice)?$")


@dataclass(frozen=True)
class Workload:
    """The container and pod a cgroup belongs to; empty strings for host processes. The names come
    from the kubelet (kubelet.py), where the agent runs in Kubernetes."""

    cgroup: str
    container_id: str = ""
    pod_uid: str = ""
    namespace: str = ""
    pod: str = ""
    container_name: str = ""

    @property
    def container(self) -> str:
        """The label value: the container's name in its pod (dcgm-exporter's and cAdvisor's `container`
        in Kubernetes), else a short container id, or "host"."""
        return self.container_name or (self.container_id[:12] if self.container_id else "host")

    def label(self, record: Placed) -> None:
        """Fill a record's joined workload fields (its labels)."""
        record.container, record.namespace, record.pod = self.container, self.namespace, self.pod


@functools.lru_cache(maxsize=4096)  # a refresh asks for every record's: parsed once per cgroup
def workload_of(cgroup_path: str) -> Workload:
    """Parse a cgroup path such as /kubepods.slice/.../cri-containerd-<id>.scope."""
    container_id = pod_uid = ""
    for part in cgroup_path.strip("/").split("/"):
        for pattern in _CONTAINER_PATTERNS:
            match = pattern.search(part)
            if match:
                container_id = match.group(1)
        pod = _POD_UID.search(part)
        if pod:
            pod_uid = pod.group(1).replace("_", "-")
    return Workload(cgroup_path or "/", container_id, pod_uid)


def cgroup_of_pid(pid: int, proc: Path = Path("/proc")) -> str | None:
    """The cgroup v2 path of a process, or None when it is gone."""
    try:
        raw = (proc / str(pid) / "cgroup").read_bytes()
    except OSError:
        return None
    for line in raw.splitlines():
        if line.startswith(b"0::"):
            return text_of(line[3:])  # cgroup names are anyone's bytes
    return None


class CgroupIndex:
    """cgroup id (inode) -> cgroup path, rebuilt when an unknown id shows up — at most once per
    `min_rebuild_seconds`, so ids of cgroups already gone don't trigger a walk on every read."""

    def __init__(self, root: Path | None = None, min_rebuild_seconds: float = 2.0) -> None:
        self._root = root or cgroup2_root()
        self._paths: dict[int, str] = {}
        self._min_rebuild = min_rebuild_seconds
        self._rebuilt_at = -min_rebuild_seconds

    def _rebuild(self) -> None:
        paths: dict[int, str] = {}
        stack = [str(self._root)]
        while stack:
            directory = stack.pop()
            try:
                relative = text_of(os.fsencode(os.path.relpath(directory, self._root)))
                paths[os.stat(directory).st_ino] = "/" + relative.removeprefix(".")
                with os.scandir(directory) as entries:
                    stack.extend(e.path for e in entries if e.is_dir(follow_symlinks=False))
            except OSError:
                continue  # a cgroup removed while walking
        self._paths = {ino: path.replace("//", "/") for ino, path in paths.items()}

    def path(self, cgroup_id: int) -> str | None:
        now = time.monotonic()
        if cgroup_id and cgroup_id not in self._paths and now - self._rebuilt_at >= self._min_rebuild:
            self._rebuilt_at = now
            self._rebuild()
        return self._paths.get(cgroup_id)

    def workload(self, cgroup_id: int) -> Workload:
        path = self.path(cgroup_id)
        return workload_of(path) if path is not None else Workload("", "", "")


SocketKey = tuple[str, int, str, int]  # local address and port, remote address and port


class SocketOwners:
    """Which process owns a socket, by its addresses, in the agent's (the host's) network namespace.
    A scan dumps the kernel's TCP and UDP sockets but those in TIME_WAIT (sock_diag: the kernel walks
    its whole established hash, but a busy server's thousands of TIME_WAIT sockets are never sent,
    never parsed) and reads process descriptors until each socket has its owner. So it runs for a
    socket asked for since the last scan, at most every `refresh_seconds`, and otherwise every
    `max_age_seconds` while any is asked for (an address pair closed and reused by another process):
    long-lived connections cost no scans.
    Sockets inside pod network namespaces are not seen: their flows keep the container from the
    egress cgroup id instead."""

    def __init__(self, refresh_seconds: float = 5.0, max_age_seconds: float = 60.0) -> None:
        self._refresh = refresh_seconds
        self._max_age = max_age_seconds
        self._refreshed_at = -max_age_seconds
        self._connected: dict[SocketKey, int] = {}
        self._listening: dict[int, int] = {}  # local port -> pid (wildcard and specific binds)
        self._unknown: dict[SocketKey, float] = {}  # asked for, not in the latest scan: when first asked
        self._unlisted: set[str] = set()  # protocols whose dump the kernel refused (said once)

    def owner(self, local_address: str, local_port: int, remote_address: str, remote_port: int) -> int | None:
        key = (local_address, local_port, remote_address, remote_port)
        now = time.monotonic()
        asked = self._unknown.setdefault(key, now) if key not in self._connected else None
        age = now - self._refreshed_at
        if age >= self._max_age or (asked is not None and asked > self._refreshed_at and age >= self._refresh):
            self._scan(now)
        pid = self._connected.get(key)
        return pid if pid is not None else self._listening.get(local_port)

    def _scan(self, now: float) -> None:
        self._refreshed_at = now
        if (sockets := self._held_sockets()) is None:
            return
        pids = sockdiag.owners({s.inode for s in sockets if s.inode})
        connected, listening = {}, {}
        for s in sockets:
            if (pid := pids.get(s.inode)) is None:
                continue
            if s.remote_port:
                key = (_unmapped(s.local_address), s.local_port, _unmapped(s.remote_address), s.remote_port)
                connected[key] = pid
            else:
                listening[s.local_port] = pid
        self._connected, self._listening = connected, listening
        # Those this scan missed wait for the next full one; a forgotten one, asked again, is new again.
        self._unknown = {key: at for key, at in self._unknown.items()
                         if key not in connected and now - at < self._max_age}

    def _held_sockets(self) -> list[sockdiag.DiagSocket] | None:
        """TCP's and UDP's sockets that a process can hold; None when the kernel listed neither (the
        previous scan's owners stay). A refused protocol is a warning once."""
        sockets: list[sockdiag.DiagSocket] = []
        listed = False
        for name, protocol in (("TCP", socket.IPPROTO_TCP), ("UDP", socket.IPPROTO_UDP)):
            try:
                sockets += sockdiag.held(protocol)
                listed = True
            except OSError as exc:
                level = logging.DEBUG if name in self._unlisted else logging.WARNING
                log.log(level, "cannot list %s sockets to find flow owners: %s", name, exc)
                self._unlisted.add(name)
        return sockets if listed else None


def _unmapped(address: str) -> str:
    """An IPv4-mapped IPv6 address (dual-stack sockets) as the IPv4 address flows carry."""
    return address.removeprefix("::ffff:")
