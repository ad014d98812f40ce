"""The flows probe's cost, as ratios measured in one run.

Per packet (BPF_PROG_TEST_RUN), against an empty program on the same hook: an existing flow, a new
flow, and a full flow table. Existing flow and full table repeat one frame >= 1e6 times in the
kernel. A new flow cannot repeat (the second run finds it), so that case runs distinct frames once
each and compares with the empty program run the same way; both then include the kernel's per-call
timer overhead.

On real traffic: iperf3 TCP throughput through a veth pair into a network namespace, with the probe
attached (and read every second, as the agent does) vs not, each direction, rounds interleaved so
both see the same background load.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import secrets
import statistics
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from aiprobe.loader import BpfObject, Program
from aiprobe.probes.flows.kernel import size_flow_table
from aiprobe.probes.flows.probe import FlowsProbe

from benchmarks import Result

REPEAT = 1_000_000
ROUNDS = 9
NEW_FLOWS = 50_000
FULL_TABLE = 4096
HOOKS = {"xdp": ("flows_xdp", "flows_xdp_empty"), "tc": ("flows_egress", "flows_tc_empty")}
IPERF_ROUNDS = 7
IPERF_SECONDS = 2
HOST_IP, PEER_IP = "198.19.251.1", "198.19.251.2"


def udp_frame(src: int, sport: int = 40000, payload: int = 100) -> bytes:
    """Ethernet + IPv4 + UDP from 10.0.0.0/8 host number `src`."""
    udp = struct.pack("!HHHH", sport, 53, 8 + payload, 0) + bytes(payload)
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0, 0, 64, 17, 0,
                     (ipaddress.IPv4Address("10.0.0.0") + src).packed, bytes([192, 0, 2, 1]))
    return bytes(6) + bytes([2, 0, 0, 0, 0, 1]) + struct.pack("!H", 0x0800) + ip + udp


def _repeated_ns(ours: Program, empty: Program, frame: bytes) -> tuple[float, float]:
    """Best of ROUNDS for each, interleaved so both see the same background load."""
    pairs = [(ours.test_run(frame, REPEAT).duration_ns, empty.test_run(frame, REPEAT).duration_ns)
             for _ in range(ROUNDS)]
    return min(p[0] for p in pairs), min(p[1] for p in pairs)


def _ratio(hook: str, case: str, ours: float, empty: float, how: str) -> Result:
    return Result("flows", f"{hook} {case}", ours / empty, "x empty", f"{ours:.1f} ns vs {empty:.1f} ns, {how}")


def _existing_flow(obj: BpfObject, hook: str) -> Result:
    ours, empty = (obj.programs[name] for name in HOOKS[hook])
    frame = udp_frame(1)
    ours.test_run(frame)  # the flow now exists
    return _ratio(hook, "existing flow", *_repeated_ns(ours, empty, frame), f"best of {ROUNDS} x {REPEAT} runs")


def _new_flows(obj: BpfObject, hook: str) -> Result:
    ours, empty = (obj.programs[name] for name in HOOKS[hook])
    frames = [udp_frame(2 + i, sport=50000) for i in range(NEW_FLOWS)]
    ours_ns = statistics.mean(ours.test_run(frame).duration_ns for frame in frames)
    empty_ns = statistics.mean(empty.test_run(frame).duration_ns for frame in frames)
    return _ratio(hook, "new flow", ours_ns, empty_ns, f"mean of {NEW_FLOWS} distinct frames, 1 run each")


def _full_table(hook: str) -> Result:
    with BpfObject("flows", programs=HOOKS[hook]) as obj:
        size_flow_table(obj, FULL_TABLE)
        obj.load()
        ours, empty = (obj.programs[name] for name in HOOKS[hook])
        for i in range(FULL_TABLE):
            ours.test_run(udp_frame(100_000 + i))
        frame = udp_frame(1)  # never fits: every run looks up, fails to insert, counts the failure
        return _ratio(hook, "full table", *_repeated_ns(ours, empty, frame), f"best of {ROUNDS} x {REPEAT} runs")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@contextlib.contextmanager
def _veth_into_namespace() -> Iterator[tuple[str, str]]:
    """(host interface, namespace): a veth pair with default offloads, the peer in its own namespace."""
    suffix = secrets.token_hex(3)
    ns, host = f"aipb-ns-{suffix}", f"aipb{suffix}"
    _ip("netns", "add", ns)
    try:
        _ip("link", "add", host, "type", "veth", "peer", "name", "peer0", "netns", ns)
        _ip("addr", "add", f"{HOST_IP}/24", "dev", host)
        _ip("link", "set", host, "up")
        _ip("-n", ns, "addr", "add", f"{PEER_IP}/24", "dev", "peer0")
        _ip("-n", ns, "link", "set", "peer0", "up")
        yield host, ns
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _iperf3_bytes_per_second(reverse: bool) -> float:
    out = subprocess.run(["iperf3", "-c", PEER_IP, "-t", str(IPERF_SECONDS), "-J", *(["-R"] if reverse else [])],
                         check=True, capture_output=True, text=True).stdout
    received = json.loads(out)["end"]["sum_received"]
    return received["bytes"] / received["seconds"]


def _read_until(probe: FlowsProbe, stop: threading.Event) -> None:
    while not stop.wait(1.0):
        probe.read()


@contextlib.contextmanager
def _probe_read_every_second(host: str) -> Iterator[None]:
    stop = threading.Event()
    with FlowsProbe([host]) as probe:
        reader = threading.Thread(target=_read_until, args=(probe, stop))
        reader.start()
        try:
            yield
        finally:
            stop.set()
            reader.join()


@contextlib.contextmanager
def _native_xdp(host: str) -> Iterator[None]:
    """What the probe did before tc became its ingress hook: native XDP on the veth."""
    with BpfObject("flows", programs=["flows_xdp"]) as obj:
        obj.load()
        obj.programs["flows_xdp"].attach_xdp(int(Path(f"/sys/class/net/{host}/ifindex").read_text()), "native")
        yield


def _throughput(host: str, reverse: bool, attach: Callable[[str], Any] = _probe_read_every_second,
                label: str = "") -> Result:
    ratios, attached, detached = [], [], []
    for _ in range(IPERF_ROUNDS):
        detached.append(_iperf3_bytes_per_second(reverse))
        with attach(host):
            attached.append(_iperf3_bytes_per_second(reverse))
        ratios.append(attached[-1] / detached[-1])
    case = "iperf3 TCP veth " + ("ingress (-R)" if reverse else "egress") + label
    detail = (f"median {statistics.median(attached) / 1e9:.2f} vs {statistics.median(detached) / 1e9:.2f} GB/s; "
              f"median of rounds; rounds {min(ratios):.3f}-{max(ratios):.3f}, {IPERF_ROUNDS} of {IPERF_SECONDS} s each")
    # The median of paired rounds: each pair ran back to back, under the same background load.
    return Result("flows", case, statistics.median(ratios), "x detached", detail)


def _wait_for_listener(ns: str) -> None:
    for _ in range(50):
        out = subprocess.run(["ip", "netns", "exec", ns, "ss", "-tlnH"], capture_output=True, text=True).stdout
        if ":5201" in out:
            return
        time.sleep(0.1)
    raise RuntimeError("iperf3 server did not start")


def _throughput_results() -> list[Result]:
    with _veth_into_namespace() as (host, ns):
        server = subprocess.Popen(["ip", "netns", "exec", ns, "iperf3", "-s", "-B", PEER_IP],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_for_listener(ns)
            _iperf3_bytes_per_second(False)  # warm up
            return [*(_throughput(host, reverse) for reverse in (False, True)),
                    _throughput(host, True, _native_xdp, ", native XDP instead (not the default)")]
        finally:
            server.kill()
            server.wait()


def run() -> list[Result]:
    results = []
    for hook in HOOKS:
        with BpfObject("flows", programs=HOOKS[hook]) as obj:
            size_flow_table(obj, NEW_FLOWS + 16)
            obj.load()
            results += [_existing_flow(obj, hook), _new_flows(obj, hook)]
        results.append(_full_table(hook))
    return results + _throughput_results()
