"""Shipping: the Kubernetes manifests (validated offline against the API schemas), the Dockerfile
(no container engine here: its inputs and build commands), and the Vagrant VM."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from aiprobe import system
from aiprobe.config import Config, from_dict
from aiprobe.registry import catalog
from kubernetes_validate.utils import all_versions

ROOT = Path(__file__).resolve().parent.parent
KUBE = ROOT / "deploy" / "kubernetes"
VARIANTS = ["base", "overlays/privileged", "overlays/seccomp-unconfined", "overlays/nvidia-runtime"]
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}
# The oldest and the newest Kubernetes whose schemas kubernetes-validate bundles.
KUBE_VERSIONS = sorted({all_versions()[0], all_versions()[-1]})


# --- kustomize, as far as these manifests use it (cross-checked with `kubectl kustomize` below) ---

MERGE_KEYS = {"containers": "name", "volumes": "name", "env": "name", "volumeMounts": "mountPath",
              "ports": "containerPort"}


def strategic_merge(base: Any, patch: Any, field: str = "") -> Any:
    """Kubernetes strategic merge: maps merge, null deletes, keyed lists merge by their merge key."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for key, value in patch.items():
            if value is None:
                merged.pop(key, None)
            else:
                merged[key] = strategic_merge(base.get(key), value, key) if key in base else value
        return merged
    if isinstance(base, list) and isinstance(patch, list) and field in MERGE_KEYS:
        key = MERGE_KEYS[field]
        merged = list(base)
        for item in patch:
            index = next((i for i, old in enumerate(merged) if old.get(key) == item.get(key)), None)
            if index is None:
                merged.append(item)
            else:
                merged[index] = strategic_merge(merged[index], item)
        return merged
    return patch


def load_yaml_docs(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def render(directory: Path) -> list[dict]:
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    docs: list[dict] = []
    for resource in kustomization.get("resources", []):
        path = directory / resource
        docs += render(path) if path.is_dir() else load_yaml_docs(path)
    for patch_ref in kustomization.get("patches", []):
        patch = yaml.safe_load((directory / patch_ref["path"]).read_text())
        index = next(i for i, doc in enumerate(docs)
                     if (doc["kind"], doc["metadata"]["name"]) == (patch["kind"], patch["metadata"]["name"]))
        docs[index] = strategic_merge(docs[index], patch)
    for image in kustomization.get("images", []):
        for container in containers(docs):
            if container["image"].split(":")[0] == image["name"]:
                container["image"] = f"{image.get('newName', image['name'])}:{image['newTag']}"
    return docs


def by_kind(docs: list[dict], kind: str) -> dict:
    [doc] = [d for d in docs if d["kind"] == kind]
    return doc


def containers(docs: list[dict]) -> list[dict]:
    return [c for d in docs if d["kind"] == "DaemonSet" for c in d["spec"]["template"]["spec"]["containers"]]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {variant: render(KUBE / variant) for variant in VARIANTS}


@pytest.fixture(scope="module")
def base(rendered: dict[str, list[dict]]) -> list[dict]:
    return rendered["base"]


# --- schemas ---

@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_manifests_validate_against_the_kubernetes_api_schemas(rendered: dict, version: str) -> None:
    checked = 0
    for variant, docs in rendered.items():
        for doc in docs:
            if doc["kind"] in CRD_KINDS:
                # Their ObjectMeta is still core API: check it through a kind that has only metadata.
                doc = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc["metadata"]}
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{variant}: {doc['kind']} {'.'.join(map(str, exc.path))}: {exc.message}")
            checked += 1
    assert checked == sum(len(docs) for docs in rendered.values()) >= 7 * len(VARIANTS)


# The Prometheus Operator's CRDs are not in the Kubernetes schemas, and no PyPI package ships
# them as schemas. These are the parts of monitoring.coreos.com/v1 the manifests use, with the
# upstream field names and value patterns; unknown fields fail, as kubectl's server-side
# validation would. The rules' content is checked by promtool itself (the operator's own check).
DURATION = {"type": "string", "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?"
                                         r"(([0-9]+)s)?(([0-9]+)ms)?)$"}
LABEL_NAME = {"type": "string", "pattern": r"^[a-zA-Z_][a-zA-Z0-9_]*$"}
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
RELABEL_CONFIG = {
    "type": "object", "additionalProperties": False,
    "properties": {
        "action": {"enum": ["replace", "keep", "drop", "hashmod", "labelmap", "labeldrop", "labelkeep",
                            "lowercase", "uppercase", "keepequal", "dropequal"]},
        "sourceLabels": {"type": "array", "items": {"type": "string", "pattern": r"^[a-zA-Z_][a-zA-Z0-9_]*$"}},
        "separator": {"type": "string"}, "targetLabel": {"type": "string"}, "regex": {"type": "string"},
        "modulus": {"type": "integer"}, "replacement": {"type": "string"},
    },
}
CRD_SPECS = {
    "ServiceMonitor": {
        "type": "object", "additionalProperties": False, "required": ["selector", "endpoints"],
        "properties": {
            "jobLabel": {"type": "string"},
            "selector": {"type": "object", "additionalProperties": False,
                         "properties": {"matchLabels": STRING_MAP, "matchExpressions": {"type": "array"}}},
            "namespaceSelector": {"type": "object", "additionalProperties": False,
                                  "properties": {"any": {"type": "boolean"},
                                                 "matchNames": {"type": "array", "items": {"type": "string"}}}},
            "endpoints": {"type": "array", "minItems": 1, "items": {
                "type": "object", "additionalProperties": False,
                "properties": {
                    "port": {"type": "string"}, "path": {"type": "string"}, "scheme": {"enum": ["http", "https"]},
                    "interval": DURATION, "scrapeTimeout": DURATION, "honorLabels": {"type": "boolean"},
                    "relabelings": {"type": "array", "items": RELABEL_CONFIG},
                    "metricRelabelings": {"type": "array", "items": RELABEL_CONFIG},
                }}},
        },
    },
    "PrometheusRule": {
        "type": "object", "additionalProperties": False,
        "properties": {"groups": {"type": "array", "items": {
            "type": "object", "additionalProperties": False, "required": ["name", "rules"],
            "properties": {
                "name": {"type": "string", "minLength": 1}, "interval": DURATION,
                "rules": {"type": "array", "items": {
                    "type": "object", "additionalProperties": False, "required": ["expr"],
                    "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
                    "properties": {"alert": {"type": "string"}, "record": {"type": "string"},
                                   "expr": {"type": ["string", "integer"]}, "for": DURATION,
                                   "keep_firing_for": DURATION, "labels": STRING_MAP, "annotations": STRING_MAP},
                }},
            }}}},
    },
}


@pytest.mark.parametrize("kind", sorted(CRD_KINDS))
def test_prometheus_operator_resources_match_their_crd(base: list[dict], kind: str) -> None:
    doc = by_kind(base, kind)
    assert doc["apiVersion"] == "monitoring.coreos.com/v1"
    jsonschema.validate(doc["spec"], CRD_SPECS[kind])
    assert set(doc) == {"apiVersion", "kind", "metadata", "spec"}


def test_servicemonitor_selects_the_service_and_keeps_the_workload_container_label(base: list[dict]) -> None:
    service, monitor = by_kind(base, "Service"), by_kind(base, "ServiceMonitor")
    labels = service["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == [service["metadata"]["namespace"]]
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    for relabel in endpoint["relabelings"]:
        re.compile(relabel.get("regex", "(.*)"))
    assert {"action": "labeldrop", "regex": "container"} in endpoint["relabelings"]
    assert any(r.get("targetLabel") == "instance" and r["sourceLabels"] == ["__meta_kubernetes_pod_node_name"]
               for r in endpoint["relabelings"])


def test_prometheusrule_holds_exactly_the_shipped_rules(base: list[dict], tmp_path: Path) -> None:
    rules_file = ROOT / "deploy" / "prometheus" / "aiprobe-rules.yml"
    rule = by_kind(base, "PrometheusRule")
    assert rule["spec"] == yaml.safe_load(rules_file.read_text()), \
        "regenerate with: python3 deploy/kubernetes/generate_prometheusrule.py"
    generator = subprocess.run([sys.executable, str(KUBE / "generate_prometheusrule.py")], capture_output=True,
                               text=True, cwd=tmp_path, env={"PYTHONDONTWRITEBYTECODE": "1"})
    assert generator.returncode == 0, generator.stderr
    assert "prometheusrule.yaml" in generator.stdout  # rewrote the same text: the test above still holds
    spec = tmp_path / "spec.yml"
    spec.write_text(yaml.safe_dump(rule["spec"]))
    check = subprocess.run(["promtool", "check", "rules", str(spec)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed (optional cross-check)")
@pytest.mark.parametrize("variant", VARIANTS)
def test_kubectl_kustomize_renders_the_same(rendered: dict, variant: str) -> None:
    out = subprocess.run(["kubectl", "kustomize", str(KUBE / variant)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr

    def unordered(value: Any, field: str = "") -> Any:
        """Keyed lists compared as sets: kustomize moves patched items to the front."""
        if isinstance(value, dict):
            return {k: unordered(v, k) for k, v in value.items()}
        if isinstance(value, list) and field in MERGE_KEYS:
            return sorted((unordered(v) for v in value), key=lambda item: str(item.get(MERGE_KEYS[field], item)))
        return value

    def keyed(docs: list[dict]) -> dict:
        return {(d["kind"], d["metadata"]["name"]): unordered(d) for d in docs}

    assert keyed([d for d in yaml.safe_load_all(out.stdout) if d]) == keyed(rendered[variant])


# --- the DaemonSet: least privilege, documented ---

def documented_capabilities() -> set[str]:
    """The capability list in deploy/kubernetes/README.md ("Capabilities: `BPF`, ...")."""
    line = re.search(r"^Capabilities added: (.+)$", (KUBE / "README.md").read_text(), flags=re.MULTILINE)
    assert line, "deploy/kubernetes/README.md lost its 'Capabilities added:' line"
    return set(re.findall(r"`(\w+)`", line.group(1)))


def test_no_container_is_privileged_by_default_and_capabilities_are_the_documented_ones(base: list[dict]) -> None:
    daemonset = by_kind(base, "DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    for container in pod["containers"] + pod.get("initContainers", []):
        context = container["securityContext"]
        assert context.get("privileged", False) is False
        assert context["allowPrivilegeEscalation"] is False
        assert context["capabilities"]["drop"] == ["ALL"]
        assert set(context["capabilities"]["add"]) == documented_capabilities()
    # What aiprobe itself asks for (agent/system.py) is a subset: the rest is for discovery.
    assert {name.removeprefix("CAP_") for name in system.REQUIRED_CAPS} <= documented_capabilities()
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"


def test_privileged_variant_is_an_overlay(rendered: dict) -> None:
    [container] = containers(rendered["overlays/privileged"])
    assert container["securityContext"]["privileged"] is True
    for variant in VARIANTS:
        if variant != "overlays/privileged":
            assert all(not c["securityContext"].get("privileged") for c in containers(rendered[variant])), variant


def test_daemonset_has_what_a_gpu_node_agent_needs(base: list[dict]) -> None:
    pod = by_kind(base, "DaemonSet")["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert pod["hostNetwork"] and pod["hostPID"]
    assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert pod["automountServiceAccountToken"] is False
    assert any(t["key"] == "nvidia.com/gpu" and t["operator"] == "Exists" for t in pod["tolerations"])
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"} in container["env"]
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert set(container["resources"]) == {"requests", "limits"}
    assert all(set(container["resources"][k]) == {"cpu", "memory"} for k in ("requests", "limits"))
    host_paths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    # tracefs is writable: CUDA uprobes are defined in its uprobe_events (aiprobe.uprobe_events); the
    # kubelet's log directories name pods and containers (aiprobe.kubelet).
    for path, writable in ((str(system.TRACEFS), True), (str(system.BPFFS), False), ("/sys/kernel/btf", False),
                           ("/sys/fs/cgroup", False), (Config().pod_logs, False),
                           (Config().container_logs, False)):
        [name] = [n for n, p in host_paths.items() if p == path]
        assert mounts[name]["mountPath"] == path and mounts[name]["readOnly"] is not writable


def test_configmap_is_a_valid_agent_config_on_the_served_port(base: list[dict]) -> None:
    config = from_dict(tomllib.loads(by_kind(base, "ConfigMap")["data"]["aiprobe.toml"]), catalog())
    _, port = config.listen_address
    [container] = containers(base)
    assert [p["containerPort"] for p in container["ports"] if p["name"] == "metrics"] == [port]
    service = by_kind(base, "Service")
    assert [p["port"] for p in service["spec"]["ports"] if p["name"] == "metrics"] == [port]
    mount = next(m for m in container["volumeMounts"] if m["name"] == "config")["mountPath"]
    assert container["args"] == ["agent", "--config", f"{mount}/aiprobe.toml"]
    # The snapshot API (every process, pod and flow of the node) is not served to the network by default.
    assert config.snapshot_api == "local" and not any(a.startswith("--web.config") for a in container["args"])


# --- Dockerfile (no container engine here) ---

def dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    return [tuple(line.split(None, 1)) for line in text.splitlines() if line.strip() and not line.startswith("#")]


def readme_make_targets() -> set[str]:
    text = (ROOT / "README.md").read_text() + (ROOT / "bpf" / "README.md").read_text()
    return set(re.findall(r"\bmake (\w+)", text))


def makefile_variable(name: str) -> list[str]:
    text = re.sub(r"\\\n", " ", (ROOT / "Makefile").read_text())
    return re.search(rf"^{name}\s*:?=(.*)$", text, flags=re.MULTILINE).group(1).split()


def test_dockerfile_copies_only_existing_paths_the_context_keeps() -> None:
    ignored = [line for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line and not line.startswith("#")]
    sources = []
    for op, args in dockerfile_instructions():
        if op == "COPY" and "--from=" not in args:
            sources += args.split()[:-1]
    assert sources
    for source in sources:
        assert (ROOT / source).exists(), f"Dockerfile copies {source}, which does not exist"
        assert not any(Path(source.rstrip("/")).match(pattern) for pattern in ignored), f"{source} is ignored"


def test_dockerfile_builds_with_the_readme_make_targets_and_ships_no_toolchain() -> None:
    instructions = dockerfile_instructions()
    stages = [i for i, (op, _) in enumerate(instructions) if op == "FROM"]
    assert len(stages) == 2, "multi-stage: build, then runtime"
    build, runtime = instructions[stages[0]:stages[1]], instructions[stages[1]:]
    makefile_targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.MULTILINE))
    commands = [command.strip() for op, args in build if op == "RUN" for command in args.split("&&")]
    make_runs = [command.removeprefix("make ") for command in commands if command.startswith("make ")]
    assert make_runs
    for run in make_runs:
        targets = [word for word in shlex.split(run) if "=" not in word]
        assert targets and set(targets) <= makefile_targets & readme_make_targets(), run
        override = re.search(r'APT_PACKAGES="([^"]*)"', run)
        if override:
            assert set(override.group(1).split()) <= set(makefile_variable("APT_PACKAGES"))
    runtime_installs = [args for op, args in runtime if op == "RUN" and "apt-get install" in args]
    [install] = runtime_installs
    packages = {w for w in install.split("--no-install-recommends", 1)[1].split("&&")[0].split()}
    assert packages == {"python3", "libbpf1"}
    runtime_text = " ".join(args for _, args in runtime)
    for toolchain in ("clang", "llvm", "-dev", "gcc", "bpftool", "make "):
        assert toolchain not in runtime_text, f"runtime stage mentions {toolchain}"
    assert ("COPY", "--from=build /opt/aiprobe /opt/aiprobe") in runtime
    assert any(op == "ENTRYPOINT" and "aiprobe" in args for op, args in runtime)


# --- Vagrant ---

def test_vagrantfile_is_ruby_and_provisions_with_the_readme_commands() -> None:
    if shutil.which("ruby") is None:
        pytest.skip("ruby not installed (make test installs it)")
    check = subprocess.run(["ruby", "-c", str(ROOT / "Vagrantfile")], capture_output=True, text=True)
    assert check.returncode == 0 and "Syntax OK" in check.stdout, check.stderr
    text = (ROOT / "Vagrantfile").read_text()
    assert 'config.vm.box = "bento/ubuntu-24.04"' in text
    provision = re.search(r"<<-SHELL\n(.*?)\n\s*SHELL", text, flags=re.DOTALL).group(1)
    commands = set(re.findall(r"\bmake (\w+)", provision))
    assert "test" in commands and commands <= readme_make_targets()
    assert "apt-get install -y -qq make" in provision  # the README's step for images without make


def test_every_document_the_deploy_files_point_to_exists() -> None:
    """Manifests and READMEs name the documents that explain them (e.g. deploy/kubernetes/README.md)."""
    named = {path for file in (ROOT / "deploy").rglob("*") if file.is_file()
             for path in re.findall(r"\b(?:deploy|docs)/[\w./-]+\.md\b", file.read_text(errors="replace"))}
    assert named and all((ROOT / path).is_file() for path in named), sorted(named)
