"""The nvml probe in `aiprobe top`: its columns of the process table and the GPUs view."""

from __future__ import annotations

import time
from typing import Any

from ...formatting import Column, View, age

PROCESS_COLUMNS = (
    Column("GPU", "gpu_utilization_ratio", 5),
    Column("GPU MEM", "gpu_memory_used_bytes", 9),
)


def _gpus(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    return list(snapshot.get("gpus") or [])


VIEW = View(
    "gpus", "GPUs",
    (
        Column("GPU", "index", 3, text=str),
        Column("NAME", "name", 16, numeric=False),
        Column("UTIL", "utilization_gpu_ratio", 5),
        Column("MEM%", "utilization_memory_ratio", 5),
        Column("MEM USED", "memory_used_bytes", 9),
        Column("MEM TOTAL", "memory_total_bytes", 9),
        Column("POWER", "power_watts", 8),
        Column("TEMP", "temperature_celsius", 6),
        Column("SM CLK", "sm_clock_hz", 9),
        Column("MEM CLK", "memory_clock_hz", 9),
        Column("THROTTLE", "clock_event_reasons", 20, numeric=False),
        Column("CUDA CTXS", "cuda_active_contexts", 9),  # 2+: time-sliced between contexts
        # The GPU's own measure of that time-slicing (GPM): its switches, and its busiest engine's share.
        Column("CTX SW", "context_switches_per_second", 8),
        Column("SWITCHING", "context_switching_ratio", 9),
        Column("MIG", "mig_profile", 8, numeric=False),  # a MIG instance's profile (GPU: its GPU's index)
        Column("XID", "last_xid", 4, text=str),  # its last Xid error; the events view has their meaning
        Column("LOST", "lost", 4, numeric=False, text=lambda lost: "LOST" if lost else "-"),
    ),
    "index", False, ("nvml",), _gpus,
    identity=("uuid",), key="g",
)


def _events(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    return list(snapshot.get("gpu_events") or [])


EVENTS_VIEW = View(
    "gpu_events", "GPU events",
    (
        Column("AGE", "time", 7, text=lambda at: age(time.time() - at)),
        Column("GPU", "gpu_index", 3, text=str),
        Column("MIG", "mig_profile", 8, numeric=False),
        Column("EVENT", "event", 14, numeric=False),
        Column("XID", "xid", 4, text=str),
        Column("MEANING", "meaning", 36, numeric=False),
        Column("ACTION", "action", 50, numeric=False),
    ),
    "time", True, ("nvml",), _events,
    identity=("time", "uuid", "event"), key="x",
)
