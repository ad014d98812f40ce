"""Shared fixtures: real network namespaces and veth pairs, C fixtures built per session, this
kernel's features, the installed command; and which tests `make test-kernels` runs (marker `kernels`).
Helpers that tests import are in helpers.py.

Every fixture that creates kernel state removes it in `finally`, so a failing test leaves nothing.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers import FIXTURE_BUILD, IS_ROOT, KERNEL_MODULES, CBuild, VethPair, make_veth_pair, remove_veth_pair


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs root to load BPF programs (CI runs as root)")
    for item in items:
        stays_on_host = any(map(item.get_closest_marker, ("host_only", "realtime")))
        if item.module.__name__ in KERNEL_MODULES and not stays_on_host:
            item.add_marker(pytest.mark.kernels)
        if "bpf" in item.keywords and not IS_ROOT:
            item.add_marker(skip)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Each failure as it happens, where AIPROBE_FAILURE_LOG says (tests/kernels/guest.sh): a round
    stopped at its time limit never prints pytest's summary, and this keeps its failures' reasons."""
    if report.failed and (path := os.environ.get("AIPROBE_FAILURE_LOG")):
        with open(path, "a") as log:
            log.write(f"== {report.nodeid} ({report.when})\n{report.longreprtext}\n")


@pytest.fixture
def veth() -> Iterator[VethPair]:
    """A fresh veth pair into a fresh network namespace, removed even when the test fails."""
    pair = make_veth_pair(secrets.randbelow(250))
    try:
        yield pair
    finally:
        remove_veth_pair(pair)


@pytest.fixture(scope="session")
def cbuild() -> CBuild:
    FIXTURE_BUILD.mkdir(parents=True, exist_ok=True)
    return CBuild(FIXTURE_BUILD)


@pytest.fixture(scope="session")
def kernel_features() -> dict:
    """What this kernel can do (aiprobe.features.probe_features: each from a real load), tried once."""
    from aiprobe.features import probe_features

    return probe_features()


@pytest.fixture(scope="session")
def tc_kind(kernel_features: dict) -> str:
    """How flows attaches tc here: TCX where the kernel has it (6.6+), else clsact."""
    return "tcx" if kernel_features["tcx"].available else "clsact"


@pytest.fixture
def aiprobe_cli() -> list[str]:
    """The installed console script, as users run it."""
    return [str(Path(sys.executable).parent / "aiprobe")]


@pytest.fixture
def named_process(tmp_path) -> Iterator[Callable[[str], subprocess.Popen]]:
    """Starts a process whose comm is the given name (a copy of sleep), killed after the test."""
    started: list[subprocess.Popen] = []

    def start(name: str) -> subprocess.Popen:
        program = tmp_path / name
        shutil.copy(shutil.which("sleep"), program)
        started.append(subprocess.Popen([str(program), "600"]))
        return started[-1]
    yield start
    for proc in started:
        proc.kill()
        proc.wait()
