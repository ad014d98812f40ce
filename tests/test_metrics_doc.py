"""docs/metrics.md and the exporter agree: the tables are the ones generated from the probes'
declarations, every metric the agent can serve is documented with the same type and labels, and
nothing documented is missing from the code. A probe's suite may give its own sample reading
(`def sample_reading()` in tests/test_<probe>.py), so adding a probe edits no list here."""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

from aiprobe.config import Config
from aiprobe.exporters.prometheus import AgentCollector, doc_tables
from aiprobe.histogram import exported_buckets, hist_slots, kernel_buckets
from aiprobe.model import Alert, MapUsage, ProbeStatus, Readings
from aiprobe.probes.cuda.records import AllocationFailures, ColdStart, CudaContext, CudaGpu, CudaProcess, CudaSnapshot
from aiprobe.probes.flows.records import FlowRecord, FlowsSnapshot, InterfaceTotals
from aiprobe.probes.netstat.records import TcpCounters
from aiprobe.probes.nvml.records import GpuEngine, GpuEventCount, GpuInfo, GpuProcess, GpuSnapshot
from aiprobe.probes.nvml.settings import NvmlSettings
from aiprobe.probes.sendlat.records import ProcessSendLatency, SendLatencySnapshot
from aiprobe.registry import faces

DOC = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"
TESTS = Path(__file__).resolve().parent
HISTOGRAM = exported_buckets(kernel_buckets([1] * hist_slots()))


def probe_suites_samples() -> dict[str, Any]:
    """The sample readings probes' suites give, by probe name."""
    samples = {}
    for face in faces():
        suite = TESTS / f"test_{face.name}.py"
        if suite.exists() and "\ndef sample_reading(" in suite.read_text():
            samples[face.name] = importlib.import_module(suite.stem).sample_reading()
    return samples


def every_kind_of_reading() -> Readings:
    """One record of each kind, so every family the exporter can build has a sample."""
    flow = FlowRecord("eth0", "ingress", "tcp", "a", 1, "b", 2, 10, 1, 1.0, 1.0, 0, 0.0, 0.0, tcp_syn=1)
    gpu = GpuInfo(0, "u", "n", 0.5, 0.5, 2, 1, 1, 1.0, 1.0, 1, 1, ["sw_power_cap"], 1, 1,
                  engines=[GpuEngine(0, 10.0, 0.01, 0.001)], lost=False, last_xid=79, ecc_corrected_volatile=1,
                  ecc_uncorrected_volatile=1, ecc_corrected_aggregate=1, ecc_uncorrected_aggregate=1,
                  remapped_rows_corrected=1, remapped_rows_uncorrected=1, row_remap_pending=False,
                  row_remap_failure=False, pcie_replays=1)
    return Readings(
        records={
            "flows": FlowsSnapshot(0.0, 1.0, [flow], [InterfaceTotals("eth0", "ingress", 10, 1)], 0, 0, 0, []),
            "sendlat": SendLatencySnapshot("tracepoint", "", [
                ProcessSendLatency(1, "x", 0, 1, 5, 0.1, 0.1, 0.1, HISTOGRAM, unwritable_histogram=HISTOGRAM)]),
            "cuda": CudaSnapshot([CudaProcess(1, "x", "lib", 1, 1, 1, 0.1, 0.1, HISTOGRAM, 0.1, 0.1, HISTOGRAM, 1,
                                              cold_start=ColdStart(0.1, 0.1, 1, 0.1, 1, 0.1, 0.2))],
                                 "tp_btf", [], [CudaContext(1, "x", "0x1", 0, "0", 1, 0, 1.0, True)],
                                 [CudaGpu("0", 1, ["1/0x1"], [1], 1.0)],
                                 allocation_failures=[AllocationFailures(1, "x", "CUDA_ERROR_OUT_OF_MEMORY", 3, 3, 1)]),
            "nvml": GpuSnapshot(True, gpu_count=1, gpus=[gpu], processes=[GpuProcess(1, "x", 0, "u", 1, 0.5, 0.2)],
                                event_counts=[GpuEventCount(0, "u", None, "", None, event, xid, 1)
                                              for event, xid in (("xid", 79), ("single_bit_ecc", None))]),
            "netstat": TcpCounters(0, 0, 0, 0),
            **probe_suites_samples(),
        },
        probes={"flows": ProbeStatus(True, "xdp+tcx")},
        map_usage={"flows": [MapUsage("flows", 1, 2)]},
        events_lost={"sendlat": 0},
        alerts=[Alert("gpu_saturated", "info", "gpu0", "firing", 1.0, {}, 0.0, 0.0)],
        collectors={"flows": (0.1, True)},
        collector_errors={"flows": 1},
        thread_restarts={"cuda_scan": 1},
        attach_errors={("flows", "eth0", "busy"): 1},
        notifications={"failure": 1},
    )


def exported() -> dict[str, tuple[str, set[str]]]:
    readings = every_kind_of_reading()
    # A budget the sample outgrows, so the families of the agent's own folding have samples too.
    collector = AgentCollector(Config(max_series=100).with_settings(NvmlSettings(dcgm_compatible_metrics=True)),
                               build_info={"version": "0", "kernel": "k", "libbpf": "1.1"}, source=lambda: readings)
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


def test_doc_tables_are_the_generated_ones() -> None:
    text = DOC.read_text()
    for table, rows in doc_tables().items():
        assert "\n".join(rows) in text, f"docs/metrics.md: regenerate the {table} table " \
                                        "(python -m aiprobe.exporters.prometheus)"
    generated = {row for rows in doc_tables().values() for row in rows}
    assert {line for line in text.splitlines() if line.startswith("| `")} == generated


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
        # Request-shaped things carry OpenTelemetry's names, as Beyla/OBI export them (docs/requests.md).
        assert name.startswith(("aiprobe_", "http_server_", "rpc_server_", "http_client_")), name
        assert name.endswith("_total") == (kind == "counter"), name
        assert not re.search(r"_(ms|milliseconds|kb|mb|percent)(_|$)", name), name


def test_the_readme_says_what_an_entry_costs_in_series() -> None:
    """Its figures are the generated table's: a process's sends, a listener, an endpoint, a request key."""
    readme = " ".join((DOC.parent.parent / "README.md").read_text().split())
    said = re.search(r"about (\d+) per sending process name, (\d+) per listening port, (\d+) per streaming "
                     r"endpoint and (\d+) per request", readme)
    assert said, "README.md: what a node costs in series"
    series = {re.findall(r"`(\w+)`", row)[-1]: int(row.split("|")[-2]) for row in doc_tables()["series"]}
    assert [int(n) for n in said.groups()] == \
        [series[name] for name in ("ProcessSendLatency", "Listener", "StreamEndpoint", "HttpRequests")]
