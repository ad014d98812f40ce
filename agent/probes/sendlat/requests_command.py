"""`aiprobe requests`: requests TCP servers answered, by port, method and status code, with their durations."""

from __future__ import annotations

import contextlib

import click

from ...cli import duration_option, emit_json, friendly_errors, json_option, require_privileges, ticks
from ...formatting import record_table
from .probe import SendLatencyProbe
from .records import Requests
from .requests import RequestsProbe
from .streams import StreamsProbe

FIELDS = ("port", "protocol", "pid", "comm", "method", "status", "count", "p50_seconds", "p99_seconds",
          "request_bytes", "response_bytes")


def rows(records: list[Requests]) -> list[dict[str, object]]:
    """One row per (process, port, protocol, method, status); a port is a name, not a count."""
    ordered = sorted(records, key=lambda r: (r.port, r.protocol, r.pid, r.method, r.status_code))
    return [{**r.to_dict(), "port": str(r.port), "status": r.status_label or "?"} for r in ordered]


@click.command()
@duration_option
@json_option
@friendly_errors
def command(duration: float | None, as_json: bool) -> None:
    """Requests of TCP servers from the wire: status codes, methods and durations (HTTP/1.x, HTTP/2, gRPC)."""
    require_privileges()
    with contextlib.ExitStack() as stack:
        host = stack.enter_context(SendLatencyProbe(per_flow=False))
        stack.enter_context(StreamsProbe(host))
        probe = stack.enter_context(RequestsProbe(host))
        status = probe.status()
        click.echo(f"Counting requests of TCP servers ({status.strategy}: {status.span}); Ctrl-C to end.", err=True)
        for _ in ticks(duration, 0.2):
            pass
        snapshot = probe.read()
    if as_json:
        emit_json(snapshot.to_dict())
        return
    for line in record_table(rows([*snapshot.http, *snapshot.rpc]), FIELDS):
        click.echo(line)
    if snapshot.uncounted_requests:
        click.echo(f"\n{snapshot.uncounted_requests} responses not counted (the request table was full)", err=True)
