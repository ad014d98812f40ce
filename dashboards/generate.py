"""Builds the Grafana dashboards in this folder from one description, so the four share their
variables, label selector and panel styles. Run it after a change and commit the JSON:

    python3 dashboards/generate.py

A probe brings its own row of the overview in dashboards/rows/<probe>.py: a function
`panels(kit)` returning its panels, `kit` holding this module's vocabulary (Panel, Target, rate,
quantile, gauge, TARGET, RATE ...), so adding a probe's row edits no file but its own.

tests/test_dashboards.py fails when the JSON files and this script disagree, and runs every
panel's PromQL against a real Prometheus scraping a real agent.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
ROWS = HERE / "rows"

# The scrape target's labels: `instance` is the node name (ServiceMonitor relabeling), `namespace`
# and `pod` are the agent's own, set by Prometheus' Kubernetes service discovery. Outside
# Kubernetes the latter two are absent, which `=~".*"` (the "All" value) still matches.
TARGET = 'namespace=~"$namespace",instance=~"$node",pod=~"$pod"'
# Workload filter for per-process metrics: `container` is the short container id or "host".
WORKLOAD = TARGET + ',container=~"$container"'
PROCESS = "instance, process, container"
RATE = "$__rate_interval"


@dataclass
class Target:
    expr: str
    legend: str = ""
    instant: bool = False  # tables show the latest value only
    heatmap: bool = False


@dataclass
class Panel:
    title: str
    targets: list[Target]
    unit: str = "short"
    kind: str = "timeseries"
    description: str = ""
    width: int = 12
    height: int = 8
    extra: dict = field(default_factory=dict)


def rate(metric: str, selector: str = TARGET, by: str = PROCESS) -> str:
    return f"sum by ({by}) (rate({metric}{{{selector}}}[{RATE}]))"


def quantile(q: float, histogram: str, selector: str = WORKLOAD, by: str = PROCESS) -> str:
    """From the classic buckets, or the native histogram where Prometheus keeps that instead."""
    return (f"histogram_quantile({q}, sum by ({by}, le) (rate({histogram}_bucket{{{selector}}}[{RATE}])))\n"
            f"or histogram_quantile({q}, sum by ({by}) (rate({histogram}{{{selector}}}[{RATE}])))")


def count_rate(histogram: str, selector: str = TARGET, by: str = PROCESS) -> str:
    """Observations per second, from the classic _count or the native histogram."""
    return (f"{rate(histogram + '_count', selector, by)}\n"
            f"or sum by ({by}) (histogram_count(rate({histogram}{{{selector}}}[{RATE}])))")


def gauge(metric: str, selector: str = TARGET) -> str:
    return f"{metric}{{{selector}}}"


GPU_LEGEND = "{{instance}} gpu{{gpu}}"
ENGINE_LEGEND = GPU_LEGEND + " engine{{engine}}"
GPM_NOTE = " From GPM (Hopper and newer), per graphics engine (several under MIG); none for a GPU without GPM."
PROCESS_LEGEND = "{{process}} @ {{container}} ({{instance}})"
SHARE_LEGEND = "gpu{{gpu}}/{{GPU_I_ID}} " + PROCESS_LEGEND + " {{attribution}}"


def label_variable(name: str, label: str, metric: str, selector: str = "", hide_all: bool = False) -> dict:
    query = f"label_values({metric}{{{selector}}}, {label})" if selector else f"label_values({metric}, {label})"
    return {
        "name": name, "label": name, "type": "query", "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "query": {"query": query, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
        "definition": query, "refresh": 2, "sort": 1, "multi": True, "includeAll": not hide_all,
        "allValue": ".*", "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
    }


def variables(workload_metric: str | None, extra: list[dict] = ()) -> list[dict]:
    out = [
        {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
         "current": {}, "refresh": 1},
        label_variable("namespace", "namespace", "aiprobe_build_info"),
        label_variable("node", "instance", "aiprobe_build_info", 'namespace=~"$namespace"'),
        label_variable("pod", "pod", "aiprobe_build_info", 'namespace=~"$namespace",instance=~"$node"'),
    ]
    if workload_metric:
        out.append(label_variable("container", "container", workload_metric, TARGET))
    return out + list(extra)


def render_panel(panel: Panel, panel_id: int, x: int, y: int) -> dict:
    targets = []
    for ref, target in zip("ABCDEFGH", panel.targets, strict=False):
        rendered = {"datasource": {"type": "prometheus", "uid": "${datasource}"}, "refId": ref,
                    "expr": target.expr, "legendFormat": target.legend or "__auto", "range": not target.instant,
                    "instant": target.instant}
        if target.instant:
            rendered["format"] = "table"
        if target.heatmap:
            rendered["format"] = "heatmap"
        targets.append(rendered)
    out = {
        "id": panel_id, "type": panel.kind, "title": panel.title, "description": panel.description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": panel.height, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
        "options": {}, "targets": targets,
    }
    if panel.kind == "timeseries":
        out["options"] = {"legend": {"displayMode": "table", "placement": "bottom", "calcs": ["lastNotNull", "max"]},
                          "tooltip": {"mode": "multi", "sort": "desc"}}
    out.update(panel.extra)
    return out


def dashboard(uid: str, title: str, description: str, panels: list[Panel], templating: list[dict]) -> dict:
    rendered, x, y, row_height = [], 0, 0, 0
    for panel_id, panel in enumerate(panels, start=1):
        if x + panel.width > 24:
            x, y, row_height = 0, y + row_height, 0
        rendered.append(render_panel(panel, panel_id, x, y))
        x, row_height = x + panel.width, max(row_height, panel.height)
    return {
        "uid": uid, "title": title, "description": description, "tags": ["aiprobe"],
        "schemaVersion": 39, "version": 1, "editable": True, "graphTooltip": 1,
        "time": {"from": "now-1h", "to": "now"}, "refresh": "30s", "timezone": "",
        "links": [{"type": "dashboards", "tags": ["aiprobe"], "asDropdown": True, "title": "aiprobe"}],
        "annotations": {"list": []},
        "templating": {"list": templating},
        "panels": rendered,
    }


def overview() -> dict:
    return dashboard("aiprobe-overview", "aiprobe / Inference host overview",
                     "Is the network, the host CPU or the GPU to blame? Start here.", [
        Panel("Active bottlenecks", [Target(f"aiprobe_bottleneck_active{{{TARGET}}} == 1", instant=True)],
              kind="table", width=16,
              description="Built-in bottleneck rules firing now (docs/config.md); evidence in the agent's snapshot."),
        Panel("Probes", [Target(gauge("aiprobe_probe_up"), "{{instance}} {{probe}} ({{strategy}})", instant=True)],
              kind="table", width=8, description="1 when a probe runs, with the strategy it runs."),
        Panel("GPU utilization", [Target(gauge("aiprobe_gpu_utilization_ratio"), GPU_LEGEND)], unit="percentunit"),
        Panel("GPU memory used", [
            Target(f"{gauge('aiprobe_gpu_memory_used_bytes')} / {gauge('aiprobe_gpu_memory_total_bytes')}",
                   GPU_LEGEND)], unit="percentunit"),
        Panel("Network in / out", [
            Target(rate("aiprobe_interface_bytes_total", by="instance, direction"), "{{instance}} {{direction}}")],
              unit="Bps", description="Bytes per second over every attached interface (ingress = in)."),
        Panel("tcp_sendmsg p99", [
            Target(quantile(0.99, "aiprobe_tcp_sendmsg_duration_seconds", TARGET), PROCESS_LEGEND)], unit="s",
              description="High values: sends block on full socket buffers (slow clients, congestion)."),
        Panel("TCP retransmitted / sent segments", [
            Target(f"rate(aiprobe_tcp_retransmitted_segments_total{{{TARGET}}}[{RATE}])"
                   f" / rate(aiprobe_tcp_sent_segments_total{{{TARGET}}}[{RATE}])", "{{instance}}")],
              unit="percentunit"),
        Panel("Listen queue overflows + drops", [
            Target(f"rate(aiprobe_tcp_listen_overflows_total{{{TARGET}}}[{RATE}])"
                   f" + rate(aiprobe_tcp_listen_drops_total{{{TARGET}}}[{RATE}])", "{{instance}}")],
              unit="ops", description="Connections the server did not accept in time."),
        *token_streams(),
        *probe_rows(),
    ], variables(None))


STREAM = "instance, port, protocol, process"
STREAM_LEGEND = "{{process}} :{{port}} {{protocol}} ({{instance}})"


def token_streams() -> list[Panel]:
    """The overview's token-streams row: what clients of streaming APIs see, and why it stalls."""
    return [
        Panel("Token streams: time to first byte p50 / p99", [
            Target(quantile(0.5, "aiprobe_stream_ttfb_seconds", TARGET, STREAM), "p50 " + STREAM_LEGEND),
            Target(quantile(0.99, "aiprobe_stream_ttfb_seconds", TARGET, STREAM), "p99 " + STREAM_LEGEND)],
              unit="s", width=8, description="Request received to the response's first body byte written."),
        Panel("Token streams: gap between chunks p50 / p99", [
            Target(quantile(0.5, "aiprobe_stream_chunk_gap_seconds", TARGET, STREAM), "p50 " + STREAM_LEGEND),
            Target(quantile(0.99, "aiprobe_stream_chunk_gap_seconds", TARGET, STREAM), "p99 " + STREAM_LEGEND)],
              unit="s", width=8, description="Time between successive writes of a streamed response."),
        Panel("Token streams: stalls by cause", [
            Target(rate("aiprobe_stream_stalls_total", by="instance, port, protocol, cause"),
                   "{{cause}} :{{port}} {{protocol}} ({{instance}})")],
              unit="ops", width=8,
              description="Gaps above stream_stall_threshold_ms: network (socket full), cpu (writer waited for a "
                          "CPU), gpu, server (the application was slow)."),
    ]


def probe_rows() -> list[Panel]:
    """The overview's rows the probes bring (dashboards/rows/<probe>.py), in file name order."""
    kit = SimpleNamespace(**{name: value for name, value in globals().items() if not name.startswith("_")})
    panels: list[Panel] = []
    for path in sorted(ROWS.glob("*.py")):
        spec = importlib.util.spec_from_file_location(f"dashboards_rows_{path.stem}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        panels += module.panels(kit)
    return panels


def network_flows() -> dict:
    selector = TARGET + ',interface=~"$interface"'
    flow_maps = TARGET + ',probe="flows"'
    flow_key = "instance, interface, direction, protocol, local_address, local_port, remote_address, remote_port"
    interface = label_variable("interface", "interface", "aiprobe_interface_bytes_total", TARGET)
    return dashboard("aiprobe-network-flows", "aiprobe / Network flows",
                     "Per-flow and per-interface throughput (wire packets and bytes) from tc ingress and egress.", [
        Panel("Top flows by throughput", [
            Target(f"topk(20, {rate('aiprobe_flow_bytes_total', selector, flow_key)})", instant=True)],
              kind="table", unit="Bps", width=24,
              description='The top K flows (agent option top_flows); the rest are summed as remote_address="other".'),
        Panel("Interface throughput", [
            Target(rate("aiprobe_interface_bytes_total", selector, "instance, interface, direction"),
                   "{{instance}} {{interface}} {{direction}}")], unit="Bps"),
        Panel("Interface packets", [
            Target(rate("aiprobe_interface_packets_total", selector, "instance, interface, direction"),
                   "{{instance}} {{interface}} {{direction}}")], unit="pps"),
        Panel("TCP SYN / RST", [
            Target(rate("aiprobe_flow_tcp_flags_total", selector + ',flag=~"syn|rst"', "instance, interface, flag"),
                   "{{instance}} {{interface}} {{flag}}")], unit="ops",
              description="Connection churn (SYN) and resets (RST) per interface."),
        Panel("Flow table usage", [
            Target(f"{gauge('aiprobe_bpf_map_entries', flow_maps)} / {gauge('aiprobe_bpf_map_capacity', flow_maps)}",
                   "{{instance}} {{map}}")], unit="percentunit",
              description="Full tables evict flows early: their bytes still count in the interface totals."),
    ], variables(None, [interface]))


def send_latency() -> dict:
    histogram = "aiprobe_tcp_sendmsg_duration_seconds"
    return dashboard("aiprobe-send-latency", "aiprobe / Send latency",
                     "Duration of tcp_sendmsg calls per process: how long senders block on the network.", [
        Panel("tcp_sendmsg duration", [
            Target(f"sum by (le) (increase({histogram}_bucket{{{WORKLOAD}}}[{RATE}]))", "{{le}}", heatmap=True)],
              kind="heatmap", unit="s", width=24,
              extra={"options": {"calculate": False, "yAxis": {"unit": "s"}, "cellGap": 1,
                                 "color": {"mode": "scheme", "scheme": "Oranges"}}}),
        Panel("p50 per process", [Target(quantile(0.5, histogram), PROCESS_LEGEND)], unit="s"),
        Panel("p99 per process", [Target(quantile(0.99, histogram), PROCESS_LEGEND)], unit="s"),
        Panel("Bytes sent per process", [Target(rate("aiprobe_tcp_send_bytes_total", WORKLOAD), PROCESS_LEGEND)],
              unit="Bps"),
        Panel("Sends per process", [Target(count_rate(histogram, WORKLOAD), PROCESS_LEGEND)], unit="ops"),
    ], variables("aiprobe_tcp_send_bytes_total"))


def gpu_cuda() -> dict:
    return dashboard("aiprobe-gpu-cuda", "aiprobe / GPU & CUDA",
                     "CUDA driver activity per process, the scheduling of GPU-driving threads, and NVML.", [
        Panel("CUDA context changes by threads", [
            Target(rate("aiprobe_cuda_context_switches_total", WORKLOAD), PROCESS_LEGEND)], unit="ops",
              description="Times a thread changed its current CUDA context (driver time on the host). Not the "
                          "GPU time-slicing between busy contexts: that is aiprobe_gpu_active_contexts."),
        Panel("CUDA kernel and graph launches", [
            Target(rate("aiprobe_cuda_kernel_launches_total", WORKLOAD), "kernels " + PROCESS_LEGEND),
            Target(rate("aiprobe_cuda_graph_launches_total", WORKLOAD), "graphs " + PROCESS_LEGEND)], unit="ops",
              description="Each call once, whether made through libcudart or libcuda."),
        Panel("Synchronize duration p50 / p99", [
            Target(quantile(0.5, "aiprobe_cuda_sync_duration_seconds"), "p50 " + PROCESS_LEGEND),
            Target(quantile(0.99, "aiprobe_cuda_sync_duration_seconds"), "p99 " + PROCESS_LEGEND)], unit="s",
              description="cuStreamSynchronize / cuCtxSynchronize: time the host waits for the GPU."),
        Panel("Run-queue delay p99 of GPU-driving threads", [
            Target(quantile(0.99, "aiprobe_gpu_thread_runqueue_delay_seconds"), PROCESS_LEGEND)], unit="s",
              description="Runnable GPU-driving threads waiting for a CPU: the GPU starves while they wait."),
        Panel("Involuntary preemptions of GPU-driving threads", [
            Target(rate("aiprobe_gpu_thread_involuntary_preemptions_total", WORKLOAD), PROCESS_LEGEND)], unit="ops"),
        Panel("Busy CUDA contexts per GPU", [Target(gauge("aiprobe_gpu_active_contexts"), GPU_LEGEND)],
              description="Contexts that launched work on the GPU in the last refresh: 2 or more are time-sliced "
                          "by the GPU (the gpu_time_sliced rule)."),
        Panel("Launches into each GPU's contexts, by process", [
            Target(gauge("aiprobe_gpu_context_launches_per_second", WORKLOAD), "gpu{{gpu}} " + PROCESS_LEGEND)],
              unit="ops", description="Which processes keep the contexts on a GPU busy."),
        Panel("GPU context switches", [Target(gauge("aiprobe_gpu_context_switches_per_second"), ENGINE_LEGEND)],
              unit="ops", description="The GPU saving one context's state and restoring another's." + GPM_NOTE),
        Panel("Share of GPU time spent switching contexts", [
            Target(gauge("aiprobe_gpu_context_switching_ratio"), ENGINE_LEGEND)], unit="percentunit",
              description="The gpu_context_switch_overhead rule fires while a GPU's busiest engine spends more "
                          "than 5% of its time switching (30 s)." + GPM_NOTE),
        Panel("Time per GPU context switch", [Target(gauge("aiprobe_gpu_context_switch_seconds"), ENGINE_LEGEND)],
              unit="s", description="Cycles per switch over the SM clock: register save, page-table switch and "
                                    "command-queue reload together." + GPM_NOTE),
        Panel("GPU utilization", [
            Target(gauge("aiprobe_gpu_utilization_ratio"), "kernel " + GPU_LEGEND),
            Target(gauge("aiprobe_gpu_memory_utilization_ratio"), "memory " + GPU_LEGEND)], unit="percentunit"),
        Panel("GPU memory per process", [
            Target(gauge("aiprobe_gpu_process_memory_used_bytes", WORKLOAD), "gpu{{gpu}} " + PROCESS_LEGEND)],
              unit="bytes"),
        Panel("GPU share per process", [
            Target(gauge("aiprobe_gpu_process_sm_utilization_ratio", WORKLOAD), "SM " + SHARE_LEGEND),
            Target(gauge("aiprobe_gpu_process_memory_utilization_ratio", WORKLOAD), "memory " + SHARE_LEGEND)],
              unit="percentunit",
              description="Each process's share of a shared GPU (time-sliced, or a MIG instance: GPU_I_ID) from "
                          "NVML's per-process samples; MPS clients' (attribution cuda_launches) are the MPS "
                          "server's share split by their kernel launches."),
        Panel("Power", [Target(gauge("aiprobe_gpu_power_watts"), GPU_LEGEND)], unit="watt"),
        Panel("Temperature", [Target(gauge("aiprobe_gpu_temperature_celsius"), GPU_LEGEND)], unit="celsius"),
        Panel("Clocks (drops under load = throttling)", [
            Target(gauge("aiprobe_gpu_sm_clock_hertz"), "SM " + GPU_LEGEND),
            Target(gauge("aiprobe_gpu_memory_clock_hertz"), "memory " + GPU_LEGEND)], unit="hertz",
              description="An SM clock that falls while utilization stays high is power or thermal throttling."),
        Panel("Throttling: active clock event reasons", [
            Target(gauge("aiprobe_gpu_clock_event_reason_active"), GPU_LEGEND + " {{reason}}")], unit="short",
              description="1 while NVML reports the reason for lowered clocks: power cap, thermal or hardware "
                          "slowdown, power brake; gpu_idle is not throttling."),
        Panel("PCIe throughput", [
            Target(gauge("aiprobe_gpu_pcie_tx_bytes_per_second"), "tx " + GPU_LEGEND),
            Target(gauge("aiprobe_gpu_pcie_rx_bytes_per_second"), "rx " + GPU_LEGEND)], unit="Bps"),
    ], variables("aiprobe_cuda_kernel_launches_total"))


DASHBOARDS = {
    "aiprobe-overview.json": overview,
    "aiprobe-network-flows.json": network_flows,
    "aiprobe-send-latency.json": send_latency,
    "aiprobe-gpu-cuda.json": gpu_cuda,
}


def render_all() -> dict[str, str]:
    """File name -> JSON text, exactly as committed."""
    return {name: json.dumps(build(), indent=2) + "\n" for name, build in DASHBOARDS.items()}


def main() -> None:
    for name, text in render_all().items():
        (HERE / name).write_text(text)
        print(f"wrote dashboards/{name}")


if __name__ == "__main__":
    main()
