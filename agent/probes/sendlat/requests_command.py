"""`aiprobe requests`: requests TCP servers answered, by port, method and status code, with their durations;
then the HTTP/1.x requests the host sent, by server, method and status code."""

from __future__ import annotations

import contextlib

import click

from ...cli import duration_option, emit_json, friendly_errors, json_option, require_privileges, ticks
from ...formatting import record_table
from ...names import endpoint
from .probe import SendLatencyProbe
from .records import ClientRequests, Requests, RpcRequests
from .requests import RequestsProbe
from .streams import StreamsProbe

FIELDS = ("port", "protocol", "pid", "comm", "method", "status", "count", "p50_seconds", "p99_seconds",
          "request_bytes", "response_bytes")
CLIENT_FIELDS = ("server", "pid", "comm", "method", "status", "count", "ttfb_p50_seconds", "p50_seconds",
                 "p99_seconds")


def _status(record: Requests) -> str:
    """The status column: HTTP's (`?`: not readable); a gRPC call's grpc-status after it."""
    status = record.status_label or "?"
    if isinstance(record, RpcRequests):
        status += f" grpc {record.grpc_status_label or '?'}"
    return status


def rows(records: list[Requests]) -> list[dict[str, object]]:
    """One row per (process, port, protocol, method, status); a port is a name, not a count."""
    ordered = sorted(records, key=lambda r: (r.port, r.protocol, r.pid, r.method, r.status_code, _status(r)))
    return [{**r.to_dict(), "port": str(r.port), "status": _status(r)} for r in ordered]


def client_rows(records: list[ClientRequests]) -> list[dict[str, object]]:
    """One row per (process, server, method, status)."""
    ordered = sorted(records, key=lambda r: (r.server_address, r.server_port, r.pid, r.method, r.status_code))
    return [{**r.to_dict(), "server": endpoint(r.server_address, r.server_port), "status": r.status_label or "?"}
            for r in ordered]


@click.command()
@duration_option
@json_option
@friendly_errors
def command(duration: float | None, as_json: bool) -> None:
    """Requests of TCP servers from the wire: status codes, methods and durations (HTTP/1.x, HTTP/2, gRPC);
    then the HTTP/1.x requests the host sent on connections it opened."""
    require_privileges()
    with contextlib.ExitStack() as stack:
        host = stack.enter_context(SendLatencyProbe(per_flow=False))
        stack.enter_context(StreamsProbe(host))
        probe = stack.enter_context(RequestsProbe(host))
        status = probe.status()
        click.echo(f"Counting requests of TCP servers and requests sent ({status.strategy}: {status.span}); "
                   "Ctrl-C to end.", err=True)
        for _ in ticks(duration, 0.2):
            pass
        snapshot = probe.read()
    if as_json:
        emit_json(snapshot.to_dict())
        return
    for line in record_table(rows([*snapshot.http, *snapshot.rpc]), FIELDS):
        click.echo(line)
    if snapshot.clients:
        click.echo("\nRequests sent:")
        for line in record_table(client_rows(snapshot.clients), CLIENT_FIELDS):
            click.echo(line)
    if snapshot.uncounted_requests:
        click.echo(f"\n{snapshot.uncounted_requests} responses not counted (the request table was full)", err=True)
    if snapshot.uncounted_client_requests:
        click.echo(f"\n{snapshot.uncounted_client_requests} requests sent not counted (the client table was full)",
                   err=True)
