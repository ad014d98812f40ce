"""`aiprobe` command line. Probe subcommands live in their probe modules and load lazily, so
`aiprobe --help` and `aiprobe check` import nothing they don't use."""

from __future__ import annotations

import importlib
import json
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import click

from . import __version__

# subcommand -> "module:attribute"; each probe module owns its command.
SUBCOMMANDS = {
    "check": "aiprobe.check:command",
    "flows": "aiprobe.flows:command",
    "top": "aiprobe.top:command",
    "agent": "aiprobe.daemon:command",
    "sendlat": "aiprobe.sendlat:command",
    "cuda": "aiprobe.cuda:command",
    "gpus": "aiprobe.nvml:command",
}


class AiprobeError(click.ClickException):
    """A user-facing failure: printed as one line `aiprobe: <message>`, exit 1 (no traceback)."""

    def show(self, file: Any = None) -> None:
        click.echo(f"aiprobe: {self.format_message()}", err=True)


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *SUBCOMMANDS})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in SUBCOMMANDS:
            module, attribute = SUBCOMMANDS[name].split(":")
            return getattr(importlib.import_module(module), attribute)
        return super().get_command(ctx, name)


_stop = threading.Event()


def _stop_on_signals() -> None:
    """SIGTERM and Ctrl-C ask the running loop (`ticks`) to end at its next wait instead of raising
    wherever the program happens to be: every `with` block then detaches its programs, --json output
    is still printed, and the exit status is 0. A second signal interrupts at once."""

    def handler(_signum: int, _frame: object) -> None:
        if _stop.is_set():
            raise KeyboardInterrupt
        _stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, handler)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="aiprobe")
def main() -> None:
    """eBPF observability for AI-inference hosts: is the network, the host CPU or the GPU to blame?"""
    _stop_on_signals()


# --- pieces shared by the probe subcommands (bcc-tool style: --duration, --json) ---

json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON document at exit.")
duration_option = click.option(
    "--duration", type=click.FloatRange(min=0, min_open=True), default=None, metavar="SECONDS",
    help="Stop after this many seconds (default: run until Ctrl-C).",
)
interval_option = click.option(
    "--interval", type=click.FloatRange(min=0.1), default=1.0, show_default=True, metavar="SECONDS",
    help="Refresh interval.",
)


def require_privileges() -> None:
    """Exit 1 with one line when aiprobe lacks the privileges to load BPF programs."""
    from .system import prepare_mounts, privilege_error

    error = privilege_error()
    if error:
        raise AiprobeError(error)
    prepare_mounts()


def ticks(duration: float | None, interval: float) -> Iterator[float]:
    """Yield once per interval until `duration` passes or Ctrl-C / SIGTERM; yields elapsed seconds."""
    start = time.monotonic()
    deadline = None if duration is None else start + duration
    while True:
        wait = interval if deadline is None else min(interval, deadline - time.monotonic())
        if _stop.wait(max(wait, 0)):
            return
        yield time.monotonic() - start
        if deadline is not None and time.monotonic() >= deadline:
            return


def emit_json(document: Any) -> None:
    json.dump(document, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


def friendly_errors(func: Callable[..., Any]) -> Callable[..., Any]:
    """Turn the expected failures of a probe command into one-line errors."""
    import functools

    from .libbpf import BpfError, LibbpfUnavailable
    from .loader import ProbeUnavailable

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except (BpfError, LibbpfUnavailable, ProbeUnavailable, FileNotFoundError, PermissionError) as exc:
            raise AiprobeError(str(exc)) from None

    return wrapper
