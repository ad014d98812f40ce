"""Failed CUDA allocations per process (bpf/cuda.bpf.c, maps `alloc_failures` and `alloc_pending`):
counted by CUDA error at the return of the driver's allocation entry points, with the bytes they
asked for. A failure followed within ALLOC_RETRY_WINDOW_SECONDS by a success of the same size in the
same process was retried (as PyTorch's caching allocator does after freeing its cache); the others
failed for good."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ...loader import Map
from ...refresh import Refresh
from .records import AllocationFailures

# The driver's allocation entry points: the size asked for is the second argument of each but
# cuMemAllocPitch_v2 (width x height).
ALLOCATION_SYMBOLS = ("cuMemAlloc_v2", "cuMemAllocAsync", "cuMemAllocManaged", "cuMemCreate")
PITCH_ALLOCATION_SYMBOL = "cuMemAllocPitch_v2"
ALLOCATION_ENTRY_POINTS = (*ALLOCATION_SYMBOLS, PITCH_ALLOCATION_SYMBOL)

ALLOC_RETRY_WINDOW_SECONDS = 1.0  # bpf/cuda.h, ALLOC_RETRY_WINDOW_NS
# Waiting failures older than this failed for good: their entries go (map `alloc_pending` stays
# bounded). Far past the window, so that no retry is judged while its entry goes.
PENDING_EXPIRY_NS = int(10 * ALLOC_RETRY_WINDOW_SECONDS * 1e9)

# CUresult names (cuda.h) an allocation may return; any other code is "other" (a bounded label).
CUDA_ERRORS = {
    1: "CUDA_ERROR_INVALID_VALUE",
    2: "CUDA_ERROR_OUT_OF_MEMORY",
    3: "CUDA_ERROR_NOT_INITIALIZED",
    4: "CUDA_ERROR_DEINITIALIZED",
    46: "CUDA_ERROR_DEVICE_UNAVAILABLE",
    100: "CUDA_ERROR_NO_DEVICE",
    101: "CUDA_ERROR_INVALID_DEVICE",
    201: "CUDA_ERROR_INVALID_CONTEXT",
    214: "CUDA_ERROR_ECC_UNCORRECTABLE",
    400: "CUDA_ERROR_INVALID_HANDLE",
    700: "CUDA_ERROR_ILLEGAL_ADDRESS",
    719: "CUDA_ERROR_LAUNCH_FAILED",
    801: "CUDA_ERROR_NOT_SUPPORTED",
    802: "CUDA_ERROR_SYSTEM_NOT_READY",
    999: "CUDA_ERROR_UNKNOWN",
}
OUT_OF_MEMORY = CUDA_ERRORS[2]


def error_name(code: int) -> str:
    return CUDA_ERRORS.get(code, "other")


def allocation_failures(items: Iterable[tuple[Any, Any]], comms: dict[int, str],
                        starts: dict[int, int]) -> list[AllocationFailures]:
    """One record per process and error name from map `alloc_failures`' entries (codes outside the
    table are summed as "other")."""
    records: dict[tuple[int, str], AllocationFailures] = {}
    for key, value in items:
        pid, error = key.tgid, error_name(key.error)
        record = records.get((pid, error))
        if record is None:
            record = records[pid, error] = AllocationFailures(pid, comms.get(pid, ""), error, 0, 0, 0,
                                                              starts.get(pid, 0))
        record.failures += value.failures
        record.failed_bytes += value.bytes
        record.retried += value.retried
    return sorted(records.values(), key=lambda r: (r.pid, r.error))


def expire_pending(pending: Map) -> None:
    """Delete the waiting failures whose time for a retry is long over."""
    now = time.monotonic_ns()
    pending.delete_keys(key for key, value in pending.items() if now - value.last_ns > PENDING_EXPIRY_NS)


@dataclass(frozen=True)
class RecentFailures:
    """A process's out-of-memory failures, and those retried, in the last SIGNAL_WINDOW_SECONDS."""

    record: AllocationFailures
    failures: float
    retried: float

    @property
    def final(self) -> float:
        return self.failures - self.retried


def recent_out_of_memory(failures: list[AllocationFailures], kind: str, refresh: Refresh,
                         now: float) -> list[RecentFailures]:
    """The out-of-memory failures of each process in the rules' window (`kind` names the rule's own)."""
    recent = []
    for failed in failures:
        if failed.error == OUT_OF_MEMORY:
            added, retried = refresh.recent((kind, failed.identity()), [failed.failures, failed.retried], now)
            recent.append(RecentFailures(failed, added, retried))
    return recent
