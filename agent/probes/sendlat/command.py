"""`aiprobe sendlat`: slow sends as they happen, then each process's latency histogram (like bcc's tools)."""

from __future__ import annotations

import time

import click
import psutil

from ...cli import (
    AiprobeError,
    duration_option,
    emit_json,
    friendly_errors,
    json_option,
    require_privileges,
    strategy_option,
    ticks,
)
from ...formatting import bucket_histogram, columns_for, field, table
from ...names import endpoint
from ...registry import strategies_named
from .probe import SPEC, SendLatencyProbe
from .records import ProcessSendLatency, SlowSend

SLOW_FIELDS = ("time", "pid", "comm", "local", "remote", "bytes", "duration_seconds")
SLOW_COLUMNS = columns_for(SLOW_FIELDS, widths={"time": 9, "pid": 7, "comm": 16, "local": 24, "remote": 24,
                                                "bytes": 9, "duration_seconds": 9})


def _slow_send_row(send: SlowSend) -> dict[str, object]:
    return {**send.to_dict(), "time": time.strftime("%H:%M:%S"),
            "local": endpoint(send.local_address, send.local_port),
            "remote": endpoint(send.remote_address, send.remote_port)}


def _print_histogram(process: ProcessSendLatency) -> None:
    failed = "".join(f", {count} failed ({error})" for error, count in process.errors.items())
    click.echo(
        f"\npid {process.pid} ({process.comm}) cgroup {process.cgroup_id}: {process.count} sends{failed}, "
        f"{process.bytes} bytes, p50 {field('p50_seconds', process.p50_seconds)}, "
        f"p99 {field('p99_seconds', process.p99_seconds)}"
    )
    for line in bucket_histogram(process.histogram):
        click.echo(line)
    if process.unwritable_count:
        click.echo(f"sockets unwritable {process.unwritable_count} times, "
                   f"{field('unwritable_sum_seconds', process.unwritable_sum_seconds)} in all, "
                   f"p99 {field('unwritable_p99_seconds', process.unwritable_p99_seconds)}")


@click.command()
@duration_option
@click.option("--pid", type=click.IntRange(min=1), default=None, help="Only this process (its pid / tgid).")
@click.option(
    "--threshold-ms", type=click.FloatRange(min=0), default=10.0, show_default=True,
    help="Print each send slower than this as it happens.",
)
@strategy_option(SPEC)
@json_option
@friendly_errors
def command(duration: float | None, pid: int | None, threshold_ms: float, strategy: str | None, as_json: bool) -> None:
    """TCP send latency per process, and each slow send as it happens (like bcc's tools)."""
    require_privileges()
    if pid is not None and not psutil.pid_exists(pid):
        raise AiprobeError(f"no process with pid {pid}")
    with SendLatencyProbe(threshold_ms=threshold_ms, pid=pid, strategies=strategies_named(SPEC, strategy)) as probe:
        # Status on stderr (stdout is the data): also tells a caller that the probe is attached.
        status = probe.status()
        click.echo(f"Tracing TCP sends ({status.strategy}: {status.span}); Ctrl-C to end.", err=True)
        if not as_json:
            click.echo(f"Sends slower than {threshold_ms:g} ms:")
            click.echo(table(SLOW_COLUMNS, [])[0])
        for _ in ticks(duration, 0.2):
            for send in probe.poll(0):
                if not as_json:
                    click.echo(table(SLOW_COLUMNS, [_slow_send_row(send)])[1])
        snapshot = probe.read()
    if as_json:
        emit_json(snapshot.to_dict())
        return
    for process in sorted(snapshot.processes, key=lambda p: (p.pid, p.cgroup_id)):
        _print_histogram(process)
    if snapshot.lost_events:
        click.echo(f"\n{snapshot.lost_events} slow-send events lost", err=True)
