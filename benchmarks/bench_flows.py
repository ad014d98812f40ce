"""Per-packet cost of the flows programs (BPF_PROG_TEST_RUN), as a ratio to an empty program on
the same hook measured in the same run: an existing flow, a new flow, and a full flow table.

Existing flow and full table repeat one frame >= 1e6 times in the kernel. A new flow cannot repeat
(the second run finds it), so that case runs distinct frames once each and compares with the
empty program run the same way; both then include the kernel's per-call timer overhead.
"""

from __future__ import annotations

import ipaddress
import statistics
import struct

from aiprobe.loader import BpfObject, Program

from benchmarks import Result

REPEAT = 1_000_000
ROUNDS = 9
NEW_FLOWS = 50_000
FULL_TABLE = 4096
HOOKS = {"xdp": ("flows_xdp", "flows_xdp_empty"), "tc": ("flows_tc", "flows_tc_empty")}


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
        obj.maps["flows"].max_entries = FULL_TABLE
        obj.load()
        ours, empty = (obj.programs[name] for name in HOOKS[hook])
        for i in range(FULL_TABLE):
            ours.test_run(udp_frame(100_000 + i))
        frame = udp_frame(1)  # never fits: every run looks up, fails to insert, counts the failure
        return _ratio(hook, "full table", *_repeated_ns(ours, empty, frame), f"best of {ROUNDS} x {REPEAT} runs")


def run() -> list[Result]:
    results = []
    for hook in HOOKS:
        with BpfObject("flows", programs=HOOKS[hook]) as obj:
            obj.maps["flows"].max_entries = NEW_FLOWS + 16
            obj.load()
            results += [_existing_flow(obj, hook), _new_flows(obj, hook)]
        results.append(_full_table(hook))
    return results
