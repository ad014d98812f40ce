"""The cuda probe's bottleneck rules (and its scheduler side's): what each means, its PromQL and
its default thresholds (`[rules.<name>]` overrides them)."""

from __future__ import annotations

from ...config import RuleConfig
from ...rules import RuleSpec, added_in_window, p99

CUDA_CONTEXT_SWITCH_STORM = RuleSpec(
    False, "{target} switches CUDA contexts {value:.0f} times/s: context-switch overhead",
    "sum by (instance, process, container) (rate(aiprobe_cuda_context_switches_total[1m]))",
    "{{ $labels.process }} switches CUDA contexts more than %(threshold)s times/s",
    "CUDA context-switch overhead.",
    name="cuda_context_switch_storm",
    # CUDA context switches per second in one process
    default=RuleConfig(threshold=1000.0, clear=500.0, for_seconds=10, severity="warning"),
)


GPU_TIME_SLICED = RuleSpec(
    False, "{target} is time-sliced between {value:.0f} busy CUDA contexts: each switch saves and restores "
    "the GPU's state (merge the work into one context or process, or use MPS)",
    "aiprobe_gpu_active_contexts",
    "GPU {{ $labels.gpu }} is time-sliced between {{ $value }} busy CUDA contexts",
    "Each switch between contexts saves and restores the GPU's state: merge the work into one context or "
    "process, or use MPS.",
    name="gpu_time_sliced",
    # CUDA contexts that launched work on one GPU in the last refresh (2 or more: time-sliced)
    default=RuleConfig(threshold=1.5, clear=1.5, for_seconds=30, severity="warning"),
)


GPU_THREADS_STARVED = RuleSpec(
    False, "GPU-driving threads of {target} wait {value:.3g}s (p99) for a CPU: the GPU is starved by the host",
    p99("aiprobe_gpu_thread_runqueue_delay_seconds"),
    "GPU-driving threads of {{ $labels.process }} wait for a CPU",
    "Run-queue delay p99 of GPU-driving threads is high: the GPU is starved by the host.",
    name="gpu_threads_starved",
    # p99 run-queue delay of GPU-driving threads, seconds
    default=RuleConfig(threshold=0.005, clear=0.002, for_seconds=10, severity="critical"),
)


# Out-of-memory failures of a process in the rule file's window, less those retried.
OUT_OF_MEMORY_SELECTOR = '{error="CUDA_ERROR_OUT_OF_MEMORY"}'
CUDA_OUT_OF_MEMORY = RuleSpec(
    False, "{target} failed {value:.0f} CUDA allocation(s) for good: out of GPU memory (not retried; the evidence "
    "names the process, the bytes asked and the retries)",
    "sum by (instance, process, container) (\n  "
    + added_in_window(f"aiprobe_cuda_memory_allocation_failures_total{OUT_OF_MEMORY_SELECTOR}")
    + "\n  - " + added_in_window(f"aiprobe_cuda_memory_allocation_retried_total{OUT_OF_MEMORY_SELECTOR}") + "\n)",
    "{{ $labels.process }} fails CUDA allocations for good: out of GPU memory",
    "CUDA allocations returned CUDA_ERROR_OUT_OF_MEMORY and were not retried with success within a second: the "
    "process's work fails (lower its batch size or memory fraction, or give it a GPU of its own).",
    name="cuda_out_of_memory",
    # CUDA_ERROR_OUT_OF_MEMORY failures of one process not retried with success, in the window; held longer
    # than the 1 s a retry may take
    default=RuleConfig(threshold=0, clear=0, for_seconds=2, severity="critical"),
)
