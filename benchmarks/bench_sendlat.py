"""sendlat overhead: a loopback TCP send loop (C, 64-byte send() calls) detached vs attached with
each strategy that runs on this kernel, rounds alternating within one run. The probe runs
unfiltered, as the agent runs it. A second loop of getppid() calls (no sends) shows what each
strategy costs every other process on the host: nothing for one that hooks TCP tracepoints, the
syscall tracepoint slow path plus a program run for one that hooks sys_enter.

Two figures per strategy, medians of the per-round ratios: the sender's throughput (wall clock,
what a user sees, noisy when other work shares the CPUs) and the sender's CPU time per send (where
the probe's programs run; other load on the host barely moves it)."""

from __future__ import annotations

import contextlib
import statistics
import sys
from pathlib import Path

from benchmarks import Result

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the C peer and its build live with the test fixtures

from aiprobe.loader import ProbeUnavailable, Strategy  # noqa: E402
from aiprobe.sendlat import SPEC, SendLatencyProbe  # noqa: E402
from conftest import FIXTURE_BUILD, CBuild  # noqa: E402
from fixtures.sendlat_peer import Sent, build, send, sink, syscall_cpu_seconds  # noqa: E402

SENDS = 300_000
SYSCALLS = 1_000_000
SIZE = 64
ROUNDS = 7
DETACHED = "detached"


def _send_loop(peer: str) -> Sent:
    with sink(peer, "127.0.0.1") as to:
        return send(peer, to, SENDS, SIZE)


def _run_case(peer: str, strategy: Strategy | None) -> tuple[Sent, float]:
    """The send loop's result and the CPU seconds of the getppid loop, with `strategy` attached."""
    with contextlib.ExitStack() as stack:
        if strategy is not None:
            stack.enter_context(SendLatencyProbe(strategies=[strategy]))
        return _send_loop(peer), syscall_cpu_seconds(peer, SYSCALLS)


def _runnable() -> list[Strategy]:
    """The strategies this kernel loads and attaches (fentry and kprobe where it allows)."""
    runnable = []
    for strategy in SPEC.strategies:
        try:
            with SendLatencyProbe(strategies=[strategy]):
                runnable.append(strategy)
        except ProbeUnavailable:
            continue
    return runnable


def _results(name: str, runs: list[tuple[Sent, float]], detached: list[tuple[Sent, float]]) -> list[Result]:
    syscall_added_ns = statistics.median((a - d) / SYSCALLS * 1e9
                                         for (_, a), (_, d) in zip(runs, detached, strict=True))
    return [*_send_results(name, [r for r, _ in runs], [d for d, _ in detached]),
            Result("sendlat", f"{name}: added CPU time per other syscall (getppid)", syscall_added_ns, "ns",
                   "paid by every process on the host")]


def _send_results(name: str, runs: list[Sent], detached: list[Sent]) -> list[Result]:
    throughput = statistics.median(d.elapsed_seconds / a.elapsed_seconds for a, d in zip(runs, detached, strict=True))
    cpu = statistics.median(d.cpu_seconds / a.cpu_seconds for a, d in zip(runs, detached, strict=True))
    added_ns = statistics.median((a.cpu_seconds - d.cpu_seconds) / SENDS * 1e9
                                 for a, d in zip(runs, detached, strict=True))
    detail = f"{SENDS} x {SIZE} B sends, median of {ROUNDS} alternating rounds"
    return [
        Result("sendlat", f"{name}: throughput attached/detached", throughput, "ratio", detail),
        Result("sendlat", f"{name}: overhead (throughput)", (1 - throughput) * 100, "%", "target <= 3%"),
        Result("sendlat", f"{name}: overhead (sender CPU per send)", (1 - cpu) * 100, "%", "target <= 3%"),
        Result("sendlat", f"{name}: added CPU time per send", added_ns, "ns"),
    ]


def run() -> list[Result]:
    FIXTURE_BUILD.mkdir(parents=True, exist_ok=True)
    peer = build(CBuild(FIXTURE_BUILD))
    _send_loop(peer)  # warm-up: page cache, CPU frequency
    cases: list[Strategy | None] = [None, *_runnable()]
    runs: dict[str, list[tuple[Sent, float]]] = {}
    for round_ in range(ROUNDS):
        # Alternate the order so a drift in machine load does not favour one case.
        for case in cases if round_ % 2 == 0 else cases[::-1]:
            runs.setdefault(case.name if case else DETACHED, []).append(_run_case(peer, case))
    detached = runs.pop(DETACHED)
    per_send = statistics.median(d.cpu_seconds for d, _ in detached) / SENDS * 1e9
    results = [Result("sendlat", "detached: sender CPU time per send", per_send, "ns")]
    for name, strategy_runs in runs.items():
        results.extend(_results(name, strategy_runs, detached))
    return results
