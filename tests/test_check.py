"""`aiprobe check` and the CLI's behaviour on bad input and missing privileges."""

from __future__ import annotations

import json
import subprocess

import pytest
from aiprobe.registry import faces
from aiprobe.system import missing_privileges
from helpers import PATIENCE

EXPECTED_HERE = {
    # The dev/CI kernel: no kprobes compiled in, fentry refused, everything else works.
    "btf": True, "tp_btf": True, "raw_tp": True, "tracepoint": True, "uprobe": True,
    "xdp": True, "tc": True, "ringbuf": True,
}


@pytest.mark.bpf
def test_check_json_reports_real_capabilities(aiprobe_cli: list[str]) -> None:
    # A check loads and attaches every feature: 45-150 s in an emulated guest.
    result = subprocess.run([*aiprobe_cli, "check", "--json"], capture_output=True, text=True, timeout=2 * PATIENCE)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    features = {name: f["available"] for name, f in report["features"].items()}
    for name, available in EXPECTED_HERE.items():
        assert features[name] is available, (name, report["features"][name])
    kprobes_built = subprocess.run(["test", "-e", "/sys/bus/event_source/devices/kprobe"]).returncode == 0
    if not kprobes_built:
        assert features["kprobe"] is False
        assert features["fentry"] is False
        assert report["probes"]["sendlat"]["strategy"] == "tracepoint"
        assert set(report["probes"]["sendlat"]["skipped"]) == {"fentry", "kprobe"}
    assert set(report["probes"]) == {face.name for face in faces()}
    assert report["probes"]["netstat"]["strategy"] == "procfs"
    for probe in report["probes"].values():
        assert probe["available"] == (probe["strategy"] is not None)
        assert probe["available"] or probe["reason"]


@pytest.mark.host_only  # command-line output: no kernel-specific path
@pytest.mark.bpf
def test_check_text_names_every_probe(aiprobe_cli: list[str]) -> None:
    result = subprocess.run([*aiprobe_cli, "check"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    for probe in (face.name for face in faces()):
        assert f"  {probe} " in result.stdout


@pytest.mark.host_only  # command-line output: no kernel-specific path
@pytest.mark.bpf
def test_unprivileged_check_prints_one_line_and_exits_1(aiprobe_cli: list[str]) -> None:
    result = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all", *aiprobe_cli, "check"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert "CAP_BPF" in lines[0] and "CAP_NET_ADMIN" in lines[0]


def test_missing_privileges_from_capability_sets() -> None:
    full = (1 << 12) | (1 << 38) | (1 << 39)
    assert missing_privileges(full) == []
    assert missing_privileges((1 << 12) | (1 << 21)) == []  # CAP_SYS_ADMIN covers BPF and PERFMON
    assert missing_privileges(0) == ["CAP_BPF", "CAP_PERFMON", "CAP_NET_ADMIN"]


def test_version_and_help(aiprobe_cli: list[str]) -> None:
    version = subprocess.run([*aiprobe_cli, "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and "0.1.0" in version.stdout
    helptext = subprocess.run([*aiprobe_cli, "--help"], capture_output=True, text=True)
    assert helptext.returncode == 0 and "check" in helptext.stdout


def test_unknown_option_is_one_line_error(aiprobe_cli: list[str]) -> None:
    result = subprocess.run([*aiprobe_cli, "check", "--bogus"], capture_output=True, text=True)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr


def test_a_network_feature_never_tried_is_missing_not_a_crash() -> None:
    """The netns probe thread may fail before trying anything (no veth support): check goes on."""
    from aiprobe.features import Feature, _any

    combined = _any({"tcx": Feature(False, "EPERM")}, "tcx", "tc_clsact")
    assert not combined.available and "tc_clsact: not tried" in combined.detail
