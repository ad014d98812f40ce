"""The probe registry: each probe module declares a `SPEC`; `aiprobe check` plans them all."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .features import Feature
from .loader import Loaded, Strategy

# One module per probe, each owning its load, attach and read; listed in `aiprobe check` order.
PROBE_MODULES = ("flows", "sendlat", "cuda", "sched", "nvml")


@dataclass(frozen=True)
class ProbeSpec:
    name: str
    description: str
    strategies: tuple[Strategy, ...]
    # A prerequisite outside the kernel (a user-space library, a device); returns why it is unmet.
    requirement: Callable[[], str | None] | None = None


@dataclass
class ProbePlan:
    probe: str
    description: str
    strategy: str | None
    span: str = ""
    reason: str = ""
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def available(self) -> bool:
        return self.strategy is not None

    def as_dict(self) -> dict:
        return {
            "available": self.available,
            "strategy": self.strategy,
            "span": self.span,
            "reason": self.reason,
            "skipped": self.skipped,
            "description": self.description,
        }


def specs() -> list[ProbeSpec]:
    return [importlib.import_module(f"aiprobe.{name}").SPEC for name in PROBE_MODULES]


def plan(spec: ProbeSpec, features: dict[str, Feature]) -> ProbePlan:
    """The first strategy whose kernel features all work here, and why the ones before it don't."""
    unmet = spec.requirement() if spec.requirement else None
    if unmet:
        return ProbePlan(spec.name, spec.description, None, reason=unmet)
    skipped: dict[str, str] = {}
    for strategy in spec.strategies:
        missing = [f for f in strategy.features if not features[f].available]
        if not missing:
            return ProbePlan(spec.name, spec.description, strategy.name, strategy.span, skipped=skipped)
        skipped[strategy.name] = "kernel lacks " + ", ".join(missing)
    reason = "; ".join(f"{name}: {why}" for name, why in skipped.items())
    return ProbePlan(spec.name, spec.description, None, reason=reason, skipped=skipped)


@dataclass
class MapUsage:
    """How full a bounded BPF map is (exported as aiprobe_bpf_map_entries / _capacity)."""

    map: str
    entries: int
    capacity: int


class Probe:
    """Uniform life cycle of every probe module, so the agent, `top` and the subcommands drive
    them alike: `start()` loads and attaches (raising `ProbeUnavailable` with every strategy's
    reason), `read()` returns the probe's snapshot, `close()` detaches everything and may be
    called any number of times. Use as a context manager."""

    spec: ProbeSpec

    def __init__(self) -> None:
        self.loaded: Loaded | None = None

    @property
    def strategy(self) -> str | None:
        return self.loaded.strategy.name if self.loaded else None

    @property
    def skipped(self) -> dict[str, str]:
        return self.loaded.skipped if self.loaded else {}

    def start(self) -> None:
        raise NotImplementedError

    def read(self) -> Any:
        raise NotImplementedError

    def map_usage(self) -> list[MapUsage]:
        return []

    def events_lost(self) -> int:
        return 0

    def close(self) -> None:
        loaded, self.loaded = self.loaded, None
        if loaded is not None:
            loaded.obj.close()

    def __enter__(self) -> Probe:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
