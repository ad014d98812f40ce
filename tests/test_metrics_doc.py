"""docs/metrics.md and the exporter agree: every metric the agent can serve is documented with the
same type and labels, and nothing documented is missing from the code."""

from __future__ import annotations

import re
from pathlib import Path

from aiprobe.exporters.prometheus import AgentCollector, Readings

DOC = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"
HISTOGRAM = [{"le_seconds": 2.0**i / 1e9, "count": 1} for i in range(1, 36)] + [{"le_seconds": None, "count": 1}]


def every_kind_of_reading() -> Readings:
    """One record of each kind, so every family the exporter can build has a sample."""
    flow = {"interface": "eth0", "direction": "ingress", "protocol": "tcp", "local_address": "a", "local_port": 1,
            "remote_address": "b", "remote_port": 2, "bytes": 10, "packets": 1, "bytes_per_second": 1,
            "tcp_syn": 1, "tcp_fin": 0, "tcp_rst": 0}
    gpu = {"index": 0, "uuid": "u", "name": "n", "utilization_gpu_ratio": 0.5, "utilization_memory_ratio": 0.5,
           "memory_used_bytes": 1, "memory_total_bytes": 2, "memory_free_bytes": 1, "power_watts": 1,
           "temperature_celsius": 1, "sm_clock_hz": 1, "memory_clock_hz": 1, "pcie_tx_bytes_per_second": 1,
           "pcie_rx_bytes_per_second": 1, "clock_event_reasons": ["sw_power_cap"]}
    process = {"pid": 1, "comm": "x", "container": "host"}
    return Readings(
        flows={"flows": [flow], "interfaces": [{"interface": "eth0", "direction": "ingress", "bytes": 10,
                                                "packets": 1}]},
        sendlat={"processes": [{**process, "count": 1, "bytes": 5, "sum_seconds": 0.1, "histogram": HISTOGRAM}]},
        cuda={"processes": [{**process, "context_switches": 1, "kernel_launches": 1, "involuntary_preemptions": 1,
                             "sync_histogram": HISTOGRAM, "sync_seconds_sum": 0.1, "runqueue_histogram": HISTOGRAM,
                             "runqueue_delay_seconds_sum": 0.1}]},
        gpus={"gpus": [gpu], "processes": [{**process, "gpu_index": 0, "used_memory_bytes": 1}]},
        tcp={"listen_overflows": 0, "listen_drops": 0, "retransmitted_segments": 0, "sent_segments": 0},
        probes={"flows": {"up": True, "strategy": "xdp+tcx"}},
        map_usage=[{"probe": "flows", "map": "flows", "entries": 1, "capacity": 2}],
        events_lost={"sendlat": 0},
        alerts=[{"rule": "gpu_saturated", "severity": "info", "target": "gpu0", "state": "firing"}],
        collectors={"flows": (0.1, True)},
    )


def exported() -> dict[str, tuple[str, set[str]]]:
    collector = AgentCollector(top_flows=100, dcgm_compatible=True,
                               build_info={"version": "0", "kernel": "k", "libbpf": "1.1"})
    collector.update(every_kind_of_reading())
    out = {}
    for family in collector.collect():
        labels = set().union(*(set(s.labels) for s in family.samples)) - {"le"}
        name = family.name + ("_total" if family.type == "counter" else "")
        out[name] = (family.type, labels)
    return out


def documented() -> dict[str, tuple[str, set[str]]]:
    rows = re.findall(r"^\| `([A-Za-z_:]+)` \| (\w+) \|([^|]*)\|", DOC.read_text(), flags=re.MULTILINE)
    return {name: (kind, {label.strip() for label in labels.split(",") if label.strip()})
            for name, kind, labels in rows}


def test_every_exported_metric_is_documented_and_vice_versa() -> None:
    code, doc = exported(), documented()
    assert set(code) - set(doc) == set(), "exported but not in docs/metrics.md"
    assert set(doc) - set(code) == set(), "documented but never exported"
    for name, (kind, labels) in code.items():
        assert doc[name] == (kind, labels), name


def test_names_follow_prometheus_conventions() -> None:
    for name, (kind, _) in exported().items():
        if name.startswith("DCGM_"):
            continue
        assert name.startswith("aiprobe_")
        assert name.endswith("_total") == (kind == "counter"), name
        assert not re.search(r"_(ms|milliseconds|kb|mb|percent)(_|$)", name), name
