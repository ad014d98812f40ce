"""Benchmarks: each `bench_*.py` module exposes `run() -> list[Result]`; `make bench` prints them all.

Every figure is a ratio or a per-call cost measured within one run (with vs without a probe, our
program vs an empty one), because these machines are shared and absolute timings are noise.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol, TypeVar

from aiprobe import libbpf

BPF_STATS_RUN_TIME = 0  # enum bpf_stats_type
T = TypeVar("T")


@dataclass
class Result:
    benchmark: str
    case: str
    value: float
    unit: str
    detail: str = ""


class Case(Protocol):
    """Something a benchmark measures with and without: attached, then detached again."""

    name: str

    def attach(self) -> None: ...

    def detach(self) -> None: ...


@contextmanager
def attached(case: Case) -> Iterator[None]:
    case.attach()
    try:
        yield
    finally:
        case.detach()


def alternate(cases: Sequence[Case], rounds: int, measure: Callable[[], T],
              enough: Callable[[dict[str, list[T]]], bool] | None = None, max_rounds: int = 0) -> dict[str, list[T]]:
    """`measure()` under each case in turn, `rounds` times, the order reversed every other round so
    a drift in machine load favours no case; then, where `enough` is given, more rounds until it holds
    for the values so far or `max_rounds` ran. The values by case name."""
    runs: dict[str, list[T]] = {case.name: [] for case in cases}
    round_ = 0
    while round_ < rounds or (enough is not None and round_ < max_rounds and not enough(runs)):
        for case in cases if round_ % 2 == 0 else cases[::-1]:
            with attached(case):
                runs[case.name].append(measure())
        round_ += 1
    return runs


def spread(values: list[float]) -> str:
    return f"median of {len(values)} rounds, range {min(values):.0f}..{max(values):.0f}"


def median_interval(values: Sequence[float], confidence: float = 0.90) -> tuple[float, float]:
    """An interval holding the median of what the rounds sample with at least `confidence`, whatever its
    distribution: the k-th smallest and k-th largest values, k the largest with P(Binomial(n, 1/2) < k)
    <= (1 - confidence) / 2 (from 5 values at 90%); the whole range where there are too few for that."""
    ordered, n = sorted(values), len(values)
    k, below = 0, 0.0  # below: P(Binomial(n, 1/2) < k + 1)
    while k < n // 2:
        below += math.comb(n, k) / 2 ** n
        if below > (1 - confidence) / 2:
            break
        k += 1
    k = max(k, 1)
    return ordered[k - 1], ordered[n - k]


@contextmanager
def bpf_stats() -> Iterator[None]:
    """The kernel's BPF run-time statistics on for the block: every program run, host-wide, then pays
    two more clock reads, so never while timing anything else. Off again when the process exits, too."""
    fd = libbpf.call("bpf_enable_stats", BPF_STATS_RUN_TIME)
    try:
        yield
    finally:
        os.close(fd)


def _fdinfo(path: str) -> dict[str, str]:
    with open(path) as fdinfo:
        return dict(line.split(":", 1) for line in fdinfo.read().splitlines() if ":" in line)


def bpf_run_stats(program_fd: int) -> tuple[int, int]:
    """(run_time_ns, run_cnt) of a program so far, counted while bpf_stats() is on (its fdinfo)."""
    fields = _fdinfo(f"/proc/self/fdinfo/{program_fd}")
    return int(fields["run_time_ns"]), int(fields["run_cnt"])


def programs_of(pid: int) -> dict[int, tuple[int, int]]:
    """(run_time_ns, run_cnt) so far of every BPF program another process holds open, by program id
    (its fds' fdinfo: a link's names a program too, but only a program's own fd carries the counts)."""
    programs = {}
    for fd in os.listdir(f"/proc/{pid}/fdinfo"):
        try:
            fields = _fdinfo(f"/proc/{pid}/fdinfo/{fd}")
        except OSError:  # closed meanwhile
            continue
        if "run_cnt" in fields:
            programs[int(fields["prog_id"])] = (int(fields["run_time_ns"]), int(fields["run_cnt"]))
    return programs
