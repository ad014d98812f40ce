"""Kernel capability matrix, found by trying: each feature is one real load and attach of a tiny
program from features.bpf.o (or one map creation), never a guess from the kernel version.

Network attachments are tried inside a private network namespace, on a veth pair that lives only
as long as the probe, so checking never touches the host's interfaces.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from . import libbpf
from .btf import Btf
from .loader import BpfObject

CLONE_NEWNET = 0x40000000
FEATURE_OBJECT = "features"

# Order is the order `aiprobe check` prints.
FEATURES = (
    "btf", "fentry", "syn_recv_fexit", "kprobe", "tp_btf", "tcp_send_tp", "sock_length_tp", "raw_tp", "tracepoint",
    "uprobe",
    "xdp", "xdp_native", "xdp_generic", "xdp_link", "tc", "tcx", "tc_clsact", "ringbuf", "map_batch",
)


@dataclass
class Feature:
    available: bool
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _attempt(action: Callable[[], str | None]) -> Feature:
    try:
        return Feature(True, action() or "")
    except Exception as exc:  # whatever went wrong, this feature is the one that is missing
        return Feature(False, str(exc) or type(exc).__name__)


# What a failure of these usually means; libbpf's own hints (e.g. "raise ulimit -l") mislead here.
_HINTS = {
    "probe_fentry": "the kernel refuses BPF trampolines (built without function tracer / direct calls)",
    "probe_syn_recv_fexit": "no trampoline on tcp_v4_syn_recv_sock (none at all, or more arguments than this "
                            "kernel's trampolines take)",
    "probe_kprobe": "no kprobe PMU and no kprobe_events (kernel built without CONFIG_KPROBES)",
    "probe_tcp_send_tp": "no tcp:tcp_sendmsg_locked tracepoint",
    "probe_sock_length_tp": "no sock:sock_send_length / sock_recv_length tracepoints (6.3+)",
    "probe_sk_storage_tracing": "BTF programs (fentry, tp_btf) may not use socket storage (5.11+)",
}


def _program(name: str, attach: Callable[[BpfObject], object] | None = None) -> Feature:
    def run() -> None:
        with BpfObject(FEATURE_OBJECT, programs=[name]) as obj:
            obj.load()
            (attach or (lambda o: o.programs[name].attach()))(obj)

    feature = _attempt(run)
    if not feature.available and name in _HINTS:
        feature.detail = f"{_HINTS[name]}: {feature.detail}"
    return feature


def _btf() -> str:
    path = Path("/sys/kernel/btf/vmlinux")
    if not path.exists():
        raise FileNotFoundError("no /sys/kernel/btf/vmlinux (kernel built without CONFIG_DEBUG_INFO_BTF)")
    handle = libbpf.new_ptr("btf__load_vmlinux_btf")
    try:
        Btf(handle).find("task_struct", 4)
    finally:
        libbpf.lib().btf__free(handle)
    return str(path)


def libc_path() -> str:
    """The libc this process maps: a uprobe target present on every host."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1]
        if "/libc.so" in path or "/libc-" in path:
            return path
    raise FileNotFoundError("libc not found in /proc/self/maps")


def _uprobe() -> Feature:
    return _program("probe_uprobe", lambda obj: obj.programs["probe_uprobe"].attach_uprobe(libc_path(), "getpid"))


@functools.cache
def helper_available(prog_type: int, helper: int) -> bool:
    """Whether programs of type `prog_type` may call helper `helper` on this kernel: libbpf loads a
    tiny one that calls it (the verifier names an unknown or refused helper before anything else)."""
    rc = libbpf.lib().libbpf_probe_bpf_helper(prog_type, helper, None)
    return libbpf.check_rc(rc, f"probe of helper {helper} for program type {prog_type}") > 0


@functools.cache
def sk_storage_in_tracing() -> Feature:
    """Whether BTF programs (fentry, tp_btf) may use socket storage (5.11): one tiny program's load."""
    return _program("probe_sk_storage_tracing")


def _map_create(map_type: int, key: int, value: int, entries: int) -> int:
    return libbpf.call("bpf_map_create", map_type, b"aiprobe_probe", key, value, entries, None)


def _ringbuf() -> None:
    os.close(_map_create(libbpf.BPF_MAP_TYPE_RINGBUF, 0, 0, 4096))


def _map_batch() -> None:
    fd = _map_create(libbpf.BPF_MAP_TYPE_HASH, 4, 4, 1)
    try:
        keys, values, token = (ctypes.c_uint32 * 1)(), (ctypes.c_uint32 * 1)(), ctypes.c_uint64()
        count = ctypes.c_uint32(1)
        opts = libbpf.sized(libbpf.MapBatchOpts)
        rc = libbpf.lib().bpf_map_lookup_batch(
            fd, None, ctypes.byref(token), keys, values, ctypes.byref(count), ctypes.byref(opts)
        )
        if rc not in (0, -errno.ENOENT):  # ENOENT: the (empty) map was read to its end
            libbpf.check_rc(rc, "bpf_map_lookup_batch")
    finally:
        os.close(fd)


_NETWORK = ("xdp_native", "xdp_generic", "xdp_link", "tcx", "tc_clsact")


@functools.cache
def network_features() -> dict[str, Feature]:
    """XDP and tc attempts in a throwaway network namespace, owned by a short-lived thread
    (namespaces are per thread, so the rest of the process stays where it was). Once a process: check
    asks for them, then flows' plan for each of its hooks (5.5 s each in an emulated 5.10 guest)."""
    result: dict[str, Feature] = {}

    def run() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            for name in _NETWORK:
                result[name] = Feature(False, f"cannot create a private netns to test in: {errno.errorcode[err]}")
            return
        from pyroute2 import IPRoute

        with IPRoute() as ipr:
            ipr.link("add", ifname="aiprobe-p0", kind="veth", peer="aiprobe-p1")
            veth = ipr.link_lookup(ifname="aiprobe-p0")[0]

            def xdp(mode: str | None, ifindex: int) -> Callable[[BpfObject], object]:
                return lambda obj: obj.programs["probe_xdp"].attach_xdp(ifindex, mode)

            result["xdp_native"] = _program("probe_xdp", xdp("native", veth))
            result["xdp_generic"] = _program("probe_xdp", xdp("generic", 1))
            result["xdp_link"] = _program("probe_xdp", xdp(None, veth))
            result["tcx"] = _program("probe_tc", lambda obj: obj.programs["probe_tc"].attach_tcx(veth, "egress"))
            result["tc_clsact"] = _program(
                "probe_tc",
                lambda obj: obj.programs["probe_tc"].attach_tc_clsact(veth, "egress", handle=1, priority=1),
            )

    def guarded() -> None:
        try:
            run()
        except Exception as exc:  # e.g. no veth support: every network feature says why, check goes on
            for name in _NETWORK:
                result.setdefault(name, Feature(False, f"cannot test in a private netns: {exc}"))

    thread = threading.Thread(target=guarded, name="aiprobe-netns-probe")
    thread.start()
    thread.join()
    return result


def probe_features() -> dict[str, Feature]:
    """Try every feature once. Requires privileges (see system.missing_privileges)."""
    found = {
        "btf": _attempt(_btf),
        "fentry": _program("probe_fentry"),
        "syn_recv_fexit": _program("probe_syn_recv_fexit"),
        "kprobe": _program("probe_kprobe"),
        "tp_btf": _program("probe_tp_btf"),
        "tcp_send_tp": _program("probe_tcp_send_tp"),
        "sock_length_tp": _program("probe_sock_length_tp"),
        "raw_tp": _program("probe_raw_tp"),
        "tracepoint": _program("probe_tracepoint"),
        "uprobe": _uprobe(),
        "ringbuf": _attempt(_ringbuf),
        "map_batch": _attempt(_map_batch),
    }
    found.update(network_features())
    found["xdp"] = _any(found, "xdp_native", "xdp_generic")
    found["tc"] = _any(found, "tcx", "tc_clsact")
    return {name: found[name] for name in FEATURES}


def _any(found: dict[str, Feature], *names: str) -> Feature:
    tried = {n: found.get(n, Feature(False, "not tried")) for n in names}
    working = [n for n, feature in tried.items() if feature.available]
    if working:
        return Feature(True, "via " + ", ".join(working))
    return Feature(False, "; ".join(f"{n}: {feature.detail}" for n, feature in tried.items()))
