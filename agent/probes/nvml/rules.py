"""The GPUs' bottleneck rules: what each means, its PromQL and its default thresholds
(`[rules.<name>]` overrides them)."""

from __future__ import annotations

from ...config import RuleConfig
from ...rules import PROCESS, RuleSpec, added_in_window, histogram_quantile
from ..cuda.rules import OUT_OF_MEMORY_SELECTOR

GPU_SATURATED = RuleSpec(
    False, "{target} is {value:.0%} busy: the GPU is the bottleneck",
    "aiprobe_gpu_utilization_ratio", "GPU {{ $labels.gpu }} is saturated", "The GPU is the bottleneck.",
    name="gpu_saturated",
    # GPU utilization ratio
    default=RuleConfig(threshold=0.95, clear=0.85, for_seconds=60, severity="info"),
)


GPU_IDLE_WITH_TRAFFIC = RuleSpec(
    True, "{target} is only {value:.0%} busy while the endpoint receives traffic: "
    "the bottleneck is on the host side (CPU, scheduling, batching, network)",
    "aiprobe_gpu_utilization_ratio", "GPU {{ $labels.gpu }} is idle while the endpoint receives traffic",
    "The bottleneck is on the host side: CPU, scheduling, batching or network.",
    guard="and on (instance) (sum by (instance) (rate(aiprobe_interface_bytes_total{direction=\"ingress\"}[1m]))"
          " > %(traffic_floor)s)",
    name="gpu_idle_with_traffic",
    # GPU utilization ratio below which a GPU counts as idle while the endpoint has traffic (bytes/s)
    default=RuleConfig(threshold=0.10, clear=0.25, for_seconds=30, severity="warning"),
)


GPU_CONTEXT_SWITCH_OVERHEAD = RuleSpec(
    False, "{target} spends {value:.0%} of its time switching contexts (its busiest graphics engine): "
    "time-slicing overhead (fewer contexts per GPU, merge the work into one process, or use MPS)",
    "max by (instance, gpu, uuid) (aiprobe_gpu_context_switching_ratio)",
    "GPU {{ $labels.gpu }} spends more than %(threshold_percent)s of its time switching contexts",
    "The GPU saves and restores contexts' state instead of running kernels: fewer contexts per GPU, "
    "merge the work into one context or process, or use MPS.",
    name="gpu_context_switch_overhead",
    # fraction of time the GPU's busiest graphics engine spends switching contexts (GPM)
    default=RuleConfig(threshold=0.05, clear=0.03, for_seconds=30, severity="warning"),
)



# A smaller move of two processes' shares (of the GPU's time) is not contention.
MIN_SHARE_SHIFT = 0.1
_LAST, _BEFORE = "[5m]", "[5m] offset 5m"  # the rule file's windows (the agent's: 10 s each)


def _share(window: str) -> str:
    """Each process's mean share of its GPU (or MIG instance) over a window, in PromQL."""
    return ("sum by (instance, gpu, GPU_I_ID, GPU_CI_ID, process, container) "
            f"(avg_over_time(aiprobe_gpu_process_sm_utilization_ratio{window}))")


def _shifted(fell: str, rose: str) -> str:
    return f"{_share(rose)}\n  - {_share(fell)} > {MIN_SHARE_SHIFT}"


def _growth(histogram: str, figure: str) -> str:
    """How many times a histogram's p99 of the last window is the window's before, per process, labelled
    `figure`, in PromQL."""
    last, before = (histogram_quantile(0.99, histogram, PROCESS, window) for window in (_LAST, _BEFORE))
    return f'label_replace(\n    {last}\n    / {before},\n    "figure", "{figure}", "", "")'


GPU_CONTENDED = RuleSpec(
    False, "token streams of {target} slowed {value:.1f}x while another process took its share of the GPU "
    "(the evidence names both, their shares and the stream figures)",
    "max by (instance, process, container) (\n  " + _growth("aiprobe_stream_chunk_gap_seconds", "chunk_gap")
    + "\n  or\n  " + _growth("aiprobe_stream_ttfb_seconds", "ttfb") + "\n)",
    "token streams of {{ $labels.process }} slow down while another process takes its share of the GPU",
    "On one GPU, the process's share fell while another's rose, and its token streams' gaps between writes or "
    "time to first byte grew in the same window: the other process's work delays its responses (separate them: "
    "another GPU, MIG, or priorities).",
    # its share fell, and on its GPU (or MIG instance) another's rose
    guard=f"and on (instance, process, container) (\n  {_shifted(fell=_LAST, rose=_BEFORE)}\n"
          f"  and on (instance, gpu, GPU_I_ID, GPU_CI_ID)\n  {_shifted(fell=_BEFORE, rose=_LAST)}\n)",
    name="gpu_contended",
    # how many times the p99 gap between a stream's writes, or its time to first byte, grew from one window
    # to the next while the process's GPU share fell and another's rose
    default=RuleConfig(threshold=1.5, clear=1.2, for_seconds=0, severity="warning"),
)


# New Xids in the rule file's window (the agent's: the last 10 s).
GPU_XID_ERROR = RuleSpec(
    False, "{target}: {value:.0f} new Xid error(s) (the evidence names its meaning, NVIDIA's action and the "
    "GPU's processes)",
    "sum by (instance, gpu, uuid, GPU_I_ID, GPU_CI_ID, xid) (\n  " + added_in_window("aiprobe_gpu_xid_errors_total")
    + "\n)",
    "GPU {{ $labels.gpu }} reported Xid {{ $labels.xid }}",
    "NVML reported a critical Xid error: the agent's evidence (or `aiprobe top`'s GPU events) names its meaning and "
    "NVIDIA's recommended action (13, 31, 43: restart the application; 48, 63, 64, 74, 79, 94, 95, 119: act on "
    "the GPU or the node).",
    name="gpu_xid_error",
    # Xid errors of one Xid on one GPU (or MIG instance) in the window
    default=RuleConfig(threshold=0, clear=0, for_seconds=0, severity="warning"),
)


GPU_LOST = RuleSpec(
    False, "{target} is lost: NVML answers GPU_IS_LOST (it fell off the bus: drain the node, reset or reboot)",
    "max by (instance, gpu, uuid) (aiprobe_gpu_lost)",
    "{{ if $labels.gpu }}GPU {{ $labels.gpu }} is lost{{ else }}NVML counts fewer GPUs than in the last hour{{ end }}",
    "The GPU fell off the bus (Xid 79): its work fails until the node is drained and the GPU reset or the node "
    "rebooted; check its power, PCIe link and cooling.",
    # a GPU the agent no longer sees at all (after its restart): NVML counts fewer than in the last hour
    guard="or on (instance) (max by (instance) (max_over_time(aiprobe_gpus[1h]) - aiprobe_gpus) > 0)",
    name="gpu_lost",
    # 1 while NVML answers GPU_IS_LOST for the GPU
    default=RuleConfig(threshold=0.5, clear=0.5, for_seconds=0, severity="critical"),
)


GPU_MEMORY_ERRORS = RuleSpec(
    False, "{target} has uncorrected memory errors or a failed row remapping (value {value:.0f}): drain its work and "
    "reset it; a failed remapping: replace the GPU",
    "max by (instance, gpu, uuid) (\n  aiprobe_gpu_ecc_errors_total{error=\"uncorrected\"}\n"
    "  or aiprobe_gpu_row_remap_failed\n)",
    "GPU {{ $labels.gpu }} has uncorrected memory errors or a failed row remapping",
    "Uncorrected ECC errors since the driver loaded corrupt the work on the GPU: drain it and reset the GPU (the "
    "reset also applies pending row remappings). A failed row remapping left no spare row: replace the GPU.",
    name="gpu_memory_errors",
    # the larger of the uncorrected ECC errors since the driver loaded and the row-remap failure flag (0/1)
    default=RuleConfig(threshold=0, clear=0, for_seconds=0, severity="critical"),
)


# The processes on a GPU (or MIG instance) whose CUDA allocations ran out of memory in the rule file's window,
# retried or not: allocation failures are counted per process, joined to the GPUs NVML lists each process on.
_FAILING_ON_GPU = (
    "aiprobe_gpu_process_memory_used_bytes\n  and on (instance, process, container) (\n"
    "    sum by (instance, process, container) (\n      "
    + added_in_window(f"aiprobe_cuda_memory_allocation_failures_total{OUT_OF_MEMORY_SELECTOR}") + "\n    ) > 0\n  )")
GPU_MEMORY_PRESSURE = RuleSpec(
    False, "{target} has {value:.0%} of its memory in use while CUDA allocations of its processes run out of memory "
    "(the evidence names its processes, their memory, failures and retries)",
    "max by (instance, gpu, uuid, GPU_I_ID) (aiprobe_gpu_memory_used_bytes / aiprobe_gpu_memory_total_bytes)",
    "GPU {{ $labels.gpu }} has more than %(threshold_percent)s of its memory in use while CUDA allocations on it "
    "fail",
    "The GPU's memory is nearly full and its processes' CUDA allocations return CUDA_ERROR_OUT_OF_MEMORY (retried "
    "after a caching allocator freed its cache, or failed for good): fragmentation or too many processes or models "
    "on one GPU (lower memory fractions or batch sizes, or move a process to another GPU).",
    guard=f"and on (instance, gpu, GPU_I_ID) (\n  {_FAILING_ON_GPU}\n)",
    name="gpu_memory_pressure",
    # a GPU's (or MIG instance's) memory used over its total, while CUDA allocations of its processes ran out of
    # memory in the window (retried or not)
    default=RuleConfig(threshold=0.9, clear=0.85, for_seconds=0, severity="warning"),
)
