"""Agent configuration: a TOML file, validated at start (docs/config.md documents every key).

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
from typing import Any

from .names import printable

DEFAULT_PORT = 9645
MAX_FILE_BYTES = 1 << 20


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
    # CUDA contexts that launched work on one GPU in the last refresh (2 or more: time-sliced)
    "gpu_time_sliced": RuleConfig(threshold=1.5, clear=1.5, for_seconds=30, severity="warning"),
    # fraction of time the GPU's busiest graphics engine spends switching contexts (GPM)
    "gpu_context_switch_overhead": RuleConfig(threshold=0.05, clear=0.03, for_seconds=30, severity="warning"),
    # listen-queue drops per second (TcpExt ListenDrops, which counts every overflow too)
    "listen_queue_overflow": RuleConfig(threshold=1.0, clear=0.0, for_seconds=0, severity="critical"),
    # stalls (gaps between writes above stream_stall_threshold_ms) of one process's responses in the window
    "token_streams_stalling": RuleConfig(threshold=0.0, clear=0.0, for_seconds=0, severity="warning"),
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
    xdp_interfaces: tuple[str, ...] = ()
    probes: tuple[str, ...] = field(default_factory=probe_names)
    top_flows: int = 100
    flow_idle_seconds: float = 30.0
    # Entries of the flow table (one per flow and direction), preallocated: 168 bytes of kernel memory each.
    max_flows: int = 262_144
    slow_send_threshold_ms: float = 10.0
    stream_stall_threshold_ms: float = 250.0
    sendlat_cpu_budget: float = 0.01  # of one CPU, for sendlat's programs; past it, 1 send in N is timed
    cuda_cpu_budget: float = 0.01  # of one CPU, for the kernel-launch uprobes; past it, they are duty-cycled
    dcgm_compatible_metrics: bool = False
    traffic_floor_bytes_per_second: float = DEFAULT_TRAFFIC_FLOOR_BYTES_PER_SECOND
    alertmanager_url: str | None = None
    # TLS and basic auth, Prometheus exporter-toolkit format (exporters/webconfig.py)
    web_config_file: str | None = None
    # "local": /api/v1/snapshot answers loopback clients only (and, with basic auth, any authenticated
    # one); "network": anyone who reaches the listen address
    snapshot_api: str = "local"
    alert_log: str = "-"  # "-" is stdout; a path appends JSON lines to that file
    # Bounded series under churn: distinct `process` label values (the rest are process="other"),
    # and how long a label set may go unseen before it leaves /metrics.
    max_process_labels: int = 200
    idle_series_seconds: float = 300.0
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


# Every number's range, inclusive: outside it a value is a mistake (nan, inf, 1e308 seconds), not a wish.
_RANGES: dict[str, tuple[float, float]] = {
    "interval_seconds": (0.1, 3600.0),
    "top_flows": (1, 100_000),
    "flow_idle_seconds": (1.0, 86_400.0),
    "max_flows": (1024, 4_194_304),
    "slow_send_threshold_ms": (0.001, 60_000.0),
    "stream_stall_threshold_ms": (1.0, 600_000.0),
    "sendlat_cpu_budget": (0.0, 64.0),
    "cuda_cpu_budget": (0.0, 64.0),
    "traffic_floor_bytes_per_second": (0.0, 1e12),
    "max_process_labels": (1, 100_000),
    "idle_series_seconds": (1.0, 7 * 86_400.0),
    # [rules.*]
    "threshold": (0.0, 1e12),
    "clear": (0.0, 1e12),
    "for_seconds": (0.0, 86_400.0),
}
# Lists that must name something: an empty one would silently mean "everything" or "nothing".
_NON_EMPTY = ("interfaces", "probes")


def _check_number(key: str, value: Any, expected: float | int) -> float | int:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}: expected a finite number, got {value!r}")
    low, high = _RANGES[key.rsplit(".", 1)[-1]]
    if not low <= value <= high:
        raise ConfigError(f"{key}: expected {low:g} to {high:g}, got {value!r}")
    return float(value) if isinstance(expected, float) else value


def _check_text(key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    if not value or printable(value) != value:
        raise ConfigError(f"{key}: expected printable text, got {value!r}")
    return value


def _check_value(key: str, value: Any, expected: Any) -> Any:
    if isinstance(expected, bool) or expected is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if isinstance(expected, float | int):
        return _check_number(key, value, expected)
    if isinstance(expected, tuple):
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list of strings, got {value!r}")
        if not value and key in _NON_EMPTY:
            hint = ' (["*"] for all)' if key == "interfaces" else ""
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


def _validate_top(key: str, value: Any) -> Any:
    defaults = Config()
    expected = getattr(defaults, key)
    if expected is None:  # optional strings
        expected = ""
    value = _check_value(key, value, expected)
    if key == "listen":
        host, sep, port = value.rpartition(":")
        if not sep or not port.isdigit() or not 0 < int(port) < 65536 or not _is_ip(host.strip("[]") or "0.0.0.0"):
            raise ConfigError(f"listen: expected IP:PORT or [IPv6]:PORT, got {value!r}")
    if key == "probes":
        unknown = set(value) - set(probe_names())
        if unknown:
            raise ConfigError(f"probes: unknown probe {sorted(unknown)[0]!r} (known: {', '.join(probe_names())})")
    if key in ("top_flows", "max_flows", "max_process_labels") and not isinstance(value, int):
        raise ConfigError(f"{key}: expected a whole number, got {value!r}")
    if key == "snapshot_api" and value not in ("local", "network"):
        raise ConfigError(f"snapshot_api: expected \"local\" or \"network\", got {value!r}")
    if key == "alertmanager_url":
        _check_url(key, value)
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
    known = {spec.name: spec for spec in specs() if len(spec.strategies) > 1 and not spec.follows_strategy}
    hosts = {spec.name: spec.runs_with for spec in specs() if spec.follows_strategy}
    for probe, name in table.items():
        if probe in hosts:
            raise ConfigError(f"strategies.{probe}: {probe} runs on {hosts[probe]}'s strategy; "
                              f"set strategies.{hosts[probe]}")
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


def load(path: str | Path | None, **overrides: Any) -> Config:
    """The config from `path` (None: defaults), then command-line `overrides` (None values ignored)."""
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
    config = from_dict(data)
    check_alert_log(config.alert_log)
    return config
