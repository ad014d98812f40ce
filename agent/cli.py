"""`aiprobe` command line. Subcommands live in `aiprobe.commands` (a probe's command is named in its
registry entry, `SPEC.command`) and load lazily, so `aiprobe --help` imports nothing it doesn't use."""

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

# The agent's own subcommands; each probe's comes from the registry.
AGENT_SUBCOMMANDS = {
    "check": "aiprobe.commands.check:command",
    "top": "aiprobe.commands.top:command",
    "agent": "aiprobe.commands.agent:command",
}


def subcommands() -> dict[str, str]:
    """subcommand -> "module:attribute"."""
    from .registry import faces

    return {**AGENT_SUBCOMMANDS, **{face.subcommand: face.command for face in faces() if face.command}}


class AiprobeError(click.ClickException):
    """A user-facing failure: printed as one line `aiprobe: <message>`, exit 1 (no traceback)."""

    def show(self, file: Any = None) -> None:
        click.echo(f"aiprobe: {self.format_message()}", err=True)


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *subcommands()})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = AGENT_SUBCOMMANDS.get(name) or subcommands().get(name)
        if target:
            module, attribute = target.split(":")
            command: click.Command = getattr(importlib.import_module(module), attribute)
            return command
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
def strategy_option(spec: Any, chain: str = "the probe's chain") -> Callable[[Callable[..., Any]], Any]:
    """--strategy NAME: run only this strategy of the probe's chain (its names come from the registry)."""
    return click.option(
        "--strategy", type=click.Choice([s.name for s in spec.strategies]), default=None,
        help=f"Run only this strategy of {chain} (default: the first this kernel allows).",
    )


interval_option = click.option(
    "--interval", type=click.FloatRange(min=0.1), default=1.0, show_default=True, metavar="SECONDS",
    help="Refresh interval.",
)


def require_privileges() -> None:
    """Exit 1 with one line when aiprobe lacks the privileges to load BPF programs."""
    from .system import UserError
    from .system import require_privileges as check

    try:
        check()
    except UserError as exc:
        raise AiprobeError(str(exc)) from None


def ticks(duration: float | None, interval: float | Callable[[], float]) -> Iterator[float]:
    """Yield once per interval (a number, or what the callable says before each wait) until `duration`
    passes or Ctrl-C / SIGTERM; yields elapsed seconds."""
    start = time.monotonic()
    deadline = None if duration is None else start + duration
    while True:
        pause = interval() if callable(interval) else interval
        wait = pause if deadline is None else min(pause, deadline - time.monotonic())
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
    from .system import UserError

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except (BpfError, LibbpfUnavailable, ProbeUnavailable, UserError, FileNotFoundError,
                PermissionError) as exc:
            raise AiprobeError(str(exc)) from None

    return wrapper
