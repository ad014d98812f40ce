"""The cuda probe and its scheduler side in `aiprobe top`: their columns of the process table."""

from __future__ import annotations

from ...formatting import Column

PROCESS_COLUMNS = (
    Column("THR CTX", "cuda_context_switches_per_second", 8),  # a thread changing its context
    Column("LAUNCH", "cuda_kernel_launches_per_second", 8),
    Column("GRAPHS", "cuda_graph_launches_per_second", 8),
    Column("1ST LAUNCH", "cuda_time_to_first_launch_seconds", 10),  # cold start, recent processes
)
SCHED_PROCESS_COLUMNS = (Column("RUNQ p99", "runqueue_delay_p99_seconds", 9),)
