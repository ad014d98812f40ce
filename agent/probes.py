"""The probe registry. A probe is one module `agent/<name>.py` declaring `SPEC = ProbeSpec(...)`: its
name, strategies, factory from the config, config keys, CLI command and metric families. Everything
that lists probes derives the list from here: `aiprobe check`, the CLI, config validation, the
daemon and the exporter. Adding a probe touches only its own files.

Every probe has one life cycle (`Probe`): `start()` loads and attaches (raising `ProbeUnavailable`
with every strategy's reason), `read()` returns its model records, `status()` says what runs and
why not, `close()` detaches everything and may be called any number of times.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from .features import Feature
from .loader import Loaded, Strategy
from .model import MapUsage, ProbeStatus

if TYPE_CHECKING:
    from .config import Config
    from .metrics import Family

# A probe module is recognised by its declaration, so registering a probe needs no list elsewhere.
_DECLARES_SPEC = re.compile(r"^SPEC = ProbeSpec\(", re.MULTILINE)


class Probe:
    """Uniform life cycle of every probe; use as a context manager."""

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

    def read_for_scrape(self) -> Any:
        """What a scrape reads of a SPEC.read_at_scrape probe: read(), unless it has a cheaper way."""
        return self.read()

    def status(self) -> ProbeStatus:
        """Running (with its strategy and what it measures), or why not."""
        if self.loaded is None:
            return ProbeStatus(False, reason="not started")
        overflows = {usage.map: usage.overflows for usage in self.map_usage() if usage.overflows}
        return ProbeStatus(True, self.loaded.strategy.name, self.loaded.strategy.span, overflows=overflows)

    def map_usage(self) -> list[MapUsage]:
        return []

    def events_lost(self) -> int:
        return 0

    def close(self) -> None:
        loaded, self.loaded = self.loaded, None
        if loaded is not None:
            loaded.obj.close()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# factory(config, probes started before this one) -> an unstarted probe
Factory = Callable[["Config", Mapping[str, Probe]], Probe]


@dataclass(frozen=True)
class ProbeSpec:
    name: str
    description: str
    strategies: tuple[Strategy, ...]
    order: int  # place in `aiprobe check`, the snapshot's `probes` and the start order
    bpf_object: str = ""  # its agent/bpf_objects/<name>.bpf.o, if it has one
    factory: Factory | None = None
    # A prerequisite outside the kernel (a user-space library, a device); returns why it is unmet.
    requirement: Callable[[], str | None] | None = None
    # What the probe cannot see on this host though it runs (a GPU without GPM), one line each.
    limitations: Callable[[], list[str]] | None = None
    config_keys: tuple[str, ...] = ()  # the Config fields only this probe reads
    command: str = ""  # "module:attribute" of its `aiprobe <cli_name>` command
    cli_name: str = ""  # defaults to the probe's name
    metrics: tuple[Family, ...] = ()
    # Runs inside another probe (sched's programs live in cuda's object): selected with it.
    runs_with: str | None = None
    # Runs on that probe's strategy (streams is part of sendlat's programs): not chosen on its own.
    follows_strategy: bool = False
    # Cheap host-wide counters that run whatever the config selects.
    always: bool = False
    # Its read_for_scrape() is cheap and safe from another thread: /metrics reads it at each scrape.
    read_at_scrape: bool = False

    @property
    def subcommand(self) -> str:
        return self.cli_name or self.name

    @property
    def selectable(self) -> bool:
        """Whether the config's `probes` names it."""
        return self.runs_with is None and not self.always


@cache
def specs() -> tuple[ProbeSpec, ...]:
    package = Path(__file__).parent
    modules = [path.stem for path in sorted(package.glob("*.py")) if _DECLARES_SPEC.search(path.read_text())]
    found = [importlib.import_module(f"{__package__}.{name}").SPEC for name in modules]
    return tuple(sorted(found, key=lambda spec: spec.order))


def spec(name: str) -> ProbeSpec:
    return next(s for s in specs() if s.name == name)


def strategies_named(spec: ProbeSpec, name: str | None) -> tuple[Strategy, ...]:
    """The probe's chain, or only its strategy `name` when one is forced (`--strategy`, the config's
    `strategies`): to keep BPF trampolines off a host, or to compare strategies. ValueError, naming
    the chain, when the probe has no such strategy."""
    if name is None:
        return spec.strategies
    forced = tuple(s for s in spec.strategies if s.name == name)
    if not forced:
        chain = ", ".join(s.name for s in spec.strategies)
        raise ValueError(f"{spec.name} has no strategy {name!r} (its chain: {chain})")
    return forced


def selectable_names() -> tuple[str, ...]:
    return tuple(s.name for s in specs() if s.selectable)


def selected(names: tuple[str, ...]) -> list[ProbeSpec]:
    """The probes a config's `probes` runs, in start order."""
    return [s for s in specs() if s.always or s.name in names or s.runs_with in names]


@dataclass
class ProbePlan:
    probe: str
    description: str
    strategy: str | None
    span: str = ""
    reason: str = ""
    skipped: dict[str, str] = field(default_factory=dict)
    limitations: list[str] = field(default_factory=list)

    @property
    def available(self) -> bool:
        return self.strategy is not None

    def as_dict(self) -> dict[str, Any]:
        return {
            "available": self.available,
            "strategy": self.strategy,
            "span": self.span,
            "reason": self.reason,
            "skipped": self.skipped,
            "limitations": self.limitations,
            "description": self.description,
        }


def plan(spec: ProbeSpec, features: dict[str, Feature]) -> ProbePlan:
    """The first strategy whose kernel features all work here, and why the ones before it don't."""
    unmet = spec.requirement() if spec.requirement else None
    if unmet:
        return ProbePlan(spec.name, spec.description, None, reason=unmet)
    skipped: dict[str, str] = {}
    for strategy in spec.strategies:
        missing = [f for f in strategy.features if not features[f].available]
        if not missing:
            return ProbePlan(spec.name, spec.description, strategy.name, strategy.span, skipped=skipped,
                             limitations=spec.limitations() if spec.limitations else [])
        skipped[strategy.name] = "kernel lacks " + ", ".join(missing)
    reason = "; ".join(f"{name}: {why}" for name, why in skipped.items())
    return ProbePlan(spec.name, spec.description, None, reason=reason, skipped=skipped)
