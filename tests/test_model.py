"""The model (agent/model.py) without root: documents of records, joins left out of a probe's own
output, and docs/snapshot.md documenting every field the snapshot can carry."""

from __future__ import annotations

import dataclasses
import re
import sys
import typing
from pathlib import Path

from aiprobe import model
from aiprobe.histogram import kernel_buckets
from aiprobe.probes.flows.records import FlowRecord, FlowsSnapshot, InterfaceTotals
from aiprobe.probes.netstat.records import TcpCounters
from aiprobe.probes.nvml.records import GpuInfo
from aiprobe.probes.sendlat.records import ProcessSendLatency
from aiprobe.registry import faces

DOC = Path(__file__).resolve().parent.parent / "docs" / "snapshot.md"


def records_in(cls: type) -> set[type]:
    """Every record type reachable from `cls`'s fields (lists, dicts, optionals unwrapped)."""
    found = {cls}
    hints = typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))
    for hint in hints.values():
        for arg in _flatten(hint):
            if dataclasses.is_dataclass(arg) and arg not in found:
                found |= records_in(arg)
    return found


def _flatten(hint: object) -> list[object]:
    args = typing.get_args(hint)
    if not args:
        return [hint]
    return [leaf for arg in args for leaf in _flatten(arg)]


def test_every_snapshot_field_is_documented() -> None:
    documented = set(re.findall(r'"([a-z0-9_]+)":', DOC.read_text()))
    sections = [section.record for face in faces() for section in face.hooks.sections.values()]
    records = {cls for root in (model.Snapshot, *sections) for cls in records_in(root)}
    missing = {f"{cls.__name__}.{field.name}" for cls in records
               for field in dataclasses.fields(cls) if field.name not in documented and field.name != "sections"}
    assert missing == set(), "fields of the snapshot missing from docs/snapshot.md"


def test_joined_fields_stay_out_of_a_probes_own_document() -> None:
    record = ProcessSendLatency(7, "app", 3, 1, 10, 0.5, 0.1, 0.2, kernel_buckets([0, 1]), start_ticks=99)
    record.container, record.bytes_per_second = "abc", 5.0
    own = record.to_dict()
    assert "container" not in own and "bytes_per_second" not in own
    assert own["histogram"] == [{"le_seconds": 1 / 16384 / 1000, "count": 0}, {"le_seconds": "+Inf", "count": 1}]
    joined = record.to_dict(joined=True)
    assert (joined["container"], joined["bytes_per_second"]) == ("abc", 5.0)


def test_snapshot_document_has_every_section_and_empty_tcp_without_counters() -> None:
    sections = {name: section.empty for face in faces() for name, section in face.hooks.sections.items()}
    snapshot = model.Snapshot(model.HostInfo("h", "k", "v", 1.0, 1.0), {"flows": model.ProbeStatus(True, "xdp+tcx")},
                              [], [], sections)
    document = snapshot.to_dict()
    names = [name for face in faces() for name in face.hooks.sections]
    assert list(document) == ["host", "probes", "processes", *names, "alerts"]
    assert {"flows", "interfaces", "streams", "gpus", "tcp"} <= set(names)
    assert document["tcp"] == {}
    assert document["probes"]["flows"] == {"up": True, "strategy": "xdp+tcx", "span": "", "reason": "", "overflows": {}}


def test_readings_find_records_inside_each_probes_reading() -> None:
    flow = FlowRecord("eth0", "egress", "udp", "a", 1, "b", 2, 1, 1, 0.0, 0.0, 0, 0.0, 0.0)
    totals = InterfaceTotals("eth0", "egress", 1, 1)
    readings = model.Readings(records={
        "flows": FlowsSnapshot(0.0, 1.0, [flow], [totals], 0, 0, 0, []),
        "netstat": TcpCounters(1, 2, 3, 4), "sched": None})
    assert readings.of(FlowRecord) == [flow]
    assert readings.of(InterfaceTotals) == [totals]
    assert readings.of(TcpCounters) == [TcpCounters(1, 2, 3, 4)]
    assert readings.of(GpuInfo) == []


def test_identities() -> None:
    one = ProcessSendLatency(7, "app", 3, 0, 0, 0.0, None, None, [], start_ticks=100)
    other_cgroup = dataclasses.replace(one, cgroup_id=4)
    reused_pid = dataclasses.replace(one, start_ticks=200)
    assert len({one.identity(), other_cgroup.identity(), reused_pid.identity()}) == 3
