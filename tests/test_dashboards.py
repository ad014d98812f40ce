"""Grafana dashboards: generated from dashboards/generate.py; every panel's PromQL parses (by
Prometheus itself), names only documented metrics, and returns data from a real Prometheus that
scrapes a real agent running every probe under test traffic, with the target
labels a ServiceMonitor gives it on Kubernetes."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from aiprobe.probes.sendlat.rules import POD_SUFFIX
from fixtures import cuda_fake
from helpers import FIXTURE_BUILD, FIXTURES, CBuild, free_port, make_veth_pair, remove_veth_pair, wait_until
from servers import Agent, Prometheus
from test_agent import STALL_RULES, blocked_sender, send_tcp, tcp_sink
from test_containers import POD as POD_UID
from test_containers import container_cgroup
from test_kubelet import kubelet_tree
from test_metrics_doc import documented

ROOT = Path(__file__).resolve().parent.parent
SSE_SERVER = FIXTURES / "sse_server.py"
DASHBOARDS = ROOT / "dashboards"
RATE_INTERVAL = "15s"
# What Prometheus' Kubernetes service discovery knows about the agent pod, and the relabelings
# the Prometheus Operator generates before a ServiceMonitor's own.
POD = {"__meta_kubernetes_namespace": "aiprobe", "__meta_kubernetes_pod_name": "aiprobe-x7k2p",
       "__meta_kubernetes_pod_node_name": "gpu-node-1", "__meta_kubernetes_pod_container_name": "aiprobe",
       "__meta_kubernetes_service_name": "aiprobe"}
OPERATOR_RELABELINGS = [{"source_labels": [f"__meta_kubernetes_{meta}"], "target_label": label}
                        for meta, label in (("namespace", "namespace"), ("service_name", "service"),
                                            ("pod_name", "pod"), ("pod_container_name", "container"))]
TARGET_LABELS = {"instance", "job", "namespace", "pod", "service"}
# A workload's namespace and pod, where the target has its own (deploy/kubernetes/README.md).
EXPORTED_LABELS = {"exported_namespace", "exported_pod"}
# The token-streaming server runs as a replica of a Deployment (the replica-skew row needs one).
REPLICA = ("inference", "llm-7d9f8b6c5d-x2k4p", "server")
GPU_METRIC = re.compile(r"\baiprobe_(gpu|cuda)_")


def load_generator():
    spec = importlib.util.spec_from_file_location("dashboards_generate", DASHBOARDS / "generate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def load_row(name: str):
    spec = importlib.util.spec_from_file_location(f"dashboards_rows_{name}", DASHBOARDS / "rows" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dashboards() -> dict[str, dict]:
    return {path.name: json.loads(path.read_text()) for path in sorted(DASHBOARDS.glob("*.json"))}


def panel_targets() -> list[tuple[str, str, str]]:
    """(dashboard file, panel title, expr) of every query."""
    return [(name, panel["title"], target["expr"])
            for name, board in dashboards().items() for panel in board["panels"] for target in panel["targets"]]


def label_variables(board: dict) -> list[dict]:
    return [v for v in board["templating"]["list"] if v["type"] == "query"]


def variable_query(variable: dict) -> tuple[str, str]:
    """Grafana's `label_values(SELECTOR, LABEL)` as (PromQL selector, label)."""
    selector, label = re.fullmatch(r"label_values\((.*), (\w+)\)", variable["definition"]).groups()
    return selector, label


# --- PromQL, read the way Prometheus reads it ---

KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan", "group_left", "group_right"}  # modifiers bare too


def metric_names(expr: str) -> set[str]:
    """Names of the series an expression selects (everything that is not a function, keyword or label)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", expr)
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    return {m.group() for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr)
            if m.group().lower() not in KEYWORDS and not expr[m.end():].lstrip().startswith("(")}


def selectors(expr: str) -> list[tuple[str, set[str]]]:
    """(metric, label names it matches on) of every `metric{...}`."""
    return [(name, set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers)))
            for name, matchers in re.findall(r"([A-Za-z_:][A-Za-z0-9_:]*)\{([^}]*)\}", expr)]


def documented_series(name: str) -> tuple[str, set[str]] | None:
    """(base metric, its labels) for a metric name or one of a documented histogram's series."""
    docs = documented()
    if name in docs:
        return name, docs[name][1]
    base = re.sub(r"_(bucket|sum|count)$", "", name)
    if docs.get(base, ("",))[0] == "histogram":
        return base, docs[base][1] | ({"le"} if name.endswith("_bucket") else set())
    return None


def substitute(expr: str, values: dict[str, str]) -> str:
    expr = expr.replace("$__rate_interval", RATE_INTERVAL)
    return re.sub(r"\$(\w+)", lambda m: values.get(m.group(1), ".*"), expr)


# --- static checks ---

def test_dashboards_are_what_the_generator_writes() -> None:
    expected = load_generator().render_all()
    assert sorted(expected) == sorted(dashboards()), "run: python3 dashboards/generate.py"
    for name, text in expected.items():
        assert (DASHBOARDS / name).read_text() == text, f"{name} is stale: run python3 dashboards/generate.py"


def test_every_dashboard_has_datasource_node_namespace_pod_variables() -> None:
    titles = {board["title"] for board in dashboards().values()}
    assert titles == {"aiprobe / Inference host overview", "aiprobe / Network flows", "aiprobe / Send latency",
                      "aiprobe / GPU & CUDA"}
    for name, board in dashboards().items():
        variables = {v["name"]: v for v in board["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
        assert {"namespace", "node", "pod"} <= set(variables), name
        for panel in board["panels"]:
            assert panel["datasource"]["uid"] == "${datasource}", (name, panel["title"])
            assert panel["targets"], (name, panel["title"])
        uids = [board["uid"] for board in dashboards().values()]
        assert len(set(uids)) == len(uids)


def test_every_panel_names_only_documented_metrics_and_labels() -> None:
    exprs = [(name, title, expr) for name, title, expr in panel_targets()]
    exprs += [(name, v["name"], variable_query(v)[0]) for name, board in dashboards().items()
              for v in label_variables(board)]
    for name, title, expr in exprs:
        found = metric_names(expr)
        assert found, (name, title, expr)
        for metric in found:
            assert documented_series(metric), f"{name} / {title}: {metric} is not in docs/metrics.md"
        for metric, labels in selectors(expr):
            _, known = documented_series(metric)
            assert labels <= known | TARGET_LABELS | EXPORTED_LABELS, \
                f"{name} / {title}: {metric} has no label {labels - known}"


def test_the_skew_row_names_workloads_as_the_fleet_rules_do() -> None:
    row = load_row("requests_skew")
    assert row.POD_SUFFIX == POD_SUFFIX
    workload = re.compile(f"(.+?){POD_SUFFIX}")
    for pod, name in (("vllm-7d9f8b6c5d-x2k4p", "vllm"), ("vllm-5b8c7f9d64-h2j9k", "vllm"), ("api-v2-x2k4p", "api-v2"),
                      ("llm-12", "llm"), ("mypod", "mypod")):
        assert workload.fullmatch(pod).group(1) == name, pod


# --- against a real agent and Prometheus ---

def servicemonitor_relabelings() -> list[dict]:
    """The ServiceMonitor's relabelings in Prometheus' own spelling."""
    monitor = yaml.safe_load((ROOT / "deploy/kubernetes/base/servicemonitor.yaml").read_text())
    snake = {"sourceLabels": "source_labels", "targetLabel": "target_label"}
    [endpoint] = monitor["spec"]["endpoints"]
    return [{snake.get(k, k): v for k, v in relabel.items()} for relabel in endpoint["relabelings"]]


def gpu_fixtures(cbuild: CBuild) -> Path:
    """The fake libnvidia-ml.so.1 / libcuda.so.1 and a CUDA "application" (tests/fixtures/)."""
    cbuild("libnvidia-ml.so.1", "nvml_libnvidia_ml.c", shared=True)
    cuda_fake.build(cbuild)
    return cuda_fake.DRIVER


def run_cuda_driver(driver: Path, env: dict[str, str]) -> None:
    """One run of the fake CUDA application: context switches, launches and synchronizations."""
    proc = subprocess.Popen([str(driver), "200", "400", "30"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "ready"
        threading.Event().wait(1.5)  # the agent rescans /proc every second and attaches to the new library
        proc.stdin.write("go\n")
        proc.stdin.flush()
        proc.wait(timeout=30)
    finally:
        proc.kill()


def keep_busy(stop: threading.Event, work, interval: float) -> threading.Thread:
    def loop() -> None:
        while not stop.is_set():
            work()
            stop.wait(interval)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


@contextlib.contextmanager
def in_pod(logs: Path, command: list[str]) -> Iterator[subprocess.Popen]:
    """`command` running as REPLICA: in a container cgroup that a fake kubelet log tree under `logs` names."""
    with container_cgroup() as (leaf, container_id):
        kubelet_tree(logs, REPLICA[0], REPLICA[1], POD_UID, REPLICA[2], container_id)
        process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        try:
            (leaf / "cgroup.procs").write_text(str(process.pid))
            yield process
        finally:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory, cbuild: CBuild) -> Iterator[Prometheus]:
    workdir = tmp_path_factory.mktemp("dashboards")
    driver = gpu_fixtures(cbuild)  # GPU and CUDA panels: the fake NVML and CUDA driver (tests/fixtures/)
    env = {**os.environ, "LD_LIBRARY_PATH": str(FIXTURE_BUILD), "FAKE_CUDA_SYNC_US": "2000"}
    veth = make_veth_pair()
    sink = tcp_sink(veth, 9000)
    stop = threading.Event()
    logs = workdir / "kubelet"
    config = (f'interfaces = ["{veth.host}"]\nexclude = []\npod_logs = "{logs}/pods"\n'
              f'container_logs = "{logs}/containers"\n' + STALL_RULES)  # every probe: every row's panels
    stream_port = free_port()  # token streams for the overview's streams row: 3 SSE events 20 ms apart
    stream_url = f"http://127.0.0.1:{stream_port}/stream"
    try:
        with in_pod(logs, [sys.executable, str(SSE_SERVER), str(stream_port), "--events", "3", "--prefill-ms",
                           "10"]) as streamer:
            assert streamer.stdout.readline().strip() == "ready"
            threading.Thread(target=streamer.stdout.read, daemon=True).start()  # its accounts: not needed here
            with Agent(workdir, config, env=env) as agent, \
                    Prometheus(workdir, [agent.target], target_labels=POD,
                               relabel_configs=OPERATOR_RELABELINGS + servicemonitor_relabelings()) as prom:
                threads = [keep_busy(stop, lambda: send_tcp(veth.peer_ip4, 9000, 200_000), 0.3),
                           keep_busy(stop, lambda: httpx.get(stream_url, timeout=30), 0.2),
                           keep_busy(stop, lambda: run_cuda_driver(driver, env), 0.2)]
                sender = blocked_sender(stall=0.6)  # a network_send_stall bottleneck for "Active bottlenecks"
                try:
                    yield prom
                finally:
                    stop.set()
                    sender.kill()
                    for thread in threads:
                        thread.join(timeout=30)
    finally:
        sink.kill()
        remove_veth_pair(veth)


def promql_regex_literal(value: str) -> str:
    """A value matched literally by a regex inside a PromQL string (backslashes doubled, as Grafana does)."""
    return re.sub(r"([.+*?()|\[\]{}^$\\])", r"\\\\\1", value)


def variable_values(prom: Prometheus, board: dict) -> dict[str, str] | None:
    """Each label variable resolved by its own query, in order (later ones use earlier values), as a
    multi-value selection of everything it offers; None while one has no values yet."""
    values: dict[str, str] = {}
    for variable in label_variables(board):
        metric, label = variable_query(variable)
        found = sorted({series["metric"].get(label, "") for series in prom.query(substitute(metric, values))})
        if not found:
            return None
        values[variable["name"]] = "|".join(promql_regex_literal(value) for value in found)
    return values


@pytest.mark.bpf
def test_servicemonitor_labels_reach_the_series(prometheus: Prometheus) -> None:
    series = prometheus.wait_for_series("aiprobe_tcp_send_bytes_total")
    assert series
    for s in series:
        labels = s["metric"]
        assert (labels["instance"], labels["namespace"], labels["pod"]) == ("gpu-node-1", "aiprobe", "aiprobe-x7k2p")
        assert labels["container"] != "aiprobe" and "exported_container" not in labels


def panel_queries(prom: Prometheus, gpu: bool) -> dict[tuple[str, str, str], str]:
    """(dashboard, panel, refId) -> PromQL with the variables resolved, for the GPU/CUDA panels or the others."""
    queries = {}
    for board in dashboards().values():
        targets = [(panel["title"], target) for panel in board["panels"] for target in panel["targets"]
                   if bool(GPU_METRIC.search(target["expr"])) == gpu]
        if not targets:
            continue
        assert wait_until(lambda b=board: variable_values(prom, b), timeout=30, interval=1), board["title"]
        values = variable_values(prom, board)
        assert (values["node"], values["namespace"], values["pod"]) == ("gpu-node-1", "aiprobe", "aiprobe-x7k2p")
        for title, target in targets:
            queries[(board["title"], title, target["refId"])] = substitute(target["expr"], values)
    return queries


def assert_all_return_data(prom: Prometheus, queries: dict[tuple[str, str, str], str]) -> None:
    """Each query returns a sample that is a number (not NaN) at least once within a minute of traffic;
    a query that does not parse is an HTTP 400, which Prometheus.query() raises on."""
    assert queries
    pending = dict(queries)

    def all_answered() -> bool:
        for key, promql in list(pending.items()):
            if any(not math.isnan(float(s["value"][1])) for s in prom.query(promql)):
                del pending[key]
        return not pending

    wait_until(all_answered, timeout=60, interval=1)
    assert not pending, "no data for: " + "; ".join(f"{k[0]} / {k[1]} ({k[2]}): {q}" for k, q in pending.items())


@pytest.mark.bpf
def test_every_network_and_host_panel_returns_data(prometheus: Prometheus) -> None:
    assert_all_return_data(prometheus, panel_queries(prometheus, gpu=False))


@pytest.mark.bpf
def test_every_gpu_and_cuda_panel_returns_data(prometheus: Prometheus) -> None:
    assert_all_return_data(prometheus, panel_queries(prometheus, gpu=True))
