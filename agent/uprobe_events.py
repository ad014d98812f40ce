"""uprobes defined through tracefs (`uprobe_events`), for when the perf uprobe PMU is refused.

Since the stable kernels of 2025 (6.1.y, 6.12.y and later; "perf: require CAP_SYS_ADMIN for
uprobes"), perf_event_open() of the uprobe PMU, which libbpf uses, needs CAP_SYS_ADMIN. A uprobe
written to tracefs's uprobe_events needs only write access to that file (uid 0 owns tracefs) and
attaching a BPF program to its tracepoint needs CAP_PERFMON: what the DaemonSet grants. The path
written there is resolved by the kernel in the writer's context, where /proc/PID/root/... of
another process is refused without CAP_SYS_ADMIN but a descriptor of our own (/proc/self/fd/N) is
not: callers pass one (see aiprobe.probes.cuda.probe.own_descriptor). Offsets come from aiprobe.elf.

Event names carry our pid (`aiprobe/p<pid>_<n>`), so events a killed agent left behind are removed
by the next agent (`remove_stale_events`); each Link removes its own event when closed.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import logging
import os
import re
import struct
import time
from pathlib import Path

from . import libbpf
from .system import TRACEFS

log = logging.getLogger(__name__)
GROUP = "aiprobe"
PERF_TYPE_TRACEPOINT = 2
PERF_FLAG_FD_CLOEXEC = 8
_SYS_PERF_EVENT_OPEN = {"x86_64": 298, "aarch64": 241}
_PERF_ATTR_SIZE = 128  # PERF_ATTR_SIZE_VER7; the kernel accepts any known size
PERF_EVENT_PARANOID = Path("/proc/sys/kernel/perf_event_paranoid")
_names = itertools.count()
_pending: set[str] = set()  # events still held by the kernel when their link closed


# ---- tracefs events ----


def _uprobe_events() -> Path:
    return TRACEFS / "uprobe_events"


def _write(line: str) -> None:
    # One write(2) per command, without the seek that Python's append mode makes (tracefs refuses it).
    fd = os.open(_uprobe_events(), os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def create_event(path: str, offset: int, *, retprobe: bool) -> tuple[str, int]:
    """Define a u(ret)probe at `offset` in `path`; its name and tracepoint id."""
    name = f"p{os.getpid()}_{next(_names)}"
    _write(f"{'r' if retprobe else 'p'}:{GROUP}/{name} {path}:{offset:#x}")
    try:
        return name, int((TRACEFS / "events" / GROUP / name / "id").read_text())
    except BaseException:
        remove_event(name)
        raise


def remove_event(name: str) -> None:
    """Remove the event. One the kernel still holds (EBUSY: the perf event on it is being released,
    a grace period after its link closed) is left to remove_pending(). Gone already is fine."""
    try:
        _write(f"-:{GROUP}/{name}")
    except OSError as exc:
        if exc.errno == errno.EBUSY:
            _pending.add(name)


def remove_pending(wait: float = 15.0) -> None:
    """Remove the events remove_event() had to leave, retrying for up to `wait` seconds: called once
    all links are closed, so the kernel's grace periods overlap instead of adding up. They take
    milliseconds on an idle host, seconds on a loaded or emulated one."""
    deadline = time.monotonic() + wait
    while _pending and time.monotonic() < deadline:
        for name in list(_pending):
            _pending.discard(name)
            remove_event(name)
        if _pending:
            time.sleep(0.01)
    if _pending:
        log.warning("the kernel still held %d uprobe events after %.0f s (%s); the next agent removes them",
                    len(_pending), wait, ", ".join(sorted(_pending)))


def remove_stale_events() -> None:
    """Remove the events of aiprobe processes that no longer run (a killed agent leaves them)."""
    with contextlib.suppress(OSError):
        for line in _uprobe_events().read_text().splitlines():
            match = re.match(rf"[pr]:{GROUP}/(p(\d+)_\d+) ", line)
            if match and not Path(f"/proc/{match.group(2)}").exists():
                remove_event(match.group(1))


def open_tracepoint(tracepoint_id: int) -> int:
    """perf_event_open() of a tracepoint on CPU 0 for every process, as libbpf does for its own
    tracefs probes: a BPF program attached to it runs on every CPU."""
    attr = struct.pack("IIQQ", PERF_TYPE_TRACEPOINT, _PERF_ATTR_SIZE, tracepoint_id, 1).ljust(_PERF_ATTR_SIZE, b"\0")
    libc = ctypes.CDLL(None, use_errno=True)
    fd = int(libc.syscall(_SYS_PERF_EVENT_OPEN[os.uname().machine], attr, -1, 0, -1, PERF_FLAG_FD_CLOEXEC))
    if fd < 0:
        err = ctypes.get_errno()
        raise libbpf.BpfError(err, f"perf_event_open of tracepoint {GROUP}:{tracepoint_id}", _paranoia_hint(err))
    return fd


def _paranoia_hint(err: int) -> str:
    """Why perf_event_open may be refused to CAP_PERFMON: Debian's kernels, at their default
    kernel.perf_event_paranoid=3, allow it only with CAP_SYS_ADMIN."""
    with contextlib.suppress(OSError, ValueError):
        level = int(PERF_EVENT_PARANOID.read_text())
        if err == errno.EACCES and level > 2:
            return f"kernel.perf_event_paranoid={level} allows perf_event_open only with CAP_SYS_ADMIN; set it to 2"
    return ""
