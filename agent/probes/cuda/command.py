"""`aiprobe cuda`: CUDA calls and run-queue delay per process, contexts and the GPUs they share, cold
start; as tables (or JSON) at exit."""

from __future__ import annotations

import dataclasses
from typing import Any

import click

from ...cli import duration_option, emit_json, friendly_errors, json_option, require_privileges, strategy_option, ticks
from ...formatting import Column, columns_for, table
from ...names import printable
from . import sched
from .probe import LIBRARY_PREFIX, CudaProbe, strategies_with_scheduler
from .records import AttachedLibrary, CudaSnapshot

FIELDS = ("pid", "comm", "kernel_launches", "estimated_launches", "graph_launches", "counted_at", "runtime",
          "context_switches", "syncs", "sync_seconds_sum", "sync_p99_seconds", "runqueue_delay_p99_seconds",
          "involuntary_preemptions", "library")
# The per-thread counter, titled for what it counts (not GPU time-slicing: see the GPU table).
TITLES = {"context_switches": "THREAD CTX CHANGES"}
CONTEXT_FIELDS = ("gpu", "pid", "comm", "context", "device", "kernel_launches", "graph_launches",
                  "launches_per_second")
COLD_START_FIELDS = ("pid", "comm", "to_init_seconds", "init_seconds", "context_create_seconds", "module_loads",
                     "module_load_seconds", "to_first_launch_seconds")


def _titled(columns: tuple[Column, ...]) -> tuple[Column, ...]:
    return tuple(dataclasses.replace(c, title=TITLES[c.key], width=max(c.width, len(TITLES[c.key])))
                 if c.key in TITLES else c for c in columns)


def _table(rows: list[dict[str, Any]], keys: tuple[str, ...]) -> list[str]:
    return table(_titled(columns_for(keys, rows)), rows)


def print_table(snapshot: CudaSnapshot) -> None:
    click.echo(f"scheduler side: {snapshot.sched_strategy or 'unavailable'}")
    if snapshot.launch_duty_cycle < 1:
        click.echo(f"CPU budget: kernel-launch probes attached {snapshot.launch_duty_cycle:.0%} of the time; "
                   "kernel_launches include estimated_launches")
    processes = [process.to_dict() for process in snapshot.processes]
    for row in processes:
        row["library"] = printable(row["library"])
    for line in _table(processes, FIELDS):
        click.echo(line)
    cold = [{"pid": p.pid, "comm": p.comm, **p.cold_start.to_dict()} for p in snapshot.processes if p.cold_start]
    if cold:
        click.echo("\ncold start of processes started while watching (seconds):")
        for line in _table(cold, COLD_START_FIELDS):
            click.echo(line)
    if snapshot.contexts:
        click.echo("\ncontexts that launched work:")
        for line in _table([context.to_dict() for context in snapshot.contexts], CONTEXT_FIELDS):
            click.echo(line)
    for gpu in snapshot.gpus:
        click.echo(f"gpu {gpu.gpu}: {gpu.active_contexts} active context(s) of pid(s) "
                   f"{', '.join(map(str, gpu.pids))} in the last interval")


def _announce(library: AttachedLibrary) -> None:
    outcome = f"error: {library.error}" if library.error else f"{len(library.symbols)} entry points"
    if library.missing:
        outcome += f"; lacks {', '.join(library.missing)}: their failures go unseen"
    how = "mapped by a process" if library.found == "process" else f"installed, found at start in {library.found}"
    click.echo(f"aiprobe cuda: probing {library.kind} {printable(library.path)} via "
               f"{printable(library.host_path)}, {how} ({outcome})", err=True)


@click.command()
@duration_option
@strategy_option(sched.PART, "the scheduler side's chain (the uprobes have no alternative)")
@click.option("--cpu-budget", type=click.FloatRange(0, 64), default=0.0, show_default=True,
              help="Fraction of one CPU the kernel-launch uprobes may cost; past it they are duty-cycled and "
                   "launch counts estimated (0: count every launch).")
@json_option
@friendly_errors
def command(duration: float | None, strategy: str | None, cpu_budget: float, as_json: bool) -> None:
    """CUDA launches, graph launches, syncs, context changes, cold start and run-queue delay per process."""
    require_privileges()
    with CudaProbe(on_attach=_announce, strategies=strategies_with_scheduler(strategy),
                   cpu_budget=cpu_budget or None) as probe:
        click.echo(f"aiprobe cuda: watching for processes that map {LIBRARY_PREFIX}* or libcudart* "
                   f"(scheduler side: {probe.sched_strategy or 'unavailable'})", err=True)
        for _ in ticks(duration, 1.0):
            pass
        snapshot = probe.read()
    if as_json:
        emit_json(snapshot.to_dict())
    else:
        print_table(snapshot)
