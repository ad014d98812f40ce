"""The probe registry: each probe module declares a `SPEC`; `aiprobe check` plans them all."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

from .features import Feature
from .loader import Strategy

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
