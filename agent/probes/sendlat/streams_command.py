"""`aiprobe streams`: stalls of token streams as they happen, then each endpoint's TTFB, gaps and stalls."""

from __future__ import annotations

import contextlib
import time

import click

from ...cli import duration_option, emit_json, friendly_errors, json_option, require_privileges, ticks
from ...formatting import columns_for, record_table, table
from ...loader import ProbeUnavailable
from ...names import endpoint
from ..cuda.probe import STRATEGIES as CUDA_STRATEGIES
from ..cuda.probe import CudaProbe
from .probe import SendLatencyProbe
from .records import CAUSES, StreamEndpoint, StreamStall
from .streams import StreamsProbe

STALL_FIELDS = ("time", "pid", "comm", "local", "remote", "protocol", "stream_id", "chunk", "gap_seconds", "cause")
STALL_COLUMNS = columns_for(STALL_FIELDS, widths={"time": 9, "pid": 7, "comm": 16, "local": 22, "remote": 22,
                                                  "protocol": 8, "stream_id": 9, "chunk": 6, "gap_seconds": 9,
                                                  "cause": 8})
ENDPOINT_FIELDS = ("port", "protocol", "pid", "comm", "streams", "chunks", "ttfb_p50_seconds", "ttfb_p99_seconds",
                   "gap_p50_seconds", "gap_p99_seconds", "stalls")
HANDSHAKE_FIELDS = ("port", "tls_version", "pid", "comm", "count", "p50_seconds", "p99_seconds")


def _stall_row(stall: StreamStall) -> dict[str, object]:
    return {**stall.to_dict(), "time": time.strftime("%H:%M:%S"),
            "local": endpoint(stall.local_address, stall.local_port),
            "remote": endpoint(stall.remote_address, stall.remote_port)}


def stalls_text(stalls: dict[str, int]) -> str:
    """`network 2, cpu 1`: the causes that stalled, in CAUSES order; `-` for none."""
    return ", ".join(f"{cause} {stalls[cause]}" for cause in CAUSES if stalls.get(cause)) or "-"


def endpoint_rows(endpoints: list[StreamEndpoint]) -> list[dict[str, object]]:
    return [{**e.to_dict(), "port": str(e.port), "stalls": stalls_text(e.stalls)}  # a port is a name, not a count
            for e in sorted(endpoints, key=lambda e: (e.port, e.protocol, e.pid))]


def _cuda_syncs(stack: contextlib.ExitStack) -> None:
    """The cuda probe's uprobes alone (no scheduler programs: only syncs are wanted), so stalls spent in
    CUDA synchronizations get cause gpu; without them (the status line says so) none does."""
    with contextlib.suppress(ProbeUnavailable):
        stack.enter_context(CudaProbe(strategies=[s for s in CUDA_STRATEGIES if s.part is None]))


@click.command()
@duration_option
@click.option("--threshold-ms", type=click.FloatRange(min=0, min_open=True), default=250.0, show_default=True,
              help="A gap between two writes of a response longer than this is a stall.")
@json_option
@friendly_errors
def command(duration: float | None, threshold_ms: float, as_json: bool) -> None:
    """Token streams of TCP servers: time to first byte, gaps between chunks, stalls and their cause."""
    require_privileges()
    with contextlib.ExitStack() as stack:
        host = stack.enter_context(SendLatencyProbe(per_flow=False))
        _cuda_syncs(stack)  # first: the streams part, as it starts, finds the synchronization times shared
        probe = stack.enter_context(StreamsProbe(host, stall_threshold_ms=threshold_ms))
        status = probe.status()
        click.echo(f"Tracing responses of TCP servers ({status.strategy}: {status.span}); Ctrl-C to end.", err=True)
        if not as_json:
            click.echo(f"Stalls (gaps over {threshold_ms:g} ms):")
            click.echo(table(STALL_COLUMNS, [])[0])
        for _ in ticks(duration, 0.2):
            for stall in probe.poll(0):
                if not as_json:
                    click.echo(table(STALL_COLUMNS, [_stall_row(stall)])[1])
        snapshot = probe.read()
    if as_json:
        emit_json(snapshot.to_dict())
        return
    click.echo("")
    for line in record_table(endpoint_rows(snapshot.endpoints), ENDPOINT_FIELDS):
        click.echo(line)
    if snapshot.tls_handshakes:
        click.echo("\nTLS handshakes (the client's ClientHello to its Finished, read by the server):")
        handshakes = sorted(snapshot.tls_handshakes, key=lambda h: (h.port, h.tls_version, h.pid))
        for line in record_table(({**h.to_dict(), "port": str(h.port)} for h in handshakes), HANDSHAKE_FIELDS):
            click.echo(line)
    if snapshot.lost_stalls:
        click.echo(f"\n{snapshot.lost_stalls} stall events lost", err=True)
