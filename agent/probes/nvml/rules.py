"""The GPUs' bottleneck rules: what each means, its PromQL and its default thresholds
(`[rules.<name>]` overrides them)."""

from __future__ import annotations

from ...config import RuleConfig
from ...rules import RuleSpec

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
