"""Shared fixtures: real network namespaces and veth pairs, C fixtures built per session, this
kernel's features, the installed command; and which tests `make test-kernels` runs (marker `kernels`).
Helpers that tests import are in helpers.py.

Every fixture that creates kernel state removes it in `finally`, so a failing test leaves nothing; and
every module is checked to leave nothing running (threads, child processes, listening sockets).
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import (
    FIXTURE_BUILD,
    IS_ROOT,
    KERNEL_MODULES,
    NVML_OTHER_PID,
    CBuild,
    VethPair,
    make_veth_pair,
    remove_veth_pair,
    wait_until,
)


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


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    note_progress(f"started {nodeid}")


def pytest_runtest_logfinish(nodeid: str, location: tuple[str, int | None, str]) -> None:
    note_progress(f"finished {nodeid}")


def note_progress(event: str) -> None:
    """The latest test started or finished, where AIPROBE_PROGRESS says (tests/kernels/guest.sh): its
    watchdog ends a round only when this stays the same for its bound, so a slow machine that keeps
    finishing tests is never stopped, and a hang is."""
    if path := os.environ.get("AIPROBE_PROGRESS"):
        Path(path).write_text(f"{event}\n")


@pytest.fixture
def veth() -> Iterator[VethPair]:
    """A fresh veth pair into a fresh network namespace, removed even when the test fails."""
    pair = make_veth_pair()
    try:
        yield pair
    finally:
        remove_veth_pair(pair)


@pytest.fixture(scope="session")
def cbuild() -> CBuild:
    FIXTURE_BUILD.mkdir(parents=True, exist_ok=True)
    return CBuild(FIXTURE_BUILD)


@pytest.fixture(scope="module")
def nvml_env(cbuild) -> dict[str, str]:
    """Environment under which pynvml finds the fake NVML (tests/fixtures/nvml_libnvidia_ml.c), reporting
    this test's pid on GPU 0."""
    cbuild("libnvidia-ml.so.1", "nvml_libnvidia_ml.c", shared=True)
    return {**os.environ, "LD_LIBRARY_PATH": str(FIXTURE_BUILD), "FAKE_NVML_PIDS": f"{os.getpid()},{NVML_OTHER_PID}"}


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


# ---- each module leaves nothing running: once, accept loops outlived their tests by many minutes ----

LEFTOVER_GRACE = 30.0  # seconds for what a module stopped to end (threads joining, children exiting)


@dataclass(frozen=True)
class Running:
    """What this pytest process runs: threads, child processes (and theirs), listening sockets by inode.
    Each maps to how the report names it."""

    threads: dict[threading.Thread, str]
    processes: dict[int, str]
    listeners: dict[int, str]

    def since(self, before: Running) -> list[str]:
        return [*(name for thread, name in self.threads.items() if thread not in before.threads),
                *(name for pid, name in self.processes.items() if pid not in before.processes),
                *(name for inode, name in self.listeners.items() if inode not in before.listeners)]


def running_now() -> Running:
    gc.collect()  # a socket or thread only garbage holds is not a leak
    frames = sys._current_frames()
    threads = {thread: f"thread {thread.name!r} at {where(frames.get(thread.ident or 0))}"
               for thread in threading.enumerate() if thread.is_alive() and thread is not threading.current_thread()}
    processes = {pid: f"process {pid}: {command_line(pid)}" for pid in descendants(os.getpid())
                 if process_state(pid) not in ("Z", "")}
    return Running(threads, processes, listening_sockets())


def where(frame: object) -> str:
    """A thread's innermost three frames, innermost last."""
    stack = traceback.extract_stack(frame)[-3:] if frame else []  # type: ignore[arg-type]
    return " > ".join(f"{entry.name} ({Path(entry.filename).name}:{entry.lineno})" for entry in stack)


def command_line(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    return "(gone)"


def process_state(pid: int) -> str:
    """One letter (R, S, D, Z...), "" when the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return ""


def descendants(pid: int) -> list[int]:
    children: list[int] = []
    for tasks in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            children += map(int, tasks.read_text().split())
    return [grandchild for child in children for grandchild in (child, *descendants(child))]


def listening_sockets() -> dict[int, str]:
    """This process's listening TCP and unix sockets: inode -> 'listening tcp port 8080'."""
    listening = {}
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/self/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # TCP_LISTEN
                listening[int(fields[9])] = f"listening {table} port {int(fields[1].rpartition(':')[2], 16)}"
    for line in Path("/proc/self/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[3], 16) & 0x10000:  # __SO_ACCEPTCON: listening
            listening[int(fields[6])] = f"listening unix socket {fields[7] if len(fields) > 7 else '(unnamed)'}"
    ours = set()
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):  # closed meanwhile
            if (target := os.readlink(fd)).startswith("socket:["):
                ours.add(int(target[8:-1]))
    return {inode: name for inode, name in listening.items() if inode in ours}


@pytest.fixture(scope="module", autouse=True)
def leaves_nothing_running(request: pytest.FixtureRequest) -> Iterator[None]:
    """Errors the module's last test when a thread, child process or listening socket the module
    started is still there LEFTOVER_GRACE seconds after its tests and fixtures ended; the processes
    are then killed, so the next module starts clean."""
    before = running_now()
    yield
    wait_until(lambda: not running_now().since(before), timeout=LEFTOVER_GRACE, interval=0.2)
    now = running_now()
    if left := now.since(before):
        for pid in now.processes.keys() - before.processes.keys():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        pytest.fail(f"{request.module.__name__} left running after its tests ended:\n  " + "\n  ".join(left))
