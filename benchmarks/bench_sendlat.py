"""sendlat overhead on its worst case: one process making blocking 64-byte send() calls over
loopback TCP, against the floor: empty programs on the default strategy's two hooks
(tcp:tcp_sendmsg_locked and sock:sock_send_length), which this benchmark loads itself.

Every case is loaded once and attached only for its own batches, so one sender process on one
connection runs batch after batch with nothing attached, the empty programs, or one sendlat case,
in an order that alternates each round: the cases differ only in what is attached, and a drift in
the machine's load reaches them all alike. Cases: each strategy that runs on this kernel,
unfiltered as the agent runs it (no per-flow counters); the default one also with per-flow counters
(`aiprobe sendlat`) and with timing sampled 1 in SAMPLED.

The figure is the sender's CPU time added per send (where the programs run), as a median over the
rounds of (attached - detached) in the same round, and its ratio to what the empty programs add
(issue 17: <= 1.5). The send loop amplifies any cost: a slower send makes loopback TCP merge fewer
sends per segment, and each segment costs microseconds of sender CPU."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks import Result

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the C peer and its build live with the test fixtures

from aiprobe.loader import ProbeUnavailable, Strategy  # noqa: E402
from aiprobe.sendlat import SPEC, SendLatencyProbe  # noqa: E402
from conftest import FIXTURE_BUILD, CBuild  # noqa: E402
from fixtures.sendlat_peer import build, sink  # noqa: E402

BATCH = int(os.environ.get("SENDLAT_BENCH_BATCH", "20000"))
SIZE = 64
ROUNDS = int(os.environ.get("SENDLAT_BENCH_ROUNDS", "100"))
SAMPLED = 16
EMPTY = Strategy("empty", programs=("sendlat_empty_start", "sendlat_empty_end"))
DEFAULT = "tracepoint"  # the strategy this kernel picks (no fentry, no kprobes)
DETACHED = "detached"
FLOOR = "empty programs"


@dataclass
class Case:
    name: str
    probe: SendLatencyProbe | None  # None: nothing attached

    def attach(self) -> None:
        if self.probe is not None:
            obj = self.probe.loaded.obj
            for program in self.probe.loaded.strategy.programs:
                obj.programs[program].attach()

    def detach(self) -> None:
        if self.probe is not None:
            obj = self.probe.loaded.obj
            for link in obj.links:
                obj.release(link)


class Sender:
    """One sender process on one connection, running a batch of sends when asked."""

    def __init__(self, peer: str, port: int) -> None:
        self._process = subprocess.Popen([peer, "batches", "127.0.0.1", str(port), str(SIZE), "send"],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

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
    cases = [Case(DETACHED, None), Case(FLOOR, _loaded(EMPTY))]
    for strategy in SPEC.strategies:
        cases.append(Case(strategy.name, _loaded(strategy)))
        if strategy.name == DEFAULT:
            cases.append(Case(f"{DEFAULT}, per-flow counters", _loaded(strategy, per_flow=True)))
            cases.append(Case(f"{DEFAULT}, timing 1 in {SAMPLED}", _loaded(strategy, sample_every=SAMPLED)))
    runnable = [case for case in cases if case.name == DETACHED or case.probe is not None]
    for case in runnable:
        case.detach()
    return runnable


def _measure(sender: Sender, cases: list[Case]) -> dict[str, list[float]]:
    """CPU ns per send of each case's batch, per round."""
    runs: dict[str, list[float]] = {case.name: [] for case in cases}
    for round_ in range(ROUNDS):
        for case in cases if round_ % 2 == 0 else cases[::-1]:
            case.attach()
            try:
                runs[case.name].append(sender.cpu_ns_per_send())
            finally:
                case.detach()
    return runs


def _spread(values: list[float], fmt: Callable[[float], str] = lambda v: f"{v:.0f}") -> str:
    return f"median of {len(values)} rounds, range {fmt(min(values))}..{fmt(max(values))}"


def _results(runs: dict[str, list[float]]) -> list[Result]:
    detached = runs.pop(DETACHED)
    added = {name: [a - d for a, d in zip(values, detached, strict=True)] for name, values in runs.items()}
    floor = statistics.median(added[FLOOR])
    results = [Result("sendlat", "detached: sender CPU time per send", statistics.median(detached), "ns",
                      _spread(detached))]
    for name, values in added.items():
        results.append(Result("sendlat", f"{name}: added CPU time per send", statistics.median(values), "ns",
                              _spread(values)))
    for name, values in added.items():
        if name != FLOOR:
            results.append(Result("sendlat", f"{name}: added CPU / empty programs' added CPU",
                                  statistics.median(values) / floor, "ratio", "target <= 1.5 (issue 17)"))
    return results


def run() -> list[Result]:
    FIXTURE_BUILD.mkdir(parents=True, exist_ok=True)
    peer = build(CBuild(FIXTURE_BUILD))
    cases = _cases()
    try:
        with sink(peer, "127.0.0.1") as to:
            sender = Sender(peer, to.port)
            try:
                sender.cpu_ns_per_send()  # warm-up: connection, page cache, CPU frequency
                runs = _measure(sender, cases)
            finally:
                sender.close()
    finally:
        for case in cases:
            if case.probe is not None:
                case.probe.close()
    return _results(runs)
