"""Which flows a read of the flows probe makes records of (agent/probes/flows/table.py) and which of them get
a series of their own (flows.TopFlows), without root: struct layouts from flows.bpf.o's own BTF
(opened, never loaded), reads fed raw batches laid out as the kernel's batch lookup hands them over.

The agent records `top` flows: those that changed since the previous read, the fastest first, then
idle ones, the most bytes first. A long-lived connection between its requests must keep its record,
read after read, or the agent loses it (and its owner) from the snapshot."""

from __future__ import annotations

import numpy as np
import pytest
from aiprobe.btf import dtype_of
from aiprobe.loader import BpfObject
from aiprobe.probes.flows.kernel import KernelFlows
from aiprobe.probes.flows.probe import MIN_RATE_WINDOW_NS, TopFlows
from aiprobe.probes.flows.records import FlowRecord, FlowsSnapshot, InterfaceTotals
from aiprobe.probes.flows.table import KEY_FIELDS, VALUE_FIELDS, FlowTable

IFINDEX, EGRESS, UDP = 7, 1, 17
HEAVY, MIDDLE, LIGHT = 5001, 5002, 5003  # local ports of three flows


@pytest.fixture(scope="module")
def layouts() -> tuple[np.dtype, np.dtype]:
    obj = BpfObject("flows")
    try:
        flows = KernelFlows(obj)
        return dtype_of(flows.key_type, KEY_FIELDS), dtype_of(flows.value_type, VALUE_FIELDS)
    finally:
        obj.close()


class Flows:
    """A flow table as the kernel holds it (one egress UDP flow per local port) and the probe's
    FlowTable reading it, one read per rate window, as the agent's refresh does."""

    def __init__(self, layouts: tuple[np.dtype, np.dtype], top: int | None) -> None:
        self.key_dtype, self.value_dtype = layouts
        self.top = top
        self.now_ns = 0
        self.table = FlowTable(self.key_dtype, self.value_dtype, self.now_ns)
        self.ports: list[int] = []
        self.values = np.zeros(0, self.value_dtype)
        self.sent_since_read: set[int] = set()

    def send(self, port: int, nbytes: int) -> None:
        if port not in self.ports:
            self.ports.append(port)
            self.values = np.concatenate((self.values, np.zeros(1, self.value_dtype)))
            self.values["first_seen_ns"][-1] = self.now_ns
        flow = self.values[self.ports.index(port):][:1]
        flow["bytes"] += nbytes
        flow["packets"] += 1
        flow["last_seen_ns"] = self.now_ns
        self.sent_since_read.add(port)

    def key(self, port: int) -> bytes:
        key = np.zeros(1, self.key_dtype)
        key["ifindex"], key["direction"], key["family"], key["protocol"] = IFINDEX, EGRESS, 4, UDP
        key["local_port"], key["remote_port"] = port, 9
        return key.tobytes()

    def read(self) -> dict[int, float]:
        """One read: the table as one raw batch, only the flows sent to since the previous read
        changed. Returns the recorded flows: local port -> bytes per second."""
        self.now_ns += MIN_RATE_WINDOW_NS
        baseline = self.table.begin(self.now_ns, MIN_RATE_WINDOW_NS)
        changed = np.array([i for i, port in enumerate(self.ports) if port in self.sent_since_read], np.intp)
        keys = memoryview(b"".join(self.key(port) for port in self.ports))
        self.table.update(keys, self.values, changed)
        self.table.end(self.now_ns)
        self.sent_since_read.clear()
        interval = (self.now_ns - baseline.at_ns) / 1e9
        slots = self.table.recorded(self.top, interval)
        byte_rates, _ = self.table.rates(slots, interval)
        ports = np.frombuffer(b"".join(self.table.keys[s] for s in slots.tolist()), self.key_dtype)["local_port"]
        return dict(zip(ports.tolist(), byte_rates.tolist(), strict=True))

    def delete(self, port: int) -> None:
        """The probe's expiry: the flow leaves the kernel's table, its counts go to its interface."""
        i = self.ports.index(port)
        self.table.retire([self.key(port)], self.values[i:i + 1])
        self.ports.pop(i)
        self.values = np.delete(self.values, i)


def three_flows(layouts: tuple[np.dtype, np.dtype], top: int | None) -> Flows:
    flows = Flows(layouts, top)
    for port, nbytes in ((HEAVY, 3000), (MIDDLE, 2000), (LIGHT, 1000)):
        flows.send(port, nbytes)
    return flows


def test_idle_flows_keep_their_records_at_rate_0_read_after_read(layouts: tuple[np.dtype, np.dtype]) -> None:
    flows = three_flows(layouts, top=2)
    assert set(flows.read()) == {HEAVY, MIDDLE}  # all three changed: the two fastest
    for _ in range(4):
        assert flows.read() == {HEAVY: 0.0, MIDDLE: 0.0}  # none changed: the two with the most bytes


def test_a_flow_that_changed_is_recorded_before_idle_ones(layouts: tuple[np.dtype, np.dtype]) -> None:
    flows = three_flows(layouts, top=2)
    flows.read()
    flows.read()
    flows.send(LIGHT, 10)
    assert flows.read() == {LIGHT: 10 / (MIN_RATE_WINDOW_NS / 1e9), HEAVY: 0.0}
    for _ in range(2):
        assert flows.read() == {LIGHT: 0.0, HEAVY: 0.0}  # idle again, both keep their records


def test_idle_flows_take_the_room_a_deleted_flow_leaves(layouts: tuple[np.dtype, np.dtype]) -> None:
    flows = three_flows(layouts, top=2)
    flows.read()
    flows.delete(HEAVY)
    assert flows.read() == {MIDDLE: 0.0, LIGHT: 0.0}
    flows.send(HEAVY, 10)  # back, as a new flow
    assert flows.read() == {HEAVY: 10 / (MIN_RATE_WINDOW_NS / 1e9), MIDDLE: 0.0}


def test_without_top_every_flow_is_recorded(layouts: tuple[np.dtype, np.dtype]) -> None:
    flows = three_flows(layouts, top=None)
    assert set(flows.read()) == {HEAVY, MIDDLE, LIGHT}
    assert flows.read() == {HEAVY: 0.0, MIDDLE: 0.0, LIGHT: 0.0}


def _flow(port: int, nbytes: int, bytes_per_second: float) -> FlowRecord:
    return FlowRecord("eth0", "egress", "udp", "198.18.0.1", port, "198.18.0.2", 9, nbytes, nbytes // 100,
                      bytes_per_second, bytes_per_second / 100, 0, first_seen=1.0, last_seen=2.0)


def test_an_idle_flow_gets_no_series_and_the_series_sum_to_the_interface() -> None:
    top = TopFlows(2, "bytes")
    idle_bytes, unrecorded = 50_000, 700
    for at, sent in enumerate((1000, 1500, 4000)):
        flows = [_flow(HEAVY, idle_bytes, 0.0), _flow(LIGHT, sent, 500.0)]
        totals = InterfaceTotals("eth0", "egress", idle_bytes + sent + unrecorded, 0)
        series = top([FlowsSnapshot(float(at), 1.0, flows, [totals], 0, 0, 0, [])])
        ports = [labels[4] for labels, _ in series]
        assert ports == [str(LIGHT), ""]  # the flow with a rate, and `other`
        assert sum(value for _, (value,) in series) == totals.bytes
