"""The probe registry. A probe is a package `agent/probes/<name>/`, one of whose modules declares
`SPEC = ProbeSpec(...)`: its name, strategies, BPF object, factory from the config, config keys,
CLI command, metric families, hooks into the refresh, and the parts riding on its programs.
Everything that lists probes derives the list from here: `aiprobe check`, the CLI, config
validation, the daemon and the exporter. Adding a probe touches only its own files; the core
imports no probe.

Every probe has one life cycle (`Probe`): `start()` loads and attaches (raising `ProbeUnavailable`
with every strategy's reason), `read()` returns its model records, `status()` says what runs and
why not, `close()` detaches everything and may be called any number of times. `faces()` gives the
probe and each of its parts by name: what the agent reads, reports and exports one by one.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, Self

from .config import Catalog, Settings
from .features import Feature
from .formatting import Column, View
from .loader import BpfObject, Loaded, ProbeUnavailable, Strategy, attach_all, load_first
from .model import MapUsage, ProbeStatus
from .refresh import NO_HOOKS, Hooks
from .rules import FleetRule, RuleSpec

if TYPE_CHECKING:
    from .config import Config
    from .metrics import Family

# A probe module is recognised by its declaration, so registering a probe needs no list elsewhere.
_DECLARES_SPEC = re.compile(r"^SPEC = ProbeSpec\(", re.MULTILINE)


class Face(Protocol):
    """A probe, or a part of one, as the agent reads and reports it."""

    def read(self) -> Any: ...

    def status(self) -> ProbeStatus: ...

    def map_usage(self) -> list[MapUsage]: ...

    def events_lost(self) -> int: ...


@dataclass
class Unavailable:
    """The face of a part that cannot run, and why."""

    reason: str

    def read(self) -> None:
        return None

    def status(self) -> ProbeStatus:
        return ProbeStatus(False, reason=self.reason)

    def map_usage(self) -> list[MapUsage]:
        return []

    def events_lost(self) -> int:
        return 0


# One step of loading an object under a strategy (load_first's configure and attach).
LoadStep = Callable[[BpfObject, Strategy], None]


@dataclass(frozen=True)
class Loading:
    """How a probe's start() loads its object (load()), so `aiprobe check` plans from the same loads:
    the chain it tries (None: the probe's strategies), what it sets before each load, and its attach
    where that is global and harmless (tracepoints, kprobes, trampolines, detached with the object).
    An attach to the host's own interfaces or libraries is left to the probe's fallback for a host
    with none (a throwaway netns), never made on them."""

    strategies: tuple[Strategy, ...] | None = None
    configure: LoadStep | None = None
    attach: LoadStep = attach_all
    bpf_object: str | None = None  # the build of its object it opens on this kernel (None: its spec's)

    def load(self, spec: ProbeSpec, strategies: tuple[Strategy, ...] | None = None) -> Loaded:
        """load_first over `strategies` (None: its chain), as start() and check's trials load."""
        chain = strategies or self.strategies or spec.strategies
        return load_first(spec.name, self.bpf_object or spec.bpf_object, chain, configure=self.configure,
                          attach=self.attach)


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

    def loading(self) -> Loading:
        """How start() loads its object (its spec's bpf_object): `aiprobe check` loads it alike."""
        return Loading()

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

    def parts(self) -> dict[str, Face]:
        """Each part it runs (`ProbeSpec.parts`), by name, or why that part cannot run."""
        return {}

    def close(self) -> None:
        loaded, self.loaded = self.loaded, None
        if loaded is not None:
            loaded.obj.close()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# factory(config) -> an unstarted probe
Factory = Callable[["Config"], Probe]


@dataclass(frozen=True, kw_only=True)
class Part:
    """What users see of a probe, or of a part of it with a face of its own: a status, records,
    metrics, hooks into the refresh and a command. Streams ride on the send path's programs and the
    scheduler side on cuda's: parts of those probes, loaded and owned by them (`ProbeSpec.parts`)."""

    name: str
    description: str
    order: int  # place in `aiprobe check`, the snapshot's `probes` and the start order
    # Its chain (a part with none of its own runs on those of its probe's strategies it names).
    strategies: tuple[Strategy, ...] = ()
    # A prerequisite outside the kernel (a user-space library, a device); returns why it is unmet.
    requirement: Callable[[], str | None] | None = None
    # What it cannot see on this host though it runs (a GPU without GPM), one line each.
    limitations: Callable[[], list[str]] | None = None
    # What `aiprobe check` adds for it about this host: report key -> (heading, lines).
    check_notes: Callable[[], dict[str, tuple[str, list[str]]]] | None = None
    settings: type[Settings] | None = None  # its keys of the config file
    command: str = ""  # "module:attribute" of its `aiprobe <cli_name>` command
    cli_name: str = ""  # defaults to its name
    metrics: tuple[Family, ...] = ()
    # Its part in each refresh: joins, rates, rule signals, process rows, snapshot sections.
    hooks: Hooks = NO_HOOKS
    # The bottleneck rules judging its figures (its hooks' signals).
    rules: tuple[RuleSpec, ...] = ()
    # Rules over the whole fleet's series of its metrics (PromQL only): in the rule files alone.
    fleet_rules: tuple[FleetRule, ...] = ()
    # What `aiprobe top` shows of it: its columns of the process table, its own views.
    process_columns: tuple[Column, ...] = ()
    views: tuple[View, ...] = ()

    @property
    def subcommand(self) -> str:
        return self.cli_name or self.name


@dataclass(frozen=True, kw_only=True)
class ProbeSpec(Part):
    """A probe: one BPF object (or none) and what loads it, with the parts riding on its programs."""

    bpf_object: str = ""  # its agent/bpf_objects/<name>.bpf.o, if it has one
    factory: Factory | None = None
    parts: tuple[Part, ...] = ()
    # Cheap host-wide counters that run whatever the config selects.
    always: bool = False
    # Its read_for_scrape() is cheap and safe from another thread: /metrics reads it at each scrape.
    read_at_scrape: bool = False

    @property
    def faces(self) -> tuple[Part, ...]:
        """The probe itself, then its parts."""
        return (self, *self.parts)

    def follows(self, part: Part) -> bool:
        """Whether `part` runs on this probe's strategy rather than on a chain of its own."""
        own = {s.name for s in self.strategies}
        return part is not self and bool(part.strategies) and all(s.name in own for s in part.strategies)


@cache
def specs() -> tuple[ProbeSpec, ...]:
    """Every probe's declaration, found in the probe packages (agent/probes/<name>/): imported here by
    name, so the core never imports a probe."""
    probes = Path(__file__).parent / "probes"
    modules = [".".join(path.relative_to(probes).with_suffix("").parts) for path in sorted(probes.glob("*/*.py"))
               if _DECLARES_SPEC.search(path.read_text())]
    found = [importlib.import_module(f"{__package__}.probes.{name}").SPEC for name in modules]
    return tuple(sorted(found, key=lambda spec: spec.order))


def faces() -> tuple[Part, ...]:
    """Every probe and part, in order."""
    return tuple(sorted((face for spec in specs() for face in spec.faces), key=lambda face: face.order))


def owner(part: Part) -> ProbeSpec:
    """The probe a part belongs to (a probe is its own)."""
    return next(spec for spec in specs() if any(face is part for face in spec.faces))


def face(name: str) -> Part:
    """The probe or part of that name."""
    return next(f for f in faces() if f.name == name)


def strategies_named(part: Part, name: str | None) -> tuple[Strategy, ...]:
    """The chain, or only its strategy `name` when one is forced (`--strategy`, the config's
    `strategies`): to keep BPF trampolines off a host, or to compare strategies. ValueError, naming
    the chain, when there is no such strategy."""
    if name is None:
        return part.strategies
    forced = tuple(s for s in part.strategies if s.name == name)
    if not forced:
        chain = ", ".join(s.name for s in part.strategies)
        raise ValueError(f"{part.name} has no strategy {name!r} (its chain: {chain})")
    return forced


def catalog() -> Catalog:
    """What the config may name of the probes: their names, sections and chains."""
    return Catalog(
        probes=selectable_names(),
        sections=tuple(face.settings for face in faces() if face.settings is not None),
        chains={face.name: tuple(s.name for s in face.strategies) for face in faces()
                if len(face.strategies) > 1 and not owner(face).follows(face)},
        hosts={face.name: owner(face).name for face in faces() if owner(face).follows(face)},
        rules={rule.name: rule.default for rule in rules()},
        histograms=tuple(family.name for face in faces() for family in face.metrics if family.buckets),
    )


def rules() -> tuple[RuleSpec, ...]:
    """Every probe's rules, in registry order."""
    return tuple(rule for face in faces() for rule in face.rules)


def fleet_rules() -> tuple[FleetRule, ...]:
    """Every probe's fleet rules, in registry order."""
    return tuple(rule for face in faces() for rule in face.fleet_rules)


def selectable_names() -> tuple[str, ...]:
    """What the config's `probes` may name: every probe but those that always run."""
    return tuple(s.name for s in specs() if not s.always)


def selected(names: tuple[str, ...] | None) -> list[ProbeSpec]:
    """The probes a config's `probes` runs (None: every one), in start order."""
    return [s for s in specs() if s.always or names is None or s.name in names]


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


@dataclass
class Trial:
    """A probe's object loaded as its start() loads it: the strategy that loaded and attached (None:
    none did), and why each one tried before it failed, by attempt (Strategy.attempt)."""

    strategy: Strategy | None
    skipped: dict[str, str]


def trial(spec: ProbeSpec, features: dict[str, Feature], config: Config) -> Trial:
    """Each strategy in the order load_first tries them, at most once, until one runs: one with
    programs by a real load and attach (load_first's own, closed at once), one without by the
    kernel features it names."""
    loading = spec.factory(config).loading() if spec.factory else Loading()
    skipped: dict[str, str] = {}
    for strategy in loading.strategies or spec.strategies:
        try:
            why = _load_failure(spec, strategy, loading) if strategy.programs else _missing(strategy, features)
        except Exception as exc:  # as the agent: a probe whose load raises cannot run, whatever came next
            skipped[strategy.attempt] = str(exc) or type(exc).__name__
            break
        if why is None:
            return Trial(strategy, skipped)
        skipped[strategy.attempt] = why
    return Trial(None, skipped)


def _load_failure(spec: ProbeSpec, strategy: Strategy, loading: Loading) -> str | None:
    try:
        loaded = loading.load(spec, (strategy,))
    except ProbeUnavailable as exc:
        return "; ".join(exc.reasons.values())
    loaded.obj.close()
    return None


def _missing(strategy: Strategy, features: dict[str, Feature]) -> str | None:
    missing = [f for f in strategy.features if not features[f].available]
    return "kernel lacks " + ", ".join(missing) if missing else None


def plans(features: dict[str, Feature], config: Config) -> list[ProbePlan]:
    """What the agent would run with `config`, every probe and part in order: each probe from a trial
    of its own loads, each part from its probe's."""
    trials = {spec.name: trial(spec, features, config) for spec in specs() if not _unmet(spec)}
    return [plan(face, trials.get(owner(face).name)) for face in faces()]


def _unmet(part: Part) -> str | None:
    return part.requirement() if part.requirement else None


def plan(face: Part, host: Trial | None) -> ProbePlan:
    """A probe's or part's plan from its probe's trial (`host`; None: its probe's prerequisite is
    unmet). A part runs the strategy of its own chain that its probe loaded (the probe's, or the
    part's loaded with it: Strategy.part), having skipped those its probe's trial skipped."""
    unmet = _unmet(face)
    if unmet or host is None:
        return ProbePlan(face.name, face.description, None, reason=unmet or _outside(face))
    own = {s.name: s for s in face.strategies}
    skipped = {name: why for name, why in host.skipped.items() if name in own}
    loaded = (host.strategy, host.strategy.part) if host.strategy else ()
    runs = next((own[s.name] for s in loaded if s is not None and s.name in own), None)
    if runs is None:
        return ProbePlan(face.name, face.description, None, reason=_why_not(face, host, skipped), skipped=skipped)
    return ProbePlan(face.name, face.description, runs.name, runs.span, skipped=skipped,
                     limitations=face.limitations() if face.limitations else [])


def _why_not(face: Part, host: Trial, skipped: dict[str, str]) -> str:
    reasons = "; ".join(f"{name}: {why}" for name, why in skipped.items())
    if host.strategy is None:
        return reasons if owner(face) is face else _outside(face)
    runs = f"the {owner(face).name} probe runs {host.strategy.name}, not one of its strategies"
    return f"{runs} ({reasons})" if reasons else runs


def _outside(part: Part) -> str:
    """As the agent says it of a part whose probe cannot run."""
    return f"runs inside the {owner(part).name} probe, which is not running"
