"""`aiprobe connections`: the host's listening sockets, their accept queues, overflows and accept
waits, live as a table (or one JSON document at exit)."""

from __future__ import annotations

import sys
from collections.abc import Callable

import click

from ...cli import duration_option, emit_json, friendly_errors, interval_option, json_option, strategy_option, ticks
from ...formatting import table
from ...registry import strategies_named
from .probe import SPEC, ConnectionsProbe
from .records import ConnectionsSnapshot
from .view import VIEW


def render_table(snapshot: ConnectionsSnapshot) -> str:
    """The listeners view of `aiprobe top` over this probe's listeners (no container join here)."""
    lines = table(VIEW.columns, VIEW.rows({"listeners": [listener.to_dict() for listener in snapshot.listeners]}))
    lines.append(f"{len(snapshot.listeners)} listeners"
                 + (f" · overflows at listeners closed or not yet read {snapshot.unattributed_overflows}"
                    if snapshot.unattributed_overflows else ""))
    return "\n".join(lines)


def _announce(probe: ConnectionsProbe) -> None:
    why_not = "; ".join(f"{name}: {reason}" for name, reason in probe.skipped.items())
    click.echo(f"aiprobe connections: {probe.strategy}" + (f" ({why_not})" if why_not else ""), err=True)


def _screen(as_json: bool) -> Callable[[ConnectionsSnapshot], None]:
    """What each read shows: the table (on a terminal, in place), or nothing until the JSON at exit."""
    if as_json:
        return lambda _snapshot: None
    clear = "\033[H\033[J" if sys.stdout.isatty() else ""
    return lambda snapshot: click.echo(clear + render_table(snapshot) + ("" if clear else "\n"))


@click.command()
@duration_option
@interval_option
@strategy_option(SPEC)
@json_option
@friendly_errors
def command(duration: float | None, interval: float, strategy: str | None, as_json: bool) -> None:
    """Listening TCP sockets: accept queue length and capacity, half-open requests, overflows and accept
    wait per listener, live. Without root only the queues (sock_diag), and only owners it may see."""
    with ConnectionsProbe(strategies_named(SPEC, strategy)) as probe:
        _announce(probe)
        show = _screen(as_json)
        snapshot = probe.read()
        show(snapshot)
        for _ in ticks(duration, interval):
            snapshot = probe.read()
            show(snapshot)
        if as_json:
            emit_json(snapshot.to_dict())
