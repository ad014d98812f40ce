"""connections overhead per accepted connection: one process making short TCP connections over
loopback to its own listener (connect, accept, the server's end closed, then the client's:
tests/fixtures/accept_churn.c), with nothing attached, with each strategy of the probe that loads on
this kernel, and with empty programs on exactly that strategy's hooks (bpf/connections.bpf.c,
cn_empty_*: the floor any program on those hooks pays). A strategy that does not load here is
skipped, its reason printed.

Every case is loaded once and attached only for its own batches, in an order that alternates each
round, so a drift in the machine's load reaches them all alike; the process is pinned to one CPU.
Figures per case:
- the process's CPU time added per connection (both ends', the loopback handshake's softirq work
  included), as a median over the rounds of (attached - detached) in the same round, and each
  strategy's over its empty programs';
- the programs' own run time and runs per connection (the kernel's BPF run-time statistics, on for
  a pass of their own after the CPU rounds, as they add two clock reads to every program run), and
  each strategy's run time over its empty programs'.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from benchmarks import Result, alternate, attached, bpf_run_stats, bpf_stats, spread

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the C client and server and their build live with the test fixtures

from aiprobe.loader import ProbeUnavailable, Strategy  # noqa: E402
from aiprobe.probes.connections.probe import STRATEGIES, ConnectionsProbe  # noqa: E402
from helpers import FIXTURE_BUILD, CBuild  # noqa: E402

from benchmarks.bench_sendlat import Case as SendlatCase  # noqa: E402

BATCH = int(os.environ.get("CONNECTIONS_BENCH_BATCH", "5000"))
ROUNDS = int(os.environ.get("CONNECTIONS_BENCH_ROUNDS", "60"))
STATS_ROUNDS = 5
DETACHED = "detached"
EMPTY = "empty programs on its hooks"


def empty_twin(strategy: Strategy) -> Strategy:
    """Empty programs on exactly the strategy's hooks: cn_empty_<name without cn_> for each program."""
    return replace(strategy, name=f"{strategy.name}, {EMPTY}",
                   programs=tuple(f"cn_empty_{name.removeprefix('cn_')}" for name in strategy.programs))


class Case(SendlatCase):
    """One started ConnectionsProbe whose programs are attached only while measured."""

    def run_stats(self) -> tuple[int, int]:
        """(run_time_ns, run_cnt) of the case's programs so far."""
        stats = [bpf_run_stats(program.fd) for program in self._programs()]
        return sum(time for time, _ in stats), sum(count for _, count in stats)

    def close(self) -> None:
        if self.probe is not None:
            self.probe.close()


class Churn:
    """The process making connections, a batch of them when asked."""

    def __init__(self, program: str, cpu: int) -> None:
        self._process = subprocess.Popen([program], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        os.sched_setaffinity(self._process.pid, {cpu})
        line = self._process.stdout.readline().split()
        assert line[:1] == ["port"], f"accept_churn did not start: {line}"

    def cpu_ns_per_connection(self) -> float:
        self._process.stdin.write(f"{BATCH}\n")
        self._process.stdin.flush()
        _, count, cpu_ns = self._process.stdout.readline().split()
        return int(cpu_ns) / int(count)

    def close(self) -> None:
        self._process.stdin.close()
        self._process.wait(timeout=30)


def _started(strategy: Strategy) -> Case:
    probe = ConnectionsProbe((strategy,))
    probe.start()
    case = Case(strategy.name, probe)
    case.detach()
    return case


def _pair(strategy: Strategy) -> list[Case]:
    """The strategy's empty programs and the strategy, both loaded, or ProbeUnavailable."""
    empty = _started(empty_twin(strategy))
    try:
        return [empty, _started(strategy)]
    except ProbeUnavailable:
        empty.close()
        raise


def _cases() -> list[Case]:
    """Nothing attached, then each strategy that loads here after its empty programs."""
    cases = [Case(DETACHED)]
    for strategy in (s for s in STRATEGIES if s.programs):
        try:
            cases += _pair(strategy)
        except ProbeUnavailable as exc:
            print(f"connections: skipped the {strategy.name} strategy: {'; '.join(exc.reasons.values())}",
                  file=sys.stderr)
    return cases


def _run_stats(churn: Churn, cases: list[Case]) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """BPF run time and program runs per connection of each case's programs, per round (a batch each)."""
    run_time: dict[str, list[float]] = {case.name: [] for case in cases}
    runs: dict[str, list[float]] = {case.name: [] for case in cases}
    with bpf_stats():
        for _ in range(STATS_ROUNDS):
            for case in cases:
                with attached(case):
                    time_before, count_before = case.run_stats()
                    churn.cpu_ns_per_connection()
                    time_after, count_after = case.run_stats()
                run_time[case.name].append((time_after - time_before) / BATCH)
                runs[case.name].append((count_after - count_before) / BATCH)
    return run_time, runs


def _ratio(values: list[float], floor: list[float], what: str, name: str, detail: str = "") -> Result:
    base = statistics.median(floor)
    ratio = statistics.median(values) / base if base > 0 else float("nan")
    return Result("connections", f"{name}: {what} vs its empty programs", ratio, "ratio",
                  detail if base > 0 else "the empty programs' figure is not above zero")


def _results(cpu: dict[str, list[float]], run_time: dict[str, list[float]],
             runs: dict[str, list[float]]) -> list[Result]:
    detached = cpu.pop(DETACHED)
    results = [Result("connections", "detached: CPU time per connection", statistics.median(detached), "ns",
                      spread(detached))]
    added = {name: [a - d for a, d in zip(values, detached, strict=True)] for name, values in cpu.items()}
    for name, values in added.items():
        results += [
            Result("connections", f"{name}: added CPU time per connection", statistics.median(values), "ns",
                   spread(values)),
            Result("connections", f"{name}: BPF run time per connection", statistics.median(run_time[name]), "ns",
                   spread(run_time[name])),
            Result("connections", f"{name}: program runs per connection", statistics.median(runs[name]), "runs"),
        ]
    for name in (n for n in added if not n.endswith(EMPTY)):
        floor = f"{name}, {EMPTY}"
        share = statistics.median(added[floor]) / statistics.median(detached)
        results += [_ratio(added[name], added[floor], "added CPU", name,
                           f"the empty programs add {share:.2%} of a connection's CPU time: "
                           "a ratio of figures within the rounds' range is noise"),
                    _ratio(run_time[name], run_time[floor], "BPF run time", name)]
    return results


def run() -> list[Result]:
    FIXTURE_BUILD.mkdir(parents=True, exist_ok=True)
    program = str(CBuild(FIXTURE_BUILD)("accept_churn", "accept_churn.c"))
    cases = _cases()
    try:
        churn = Churn(program, sorted(os.sched_getaffinity(0))[-1])
        try:
            churn.cpu_ns_per_connection()  # warm-up: page cache, CPU frequency, the TIME_WAIT table
            cpu = alternate(cases, ROUNDS, churn.cpu_ns_per_connection)
            run_time, runs = _run_stats(churn, cases[1:])
        finally:
            churn.close()
    finally:
        for case in cases:
            case.close()
    return _results(cpu, run_time, runs)
