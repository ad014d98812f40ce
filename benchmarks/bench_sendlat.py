"""sendlat overhead on its worst case: one process making blocking 64-byte send() calls over
loopback TCP, against two references on the default strategy's two hooks (tcp:tcp_sendmsg_locked and
sock:sock_send_length), which this benchmark loads itself: empty programs (the floor, issue 17's
yardstick) and programs that only read the clock, once on each hook (the least any exact timing of
every send does).

Every case is loaded once and attached only for its own batches, so one sender process on one
connection runs batch after batch with nothing attached, a reference, or one sendlat case, in an
order that alternates each round: the cases differ only in what is attached, and a drift in the
machine's load reaches them all alike. The sender and the sink are pinned to CPUs of their own,
which halves the spread between batches. Cases: each strategy that runs on this kernel,
unfiltered as the agent runs it (no per-flow counters); the default one also with per-flow counters
(`aiprobe sendlat`) and with timing sampled 1 in SAMPLED.

Two figures per case:
- the sender's CPU time added per send (where the programs run), as a median over the rounds of
  (attached - detached) in the same round, and its ratio to what each reference adds. The send loop
  amplifies any cost: a slower send makes loopback TCP merge fewer sends per segment, and each
  segment costs microseconds of sender CPU.
- the programs' own run time per send (the kernel's BPF run-time statistics, on for a pass of their
  own after the CPU rounds, as they add two clock reads to every program run).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks import Result, alternate, attached, bpf_run_stats, bpf_stats, spread

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the C peer and its build live with the test fixtures

from aiprobe.loader import ProbeUnavailable, Strategy  # noqa: E402
from aiprobe.probes.sendlat.probe import SPEC, SendLatencyProbe  # noqa: E402
from fixtures.sendlat_peer import build, sink  # noqa: E402
from helpers import FIXTURE_BUILD, CBuild  # noqa: E402

BATCH = int(os.environ.get("SENDLAT_BENCH_BATCH", "20000"))
SIZE = 64
ROUNDS = int(os.environ.get("SENDLAT_BENCH_ROUNDS", "100"))
STATS_ROUNDS = 5
SAMPLED = 16
DEFAULT = "tracepoint"  # the strategy this kernel picks (no fentry, no kprobes)
DETACHED = "detached"
FLOOR = "empty programs"
CLOCKS = "clock reads only"
REFERENCES = {
    FLOOR: Strategy("empty", programs=("sendlat_empty_start", "sendlat_empty_end")),
    CLOCKS: Strategy("clock", programs=("sendlat_clock_start", "sendlat_clock_end")),
}


@dataclass
class Case:
    """One started SendLatencyProbe whose strategy's programs are attached only while measured."""

    name: str
    probe: SendLatencyProbe | None = None  # None: nothing attached

    def _programs(self) -> list:
        if self.probe is None:
            return []
        obj = self.probe.loaded.obj
        return [obj.programs[name] for name in self.probe.loaded.strategy.programs]

    def attach(self) -> None:
        for program in self._programs():
            program.attach()

    def detach(self) -> None:
        if self.probe is not None:
            obj = self.probe.loaded.obj
            for link in obj.links:
                obj.release(link)

    def run_time_ns(self) -> int:
        return sum(bpf_run_stats(program.fd)[0] for program in self._programs())


class Sender:
    """One sender process on one connection, running a batch of sends when asked."""

    def __init__(self, peer: str, port: int, cpu: int) -> None:
        self._process = subprocess.Popen([peer, "batches", "127.0.0.1", str(port), str(SIZE), "send"],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        os.sched_setaffinity(self._process.pid, {cpu})

    def cpu_ns_per_send(self) -> float:
        self._process.stdin.write(f"{BATCH}\n")
        self._process.stdin.flush()
        _, calls, cpu_ns, _ = self._process.stdout.readline().split()
        return int(cpu_ns) / int(calls)

    def close(self) -> None:
        self._process.stdin.close()
        self._process.wait(timeout=30)


def _loaded(strategy: Strategy, *, per_flow: bool = False, sample_every: int = 1) -> SendLatencyProbe | None:
    probe = SendLatencyProbe(strategies=[strategy], per_flow=per_flow)
    try:
        probe.start()
    except ProbeUnavailable:
        return None
    probe.set_sample_every(sample_every)
    return probe


def _cases() -> list[Case]:
    cases = [Case(DETACHED, None)] + [Case(name, _loaded(strategy)) for name, strategy in REFERENCES.items()]
    for strategy in SPEC.strategies:
        cases.append(Case(strategy.name, _loaded(strategy)))
        if strategy.name == DEFAULT:
            cases.append(Case(f"{DEFAULT}, per-flow counters", _loaded(strategy, per_flow=True)))
            cases.append(Case(f"{DEFAULT}, timing 1 in {SAMPLED}", _loaded(strategy, sample_every=SAMPLED)))
    runnable = [case for case in cases if case.name == DETACHED or case.probe is not None]
    for case in runnable:
        case.detach()
    return runnable


def _run_times(sender: Sender, cases: list[Case]) -> dict[str, list[float]]:
    """BPF run time per send of each case's programs, per round (a batch each)."""
    runs: dict[str, list[float]] = {case.name: [] for case in cases}
    with bpf_stats():
        for _ in range(STATS_ROUNDS):
            for case in cases:
                with attached(case):
                    before = case.run_time_ns()
                    sender.cpu_ns_per_send()
                    runs[case.name].append((case.run_time_ns() - before) / BATCH)
    return runs


def _ratios(figures: dict[str, list[float]], what: str, target: str = "") -> list[Result]:
    """Each case's median `what` over each reference's (and the clock reads' over the empty programs')."""
    results = []
    for reference in REFERENCES:
        base = statistics.median(figures[reference])
        for name, values in figures.items():
            if name == reference or (name in REFERENCES and reference == CLOCKS):
                continue
            results.append(Result("sendlat", f"{name}: {what} vs {reference}", statistics.median(values) / base,
                                  "ratio", target if reference == FLOOR and name not in REFERENCES else ""))
    return results


def _results(cpu: dict[str, list[float]], run_time: dict[str, list[float]]) -> list[Result]:
    detached = cpu.pop(DETACHED)
    run_time.pop(DETACHED)
    added = {name: [a - d for a, d in zip(values, detached, strict=True)] for name, values in cpu.items()}
    results = [Result("sendlat", "detached: sender CPU time per send", statistics.median(detached), "ns",
                      spread(detached))]
    for name, values in added.items():
        results.append(Result("sendlat", f"{name}: added CPU time per send", statistics.median(values), "ns",
                              spread(values)))
        results.append(Result("sendlat", f"{name}: BPF run time per send", statistics.median(run_time[name]), "ns",
                              spread(run_time[name])))
    return results + _ratios(added, "added CPU", "target <= 1.5 (issue 17)") + _ratios(run_time, "BPF run time")


def run() -> list[Result]:
    FIXTURE_BUILD.mkdir(parents=True, exist_ok=True)
    peer = build(CBuild(FIXTURE_BUILD))
    cpus = sorted(os.sched_getaffinity(0))
    cases = _cases()
    try:
        with sink(peer, "127.0.0.1") as to:
            os.sched_setaffinity(to.process.pid, {cpus[0]})
            sender = Sender(peer, to.port, cpus[-1])
            try:
                sender.cpu_ns_per_send()  # warm-up: connection, page cache, CPU frequency
                cpu = alternate(cases, ROUNDS, sender.cpu_ns_per_send)
                run_time = _run_times(sender, cases)
            finally:
                sender.close()
    finally:
        for case in cases:
            if case.probe is not None:
                case.probe.close()
    return _results(cpu, run_time)
