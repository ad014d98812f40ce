"""`aiprobe gpus`: NVML's view of the GPUs and their processes, once."""

from __future__ import annotations

import time
from typing import Any

import click

from ...cli import AiprobeError, emit_json, json_option
from ...formatting import field, record_table
from ...loader import ProbeUnavailable
from .probe import GPM_SAMPLE_GAP, NvmlProbe
from .records import GpuEvent, GpuInfo, GpuSnapshot

PROCESS_FIELDS = ("gpu_index", "gpu_instance_id", "pid", "comm", "used_memory_bytes", "sm_utilization_ratio",
                  "memory_utilization_ratio")

MEMORY_ERRORS = (("ecc corrected", "ecc_corrected_volatile"), ("uncorrected", "ecc_uncorrected_volatile"),
                 ("remapped rows", "remapped_rows_corrected"), ("uncorrected", "remapped_rows_uncorrected"),
                 ("remap pending", "row_remap_pending"), ("failed", "row_remap_failure"),
                 ("pcie replays", "pcie_replays"))


def _values(gpu: dict[str, Any], *pairs: tuple[str, str]) -> str:
    return "  ".join(f"{name} {field(key, gpu[key])}" for name, key in pairs)


def failure_lines(gpu: GpuInfo) -> list[str]:
    """A GPU's memory error counts, why it has none of some, and whether NVML lost it."""
    lines = [_values(gpu.to_dict(), *MEMORY_ERRORS)]
    if gpu.memory_errors_reason:
        lines.append(f"not counted: {gpu.memory_errors_reason}")
    if gpu.lost:
        lines.append("LOST: NVML answers GPU_IS_LOST (fell off the bus): drain the node, reset or reboot")
    return lines


def event_line(event: GpuEvent) -> str:
    """`GPU 0 xid 31: GPU memory page fault; restart the application (...)`"""
    return (f"GPU {event.gpu_index} {event.event} {'' if event.xid is None else event.xid}: "
            f"{event.meaning}; {event.action or '-'}")


def print_text(snapshot: GpuSnapshot) -> None:
    for g in snapshot.gpus:
        gpu = g.to_dict()
        click.echo(f"GPU {g.index}  {g.name}  {g.uuid}")
        if g.parent_uuid:
            click.echo(f"  MIG instance: GPU instance {g.gpu_instance_id}, compute instance {g.compute_instance_id}")
        if g.utilization_reason:
            click.echo(f"  no utilization: {g.utilization_reason}")
        click.echo("  " + _values(gpu, ("util", "utilization_gpu_ratio"), ("mem-util", "utilization_memory_ratio"),
                                  ("memory", "memory_used_bytes"), ("of", "memory_total_bytes"),
                                  ("power", "power_watts"), ("temp", "temperature_celsius")))
        click.echo("  " + _values(gpu, ("sm clock", "sm_clock_hz"), ("mem clock", "memory_clock_hz"),
                                  ("pcie tx", "pcie_tx_bytes_per_second"), ("rx", "pcie_rx_bytes_per_second"),
                                  ("mode", "compute_mode"), ("clock events", "clock_event_reasons")))
        click.echo("  " + _values(gpu, ("context switches", "context_switches_per_second"),
                                  ("switching", "context_switching_ratio"), ("per switch", "context_switch_seconds")))
        for line in [] if g.parent_uuid else failure_lines(g):  # a MIG instance's are its GPU's
            click.echo("  " + line)
    for event in snapshot.events:
        click.echo(event_line(event))
    click.echo("")
    for line in record_table((process.to_dict() for process in snapshot.processes), PROCESS_FIELDS):
        click.echo(line)


@click.command()
@json_option
def command(as_json: bool) -> None:
    """Print NVML's view of the GPUs and their processes once."""
    probe = NvmlProbe()
    try:
        probe.start()
    except ProbeUnavailable:
        raise AiprobeError(probe.reason) from None
    try:
        snapshot = probe.read()
        if probe.has_gpm:
            time.sleep(GPM_SAMPLE_GAP)
            snapshot = probe.read()
    finally:
        probe.close()
    if as_json:
        emit_json(snapshot.to_dict())
    else:
        print_text(snapshot)
