"""What tests share besides fixtures: commands, ports and polling, accept loops, veth pairs in namespaces, BPF
bookkeeping (which program and link ids exist) for leak checks, C fixtures built once, and where
each test runs (the kernel matrix's modules, the clock tolerance).

Names carry a random suffix so test runs (and parallel sessions) never collide.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
FIXTURE_BUILD = FIXTURES / "build"
NVML_OTHER_PID = 4343  # a pid the fake NVML (nvml_env) reports on GPU 1 that need not exist
IS_ROOT = os.geteuid() == 0


# What `make test-kernels` runs on every kernel of its matrix (tests/kernels/matrix.py), under
# emulation: each probe's exactness tests under every strategy, the capability matrix and least
# privilege. Of these modules, the tests marked `host_only` (no kernel-specific path: command-line
# output, exporter bookkeeping) or `realtime` (held to wall-clock time that emulation stretches) run
# on this host alone.
KERNEL_MODULES = {"test_sendlat", "test_flows", "test_cuda", "test_connections", "test_loader", "test_check",
                  "test_least_privilege", "test_strategies", "test_requests", "test_tls_handshakes",
                  "test_client_requests"}


# How far a kernel-measured time may stand from a user-space clock's view of the same thing: wider
# than the histograms' resolution (a slot is 1/16 octave, 6.25% wide), with room for what a loaded
# or emulated machine adds around the kernel's part. One tolerance for every such comparison.
CLOCK_TOLERANCE = 0.10


def run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess:
    """Run a command, raising with its stderr when it fails."""
    result = subprocess.run(cmd, capture_output=True, text=True, **kwargs)  # type: ignore[call-overload]
    if result.returncode != 0 and kwargs.get("check", True):
        raise RuntimeError(f"{' '.join(cmd)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# How long a test waits for what should come at once (a peer, an attach, a refresh): it bounds a
# failure, never a pass, so it is generous: a loaded or emulated machine stretches everything.
PATIENCE = 120.0


def wait_until(predicate: Callable[[], object], timeout: float = PATIENCE, interval: float = 0.05) -> bool:
    """Poll `predicate` until it is truthy or `timeout` passes; returns whether it became truthy."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


@contextlib.contextmanager
def accepting(server: socket.socket, handle: Callable[[socket.socket], object]) -> Iterator[None]:
    """Each connection `server` accepts goes to `handle`, in a thread, until the block ends; the thread
    is joined then. Shutting the listener down wakes its accept(), which close() alone leaves blocked:
    such loops once outlived their tests by many minutes."""
    def loop() -> None:
        with contextlib.suppress(OSError):
            while True:
                handle(server.accept()[0])

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            server.shutdown(socket.SHUT_RDWR)
        thread.join(PATIENCE)


def unique(prefix: str) -> str:
    """An interface-safe unique name (IFNAMSIZ is 16 with the NUL)."""
    return f"{prefix}{secrets.token_hex(3)}"[:15]


@dataclass
class VethPair:
    """A veth pair: `host` in the root namespace, `peer` inside namespace `ns`.

    Addresses come from 198.18.0.0/15 (RFC 2544 benchmarking) and 2001:db8::/32 (documentation):
    both ends belong to the test, nothing beyond them is ever addressed.
    """

    ns: str
    host: str
    peer: str
    host_ip4: str
    peer_ip4: str
    host_ip6: str
    peer_ip6: str

    @property
    def host_ifindex(self) -> int:
        return int(Path(f"/sys/class/net/{self.host}/ifindex").read_text())

    def ns_cmd(self, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *cmd]

    def ns_run(self, cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        return run(self.ns_cmd(cmd), **kwargs)

    def ns_python(self, code: str, **kwargs: object) -> subprocess.Popen:
        """Start Python code inside the namespace (for peers: servers, senders)."""
        return subprocess.Popen(self.ns_cmd([sys.executable, "-c", code]), **kwargs)  # type: ignore[call-overload]


# Subnets in turn from a random start, not at random: a namespace's deletion ends in the background, so
# its host end and route can outlive `ip netns del`, and the next pair on the same subnet sent its
# connections there (refused; the host's selection beside three booting guests, once).
_SUBNETS = itertools.count(secrets.randbelow(250))


def make_veth_pair(index: int | None = None) -> VethPair:
    """A veth pair into a namespace of its own, on subnet 198.18.(1 + index % 250) (None: the next in turn)."""
    ns = unique("aipt-ns-")
    host, peer = unique("aipt"), unique("aipp")
    subnet = 1 + (next(_SUBNETS) if index is None else index) % 250
    pair = VethPair(
        ns, host, peer,
        f"198.18.{subnet}.1", f"198.18.{subnet}.2",
        f"2001:db8:{subnet:x}::1", f"2001:db8:{subnet:x}::2",
    )
    run(["ip", "netns", "add", ns])
    try:
        run(["ip", "link", "add", host, "type", "veth", "peer", "name", peer, "netns", ns])
        run(["ip", "addr", "add", f"{pair.host_ip4}/24", "dev", host])
        run(["ip", "-6", "addr", "add", f"{pair.host_ip6}/64", "dev", host, "nodad"])
        run(["ip", "link", "set", host, "up"])
        pair.ns_run(["ip", "addr", "add", f"{pair.peer_ip4}/24", "dev", peer])
        pair.ns_run(["ip", "-6", "addr", "add", f"{pair.peer_ip6}/64", "dev", peer, "nodad"])
        pair.ns_run(["ip", "link", "set", peer, "up"])
        pair.ns_run(["ip", "link", "set", "lo", "up"])
    except BaseException:
        remove_veth_pair(pair)
        raise
    return pair


def remove_veth_pair(pair: VethPair) -> None:
    # Deleting the namespace destroys the peer, and with it the host end.
    run(["ip", "netns", "del", pair.ns], check=False)
    run(["ip", "link", "del", pair.host], check=False)


def bpftool_json(*args: str) -> list[dict]:
    out = run(["bpftool", "-j", *args]).stdout
    return json.loads(out) if out.strip() else []


def prog_ids() -> set[int]:
    return {p["id"] for p in bpftool_json("prog", "show")}


def link_ids() -> set[int]:
    return {link["id"] for link in bpftool_json("link", "show")}


def programs_on(interface: str) -> set[str]:
    """Names of the programs on an interface's XDP and tc hooks: `bpftool net` for XDP and clsact,
    BPF_PROG_QUERY for TCX (bpftool 7.1 predates TCX listings)."""
    from aiprobe.libbpf import BPF_TCX_EGRESS, BPF_TCX_INGRESS, lib
    from aiprobe.loader import program_name

    (net,) = bpftool_json("net", "show", "dev", interface)
    ids = [entry["id"] for entry in net["xdp"] + net["tc"]]
    ifindex = int(Path(f"/sys/class/net/{interface}/ifindex").read_text())
    for attach_type in (BPF_TCX_INGRESS, BPF_TCX_EGRESS):
        prog_ids, count = (ctypes.c_uint32 * 64)(), ctypes.c_uint32(64)
        if lib().bpf_prog_query(ifindex, attach_type, 0, None, prog_ids, ctypes.byref(count)) == 0:
            ids += prog_ids[: count.value]
    return {name for prog_id in ids if (name := program_name(prog_id))}


def fd_id(fd: int, field: str) -> int:
    """The kernel id behind one of our fds ('prog_id', 'link_id', 'map_id'), from fdinfo."""
    for line in Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise LookupError(f"no {field} in fdinfo of fd {fd}")


@dataclass
class CBuild:
    """Compile C fixtures from tests/fixtures/ into tests/fixtures/build/, once per session."""

    out: Path

    def __call__(self, output: str, *sources: str, shared: bool = False, flags: tuple[str, ...] = ()) -> Path:
        target = self.out / output
        srcs = [str(FIXTURES / s) for s in sources]
        inputs = [*srcs, *map(str, FIXTURES.glob("*.h"))]
        if target.exists() and all(target.stat().st_mtime >= Path(s).stat().st_mtime for s in inputs):
            return target
        cmd = [shutil.which("cc") or "gcc", "-O1", "-g", "-Wall", "-o", str(target), *srcs, *flags]
        if shared:
            cmd[1:1] = ["-shared", "-fPIC", f"-Wl,-soname,{output}"]
        run(cmd)
        return target


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate and its key, for a TLS server on 127.0.0.1."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert, key
