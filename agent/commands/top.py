"""`aiprobe top`: processes, flows, token streams, GPUs and alerts of this host on one screen, with
htop's keys.

The screen renders docs/snapshot.md documents (top_views says which fields, formatting in which
units); top_source fetches them from a running agent or from the probes loaded in-process."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import click
from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.screen import ModalScreen
from textual.widgets import DataTable, Input, Static

from ..cli import AiprobeError, friendly_errors, interval_option, ticks
from ..formatting import View
from ..top_source import DEFAULT_URL, Credentials, SnapshotError, SnapshotSource, normalize_url, open_source
from ..top_views import header_lines, probe_notices, text_report, views, visible_rows

# Signals that end top like `q` does: terminal restored first, then the probes closed.
EXIT_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


def _arrow(descending: bool) -> str:
    return "▼" if descending else "▲"


@dataclass
class ViewState:
    """What the user chose for one view: sort column, order and filter."""

    sort_key: str
    descending: bool
    query: str = ""


class HelpScreen(ModalScreen[None]):
    """The key list, built from the app's bindings; any of escape, ?, q closes it."""

    BINDINGS = [Binding("escape,question_mark,q", "dismiss", "Close")]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > Static { width: 52; height: auto; border: round $accent; padding: 0 1; background: $surface; }
    """

    def __init__(self, keys: list[tuple[str, str]]) -> None:
        super().__init__()
        self.keys = keys

    def compose(self) -> ComposeResult:
        lines = [f"{key:>9}  {description}" for key, description in self.keys]
        yield Static("aiprobe top: keys\n\n" + "\n".join(lines) + "\n\nEsc closes this help.")


class TopApp(App[None]):
    """The interactive screen. `fetch` returns the next snapshot (blocking: it runs in a thread)."""

    TITLE = "aiprobe top"
    CSS = """
    Static { text-wrap: nowrap; text-overflow: ellipsis; }
    #header { height: 2; background: $primary-background; }
    #tabs { height: 1; }
    #notice { height: auto; max-height: 5; color: $warning; }
    #table { height: 1fr; }
    #filter { height: 1; border: none; padding: 0 1; display: none; }
    #status { height: 1; background: $primary-background; }
    """
    # Each view's key, as it declares it (a probe's views come from the registry).
    BINDINGS = [
        *(Binding(view.key, f"view('{name}')", f"{view.title} view") for name, view in views().items() if view.key),
        Binding("s", "reverse_sort", "reverse sort order"),
        Binding("less_than_sign", "sort_column(-1)", "sort by the column to the left", key_display="<"),
        Binding("greater_than_sign", "sort_column(1)", "sort by the column to the right", key_display=">"),
        # priority: runs before the keys typed right after it are routed, so they land in the filter box
        Binding("slash", "filter", "filter rows (Enter keeps, Esc clears)", key_display="/", priority=True),
        Binding("space", "pause", "pause / resume updates", key_display="space"),
        Binding("question_mark", "help", "this help", key_display="?"),
        Binding("q,ctrl+c", "quit", "quit", key_display="q"),
    ]

    def __init__(self, fetch: Callable[[], dict[str, Any]], source: str, interval: float) -> None:
        super().__init__()
        self.fetch = fetch
        self.source = source
        self.interval = interval
        self.snapshot: dict[str, Any] = {}
        self.view: View = views()["processes"]
        self.states = {name: ViewState(view.sort_key, view.descending) for name, view in views().items()}
        self.paused = False
        self.error = ""
        self.updated: float | None = None
        self._fetching = False
        self._row_ids: list[tuple[Any, ...]] = []  # identities of the rows on screen, in order

    @property
    def state(self) -> ViewState:
        return self.states[self.view.name]

    def compose(self) -> ComposeResult:
        yield Static(id="header")
        yield Static(id="tabs")
        yield Static(id="notice")
        yield DataTable(id="table", cursor_type="row", zebra_stripes=True)
        yield Input(id="filter", placeholder="filter: text in any column")
        yield Static(id="status")

    def on_mount(self) -> None:
        loop = asyncio.get_running_loop()
        for signum in EXIT_SIGNALS:
            loop.add_signal_handler(signum, self.exit)
        self.set_interval(self.interval, self.poll)
        self.call_later(self.poll)
        self.render_all()

    def on_unmount(self) -> None:
        loop = asyncio.get_running_loop()
        for signum in EXIT_SIGNALS:
            loop.remove_signal_handler(signum)

    async def poll(self) -> None:
        """Fetch one snapshot unless paused or a fetch is still running; a failed fetch keeps the last one."""
        if self.paused or self._fetching:
            return
        self._fetching = True
        try:
            self.snapshot = await asyncio.to_thread(self.fetch)
            self.error, self.updated = "", time.time()
        except SnapshotError as exc:
            self.error = str(exc)
        finally:
            self._fetching = False
        self.render_all()

    # --- rendering ---------------------------------------------------------------------------

    def render_all(self) -> None:
        header = "\n".join(header_lines(self.snapshot)) if self.snapshot else f"waiting for {self.source}…"
        self.query_one("#header", Static).update(Text(header, no_wrap=True, overflow="ellipsis"))
        self.render_tabs()
        self.render_table()
        self.render_status()

    def render_tabs(self) -> None:
        after = Text()
        # What the user just typed first: a narrow terminal cuts the sort order before the filter.
        if self.state.query:
            after.append(f"  filter “{self.state.query}”", style="bold")
        if self.paused:
            after.append("  PAUSED", style="bold reverse")
        column = self.view.columns[self.view.column_index(self.state.sort_key)]
        after.append(f"  sort {column.title} {_arrow(self.state.descending)}")
        tabs = self._tabs(titled=True)
        if tabs.cell_len + after.cell_len > self.size.width:
            tabs = self._tabs(titled=False)  # the other views by their keys, as many as fit
        self.query_one("#tabs", Static).update(tabs + after)

    def _tabs(self, titled: bool) -> Text:
        """The views, the current one by its title; the others by their titles too, or by their keys."""
        tabs = Text()
        for name, view in views().items():
            current = name == self.view.name
            tabs.append(f" {view.title if titled or current else view.key} ", style="reverse bold" if current else "")
        return tabs

    def render_table(self) -> None:
        view, state = self.view, self.state
        rows = visible_rows(view, self.snapshot, state.sort_key, state.descending, state.query)
        notices = probe_notices(view, self.snapshot)
        if not rows and self.snapshot and not notices:
            notices = [f"no {view.title.lower()} to show" + (" (filter)" if state.query else "")]
        notice = self.query_one("#notice", Static)
        notice.update(Text("\n".join(notices), no_wrap=True, overflow="ellipsis"))
        notice.display = bool(notices)
        table = self.query_one("#table", DataTable)
        cursor, scroll = table.cursor_row, (table.scroll_x, table.scroll_y)
        # As in htop, the cursor stays on the same process (flow, GPU, alert) when a refresh re-sorts.
        selected = self._row_ids[cursor] if 0 <= cursor < len(self._row_ids) else None
        self._row_ids = [view.row_id(row) for row in rows]
        table.clear(columns=True)
        for column in view.columns:
            title = column.title + (_arrow(state.descending) if column.key == state.sort_key else "")
            table.add_column(Text(title, justify=column.justify), width=column.width)
        for row in rows:
            table.add_row(*(
                Text(cell, justify=column.justify, no_wrap=True, overflow="ellipsis")
                for column, cell in zip(view.columns, view.cells(row), strict=True)
            ))
        if rows:
            index = self._row_ids.index(selected) if selected in self._row_ids else min(cursor, len(rows) - 1)
            table.move_cursor(row=index, animate=False, scroll=False)
        # clear() scrolls home; a refresh must not undo the user's scrolling
        self.call_after_refresh(table.scroll_to, *scroll, animate=False)

    def render_status(self) -> None:
        status = Text(f" {self.source}", no_wrap=True, overflow="ellipsis")
        if self.updated is not None:
            status.append(f" · {time.strftime('%H:%M:%S', time.localtime(self.updated))}")
        if self.error:
            status.append(f" · {self.error}", style="bold red")
        status.append("   ? help  q quit", style="dim")
        self.query_one("#status", Static).update(status)

    # --- actions -----------------------------------------------------------------------------

    def action_view(self, name: str) -> None:
        self.view = views()[name]
        self.render_all()

    def action_reverse_sort(self) -> None:
        self.state.descending = not self.state.descending
        self.render_all()

    def action_sort_column(self, step: int) -> None:
        columns = self.view.columns
        index = (self.view.column_index(self.state.sort_key) + step) % len(columns)
        self.state.sort_key = columns[index].key
        self.state.descending = columns[index].numeric  # numbers biggest first, names A to Z
        self.render_all()

    def action_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.value = self.state.query
        box.display = True
        # focus now, not at the next idle (Widget.focus): keys typed right after / belong to the filter
        self.screen.set_focus(box)

    def on_input_changed(self, event: Input.Changed) -> None:
        self.state.query = event.value
        self.render_all()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self._close_filter()

    def key_escape(self) -> None:
        box = self.query_one("#filter", Input)
        if box.display:
            box.value = ""  # Input.Changed clears the filter
            self._close_filter()

    def _close_filter(self) -> None:
        self.query_one("#filter", Input).display = False
        self.screen.set_focus(self.query_one("#table", DataTable))

    def action_pause(self) -> None:
        self.paused = not self.paused
        self.render_all()

    def action_help(self) -> None:
        keys = [(binding.key_display or binding.key, binding.description) for binding in self.BINDINGS
                if isinstance(binding, Binding)]
        self.push_screen(HelpScreen(keys))


def run_batch(source: SnapshotSource, interval: float, iterations: int | None, as_json: bool) -> None:
    """`top -b`: one snapshot per interval to stdout (JSON lines or text), `iterations` times."""
    for done, _elapsed in enumerate(ticks(None, interval), start=1):
        try:
            snapshot = source.snapshot()
        except SnapshotError as exc:
            raise AiprobeError(f"{source.label}: {exc}") from None
        sys.stdout.write((json.dumps(snapshot) if as_json else text_report(snapshot) + "\n") + "\n")
        sys.stdout.flush()
        if done == iterations:
            return


def _agent_url(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    try:
        return normalize_url(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _globs(value: str | None) -> list[str] | None:
    return [glob.strip() for glob in value.split(",") if glob.strip()] if value else None


@click.command()
@click.option(
    "--connect", metavar="URL", default=DEFAULT_URL, show_default=True, callback=_agent_url,
    help="Agent to read snapshots from. When it does not answer and no other agent runs here, "
    "top loads the probes itself.",
)
@interval_option
@click.option(
    "--interfaces", metavar="GLOBS", default=None,
    help="Comma-separated interface globs the in-process flows probe watches (default: all but lo).",
)
@click.option("--batch", is_flag=True, help="Print snapshots to stdout instead of the interactive screen.")
@click.option("--iterations", type=click.IntRange(min=1), default=None, metavar="N",
              help="With --batch: stop after N snapshots (default: until Ctrl-C).")
@click.option("--json", "as_json", is_flag=True, help="With --batch: one JSON snapshot per line.")
@click.option("--cacert", type=click.Path(exists=True, dir_okay=False), metavar="PATH",
              help="CA certificate that signed an https agent's certificate (default: the system's CAs).")
@click.option("--user", metavar="USER", help="Basic auth user; the password comes from $AIPROBE_PASSWORD.")
@friendly_errors
def command(connect: str, interval: float, interfaces: str | None, batch: bool, iterations: int | None,
            as_json: bool, cacert: str | None, user: str | None) -> None:
    """Processes, flows, GPUs and bottleneck alerts on one screen (keys like htop; ? for help)."""
    if not batch and (iterations or as_json):
        raise click.UsageError("--iterations and --json need --batch")
    # The password stays off the command line, which every user on the host can read.
    credentials = Credentials(cacert, user, os.environ.get("AIPROBE_PASSWORD", ""))
    source = open_source(connect, _globs(interfaces), interval, credentials)
    try:
        if batch:
            run_batch(source, interval, iterations, as_json)
        else:
            TopApp(source.snapshot, source.label, interval).run()
    finally:
        source.close()
