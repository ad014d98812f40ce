"""Cumulative histograms as (le_seconds, count) buckets: from the kernel's log2 slots, to documents,
and their quantiles. (Windows of recent changes: aiprobe.deltas.Window.)"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

Buckets = Sequence[tuple[float, float]]  # cumulative (upper bound in seconds, count), ascending
NS_PER_SECOND = 1e9


def log2_buckets(slots: Sequence[int]) -> list[tuple[float, int]]:
    """Cumulative (le_seconds, count) buckets from the log2 nanosecond slots of `struct hist`
    (bpf/common.h): slot i holds [2^i, 2^(i+1)) ns, the last is open-ended (le = +Inf). Always every
    slot, so the exporter and the alert windows see fixed bounds."""
    buckets, total = [], 0
    for index, count in enumerate(slots):
        total += count
        upper = math.inf if index == len(slots) - 1 else 2 ** (index + 1) / NS_PER_SECOND
        buckets.append((upper, total))
    return buckets


def buckets_to_json(buckets: Buckets) -> list[dict[str, Any]]:
    """[{"le_seconds", "count"}], with the open bucket's bound written "+Inf" as Prometheus does."""
    return [{"le_seconds": "+Inf" if math.isinf(le) else le, "count": count} for le, count in buckets]


def quantile(buckets: Buckets, q: float) -> float | None:
    """The q-quantile, interpolated inside its bucket as Prometheus' histogram_quantile does
    (log2 buckets: a bucket's lower bound is half its upper bound). None without observations."""
    total = buckets[-1][1] if buckets else 0
    if total <= 0:
        return None
    rank = q * total
    previous_le, previous_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return previous_le
            lower = previous_le if previous_le else le / 2
            in_bucket = count - previous_count
            fraction = (rank - previous_count) / in_bucket if in_bucket else 1.0
            return lower + (le - lower) * fraction
        previous_le, previous_count = le, count
    return previous_le
