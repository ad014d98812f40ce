"""Agent configuration: a TOML file, validated at start (docs/config.md documents every key).

The agent's own keys are `Config`'s fields; each probe declares its keys in its package as a
`Settings` dataclass (its section), and the registry hands them to the loader (`Catalog`), so this
module names no probe. Every key sits at the top level of the file whichever section it belongs to.

Validation is strict: an unknown key or a value of the wrong type or range is one error line naming
the key (`ConfigError`), so a typo never silently disables a rule.
"""

from __future__ import annotations

import ipaddress
import math
import os
import stat
import tomllib
import urllib.parse
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, TypeVar

from .names import printable

DEFAULT_PORT = 9645
MAX_FILE_BYTES = 1 << 20


def limits(low: float, high: float, *, whole: bool = False) -> dict[str, Any]:
    """A number key's range, inclusive: outside it a value is a mistake (nan, inf, 1e308 seconds), not
    a wish. `whole`: an integer."""
    return {"limits": (low, high), "whole": whole}


def non_empty(hint: str = "") -> dict[str, Any]:
    """A list that must name something: an empty one would silently mean "everything" or "nothing"."""
    return {"non_empty": True, "hint": f" ({hint})" if hint else ""}


class Settings:
    """Base of a probe's section: a frozen dataclass in the probe's package whose fields are its keys,
    with their defaults and, for numbers, their `limits`."""


S = TypeVar("S", bound=Settings)


@dataclass(frozen=True)
class Catalog:
    """What the probes declare that a config names (`aiprobe.registry.catalog()`)."""

    probes: tuple[str, ...] = ()  # what `probes` may name, the default
    sections: tuple[type[Settings], ...] = ()
    chains: dict[str, tuple[str, ...]] = field(default_factory=dict)  # what `strategies` may force, by name
    hosts: dict[str, str] = field(default_factory=dict)  # parts that run on their probe's strategy -> the probe
    rules: dict[str, RuleConfig] = field(default_factory=dict)  # the declared rules' defaults
    histograms: tuple[str, ...] = ()  # the histogram families with a bucket set `histogram_buckets` may replace


class ConfigError(ValueError):
    """A bad key or value; the message names it."""


@dataclass(frozen=True)
class RuleConfig:
    enabled: bool = True
    threshold: float = field(default=0.0, metadata=limits(0.0, 1e12))
    # The rule stops firing only below `clear` (hysteresis); defaults to the threshold.
    clear: float | None = field(default=None, metadata=limits(0.0, 1e12))
    for_seconds: float = field(default=30.0, metadata=limits(0.0, 86_400.0))
    severity: str = "warning"

    @property
    def clear_threshold(self) -> float:
        return self.threshold if self.clear is None else self.clear


# gpu_idle_with_traffic also needs a traffic floor: inbound bytes/s that counts as "the endpoint has traffic".
DEFAULT_TRAFFIC_FLOOR_BYTES_PER_SECOND = 10_000.0


@dataclass(frozen=True)
class Config:
    listen: str = f"0.0.0.0:{DEFAULT_PORT}"
    interval_seconds: float = field(default=1.0, metadata=limits(0.1, 3600.0))
    # The share of one CPU the agent's refreshes may take: past it they come less often (RefreshPacer).
    refresh_budget: float = field(default=0.01, metadata=limits(0.0, 1.0))
    # The probes to run (their names: the registry's); None: every one.
    probes: tuple[str, ...] | None = field(default=None, metadata=non_empty())
    traffic_floor_bytes_per_second: float = field(default=DEFAULT_TRAFFIC_FLOOR_BYTES_PER_SECOND,
                                                  metadata=limits(0.0, 1e12))
    alertmanager_url: str | None = None
    # TLS and basic auth, Prometheus exporter-toolkit format (exporters/webconfig.py)
    web_config_file: str | None = None
    # "local": /api/v1/snapshot answers loopback clients only (and, with basic auth, any authenticated
    # one); "network": anyone who reaches the listen address
    snapshot_api: str = "local"
    alert_log: str = "-"  # "-" is stdout; a path appends JSON lines to that file
    # Bounded series under churn: distinct `process` label values (the rest are process="other"),
    # and how long a label set may go unseen before it leaves /metrics.
    max_process_labels: int = field(default=200, metadata=limits(1, 100_000, whole=True))
    idle_series_seconds: float = field(default=300.0, metadata=limits(1.0, 7 * 86_400.0))
    # The probes' series a scrape may hold: past it, the least active label sets of the largest
    # counter and histogram families fold into `other` (exporters/series_budget.py).
    max_series: int = field(default=10_000, metadata=limits(100, 10_000_000, whole=True))
    # The kubelet's log directories, which name each pod and container (kubelet.py); absent outside
    # Kubernetes, where workloads have no namespace or pod.
    pod_logs: str = "/var/log/pods"
    container_logs: str = "/var/log/containers"
    # rule -> its thresholds: the declared defaults with `[rules.<name>]` over them (none here: the
    # defaults, which the rule engine has from the rules' declarations)
    rules: dict[str, RuleConfig] = field(default_factory=dict)
    # probe -> the one strategy of its chain to run (default: the first the kernel allows)
    strategies: dict[str, str] = field(default_factory=dict)
    # histogram family -> the `le` bounds (seconds) /metrics shows of it, in place of its own
    histogram_buckets: dict[str, tuple[float, ...]] = field(default_factory=dict)
    # Each probe's section, as set in the file (the others read as their defaults: `settings`).
    sections: tuple[Settings, ...] = ()

    @property
    def listen_address(self) -> tuple[str, int]:
        host, _, port = self.listen.rpartition(":")
        return host.strip("[]") or "0.0.0.0", int(port)

    def settings(self, kind: type[S]) -> S:
        """A probe's section."""
        return next((section for section in self.sections if isinstance(section, kind)), None) or kind()

    def with_settings(self, *sections: Settings) -> Config:
        """This config with those sections in place of their kinds'."""
        kinds = {type(section) for section in sections}
        return replace(self, sections=(*(s for s in self.sections if type(s) not in kinds), *sections))


_TOP_LEVEL = {f.name for f in fields(Config)} - {"rules", "strategies", "histogram_buckets", "sections"}
MAX_BUCKETS = 30
# A bound of `histogram_buckets`, seconds: what the kernel's histograms can tell apart.
BUCKET_LIMITS = (1e-6, 3600.0)
_RULE_KEYS = {f.name for f in fields(RuleConfig)}
_SEVERITIES = ("info", "warning", "critical")


def _field(holder: type, key: str) -> Any:
    return next(f for f in fields(holder) if f.name == key)


def _check_number(key: str, value: Any, expected: float | int, bounds: tuple[float, float]) -> float | int:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}: expected a finite number, got {value!r}")
    low, high = bounds
    if not low <= value <= high:
        raise ConfigError(f"{key}: expected {low:g} to {high:g}, got {value!r}")
    return float(value) if isinstance(expected, float) else value


def _check_text(key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    if not value or printable(value) != value:
        raise ConfigError(f"{key}: expected printable text, got {value!r}")
    return value


def _check_value(key: str, value: Any, holder: type) -> Any:
    """`value` for key (qualified, e.g. rules.x.threshold) of the dataclass `holder`, checked against
    its field: the default's type, and the field's limits."""
    declared = _field(holder, key.rsplit(".", 1)[-1])
    expected = declared.default_factory() if callable(declared.default_factory) else declared.default
    if isinstance(expected, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if "limits" in declared.metadata:
        value = _check_number(key, value, 0.0 if expected is None else expected, declared.metadata["limits"])
        if declared.metadata["whole"] and not isinstance(value, int):
            raise ConfigError(f"{key}: expected a whole number, got {value!r}")
        return value
    if isinstance(expected, tuple) or declared.metadata.get("non_empty"):
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list of strings, got {value!r}")
        if not value and declared.metadata.get("non_empty"):
            hint = declared.metadata.get("hint", "")
            raise ConfigError(f"{key}: expected at least one entry{hint}")
        return tuple(_check_text(key, item) for item in value)
    return _check_text(key, value)


def _check_url(key: str, value: str) -> None:
    parts = urllib.parse.urlsplit(value)
    try:
        port = parts.port
    except ValueError:
        port = 0
    if parts.scheme not in ("http", "https") or not parts.hostname or port == 0 or " " in value:
        raise ConfigError(f"{key}: expected http(s)://HOST[:PORT][/PATH], got {value!r}")


def check_alert_log(path: str) -> None:
    """`alert_log` must be a file we can append to ("-" is stdout): a missing directory or a
    read-only file system is found at start, not at the first alert."""
    if path == "-":
        return
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, 0o644))
    except OSError as exc:
        raise ConfigError(f"alert_log {path}: {exc.strerror}") from None


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _validate_top(key: str, value: Any, catalog: Catalog) -> Any:
    value = _check_value(key, value, Config)
    if key == "listen":
        host, sep, port = value.rpartition(":")
        if not sep or not port.isdigit() or not 0 < int(port) < 65536 or not _is_ip(host.strip("[]") or "0.0.0.0"):
            raise ConfigError(f"listen: expected IP:PORT or [IPv6]:PORT, got {value!r}")
    if key == "probes":
        unknown = set(value) - set(catalog.probes)
        if unknown:
            raise ConfigError(f"probes: unknown probe {sorted(unknown)[0]!r} (known: {', '.join(catalog.probes)})")
    if key == "snapshot_api" and value not in ("local", "network"):
        raise ConfigError(f"snapshot_api: expected \"local\" or \"network\", got {value!r}")
    if key == "alertmanager_url":
        _check_url(key, value)
    return value


def _validate_rule(name: str, table: Any, catalog: Catalog) -> RuleConfig:
    if name not in catalog.rules:
        raise ConfigError(f"rules.{name}: unknown rule (known: {', '.join(catalog.rules)})")
    if not isinstance(table, dict):
        raise ConfigError(f"rules.{name}: expected a table")
    rule = catalog.rules[name]
    for key, value in table.items():
        qualified = f"rules.{name}.{key}"
        if key not in _RULE_KEYS:
            raise ConfigError(f"{qualified}: unknown key (known: {', '.join(sorted(_RULE_KEYS))})")
        value = _check_value(qualified, value, RuleConfig)
        if key == "severity" and value not in _SEVERITIES:
            raise ConfigError(f"{qualified}: expected one of {', '.join(_SEVERITIES)}, got {value!r}")
        rule = replace(rule, **{key: value})
    return rule


def _validate_strategies(table: Any, catalog: Catalog) -> dict[str, str]:
    if not isinstance(table, dict):
        raise ConfigError("strategies: expected a table of probe = strategy")
    for probe, name in table.items():
        if probe in catalog.hosts:
            host = catalog.hosts[probe]
            raise ConfigError(f"strategies.{probe}: {probe} runs on {host}'s strategy; set strategies.{host}")
        if probe not in catalog.chains:
            raise ConfigError(f"strategies.{probe}: not a probe with a choice of strategies "
                              f"(those: {', '.join(catalog.chains)})")
        name = _check_text(f"strategies.{probe}", name)
        if name not in catalog.chains[probe]:
            raise ConfigError(f"strategies.{probe}: {probe} has no strategy {name!r} "
                              f"(its chain: {', '.join(catalog.chains[probe])})")
    return dict(table)


def _validate_buckets(table: Any, catalog: Catalog) -> dict[str, tuple[float, ...]]:
    if not isinstance(table, dict):
        raise ConfigError("histogram_buckets: expected a table of family = [bounds in seconds]")
    buckets = {}
    for name, bounds in table.items():
        key = f"histogram_buckets.{name}"
        if name not in catalog.histograms:
            raise ConfigError(f"{key}: not a histogram with buckets (those: {', '.join(catalog.histograms)})")
        if not isinstance(bounds, list) or not 0 < len(bounds) <= MAX_BUCKETS:
            raise ConfigError(f"{key}: expected a list of 1 to {MAX_BUCKETS} bounds in seconds, got {bounds!r}")
        checked = tuple(_check_number(key, bound, 0.0, BUCKET_LIMITS) for bound in bounds)
        if list(checked) != sorted(set(checked)):
            raise ConfigError(f"{key}: expected ascending bounds, got {bounds!r}")
        buckets[name] = checked
    return buckets


def from_dict(data: dict[str, Any], catalog: Catalog = Catalog()) -> Config:
    """The config a parsed file says, every key checked; what it leaves out is the default."""
    owners = {f.name: section for section in catalog.sections for f in fields(section)}  # type: ignore[arg-type]
    values: dict[str, Any] = {"probes": catalog.probes or None, "rules": dict(catalog.rules)}
    in_sections: dict[type[Settings], dict[str, Any]] = {section: {} for section in catalog.sections}
    for key, value in data.items():
        if key == "rules":
            if not isinstance(value, dict):
                raise ConfigError("rules: expected a table of rules")
            values["rules"] = {**values["rules"],
                               **{name: _validate_rule(name, table, catalog) for name, table in value.items()}}
        elif key == "strategies":
            values["strategies"] = _validate_strategies(value, catalog)
        elif key == "histogram_buckets":
            values[key] = _validate_buckets(value, catalog)
        elif key in _TOP_LEVEL:
            values[key] = _validate_top(key, value, catalog)
        elif key in owners:
            in_sections[owners[key]][key] = _check_value(key, value, owners[key])
        else:
            raise ConfigError(f"{key}: unknown key")
    return Config(**values, sections=tuple(section(**keys) for section, keys in in_sections.items()))


def read_config_file(path: str | Path, what: str = "config") -> bytes:
    """A config file's bytes: a regular file of at most 1 MiB — not /dev/zero, a FIFO or a directory,
    which would read for ever, block or fail oddly."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # O_NONBLOCK: a FIFO does not block open
    except OSError as exc:
        raise ConfigError(f"{what} {path}: {exc.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ConfigError(f"{what} {path}: not a regular file")
    with os.fdopen(fd, "rb") as file:
        try:
            data = file.read(MAX_FILE_BYTES + 1)
        except OSError as exc:
            raise ConfigError(f"{what} {path}: {exc.strerror}") from None
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(f"{what} {path}: larger than {MAX_FILE_BYTES} bytes")
    return data


def load(path: str | Path | None, catalog: Catalog = Catalog(), **overrides: Any) -> Config:
    """The config from `path` (None: defaults), then command-line `overrides` (None values ignored);
    the probes' keys are those of `catalog`."""
    data: dict[str, Any] = {}
    if path is not None:
        raw = read_config_file(path)
        try:
            data = tomllib.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise ConfigError(f"config {path}: not UTF-8 text (byte {exc.start})") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config {path}: not valid TOML ({exc})") from None
        except RecursionError:
            raise ConfigError(f"config {path}: nested too deeply") from None
    data.update({k: v for k, v in overrides.items() if v is not None})
    config = from_dict(data, catalog)
    check_alert_log(config.alert_log)
    return config
