"""CUDA driver uprobes: context switches, kernel launches, synchronizations (bpf/cuda.bpf.c)."""

from .loader import Strategy
from .probes import ProbeSpec

SPEC = ProbeSpec(
    name="cuda",
    description="CUDA driver calls per process: context switches, launches, syncs",
    strategies=(Strategy("uprobe", features=("uprobe",), span="libcuda.so.1 entry points"),),
)
