"""The cuda probe's keys of the config file (docs/config.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...config import Settings, limits
from .discovery import DRIVER_ROOTS, LIBRARY_DIRECTORIES


@dataclass(frozen=True)
class CudaSettings(Settings):
    # Of one CPU, for the kernel-launch uprobes; past it, they are duty-cycled.
    cuda_cpu_budget: float = field(default=0.01, metadata=limits(0.0, 64.0))
    # Host paths whose CUDA libraries are probed at start, before a process maps them (discovery.py):
    # roots with the loader's cache and the NVIDIA container toolkit's directories, and more directories.
    cuda_driver_roots: tuple[str, ...] = DRIVER_ROOTS
    cuda_library_dirs: tuple[str, ...] = LIBRARY_DIRECTORIES
