"""`aiprobe check` and the CLI's behaviour on bad input and missing privileges."""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiprobe.registry import faces
from aiprobe.system import missing_privileges
from helpers import PATIENCE, make_veth_pair, remove_veth_pair, wait_until
from servers import AIPROBE, Agent

# A check loads and attaches every feature and each probe's strategies: 60-135 s in an emulated
# guest, twice that on a machine twice as slow (matrix.py --guest-cpu 50).
CHECK_PATIENCE = 5 * PATIENCE
EXPECTED_HERE = {
    # The dev/CI kernel: no kprobes compiled in, fentry refused, everything else works.
    "btf": True, "tp_btf": True, "raw_tp": True, "tracepoint": True, "uprobe": True,
    "xdp": True, "tc": True, "ringbuf": True,
}


# A kernel warning or bug report: what fleets running with panic_on_warn reboot on.
KERNEL_TROUBLE = re.compile(r"\b(WARNING|BUG)\b")
# One from BPF: the verifier warns once a boot (WARN_ONCE), so an earlier load in the same boot (the
# matrix's own `aiprobe check`, another test) may have been the one to log it.
BPF_TROUBLE = re.compile(r"\b(WARNING|BUG)\b.*\bbpf\b|BPF program uses run-time allocation", re.IGNORECASE)
PROBE_UP = re.compile(r'^aiprobe_probe_up\{probe="([^"]+)",strategy="([^"]+)"\}', re.MULTILINE)


def kernel_log() -> list[tuple[bool, str]]:
    """The kernel log since boot (as much as its buffer holds): each record's message, and whether the
    kernel wrote it (facility 0) rather than user space through /dev/kmsg."""
    records: list[tuple[bool, str]] = []
    fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    try:
        while True:
            try:
                record = os.read(fd, 8192).decode(errors="replace")
            except BlockingIOError:
                return records
            except BrokenPipeError:  # records overwritten while read: read on from the oldest left
                continue
            header, _, message = record.partition(";")
            records.append((int(header.split(",")[0]) >> 3 == 0, message.split("\n")[0]))
    finally:
        os.close(fd)


@dataclass
class CheckedThenRun:
    report: dict  # `aiprobe check --json`
    planned: dict[str, str]  # probe or part -> the strategy check planned ("none": none)
    running: dict[str, str]  # probe or part -> aiprobe_probe_up's strategy label
    log_before: list[str]  # what the kernel logged in this boot before the check
    log_since: list[str]  # since, until every probe of the agent had loaded


def checked(workdir: Path) -> tuple[dict, str]:
    """`aiprobe check --json`'s report, and the kernel log's line just before its loads: the check this
    boot already made before the tests, where the matrix's guest.sh names its report in
    AIPROBE_CHECK_REPORT (1-3 minutes in an emulated guest), or a check of its own."""
    made = os.environ.get("AIPROBE_CHECK_REPORT")
    report = Path(made) if made else workdir / "check.json"
    marker = f"aiprobe: check --json > {report}"  # as guest.sh logs it
    if not made:
        with open("/dev/kmsg", "w") as kmsg:
            kmsg.write(marker + "\n")  # a line left open would be logged only with the next one
        result = subprocess.run([AIPROBE, "check", "--json"], capture_output=True, text=True, timeout=CHECK_PATIENCE)
        assert result.returncode == 0, result.stderr
        report.write_text(result.stdout)
    text = report.read_text()
    assert text, f"{report}: the check wrote no report (its stderr is beside it)"
    return json.loads(text), marker


@pytest.fixture(scope="module")
def checked_then_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CheckedThenRun]:
    """`aiprobe check --json` (see checked()), then the agent at its defaults (its flows on a veth pair of
    its own) until it exports every probe's aiprobe_probe_up, then stopped."""
    workdir = tmp_path_factory.mktemp("check")
    report, marker = checked(workdir)
    planned = {name: plan["strategy"] or "none" for name, plan in report["probes"].items()}
    running: dict[str, str] = {}
    veth = make_veth_pair()
    try:
        with Agent(workdir, f'interfaces = ["{veth.host}"]\nexclude = []\n') as agent:
            def every_probe_exported() -> bool:
                running.update(PROBE_UP.findall(agent.metrics()))
                return running.keys() >= planned.keys()

            assert wait_until(every_probe_exported, timeout=PATIENCE, interval=0.5), agent.log.read_text()[-3000:]
        log = kernel_log()
        at = max(i for i, record in enumerate(log) if record == (False, marker))  # a host's matrix reruns log it anew
        kernel = [[message for by_kernel, message in part if by_kernel] for part in (log[:at], log[at + 1:])]
        yield CheckedThenRun(report, planned, running, *kernel)
    finally:
        remove_veth_pair(veth)


@pytest.mark.bpf
def test_check_json_reports_real_capabilities(checked_then_run: CheckedThenRun) -> None:
    report = checked_then_run.report
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


@pytest.mark.bpf
def test_check_plans_the_strategy_the_agent_runs(checked_then_run: CheckedThenRun) -> None:
    """On every kernel: check loads each probe's own object as the probe does (fentry that loads but
    cannot attach on 6.1's seven-argument tcp_v4_syn_recv_sock, an object 5.10 refuses)."""
    assert checked_then_run.planned == checked_then_run.running


@pytest.mark.bpf
def test_loading_everything_logs_no_kernel_warning(checked_then_run: CheckedThenRun) -> None:
    """No WARNING or BUG in the kernel log while check and the agent load every probe, nor one of BPF's
    earlier in this boot (5.10-5.19 warn once of a kprobe or tracepoint program using a hash map that
    is not preallocated)."""
    since = [line for line in checked_then_run.log_since if KERNEL_TROUBLE.search(line)]
    before = [line for line in checked_then_run.log_before if BPF_TROUBLE.search(line)]
    assert not since and not before, "\n".join(checked_then_run.log_since or before)


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
