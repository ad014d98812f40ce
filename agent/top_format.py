"""Human units for `aiprobe top`: a snapshot field's name says its unit (Prometheus style:
`_seconds`, `_bytes_per_second`, `_ratio` …), so one function formats any field by its name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

MISSING = "-"  # a field the probe could not fill (null in the snapshot)

_BINARY_PREFIXES = ("", "Ki", "Mi", "Gi", "Ti", "Pi")
_DECIMAL_PREFIXES = ("", "k", "M", "G", "T")


def _scaled(value: float, step: float, prefixes: tuple[str, ...]) -> tuple[float, str]:
    prefix = 0
    while abs(value) >= step and prefix < len(prefixes) - 1:
        value /= step
        prefix += 1
    return value, prefixes[prefix]


def _number(value: float) -> str:
    """Three significant digits without trailing noise: 1.23, 12.3, 123."""
    if value == int(value) and abs(value) < 1000:
        return str(int(value))
    return f"{value:.2f}" if abs(value) < 10 else f"{value:.1f}" if abs(value) < 100 else f"{value:.0f}"


def size(value: float) -> str:
    scaled, prefix = _scaled(float(value), 1024, _BINARY_PREFIXES)
    return f"{_number(scaled)} {prefix}B"


def byte_rate(value: float) -> str:
    return size(value) + "/s"


def count(value: float) -> str:
    scaled, prefix = _scaled(float(value), 1000, _DECIMAL_PREFIXES)
    return _number(scaled) + prefix


def rate(value: float) -> str:
    return count(value) + "/s"


def duration(seconds: float) -> str:
    if seconds == 0:
        return "0 ms"
    if abs(seconds) < 1e-3:
        return f"{_number(seconds * 1e6)} µs"
    if abs(seconds) < 1:
        return f"{_number(seconds * 1e3)} ms"
    return f"{_number(seconds)} s"


def percent(ratio: float) -> str:
    return f"{ratio * 100:.0f}%"


def clock(hz: float) -> str:
    return f"{hz / 1e6:.0f} MHz"


def watts(value: float) -> str:
    return f"{_number(value)} W"


def celsius(value: float) -> str:
    return f"{value:.0f} °C"


def age(seconds: float) -> str:
    """How long ago, htop TIME+ style: 45s, 3m12s, 2h05m, 3d04h."""
    seconds = max(0, int(seconds))
    minutes, secs = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


# Longest suffix first: `_bytes_per_second` must win over `_per_second` and `_bytes`.
_BY_SUFFIX: tuple[tuple[str, Callable[[float], str]], ...] = (
    ("_bytes_per_second", byte_rate),
    ("_per_second", rate),
    ("_seconds", duration),
    ("_bytes", size),
    ("_ratio", percent),
    ("_hz", clock),
    ("_watts", watts),
    ("_celsius", celsius),
)


def formatter_for(field: str) -> Callable[[Any], str]:
    """The formatter a field's name implies; plain fields print as they are (ints as counts)."""
    for suffix, fmt in _BY_SUFFIX:
        if field.endswith(suffix) or field == suffix[1:]:
            return fmt
    return plain


def without_unit(field: str) -> str:
    """The field name without its unit suffix: `send_p99_seconds` -> `send_p99`."""
    for suffix, _fmt in _BY_SUFFIX:
        if field.endswith(suffix):
            return field.removesuffix(suffix)
    return field


def plain(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return count(value)
    if isinstance(value, float):
        return _number(value)
    if isinstance(value, list | tuple):
        return ",".join(plain(v) for v in value) or MISSING
    return str(value)


def field(name: str, value: Any) -> str:
    """`value` of snapshot field `name`, in its unit; null prints as MISSING."""
    if value is None:
        return MISSING
    return formatter_for(name)(value)
