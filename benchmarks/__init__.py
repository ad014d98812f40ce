"""Benchmarks: each `bench_*.py` module exposes `run() -> list[Result]`; `make bench` prints them all.

Every figure is a ratio or a per-call cost measured within one run (with vs without a probe, our
program vs an empty one), because these machines are shared and absolute timings are noise.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Result:
    benchmark: str
    case: str
    value: float
    unit: str
    detail: str = ""
