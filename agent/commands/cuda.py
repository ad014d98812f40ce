"""`aiprobe cuda`: CUDA calls and run-queue delay per process, as a table (or JSON) at exit."""

from __future__ import annotations

import click

from .. import sched
from ..cli import duration_option, emit_json, friendly_errors, json_option, require_privileges, strategy_option, ticks
from ..cuda import LIBRARY_PREFIX, CudaProbe, strategies_with_scheduler
from ..formatting import record_table
from ..model import AttachedLibrary, CudaSnapshot

FIELDS = ("pid", "comm", "context_switches", "kernel_launches", "syncs", "sync_seconds_sum", "sync_p99_seconds",
          "runqueue_delay_p99_seconds", "involuntary_preemptions", "library")


def print_table(snapshot: CudaSnapshot) -> None:
    click.echo(f"scheduler side: {snapshot.sched_strategy or 'unavailable'}")
    for line in record_table((process.to_dict() for process in snapshot.processes), FIELDS):
        click.echo(line)


def _announce(library: AttachedLibrary) -> None:
    outcome = f"error: {library.error}" if library.error else f"{len(library.symbols)} entry points"
    click.echo(f"aiprobe cuda: probing {library.path} via {library.host_path} ({outcome})", err=True)


@click.command()
@duration_option
@strategy_option(sched.SPEC, "the scheduler side's chain (the uprobes have no alternative)")
@json_option
@friendly_errors
def command(duration: float | None, strategy: str | None, as_json: bool) -> None:
    """CUDA context switches, kernel launches, syncs and run-queue delay per process."""
    require_privileges()
    with CudaProbe(on_attach=_announce, strategies=strategies_with_scheduler(strategy)) as probe:
        click.echo(f"aiprobe cuda: watching for processes that map {LIBRARY_PREFIX}* "
                   f"(scheduler side: {probe.sched_strategy or 'unavailable'})", err=True)
        for _ in ticks(duration, 1.0):
            pass
        snapshot = probe.read()
    if as_json:
        emit_json(snapshot.to_dict())
    else:
        print_table(snapshot)
