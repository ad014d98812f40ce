"""Cumulative histograms as (le_seconds, count) buckets: from the kernel's log-linear slots, to documents,
and their quantiles. (Windows of recent changes: aiprobe.deltas.Window.)"""

from __future__ import annotations

import bisect
import ctypes
import functools
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np

from .loader import object_btf

Buckets = Sequence[tuple[float, float]]  # cumulative (upper bound in seconds, count), ascending
# A `struct hist`'s slots: a map value's ctypes array (read in place), an array, or a list (tests).
Slots = Sequence[int] | ctypes.Array[Any] | np.ndarray[Any, np.dtype[np.uint64]]
# A histogram's cumulative counts at NATIVE_BOUNDS: a row of its refresh's Histograms, shared by all its records.
NativeCounts = np.ndarray[Any, np.dtype[np.uint64]]
CountsRow = np.ndarray[Any, np.dtype[np.uint64]]  # a histogram's cumulative counts, in numpy
NS_PER_SECOND = 1e9


# The kernel's log-linear histogram (`struct hist`, bpf/hist.h): durations in units of 2^-14 ms;
# slot i < 32 holds units [i, i + 1), slot 16 * s + m (16 <= m < 32) holds [m * 2^s, (m + 1) * 2^s),
# the last slot everything above. Every m * 2^k ms with m < 32 is an edge. The decoding below takes the
# number of slots from the slots it is given; hist_slots() says how many the kernel has.
HIST_SUB = 16
UNITS_PER_MS = 2 ** 14


@functools.cache
def hist_slots() -> int:
    """How many slots a kernel histogram has (HIST_SLOTS): read from `struct hist` in the sendlat
    object's BTF (every object has the one from bpf/hist.h), as aiprobe.loader reads C constants."""
    return object_btf("sendlat").array_length("hist", "slots")


def _slot_upper_units(index: int) -> int:
    if index < 2 * HIST_SUB:
        return index + 1
    shift, mantissa = divmod(index, HIST_SUB)
    return (mantissa + HIST_SUB + 1) << (shift - 1)


def slot_of_nanoseconds(nanoseconds: int, slots: int) -> int:
    """The slot of `slots` a duration falls in, as bpf/hist.h files one: the histogram of a value
    user space reads (a connection's RTT) or counts (a request) decodes like the kernel's."""
    units = nanoseconds * UNITS_PER_MS // 1_000_000
    if units < 2 * HIST_SUB:
        return min(units, slots - 1)
    top = units.bit_length() - 1  # units lie in [2^top, 2^(top + 1)): 16 slots of 2^(top - 4) each
    return min(HIST_SUB * (top - 3) + (units >> (top - 4)) - HIST_SUB, slots - 1)


def _units_to_seconds(units: int) -> float:
    return units / UNITS_PER_MS / 1000  # two exact-as-possible divisions: 50 ms reads 0.05


# The `le` bounds exported (Prometheus, JSON): 3 per power of two, 7.8 us to 32.8 s. Each is a kernel
# edge (so its count is exact), among them the shipped rules' thresholds 2, 5, 20 and 50 ms.
_EXPORTED_UNITS = tuple(sorted({m << s for s in range(3, 25) for m in (16, 20, 25)} | {16 << 25}))
EXPORTED_BOUNDS = tuple(_units_to_seconds(u) for u in _EXPORTED_UNITS)


# Native histograms (schema 3: bucket k is (2^((k-1)/8), 2^(k/8)] seconds, 9% wide) over the exported
# range: each boundary in force is the kernel edge nearest it (within 3%: the kernel has 16 slots per
# doubling), so a native bucket holds the kernel slots between two such edges, exact at the kernel's
# resolution. (Prometheus reads the bucket as the schema's: a count lies within 3% of where it says.)
NATIVE_SCHEMA = 3


def _nearest_edge_units(seconds: float) -> int:
    units = seconds * 1000 * UNITS_PER_MS
    step = 1 << max(0, int(math.log2(units)) - 4)  # [2^t, 2^(t+1)) has 16 slots of 2^(t-4) units
    return max(1, round(units / step)) * step


_NATIVE_UNITS = tuple(sorted({*(_nearest_edge_units(2 ** (k / (1 << NATIVE_SCHEMA)))
                                for k in range(math.ceil(math.log2(EXPORTED_BOUNDS[0]) * (1 << NATIVE_SCHEMA)),
                                               math.floor(math.log2(EXPORTED_BOUNDS[-1]) * (1 << NATIVE_SCHEMA)) + 1)),
                              _EXPORTED_UNITS[-1]}))  # and the overflow slot's lower edge, 32.8 s
NATIVE_BOUNDS = (*(_units_to_seconds(u) for u in _NATIVE_UNITS), math.inf)  # the layout of CumulativeBuckets.native


def _ms_bounds(*milliseconds: float) -> tuple[float, ...]:
    return tuple(_units_to_seconds(round(ms * UNITS_PER_MS)) for ms in milliseconds)


# What /metrics shows of each family (at most 20 series per label set, as Beyla's 15 duration bounds):
# edges among EXPORTED_BOUNDS, so every count stays exact, and the shipped rules' thresholds among them.
# Sends, waits for a GPU or a CPU, RTTs: microseconds to a second, a bound per doubling.
FAST_BOUNDS = _ms_bounds(0.015625, 0.03125, 0.0625, 0.125, 0.25, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 512, 1024)
# Requests and first bytes: Beyla's bounds, each moved to the nearest edge (75 ms: 80, 250 ms: 256, ...).
REQUEST_BOUNDS = _ms_bounds(1, 2, 5, 10, 25, 50, 80, 100, 256, 512, 800, 1024, 2560, 5120, 10240)
# Whole streams: tens of milliseconds to the last edge, 32.8 s.
STREAM_BOUNDS = _ms_bounds(10, 25, 50, 100, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


def nearest_exported(bound: float) -> float:
    """The edge of EXPORTED_BOUNDS nearest `bound` (seconds) by ratio: where a configured bound goes."""
    return min(EXPORTED_BOUNDS, key=lambda edge: abs(math.log(edge / bound)))


@functools.cache
def bucket_indices(bounds: tuple[float, ...]) -> tuple[int, ...]:
    """Where each of `bounds` (among EXPORTED_BOUNDS) sits in exported_buckets()' list."""
    return tuple(EXPORTED_BOUNDS.index(bound) for bound in bounds)


@functools.cache
def _upper_bounds(slots: int) -> tuple[float, ...]:
    """The upper bound (seconds) of each of `slots` slots, the last one +Inf."""
    return (*(_units_to_seconds(_slot_upper_units(i)) for i in range(slots - 1)), math.inf)


@functools.cache
def _slot_by_upper(slots: int) -> dict[int, int]:
    """The slot whose upper bound is `units`, of the first `slots` - 1 (the last one has none)."""
    return {_slot_upper_units(i): i for i in range(slots - 1)}


class CumulativeBuckets(Sequence[tuple[float, float]]):
    """Cumulative (le_seconds, count) buckets, the last le +Inf, kept as two sequences: the bounds
    (shared by every histogram of one layout) and the counts. A bucket's tuple is made only when asked
    for: quantiles bisect the counts, the exporter and the rules' windows take the counts whole, so
    neither the kernel's 433 slots nor the 68 exported buckets of every histogram of every entry become
    tuples at each read."""

    __slots__ = ("_counts", "array", "bounds", "native")

    def __init__(self, bounds: Sequence[float], counts: Sequence[float] | None, native: NativeCounts | None = None,
                 array: CountsRow | None = None) -> None:
        self.bounds = bounds
        self._counts = counts
        self.native = native  # exported buckets: the cumulative counts at NATIVE_BOUNDS' edges
        # The counts as a row of their Histograms' matrix: tables of them stack in C, and where `counts` is
        # None they become a list only when asked for (most records of a refresh are never asked).
        self.array = array

    @property
    def counts(self) -> Sequence[float]:
        if self._counts is None:
            assert self.array is not None  # one or the other, from the constructor
            self._counts = self.array.tolist()
        return self._counts

    def __len__(self) -> int:
        return len(self.counts)

    @overload
    def __getitem__(self, index: int) -> tuple[float, float]: ...

    @overload
    def __getitem__(self, index: slice) -> list[tuple[float, float]]: ...

    def __getitem__(self, index: int | slice) -> tuple[float, float] | list[tuple[float, float]]:
        if isinstance(index, slice):
            return list(zip(self.bounds[index], self.counts[index], strict=True))
        return self.bounds[index], self.counts[index]

    def __iter__(self) -> Iterator[tuple[float, float]]:
        return zip(self.bounds, self.counts, strict=True)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]  # as a list's: it compares by its buckets

    def __repr__(self) -> str:
        return repr(list(self))


def counts_of(buckets: Buckets) -> Sequence[float]:
    """The cumulative counts of `buckets`, in their order."""
    return buckets.counts if isinstance(buckets, CumulativeBuckets) else [count for _, count in buckets]


def counts_table(histograms: Sequence[Buckets]) -> np.ndarray[Any, np.dtype[np.float64]]:
    """The cumulative counts of histograms of one layout, a row each of a float matrix: their arrays
    stacked where they have them (a refresh's thousands), their counts converted where not."""
    rows = [buckets.array if isinstance(buckets, CumulativeBuckets) and buckets.array is not None
            else counts_of(buckets) for buckets in histograms]
    return np.array(rows, np.float64).reshape(len(rows), -1)


def bounds_of(buckets: Buckets) -> Sequence[float]:
    """The upper bounds of `buckets`, in their order."""
    return buckets.bounds if isinstance(buckets, CumulativeBuckets) else tuple(le for le, _ in buckets)


def with_counts(buckets: Buckets, counts: Sequence[float]) -> CumulativeBuckets:
    """Buckets with the bounds of `buckets` and other cumulative `counts` (a window's)."""
    return CumulativeBuckets(bounds_of(buckets), counts)


class KernelBuckets(CumulativeBuckets):
    """kernel_buckets(): full resolution, its counts also kept as the array exported_buckets() picks from."""

    __slots__ = ()
    array: CountsRow

    def __init__(self, cumulative: CountsRow) -> None:
        super().__init__(_upper_bounds(len(cumulative)), cumulative.tolist(), array=cumulative)


def kernel_buckets(slots: Slots) -> KernelBuckets:
    """The cumulative buckets of a `struct hist`'s slots, full resolution, for quantiles (also of a prefix
    of the slots, as tests write them). Summed in C: 433 slots per histogram, several per entry and refresh."""
    return KernelBuckets(np.asarray(slots, dtype=np.uint64).cumsum())


def exported_buckets(fine: KernelBuckets) -> CumulativeBuckets:
    """The bounded set of buckets shown to users (EXPORTED_BOUNDS and +Inf) from kernel_buckets():
    exact counts, since each bound is a kernel edge (Histograms picks them, for one here)."""
    return Histograms(fine.array[np.newaxis])._exported()[0]


_EXPORTED_AND_INF = (*EXPORTED_BOUNDS, math.inf)


@dataclass(frozen=True, slots=True)
class Summary:
    """What a record keeps of a kernel histogram: its exported buckets and its quantiles."""

    buckets: CumulativeBuckets
    p50: float | None
    p99: float | None


class Histograms:
    """Many kernel histograms of one layout at once (one per entry of a map: 1k stream endpoints are 4k
    histograms a refresh): summed, picked and their quantiles worked out for all of them in a few numpy
    calls, where kernel_buckets, exported_buckets and quantile take tens of microseconds per histogram."""

    __slots__ = ("cumulative",)

    def __init__(self, cumulative: np.ndarray[Any, np.dtype[np.uint64 | np.float64]]) -> None:
        self.cumulative = cumulative  # (histograms, slots): each one's cumulative counts (a window's: floats)

    @classmethod
    def of(cls, rows: Sequence[Any]) -> Histograms:
        """The histograms of these `struct hist` slots: buffers of uint64 of one length (map values' ctypes
        arrays, read in place; numpy arrays)."""
        if not rows:
            return cls(np.zeros((0, hist_slots()), dtype=np.uint64))
        return cls(np.stack([np.frombuffer(row, dtype=np.uint64) for row in rows]).cumsum(axis=1))

    @classmethod
    def of_field(cls, values: np.ndarray[Any, np.dtype[np.uint8]], value_type: Any, name: str,
                 entries: Sequence[int]) -> Histograms:
        """The histograms of `struct hist` field `name` of these entries of map values (field_slots)."""
        return cls(field_slots(values, value_type, name, entries).cumsum(axis=1))

    def summaries(self) -> list[Summary]:
        """Each one's exported_buckets() and quantile()s at 0.5 and 0.99."""
        return list(map(Summary, self._exported(), self.quantiles(0.5), self.quantiles(0.99)))

    def _exported(self) -> list[CumulativeBuckets]:
        """Each one's exported_buckets(): nothing observed in one, no_observations() stands for it (gaps of
        one-chunk streams, handshakes)."""
        slots = self.cumulative.shape[1]
        shown = self.cumulative[:, _slots_at(slots, _EXPORTED_UNITS)]
        native = self.cumulative[:, _slots_at(slots, _NATIVE_UNITS)]
        empty = no_observations()
        return [CumulativeBuckets(_EXPORTED_AND_INF, None, native_counts, row) if total else empty
                for total, native_counts, row in zip(shown[:, -1].tolist(), native, shown, strict=True)]

    def quantiles(self, q: float, bounds_of_counts: Sequence[float] | None = None) -> list[float | None]:
        """quantile() of each: the same arithmetic, on every histogram at once. The counts are the kernel's
        slots', or those of buckets with other upper bounds (`bounds_of_counts`: a window's exported buckets)."""
        cumulative = self.cumulative
        rows, slots = cumulative.shape
        bounds = np.array(_upper_bounds(slots) if bounds_of_counts is None else bounds_of_counts)
        total = cumulative[:, -1].astype(np.float64)
        rank = q * total
        index = np.minimum((cumulative < rank[:, None]).sum(axis=1), slots - 1)
        first, every = index == 0, np.arange(rows)
        previous = np.maximum(index - 1, 0)
        count = cumulative[every, index].astype(np.float64)
        previous_count = np.where(first, 0.0, cumulative[every, previous].astype(np.float64))
        previous_le = np.where(first, 0.0, bounds[previous])
        le = np.where(np.isinf(bounds[index]), previous_le, bounds[index])  # the open bucket: its lower bound
        in_bucket = count - previous_count
        fraction = np.divide(rank - previous_count, in_bucket, out=np.ones(rows), where=in_bucket != 0)
        values = previous_le + (le - previous_le) * fraction
        observed = total > 0
        return [value if seen else None for value, seen in zip(values.tolist(), observed.tolist(), strict=True)]

    def summed(self, groups: Sequence[Sequence[int]]) -> Histograms:
        """Each group's histograms (their indexes) added up: cumulative counts add up as the slots do."""
        if not groups:
            return Histograms(self.cumulative[:0])
        members = np.fromiter(itertools.chain.from_iterable(groups), dtype=np.intp)
        starts = np.cumsum([0, *(len(group) for group in groups[:-1])])
        return Histograms(np.add.reduceat(self.cumulative[members], starts, axis=0))


SUMMARIES_AT_ONCE = 1024  # 10k processes' slots summed at once would be 70 MB of temporaries


def summaries_of(rows: Sequence[Any]) -> list[Summary]:
    """Histograms.of(rows).summaries(), SUMMARIES_AT_ONCE histograms at a time."""
    return [summary for start in range(0, len(rows), SUMMARIES_AT_ONCE)
            for summary in Histograms.of(rows[start:start + SUMMARIES_AT_ONCE]).summaries()]


def field_slots(values: np.ndarray[Any, np.dtype[np.uint8]], value_type: Any, name: str,
                entries: Sequence[int]) -> np.ndarray[Any, np.dtype[np.uint64]]:
    """The slots of `struct hist` field `name` of these `entries` (indexes) of map values of BTF type `value_type`
    (an (entries, value size) byte array, aiprobe.loader.MapTable.rows()), one row each: no Python object per entry."""
    hist = dict(value_type._fields_)[name]
    start = getattr(value_type, name).offset + hist.slots.offset
    return values[np.asarray(entries, dtype=np.intp), start:start + hist.slots.size].view(np.uint64)


def field_summaries(values: np.ndarray[Any, np.dtype[np.uint8]], value_type: Any, entries: Sequence[int],
                    *fields: str) -> list[tuple[Summary, ...]]:
    """Each of these entries' summaries of these `struct hist` fields (field_slots), a field of all of them at once."""
    by_field = [Histograms.of_field(values, value_type, name, entries).summaries() for name in fields]
    return list(zip(*by_field, strict=True))


@functools.cache
def _slots_at(slots: int, edges: tuple[int, ...]) -> np.ndarray[Any, np.dtype[np.intp]]:
    """The indexes of the counts at `edges` (kernel edges, in units) and +Inf among `slots` kernel
    slots' counts: picked in one call."""
    slot_by_upper = _slot_by_upper(slots)
    return np.array([*(slot_by_upper[units] for units in edges), slots - 1], dtype=np.intp)


@functools.cache
def no_observations() -> CumulativeBuckets:
    """exported_buckets() of a histogram that holds nothing yet (a listener nothing reached)."""
    nothing = np.zeros(len(NATIVE_BOUNDS), dtype=np.uint64)
    return CumulativeBuckets(_EXPORTED_AND_INF, (0,) * len(_EXPORTED_AND_INF), nothing,
                             np.zeros(len(_EXPORTED_AND_INF), dtype=np.uint64))


def buckets_to_json(buckets: Buckets) -> list[dict[str, Any]]:
    """[{"le_seconds", "count"}], with the open bucket's bound written "+Inf" as Prometheus does."""
    return [{"le_seconds": "+Inf" if math.isinf(le) else le, "count": count} for le, count in buckets]


def quantile(buckets: Buckets, q: float) -> float | None:
    """The q-quantile, interpolated linearly inside its bucket as Prometheus' histogram_quantile
    does (the first bucket starts at 0). None without observations. The bucket is found by
    bisection over the counts: a kernel histogram has 433 (four per endpoint and refresh)."""
    counts = counts_of(buckets)
    total = counts[-1] if counts else 0
    if total <= 0:
        return None
    rank = q * total
    index = min(bisect.bisect_left(counts, rank), len(counts) - 1)
    le, count = buckets[index]
    previous_le, previous_count = buckets[index - 1] if index else (0.0, 0.0)
    if math.isinf(le):
        return previous_le
    in_bucket = count - previous_count
    fraction = (rank - previous_count) / in_bucket if in_bucket else 1.0
    return previous_le + (le - previous_le) * fraction
