"""Human units and tables for `aiprobe top` and every command's text output: a model field's name
says its unit (Prometheus style: `_seconds`, `_bytes_per_second`, `_ratio` …), so one function
formats any field by its name, and one `Column` type lays out every table."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from .histogram import Buckets

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


@dataclass(frozen=True)
class Column:
    title: str
    key: str  # the row field shown and sorted on; its name implies the unit (formatter_for)
    width: int
    numeric: bool = True  # right-aligned
    text: Callable[[Any], str] | None = None  # a formatter other than the one the key's unit implies

    @property
    def justify(self) -> Literal["left", "right"]:
        return "right" if self.numeric else "left"

    def cell(self, row: dict[str, Any]) -> str:
        value = row.get(self.key)
        if value is None:
            return MISSING
        return self.text(value) if self.text else field(self.key, value)

    def fit(self, text: str) -> str:
        """`text` padded or cut to the column width (text tables)."""
        if len(text) > self.width:
            text = text[: self.width - 1] + "…"
        return text.rjust(self.width) if self.numeric else text.ljust(self.width)


def table(columns: Iterable[Column], rows: Iterable[dict[str, Any]]) -> list[str]:
    """A header line and one line per row, every cell in its column's unit and width."""
    columns = tuple(columns)
    lines = [" ".join(column.fit(column.title) for column in columns).rstrip()]
    for row in rows:
        lines.append(" ".join(column.fit(column.cell(row)) for column in columns).rstrip())
    return lines


def bucket_histogram(buckets: Buckets, unit: str = "usecs", scale: float = 1e6) -> list[str]:
    """bcc-style text of cumulative (le_seconds, count) buckets: one line per bucket from the first
    used to the last used, with its bounds in `unit` (seconds times `scale`) and a bar of stars."""
    bounds = [0.0, *(le for le, _ in buckets)]
    counts = [cumulative - below for (_, cumulative), below in zip(buckets, [0, *(c for _, c in buckets[:-1])],
                                                                   strict=True)]
    used = [i for i, count in enumerate(counts) if count]
    if not used:
        return []
    widest = max(counts)
    lines = [f"{unit:>25} : {'count':<8} distribution"]
    for i in range(used[0], used[-1] + 1):
        stars = "*" * round(40 * counts[i] / widest)
        lines.append(f"{bounds[i] * scale:>11.1f} -> {bounds[i + 1] * scale:<11.1f} : {counts[i]:<8} |{stars:<40}|")
    return lines


def title(key: str) -> str:
    """A column title from a field name: `sync_p99_seconds` -> `SYNC P99`."""
    return without_unit(key).replace("_", " ").upper()


def columns_for(keys: Iterable[str], rows: Iterable[dict[str, Any]] = (),
                widths: dict[str, int] | None = None) -> tuple[Column, ...]:
    """Columns over model fields: titled by name, numeric when the first value is a number, as wide as
    `widths` says or as the widest cell of `rows`."""
    rows = list(rows)
    out = []
    for key in keys:
        sample = next((row[key] for row in rows if row.get(key) is not None), None)
        column = Column(title(key), key, 0, numeric=isinstance(sample, int | float) and not isinstance(sample, bool),
                        text=str if key in ("pid", "index", "gpu_index") else None)
        width = (widths or {}).get(key) or max([len(column.title), *(len(column.cell(row)) for row in rows)])
        out.append(Column(column.title, key, width, column.numeric, column.text))
    return tuple(out)


def record_table(rows: Iterable[dict[str, Any]], keys: Iterable[str]) -> list[str]:
    """`table()` of model records (as documents) over the given fields."""
    rows = list(rows)
    return table(columns_for(keys, rows), rows)


@dataclass(frozen=True)
class View:
    name: str
    title: str
    columns: tuple[Column, ...]
    sort_key: str  # the default sort column
    descending: bool
    probes: tuple[str, ...]  # probes (and parts) whose data fills it: a down one says why in the view
    rows: Callable[[dict[str, Any]], list[dict[str, Any]]]
    identity: tuple[str, ...] = ()  # row fields naming the same row across refreshes (the cursor follows it)
    key: str = ""  # the key that shows it in `aiprobe top`

    def row_id(self, row: dict[str, Any]) -> tuple[Any, ...]:
        return tuple(row.get(field) for field in self.identity)

    def column_index(self, key: str) -> int:
        return next(i for i, column in enumerate(self.columns) if column.key == key)

    def cells(self, row: dict[str, Any]) -> list[str]:
        return [column.cell(row) for column in self.columns]
