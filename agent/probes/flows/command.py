"""`aiprobe flows`: the flows probe's records, live, as a table (or one JSON document at exit)."""

from __future__ import annotations

import sys

import click

from ...cli import (
    duration_option,
    emit_json,
    friendly_errors,
    interval_option,
    json_option,
    require_privileges,
    strategy_option,
    ticks,
)
from ...formatting import table
from .probe import SPEC, FlowsProbe
from .records import FlowsSnapshot
from .view import VIEW

TOP_ROWS = 20


def render_table(snapshot: FlowsSnapshot, rows: int = TOP_ROWS) -> str:
    """The flows view of `aiprobe top` over this probe's flows (no process join here)."""
    view = VIEW
    lines = table(view.columns, view.rows({"flows": [flow.to_dict() for flow in snapshot.flows[:rows]]}))
    lines.append(
        f"{len(snapshot.flows)} flows · evictions {snapshot.evictions} · insert failures {snapshot.insert_failures}"
        f" · malformed frames {snapshot.malformed_frames}"
        + (f" · LOST frames {snapshot.lost_frames}" if snapshot.lost_frames else "")
    )
    return "\n".join(lines)


def _globs(_ctx: click.Context, _param: click.Parameter, value: str | None) -> list[str]:
    return [glob for glob in (value or "").replace(",", " ").split() if glob]


def _announce(probe: FlowsProbe) -> None:
    attachments = probe.attachments()
    where = "; ".join(a.describe() for a in attachments) or "no matching interface yet, watching for new ones"
    click.echo(f"aiprobe flows: attached ({probe.strategy}): {where}", err=True)


@click.command()
@click.option("--interfaces", callback=_globs, metavar="GLOBS",
              help="Interfaces to watch, comma-separated globs (default: every interface but loopback).")
@click.option("--exclude", callback=_globs, metavar="GLOBS", help="Interfaces to leave alone, comma-separated globs.")
@click.option("--xdp-interfaces", "xdp_interfaces", callback=_globs, metavar="GLOBS",
              help="Count ingress with native XDP on these physical NICs instead of tc (cheaper per frame; "
                   "attaching resets the receive queues on many drivers). Refused on virtual devices.")
@duration_option
@interval_option
@strategy_option(SPEC)
@json_option
@friendly_errors
def command(interfaces: list[str], exclude: list[str], xdp_interfaces: list[str], duration: float | None,
            interval: float, strategy: str | None, as_json: bool) -> None:
    """Wire packets and bytes per network flow, per direction, live (tc ingress and egress)."""
    require_privileges()
    with FlowsProbe(interfaces, exclude, strategy=strategy, xdp_interfaces=xdp_interfaces) as probe:
        _announce(probe)
        clear = "\033[H\033[J" if sys.stdout.isatty() else ""
        for _ in ticks(duration, interval):
            snapshot = probe.read()
            if not as_json:
                click.echo(clear + render_table(snapshot) + ("" if clear else "\n"))
        if as_json:
            emit_json(probe.read().to_dict())
