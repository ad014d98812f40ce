"""Host prerequisites: privileges and the pseudo-filesystems probes need (tracefs, bpffs)."""

from __future__ import annotations

import ctypes
import os
import platform
from dataclasses import dataclass
from pathlib import Path

# Capability numbers (uapi/linux/capability.h). CAP_SYS_ADMIN stands in for BPF and PERFMON on
# kernels older than 5.8, which lack them.
CAP_NET_ADMIN = 12
CAP_SYS_ADMIN = 21
CAP_PERFMON = 38
CAP_BPF = 39
REQUIRED_CAPS = {"CAP_BPF": CAP_BPF, "CAP_PERFMON": CAP_PERFMON, "CAP_NET_ADMIN": CAP_NET_ADMIN}

TRACEFS = Path("/sys/kernel/tracing")
BPFFS = Path("/sys/fs/bpf")


def effective_caps(status: str | None = None) -> int:
    text = status if status is not None else Path("/proc/self/status").read_text()
    for line in text.splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def missing_privileges(caps: int | None = None) -> list[str]:
    """Capabilities aiprobe lacks to load and attach probes; empty when it may run."""
    caps = effective_caps() if caps is None else caps
    has_sys_admin = bool(caps >> CAP_SYS_ADMIN & 1)
    missing = []
    for name, bit in REQUIRED_CAPS.items():
        if caps >> bit & 1:
            continue
        if bit in (CAP_BPF, CAP_PERFMON) and has_sys_admin:
            continue
        missing.append(name)
    return missing


def privilege_error() -> str | None:
    """One line naming what is missing, or None when privileged enough."""
    missing = missing_privileges()
    if not missing:
        return None
    return (
        f"needs root or the capabilities CAP_BPF, CAP_PERFMON and CAP_NET_ADMIN "
        f"(missing: {', '.join(missing)}); run it with sudo"
    )


@dataclass
class Mount:
    path: str
    mounted: bool
    detail: str


class UserError(Exception):
    """A failure the user can act on: the CLI prints it as one line `aiprobe: <message>`, exit 1."""


def require_privileges() -> None:
    """Raise UserError (one line) when aiprobe lacks the privileges to load BPF programs; mount what
    the probes need."""
    error = privilege_error()
    if error:
        raise UserError(error)
    prepare_mounts()


def _is_mounted(path: Path, fstype: str) -> bool:
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) > 2 and fields[1] == str(path) and fields[2] == fstype:
            return True
    return False


def _mount(fstype: str, target: Path) -> str | None:
    """mount(2) through libc; returns an error string or None."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(fstype.encode(), str(target).encode(), fstype.encode(), 0, None) == 0:
        return None
    return os.strerror(ctypes.get_errno())


def ensure_mount(fstype: str, target: Path) -> Mount:
    """Mount `fstype` at `target` when it is not mounted and we may; say so either way."""
    if _is_mounted(target, fstype):
        return Mount(str(target), True, "mounted")
    if not target.is_dir():
        return Mount(str(target), False, f"{target} does not exist")
    error = _mount(fstype, target)
    if error is None:
        return Mount(str(target), True, "mounted by aiprobe")
    return Mount(str(target), False, f"not mounted and mounting failed ({error}); mount -t {fstype} none {target}")


def prepare_mounts() -> dict[str, Mount]:
    """tracefs carries classic tracepoint ids; bpffs is where pinned objects would live."""
    return {"tracefs": ensure_mount("tracefs", TRACEFS), "bpffs": ensure_mount("bpf", BPFFS)}


def kernel_release() -> str:
    return platform.release()
