"""NVIDIA GPUs through NVML (pynvml): utilization, memory, power, processes."""

from __future__ import annotations

from .loader import Strategy
from .probes import ProbeSpec


def nvml_unavailable() -> str | None:
    """Why NVML cannot be used here, or None."""
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return f"NVML unavailable: {exc}"
    pynvml.nvmlShutdown()
    return None


SPEC = ProbeSpec(
    name="nvml",
    description="GPU utilization, memory, power, clocks and processes from NVML",
    strategies=(Strategy("nvml", span="NVML samples"),),
    requirement=nvml_unavailable,
)
