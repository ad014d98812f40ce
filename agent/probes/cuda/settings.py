"""The cuda probe's keys of the config file (docs/config.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...config import Settings, limits


@dataclass(frozen=True)
class CudaSettings(Settings):
    # Of one CPU, for the kernel-launch uprobes; past it, they are duty-cycled.
    cuda_cpu_budget: float = field(default=0.01, metadata=limits(0.0, 64.0))
