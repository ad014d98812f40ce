"""Agent configuration: a TOML file, validated at start (docs/config.md documents every key).

Validation is strict: an unknown key or a value of the wrong type or range is one error line naming
the key (`ConfigError`), so a typo never silently disables a rule.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

DEFAULT_PORT = 9645


def probe_names() -> tuple[str, ...]:
    """The probes `probes` may name: the registry's (aiprobe.probes)."""
    from .probes import selectable_names

    return selectable_names()


class ConfigError(ValueError):
    """A bad key or value; the message names it."""


@dataclass(frozen=True)
class RuleConfig:
    enabled: bool = True
    threshold: float = 0.0
    # The rule stops firing only below `clear` (hysteresis); defaults to the threshold.
    clear: float | None = None
    for_seconds: float = 30.0
    severity: str = "warning"

    @property
    def clear_threshold(self) -> float:
        return self.threshold if self.clear is None else self.clear


# Built-in bottleneck rules and their defaults; every key can be overridden under [rules.<name>].
DEFAULT_RULES: dict[str, RuleConfig] = {
    # p99 of tcp_sendmsg over the last interval, seconds
    "network_send_stall": RuleConfig(threshold=0.05, clear=0.02, for_seconds=10, severity="warning"),
    # GPU utilization ratio
    "gpu_saturated": RuleConfig(threshold=0.95, clear=0.85, for_seconds=60, severity="info"),
    # GPU utilization ratio below which a GPU counts as idle while the endpoint has traffic (bytes/s)
    "gpu_idle_with_traffic": RuleConfig(threshold=0.10, clear=0.25, for_seconds=30, severity="warning"),
    # p99 run-queue delay of GPU-driving threads, seconds
    "gpu_threads_starved": RuleConfig(threshold=0.005, clear=0.002, for_seconds=10, severity="critical"),
    # CUDA context switches per second in one process
    "cuda_context_switch_storm": RuleConfig(threshold=1000.0, clear=500.0, for_seconds=10, severity="warning"),
    # listen-queue overflows + drops per second (/proc/net/netstat)
    "listen_queue_overflow": RuleConfig(threshold=1.0, clear=0.0, for_seconds=0, severity="critical"),
    # retransmitted / sent TCP segments
    "tcp_retransmits_high": RuleConfig(threshold=0.02, clear=0.01, for_seconds=30, severity="warning"),
}

# gpu_idle_with_traffic also needs a traffic floor: inbound bytes/s that counts as "the endpoint has traffic".
DEFAULT_TRAFFIC_FLOOR_BYTES_PER_SECOND = 10_000.0


@dataclass(frozen=True)
class Config:
    listen: str = f"0.0.0.0:{DEFAULT_PORT}"
    interval_seconds: float = 1.0
    interfaces: tuple[str, ...] = ("*",)
    exclude: tuple[str, ...] = ("lo",)
    probes: tuple[str, ...] = field(default_factory=probe_names)
    top_flows: int = 100
    flow_idle_seconds: float = 30.0
    slow_send_threshold_ms: float = 10.0
    dcgm_compatible_metrics: bool = False
    traffic_floor_bytes_per_second: float = DEFAULT_TRAFFIC_FLOOR_BYTES_PER_SECOND
    alertmanager_url: str | None = None
    alert_log: str = "-"  # "-" is stdout; a path appends JSON lines to that file
    rules: dict[str, RuleConfig] = field(default_factory=lambda: dict(DEFAULT_RULES))
    # probe -> the one strategy of its chain to run (default: the first the kernel allows)
    strategies: dict[str, str] = field(default_factory=dict)

    @property
    def listen_address(self) -> tuple[str, int]:
        host, _, port = self.listen.rpartition(":")
        return host.strip("[]") or "0.0.0.0", int(port)


# key -> (type check, human description); ranges are checked in _check_value.
_TOP_LEVEL = {f.name for f in fields(Config)} - {"rules", "strategies"}
_RULE_KEYS = {f.name for f in fields(RuleConfig)}
_SEVERITIES = ("info", "warning", "critical")


def _check_value(key: str, value: Any, expected: Any) -> Any:
    if isinstance(expected, bool) or expected is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if isinstance(expected, float | int) and not isinstance(expected, bool):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        if value < 0:
            raise ConfigError(f"{key}: must not be negative, got {value!r}")
        return type(expected)(value) if isinstance(expected, float) else value
    if isinstance(expected, tuple):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{key}: expected a list of strings, got {value!r}")
        return tuple(value)
    if not isinstance(value, str):
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    return value


def _validate_top(key: str, value: Any) -> Any:
    defaults = Config()
    expected = getattr(defaults, key)
    if key == "alertmanager_url":
        expected = ""
    value = _check_value(key, value, expected)
    if key == "listen":
        _host, sep, port = value.rpartition(":")
        if not sep or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"listen: expected HOST:PORT, got {value!r}")
    if key == "probes":
        unknown = set(value) - set(probe_names())
        if unknown:
            raise ConfigError(f"probes: unknown probe {sorted(unknown)[0]!r} (known: {', '.join(probe_names())})")
    if key == "interval_seconds" and value < 0.1:
        raise ConfigError(f"interval_seconds: must be at least 0.1, got {value!r}")
    if key == "top_flows" and (not isinstance(value, int) or value < 1):
        raise ConfigError(f"top_flows: expected a whole number >= 1, got {value!r}")
    if key == "alertmanager_url" and not value.startswith(("http://", "https://")):
        raise ConfigError(f"alertmanager_url: expected an http(s) URL, got {value!r}")
    return value


def _validate_rule(name: str, table: Any) -> RuleConfig:
    if name not in DEFAULT_RULES:
        raise ConfigError(f"rules.{name}: unknown rule (known: {', '.join(DEFAULT_RULES)})")
    if not isinstance(table, dict):
        raise ConfigError(f"rules.{name}: expected a table")
    rule = DEFAULT_RULES[name]
    for key, value in table.items():
        qualified = f"rules.{name}.{key}"
        if key not in _RULE_KEYS:
            raise ConfigError(f"{qualified}: unknown key (known: {', '.join(sorted(_RULE_KEYS))})")
        expected = 0.0 if key == "clear" else getattr(rule, key)
        value = _check_value(qualified, value, expected)
        if key == "severity" and value not in _SEVERITIES:
            raise ConfigError(f"{qualified}: expected one of {', '.join(_SEVERITIES)}, got {value!r}")
        rule = replace(rule, **{key: value})
    return rule


def _validate_strategies(table: Any) -> dict[str, str]:
    from .probes import specs, strategies_named

    if not isinstance(table, dict):
        raise ConfigError("strategies: expected a table of probe = strategy")
    known = {spec.name: spec for spec in specs() if len(spec.strategies) > 1}
    for probe, name in table.items():
        if probe not in known:
            raise ConfigError(f"strategies.{probe}: not a probe with a choice of strategies "
                              f"(those: {', '.join(known)})")
        name = _check_value(f"strategies.{probe}", name, "")
        try:
            strategies_named(known[probe], name)
        except ValueError as exc:
            raise ConfigError(f"strategies.{probe}: {exc}") from None
    return dict(table)


def from_dict(data: dict[str, Any]) -> Config:
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key == "rules":
            if not isinstance(value, dict):
                raise ConfigError("rules: expected a table of rules")
            rules = dict(DEFAULT_RULES)
            rules.update({name: _validate_rule(name, table) for name, table in value.items()})
            values["rules"] = rules
        elif key == "strategies":
            values["strategies"] = _validate_strategies(value)
        elif key in _TOP_LEVEL:
            values[key] = _validate_top(key, value)
        else:
            raise ConfigError(f"{key}: unknown key")
    return Config(**values)


def load(path: str | Path | None, **overrides: Any) -> Config:
    """The config from `path` (None: defaults), then command-line `overrides` (None values ignored)."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"{path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML ({exc})") from None
    data.update({k: v for k, v in overrides.items() if v is not None})
    return from_dict(data)
