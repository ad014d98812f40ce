"""aiprobe: eBPF observability for AI-inference hosts (network, host CPU, GPU)."""

__version__ = "0.1.0"
