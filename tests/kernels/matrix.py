"""`make test-kernels`: the kernel-facing tests (marker `kernels`) on stock Debian kernels booted in
qemu by virtme-ng, and on this host's own kernel; then one table: kernel, the strategy `aiprobe
check` picks per probe, tests passed / failed / skipped, and every skip's reason.

Each kernel is the newest package of its series (resolved with apt-cache, never hard-coded),
downloaded once with `apt-get download` and unpacked with `dpkg-deb -x` under build/kernels/ (not
`dpkg -i`: its post-install wants initramfs-tools); `depmod` indexes its modules where virtme-ng
looks for them (the tree beside the image). The guest shares this host's root filesystem read-only
over 9p and sees this repository through an overlay whose writes stay in the guest's memory; only
its results directory is shared read-write. KVM is used when it works (nested KVM often does not),
plain emulation otherwise.

The emulated guests run side by side, each on one host thread (see EMULATION), while this host runs
its own selection and, with --with-suite, the rest of the suite (Host).

Usage: matrix.py [--kernel SUBSTRING]... [--repeat N] [--guest-cpu PERCENT] [--with-suite] [-- PYTEST ARGS]
(default: the modules of tests/helpers.py's KERNEL_MODULES, -m "kernels and (bpf or kernel_facing)";
naming the modules spares the guests the imports of the rest of the suite, minutes under emulation).
The slow truths (marker `slow_truth`: end-to-end truths whose kernel paths lighter tests cover on
every kernel) run on this host only: under emulation they took a third of a guest's time, and the
guests share two cores.
`--repeat N` runs the selection N times in one boot, to find flakes before CI does; every failure
names its round. `--guest-cpu 50` runs each guest half the time (a machine twice as slow for the
guests): the bounds must hold there too.
Exit status 1 when a test failed or a kernel did not report.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / "build" / "kernels"
VNG = CACHE / "vng-venv" / "bin" / "vng"
GUEST = ROOT / "tests" / "kernels" / "guest.sh"
sys.path.insert(0, str(ROOT / "tests"))
from helpers import KERNEL_MODULES  # noqa: E402  (the one list of what runs on every kernel)

# The rest needs no kernel of its own: make test runs it.
MODULES = tuple(f"tests/{module}.py" for module in sorted(KERNEL_MODULES))
SELECTED = "kernels and (bpf or kernel_facing)"
KERNEL_TESTS = (*MODULES, "-m", SELECTED)
WITHOUT_SLOW_TRUTHS = (*MODULES, "-m", f"{SELECTED} and not slow_truth")
# --with-suite: the rest of the suite, `make test` without the selection, on this host beside the guests.
REST_OF_SUITE = f"make test PYTEST_ARGS='-m \"not ({SELECTED})\"'"
# Every step is bounded by its progress, never by its total, so a hang is a failure with the stacks
# of what hung (guest.sh: hung.log), never a stalled CI, and a slow machine that keeps finishing tests
# is never stopped. Each bound is over twice the slowest seen under emulation on a machine more than
# twice as slow: a 6.12 guest beside four others on 2 cores (2026-12-06), whose round took 3,129 s
# where CI's take 685-1,160 s. `aiprobe check` as a whole took 89 s there (45-150 s in CI); 5.10's
# took 328 s beside this host's tests with --guest-cpu 50, where its guest boots now.
CHECK_SECONDS = 900
# A round's collection, and each of its tests (setup, call and teardown: tests/conftest.py marks each
# start and end). The slowest there: test_check's agent plan, 256 s (its setup runs `aiprobe check`,
# then the agent); flows' wire segments, 140 s; the rest under 125 s.
TEST_SECONDS = 600
BOOT_SECONDS = 300  # from qemu's start to guest.sh's: ~40 s
# The host's own bound on the guest's progress (results/progress), for a guest whose own watchdog
# failed: guest.sh's bound (a minute more for a round's), then time for its dump of the stacks.
STALLED_SECONDS = max(CHECK_SECONDS, TEST_SECONDS + 60) + 120
STALLED = "the guest made no progress"
# The whole run's bound, a backstop far beyond normal (a round takes 700-1,200 s in CI, 3,129 s beside
# four other guests): the progress bounds end a hang long before it; CI's own limit is 90 minutes.
ROUND_BACKSTOP_SECONDS = 3600
# Those bounds are the guest's own timers: a guest that froze whole (once in CI, silent on its console:
# no lockup, RCU-stall or hung-task report; 9p's waits are killable, which the hung-task detector
# skips) stops them too. guest.sh rewrites a heartbeat every 10 s; when it stops this long, the host
# asks qemu (over QMP) where each vCPU is, presses SysRq-W (the guest's blocked tasks' stacks, when
# it still takes interrupts), then sends an NMI, which the guest answers with a panic and every
# CPU's backtrace (unknown_nmi_panic, panic_print's bit 6).
FROZEN_SECONDS = 240
FROZE = "the guest froze"
GUEST_CMDLINE = "sysrq_always_enabled unknown_nmi_panic=1 panic_print=0x40"
VM_OPTIONS = ("--cpus", "2", "--memory", "2G", "--append", GUEST_CMDLINE)
# One host thread runs both vCPUs in turn. With a thread each (qemu's default), an emulated 6.12 guest
# oopsed on an int3 in ttwu_do_activate while its other vCPU, attaching a program (which flips static
# keys), was in text_poke_bp: most likely the first vCPU ran a translation older than the patching.
EMULATION = ("--disable-kvm", "--disable-microvm", "--force-9p", "--qemu-opts=-accel tcg,thread=single")


@dataclass(frozen=True)
class Series:
    """A kernel series: package names matching `pattern`; the highest `(\\d+)` group is the newest.
    `suite`: a Debian suite this host's apt sources lack, resolved and downloaded through lists of its
    own under build/kernels/apt/ (the host's apt configuration is left as it is). `nice`: its qemu's
    niceness, for a guest that should yield its share of the cores to a longer one."""

    label: str
    pattern: str
    suite: str = ""
    nice: int = 0


# Debian 11's 5.10 stands in for the 5.x fleets (Amazon Linux 2's 5.10, Ubuntu 22.04's 5.15): it lacks
# everything 5.15 lacks (bpf_loop, bpf_get_func_ret, TCX, XDP multi-buffer) and task storage too.
# Debian 12's stock kernel and its newer series (bookworm-backports' successor, in bookworm itself).
# 5.10 takes longest (the bounded-loop build verifies at every sendlat load): about 23 minutes of a
# core in a CI run where the three shared both cores alike, against 10 for 6.1 and 14 for 6.12 (with
# the slow truths then), and it ran alone for its last 9 minutes. So the other two yield it a core of
# its own and share the other.
YIELDS = 10  # niceness: CFS weighs such a process at a tenth of one at 0
# While this host runs its own tests (Host), each guest's niceness is this more than its own (at most
# 19): 5.10 at 15, the others at 19, weighed at 3.5% and 1.5% of a test's process. So they take the
# CPU the host's tests leave (about two thirds of CI's two cores through make test, by vmstat), 5.10
# over half of it, and still get a slice every few hundred ms: no guest timer sees a CPU gone for seconds.
BESIDE = 15
# In a guest's results while this host runs its selection: guest.sh waits for it to go before its tests.
HOLD = "hold"
MATRIX = (
    Series("Debian 11 stock", r"linux-image-5\.10\.0-(\d+)-amd64", suite="bullseye"),
    Series("Debian 12 stock", r"linux-image-6\.1\.0-(\d+)-amd64", nice=YIELDS),
    Series("Debian 12 6.12", r"linux-image-6\.12\.(\d+)\+deb12-amd64", nice=YIELDS),
)


@dataclass(frozen=True)
class Kernel:
    """A series' kernel, unpacked: what a guest boots."""

    series: Series
    image: Path

    @property
    def release(self) -> str:
        return self.image.name.removeprefix("vmlinuz-")


@dataclass
class Result:
    kernel: str
    how: str  # host, kvm or emulated
    slow_truths: bool  # whether it ran them (Selection.slow_truths)
    seconds: float = 0.0
    strategies: dict[str, str] = field(default_factory=dict)
    outcomes: Counter = field(default_factory=Counter)
    skips: Counter = field(default_factory=Counter)  # reason -> tests
    passed: set[str] = field(default_factory=set)  # test ids
    skipped: set[str] = field(default_factory=set)
    problem: str = ""  # why the kernel reported nothing (no boot, no results)
    evidence: list[str] = field(default_factory=list)  # the logs' last lines, when there is a problem
    died: bool = False  # the guest ran `aiprobe check`, then froze, or ended in time without a hang or test results
    first_boot: Result | None = None  # when it had died on an earlier boot


def log(message: str) -> None:
    print(f"test-kernels: {message}", file=sys.stderr, flush=True)


@dataclass
class Host:
    """What this host runs while the guests boot: its own selection, whose end each guest awaits before
    its tests (guest.sh waits while HOLD is in its results: the selection compiles the fixtures they
    reuse), then the rest of the suite (--with-suite). Meanwhile each guest runs at BESIDE more than
    its series' niceness; then at its own, set for every thread of its process group at once."""

    selecting: bool  # its selection runs, or is still to
    busy: bool  # it runs its selection or the rest of the suite
    held: set[Path] = field(default_factory=set)  # results directories with a HOLD
    running: dict[int, int] = field(default_factory=dict)  # a guest's process group -> its series' niceness
    lock: threading.Lock = field(default_factory=threading.Lock)

    def hold(self, results: Path) -> None:
        with self.lock:
            if self.selecting:
                (results / HOLD).touch()
                self.held.add(results)

    def selection_done(self) -> None:
        with self.lock:
            self.selecting = False
            for results in self.held:
                (results / HOLD).unlink(missing_ok=True)

    def niceness(self, own: int) -> int:
        with self.lock:
            return min(19, own + BESIDE) if self.busy else own

    @contextlib.contextmanager
    def kept(self, group: int, own: int) -> Iterator[None]:
        with self.lock:
            self.running[group] = own
            if not self.busy:  # started just before done()
                set_niceness(group, own)
        try:
            yield
        finally:
            with self.lock:
                del self.running[group]

    def done(self) -> None:
        self.selection_done()
        with self.lock:
            self.busy = False
            for group, own in self.running.items():
                set_niceness(group, own)


def set_niceness(group: int, niceness: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.setpriority(os.PRIO_PGRP, group, niceness)  # PRIO_PGRP: each thread of each process


def run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kwargs)  # type: ignore[call-overload]


# ---- kernels: resolve, download, unpack ----


def apt_options(suite: str) -> list[str]:
    """apt's options for `suite` ("" for this host's own sources): its sources list, package lists and
    downloads in build/kernels/apt/<suite>/, made on first use, signed by Debian's archive keys."""
    if not suite:
        return []
    state = CACHE / "apt" / suite
    sources = state / "sources.list"
    if not sources.exists():
        (state / "lists" / "partial").mkdir(parents=True, exist_ok=True)
        (state / "archives" / "partial").mkdir(parents=True, exist_ok=True)
        signed = "[signed-by=/usr/share/keyrings/debian-archive-keyring.gpg]"
        sources.write_text(f"deb {signed} http://deb.debian.org/debian {suite} main\n"
                           f"deb {signed} http://deb.debian.org/debian-security {suite}-security main\n")
    return [f"-oDir::Etc::SourceList={sources}", "-oDir::Etc::SourceParts=/dev/null",
            f"-oDir::State::Lists={state / 'lists'}", f"-oDir::Cache::Archives={state / 'archives'}",
            f"-oDir::Cache::pkgcache={state / 'pkgcache.bin'}",
            f"-oDir::Cache::srcpkgcache={state / 'srcpkgcache.bin'}"]


def newest_package(series: Series) -> str:
    """The highest-numbered package of the series that apt knows, updating the lists once if none."""
    options = apt_options(series.suite)
    prefix = series.pattern.split("\\.")[0]  # linux-image-5 or linux-image-6: apt's own prefix match
    for attempt in range(2):
        names = run(["apt-cache", *options, "pkgnames", prefix]).stdout.split()
        matches = [(int(m.group(1)), name) for name in names if (m := re.fullmatch(series.pattern, name))]
        if matches:
            return max(matches)[1]
        if attempt == 0:
            suite = f" for {series.suite}" if series.suite else ""
            log(f"no package of the series in apt's lists{suite}; apt-get update")
            run(["apt-get", *options, "update", "-qq"])
    raise SystemExit(f"test-kernels: no package matches {series.pattern} (check `apt-cache policy`)")


def unpacked_kernel(series: Series) -> Path:
    """build/kernels/<release>/boot/vmlinuz-<release> of the series' newest package, downloaded and
    unpacked once."""
    package = newest_package(series)
    release = package.removeprefix("linux-image-")
    tree = CACHE / release
    image = tree / "boot" / f"vmlinuz-{release}"
    if image.exists() and (tree / "lib" / "modules" / release / "modules.dep").exists():
        return image
    debs = CACHE / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    if not list(debs.glob(f"{package}_*.deb")):
        log(f"downloading {package}")
        run(["apt-get", *apt_options(series.suite), "download", "-q", package], cwd=debs)
    [deb] = sorted(debs.glob(f"{package}_*.deb"))[-1:]
    log(f"unpacking {deb.name}")
    shutil.rmtree(tree, ignore_errors=True)
    run(["dpkg-deb", "-x", str(deb), str(tree)])
    run(["depmod", "-b", str(tree), release])
    return image


# ---- running ----


def qmp_socket(image: Path) -> Path:
    """qemu's monitor for the guest of this kernel (guests run side by side); short, as a unix
    socket's path must be."""
    return Path(tempfile.gettempdir()) / f"aiprobe-{os.getpid()}-{image.name.removeprefix('vmlinuz-')}.qmp"


def vng(image: Path, accel: tuple[str, ...], *args: str) -> list[str]:
    return [str(VNG), "--verbose", "--run", str(image), *accel, *VM_OPTIONS,
            f"--qemu-opts=-qmp unix:{qmp_socket(image)},server=on,wait=off", *args]


def vng_env() -> dict[str, str]:
    # vng starts virtme-run from PATH.
    return {**os.environ, "PATH": f"{VNG.parent}:{os.environ['PATH']}"}


def run_vm(cmd: list[str], qmp: Path, timeout: float, output: int | IO[str], results: Path | None = None,
           cpu_share: float = 1.0, niceness: tuple[Host, int] | None = None) -> str:
    """Run vng in a process group of its own (`cpu_share` of the time: see throttled; `niceness`: where
    its priority is kept, and its series' own) until it ends: "" then.
    Otherwise why it was stopped: it outlived `timeout`, its heartbeat in `results` stopped (see
    FROZEN_SECONDS), or its progress (STALLED_SECONDS); report_frozen asks such a guest where it is
    first. Stopping kills the whole group (qemu included: killing vng alone would leave a guest
    running behind the next one)."""
    # A group, not a session: a session is a scheduler autogroup of its own (sched_autogroup_enabled),
    # where the guest's niceness (Series.nice) would weigh nothing against the other guests.
    vm = subprocess.Popen(cmd, env=vng_env(), stdin=subprocess.DEVNULL, stdout=output,
                          stderr=subprocess.STDOUT, process_group=0, text=True)
    priority = niceness[0].kept(vm.pid, niceness[1]) if niceness else contextlib.nullcontext()
    with throttled(vm, cpu_share), priority:
        why = wait_for_vm(vm, timeout, results)
    if why.startswith((FROZE, STALLED)) and results:
        report_frozen(vm, qmp, results)
    for sig in (signal.SIGTERM, signal.SIGKILL) if why else ():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(vm.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            vm.wait(timeout=10)
    qmp.unlink(missing_ok=True)
    return why


def wait_for_vm(vm: subprocess.Popen, timeout: float, results: Path | None) -> str:
    started = time.time()
    while vm.poll() is None:
        if time.time() - started > timeout:
            return f"no result within {timeout:.0f} s"
        if results and (why := stuck(results, started)):
            return why
        time.sleep(5)
    return ""


def stuck(results: Path, started: float) -> str:
    """Why the guest seems stuck, from the files it rewrites (their times are this host's: 9p), or "".
    Before guest.sh writes its progress, the guest is booting."""
    with contextlib.suppress(OSError):
        if time.time() - (results / "heartbeat").stat().st_mtime > FROZEN_SECONDS:
            return f"{FROZE}: no heartbeat for {FROZEN_SECONDS} s"
    try:
        if time.time() - (results / "progress").stat().st_mtime > STALLED_SECONDS:
            return f"{STALLED} for {STALLED_SECONDS} s (its own watchdog did not end the step)"
    except FileNotFoundError:
        if time.time() - started > BOOT_SECONDS:
            return f"the guest did not start guest.sh within {BOOT_SECONDS} s"
    return ""


@contextlib.contextmanager
def throttled(vm: subprocess.Popen, cpu_share: float) -> Iterator[None]:
    """The VM's process group stopped for (1 - cpu_share) of every 100 ms, as cpulimit does it (SIGSTOP,
    SIGCONT): a machine that much slower for the guest, whatever else runs beside it."""
    if cpu_share >= 1:
        yield
        return
    done = threading.Event()

    def cycle() -> None:
        while not done.wait(0.1 * cpu_share):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(vm.pid, signal.SIGSTOP)
            done.wait(0.1 * (1 - cpu_share))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(vm.pid, signal.SIGCONT)

    cycler = threading.Thread(target=cycle, daemon=True)
    cycler.start()
    try:
        yield
    finally:
        done.set()
        cycler.join()


def report_frozen(vm: subprocess.Popen, qmp: Path, results: Path) -> None:
    """Three samples of each vCPU's instruction pointer in results/frozen.log; then SysRq-W and an
    NMI, whose answers the console keeps (console_excerpt shows them)."""
    lines = []
    try:
        for _ in range(3):
            lines += vcpu_states(hmp(qmp, "info registers -a"))
            time.sleep(1)
        hmp(qmp, "sendkey alt-sysrq-w")
        time.sleep(5)
        hmp(qmp, "nmi")
        with contextlib.suppress(subprocess.TimeoutExpired):
            vm.wait(timeout=30)  # panic=-1 and qemu's -no-reboot: the guest ends once it has printed
    except (OSError, ValueError) as error:  # qemu itself stuck, or gone
        lines.append(f"QMP: {error}")
    (results / "frozen.log").write_text("\n".join(lines) + "\n")


def hmp(qmp: Path, command: str) -> str:
    """A human monitor command's output, through QMP."""
    with socket.socket(socket.AF_UNIX) as connection:
        connection.settimeout(10)
        connection.connect(str(qmp))
        stream = connection.makefile("rw")
        stream.readline()  # the greeting
        for request in ({"execute": "qmp_capabilities"},
                        {"execute": "human-monitor-command", "arguments": {"command-line": command}}):
            stream.write(json.dumps(request) + "\n")
            stream.flush()
            while not {"return", "error"} & (reply := json.loads(stream.readline())).keys():
                pass  # events
        return str(reply.get("return", reply.get("error")))


def vcpu_states(registers: str) -> list[str]:
    """'CPU#0 RIP=ffffffff81f2a0ef kernel, running' per vCPU (the NMI's backtraces name the functions)."""
    return [f"CPU#{cpu} RIP={rip} {'kernel' if cpl == '0' else 'user'}, {'halted' if halted == '1' else 'running'}"
            for cpu, rip, cpl, halted in re.findall(r"CPU#(\d+)\s.*?RIP=([0-9a-f]+) .*?CPL=(\d).*?HLT=(\d)",
                                                     registers, re.S)]


def kvm_works(image: Path) -> bool:
    """Whether a guest boots under KVM here: nested KVM may abort (failed to set MSR) or hang."""
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return False
    with tempfile.TemporaryFile("w+") as output:
        stopped = run_vm(vng(image, (), "--", "true"), qmp_socket(image), 60, output)
        output.seek(0)
        return not stopped and "script exited with code 0" in output.read()


def results_dir(name: str) -> Path:
    """build/kernels/results/<name>, emptied; a previous boot's results move to <name>.before."""
    path = CACHE / "results" / name
    before = path.with_name(f"{name}.before")
    shutil.rmtree(before, ignore_errors=True)
    if path.exists():
        path.rename(before)
    path.mkdir(parents=True)
    return path


@dataclass(frozen=True)
class Selection:
    """What every kernel runs: pytest's arguments (none: KERNEL_TESTS on this host, without the slow
    truths in a guest), `rounds` times in a row; each guest gets `cpu_share` of the time (--guest-cpu)."""

    pytest_args: list[str]
    rounds: int
    cpu_share: float = 1.0

    def slow_truths(self, on_host: bool) -> bool:
        """Whether a kernel runs them: this host does, a guest only with pytest's arguments as given."""
        return on_host or bool(self.pytest_args)

    def guest_args(self, results: Path, on_host: bool) -> list[str]:
        tests = self.pytest_args or (KERNEL_TESTS if self.slow_truths(on_host) else WITHOUT_SLOW_TRUTHS)
        return [str(results), str(CHECK_SECONDS), str(TEST_SECONDS), str(self.rounds), *tests]

    @property
    def vm_timeout(self) -> float:
        """The backstop: boot, `aiprobe check` and each round at its most."""
        return BOOT_SECONDS + CHECK_SECONDS + ROUND_BACKSTOP_SECONDS * self.rounds


def run_in_vm(kernel: Kernel, accel: tuple[str, ...], selection: Selection,
              host: Host) -> tuple[Path, float, str]:
    """Boot the kernel, run guest.sh; its results directory, the wall time, and a problem if any."""
    image = kernel.image
    results = results_dir(kernel.release)
    own = kernel.series.nice
    host.hold(results)
    cmd = ["nice", "-n", str(host.niceness(own)),
           *vng(image, accel, "--overlay-rwdir", str(ROOT), "--rwdir", str(results), "--cwd", str(ROOT),
                "--", shlex.join([str(GUEST), *selection.guest_args(results, on_host=False)]))]
    started = time.monotonic()
    # Appending: qemu's own messages and the guest's console share the file without overwriting.
    with (results / "console.log").open("a") as console:
        problem = run_vm(cmd, qmp_socket(image), selection.vm_timeout, console, results, selection.cpu_share,
                         (host, own))
    return results, time.monotonic() - started, problem


def run_on_host(selection: Selection) -> Result:
    log(f"this host ({os.uname().release}): running the selection")
    result = Result(os.uname().release, "host", selection.slow_truths(on_host=True))
    results = results_dir(f"host-{os.uname().release}")
    started = time.monotonic()
    subprocess.run(["sh", str(GUEST), *selection.guest_args(results, on_host=True)], stdin=subprocess.DEVNULL)
    result.seconds = time.monotonic() - started
    read_results(result, results)
    return result


# ---- results ----


# CI keeps only what is printed, not build/: a kernel that failed or did not report shows why in
# its logs' tails, and in what its console printed from the kernel's first report of trouble on.
EVIDENCE = (("check.err", 5), ("steps.log", 3), ("frozen.log", 6))
PYTEST_EVIDENCE = 15  # last lines of each failed round's failures and pytest logs (or of the last round)
TROUBLE = re.compile(r"\] (Oops|BUG|general protection|Kernel panic|watchdog: BUG|INFO: task|rcu: INFO|"
                     r"sysrq: Show|Uhhuh)")
DUMP_LINE = re.compile(r"\] (Code: |R(?!IP)[A-Z0-9]{2}: )")  # registers and code bytes, read by no one here


def log_tails(results: Path, failed_rounds: list[int]) -> list[str]:
    lines = console_excerpt(results)
    rounds = failed_rounds or [round_ for round_, _ in rounds_run(results, "pytest-*.log")[-1:]]
    logs = [(f"{log}-{round_}.log", PYTEST_EVIDENCE) for round_ in rounds for log in ("failures", "pytest")]
    for name, count in (*EVIDENCE, *logs):
        with contextlib.suppress(OSError):
            if tail := (results / name).read_text(errors="replace").splitlines()[-count:]:
                lines += [f"-- {name}, last {len(tail)} lines:", *tail]
    return lines


def console_excerpt(results: Path) -> list[str]:
    """The console from its first report of trouble (an oops, a panic, a lockup, SysRq's answer), at
    most 150 lines without register dumps; its last 15 lines when it reported none."""
    try:
        console = (results / "console.log").read_text(errors="replace").splitlines()
    except OSError:
        return []
    start = next((i for i, line in enumerate(console) if TROUBLE.search(line)), None)
    if start is None:
        return ["-- console.log, last 15 lines:", *console[-15:]]
    return ["-- console.log, from the kernel's first report of trouble:",
            *[line for line in console[start:] if not DUMP_LINE.search(line)][:150]]


def rounds_run(results: Path, pattern: str) -> list[tuple[int, Path]]:
    """(round, file) of the files guest.sh names <stem>-<round>.<ext>, in the order of the rounds."""
    return sorted((int(path.stem.rpartition("-")[2]), path) for path in results.glob(pattern))


def read_results(result: Result, results: Path) -> None:
    if (results / "hung.log").exists():
        result.problem = f"a step hung: stacks in {(results / 'hung.log').relative_to(ROOT)}"
    try:
        report = json.loads((results / "check.json").read_text())
        result.strategies = {name: probe["strategy"] or "-" for name, probe in report["probes"].items()}
    except (OSError, ValueError, KeyError):
        result.problem = result.problem or "no `aiprobe check` report"
    failed_rounds = []
    try:
        for round_, junit in rounds_run(results, "junit-*.xml") or [(1, results / "junit-1.xml")]:
            if read_junit(result, ET.parse(junit).getroot(), round_):
                failed_rounds.append(round_)
    except (OSError, ET.ParseError):
        result.died = not result.problem or (results / "frozen.log").exists()  # report_frozen ran
        result.problem = result.problem or f"no test results (see {results.relative_to(ROOT)})"
    if result.problem or result.outcomes["failed"]:
        result.evidence = log_tails(results, failed_rounds)


def read_junit(result: Result, suite: ET.Element, round_: int) -> bool:
    """Adds one round's outcomes to `result`; whether a test of it failed."""
    failed = result.outcomes["failed"]
    for case in suite.iter("testcase"):
        test = f"{case.get('classname')}::{case.get('name')}"
        outcome = next((child for child in case if child.tag in ("failure", "error", "skipped")), None)
        if outcome is None:
            result.outcomes["passed"] += 1
            result.passed.add(test)
        elif outcome.tag == "skipped":
            result.outcomes["skipped"] += 1
            result.skipped.add(test)
            result.skips[outcome.get("message", "").removeprefix("Skipped: ")[:150]] += 1
        else:
            result.outcomes["failed"] += 1
            result.skips[f"FAILED {test} (round {round_})"] += 1
    return result.outcomes["failed"] > failed


def print_table(results: list[Result]) -> None:
    probes = list(dict.fromkeys(name for r in results for name in r.strategies))  # in `aiprobe check`'s order
    headers = ["kernel", "run", "truths", "seconds", *probes, "passed", "failed", "skipped"]
    rows = [[r.kernel, r.how, "all" if r.slow_truths else "no slow", f"{r.seconds:.0f}",
             *(r.strategies.get(p, "?") for p in probes),
             *(str(r.outcomes[k]) for k in ("passed", "failed", "skipped"))] for r in results]
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(len(headers))]
    for row in [headers, *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    for r in results:
        if r.skips:
            print(f"\n{r.kernel}:")
            for reason, count in sorted(r.skips.items()):
                print(f"  {count:>3} x {reason}")
    # Last, where a CI log's tail shows them.
    for r in results:
        if r.first_boot is not None:
            print(f"\n{r.kernel}, first boot (booted again; its results moved to .before): {r.first_boot.problem}")
            print("\n".join(f"  {line}" for line in r.first_boot.evidence))
        if r.problem or r.outcomes["failed"]:
            print(f"\n{r.kernel}: {r.problem or 'tests failed'}")
            print("\n".join(f"  {line}" for line in r.evidence))


def never_run(results: list[Result]) -> set[str]:
    """Tests skipped on every kernel: a strategy (or hook) that no kernel of the matrix exercised."""
    return set.intersection(*(r.skipped for r in results)) - set.union(*(r.passed for r in results))


def boot(kernel: Kernel, accel: tuple[str, ...], selection: Selection, host: Host) -> Result:
    result = Result(kernel.release, "emulated" if accel else "kvm", selection.slow_truths(on_host=False))
    log(f"{result.kernel}: booting ({result.how}) and running the selection")
    path, result.seconds, result.problem = run_in_vm(kernel, accel, selection, host)
    read_results(result, path)
    log(f"{result.kernel}: done in {result.seconds:.0f} s")
    return result


def boot_until_it_reports(kernel: Kernel, accel: tuple[str, ...], selection: Selection,
                          host: Host) -> Result:
    result = boot(kernel, accel, selection, host)
    if result.died:
        # Twice in CI an emulated guest died or froze mid-run without a word; a second boot tells
        # such a flake from a kernel that cannot run the suite. The first boot's logs are still printed.
        log(f"{result.kernel}: {result.problem}; booting it once more")
        first_boot, result = result, boot(kernel, accel, selection, host)
        result.first_boot = first_boot
    return result


def run_guests(kernels: list[Kernel], selection: Selection, host: Host) -> list[Result]:
    """Every kernel booted at once: an emulated guest runs on one host thread (EMULATION), so two
    of them share CI's two cores instead of waiting for each other."""
    accel = () if kernels and kvm_works(kernels[0].image) else EMULATION
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(kernels))) as pool:
        return list(pool.map(lambda kernel: boot_until_it_reports(kernel, accel, selection, host),
                             kernels))


def run_rest_of_suite() -> tuple[int, str]:
    """REST_OF_SUITE on this host, its output as it comes: its exit status, and that status and its time."""
    log(f"this host: the rest of the suite, beside the guests: {REST_OF_SUITE}")
    started = time.monotonic()
    status = subprocess.run(shlex.split(REST_OF_SUITE), cwd=ROOT, stdin=subprocess.DEVNULL).returncode
    seconds = time.monotonic() - started
    outcome = f"the rest of the suite ({REST_OF_SUITE}): exit {status} after {seconds:.0f} s"
    log(f"this host, {outcome}")
    return status, outcome


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernel", action="append", default=[],
                        help="only kernels whose package name contains this ('host' for this host)")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="run the selection N times in one boot (finds flakes; counts add up over the rounds)")
    parser.add_argument("pytest_args", nargs="*",
                        help=f"pytest arguments for every kernel (default: {shlex.join(KERNEL_TESTS)}, where "
                             "the guests add `and not slow_truth`)")
    parser.add_argument("--guest-cpu", type=int, default=100, metavar="PERCENT",
                        help="run each guest PERCENT of the time (50: a machine twice as slow for the guests)")
    parser.add_argument("--with-suite", action="store_true",
                        help="after this host's selection, run the rest of the suite here (make test without "
                             "the selection) while the guests run beside it (see BESIDE; CI does)")
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error("--repeat takes a number of rounds, 1 or more")
    if not 0 < args.guest_cpu <= 100:
        parser.error("--guest-cpu takes a percentage, 1 to 100")
    selection = Selection(args.pytest_args, args.repeat, args.guest_cpu / 100)
    wanted = lambda name: not args.kernel or any(k in name for k in args.kernel)  # noqa: E731

    results = []
    started = time.monotonic()
    kernels = [Kernel(series, unpacked_kernel(series)) for series in MATRIX if wanted(series.pattern.replace("\\", ""))]
    if kernels:
        log(f"kernels ready in {time.monotonic() - started:.0f} s")
    host = Host(selecting=wanted("host"), busy=wanted("host") or args.with_suite)
    suite_status, suite = 0, ""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as background:
        guests = background.submit(run_guests, kernels, selection, host)
        try:
            if host.selecting:
                results.append(run_on_host(selection))
            host.selection_done()
            if args.with_suite:
                suite_status, suite = run_rest_of_suite()
        finally:
            host.done()
        results += guests.result()
    print(f"\naiprobe on {len(results)} kernels ({time.monotonic() - started:.0f} s in all):\n")
    print_table(results)
    if suite:
        print(f"\nthis host, {suite}")
    unexercised = never_run(results) if len(results) > 1 else set()
    if unexercised:
        print("\nskipped on every kernel (no kernel of the matrix ran them):")
        for test in sorted(unexercised):
            print(f"  {test}")
    return int(bool(suite_status) or bool(unexercised) or any(r.problem or r.outcomes["failed"] for r in results))


if __name__ == "__main__":
    sys.exit(main())
