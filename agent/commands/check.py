"""`aiprobe check`: what this kernel can do, and which strategy each probe will run."""

from __future__ import annotations

from typing import Any

import click

from .. import __version__, libbpf
from ..cli import AiprobeError, emit_json, friendly_errors, json_option, require_privileges
from ..config import Config
from ..features import probe_features
from ..registry import ProbePlan, faces, plans
from ..system import kernel_release, prepare_mounts


def _short(detail: str) -> str:
    """The first clause of a reason: what failed, without libbpf's trailing log."""
    return detail.split(" — ")[0]


def _print_text(report: dict[str, Any], plans: list[ProbePlan], notes: dict[str, tuple[str, list[str]]]) -> None:
    click.echo(f"aiprobe {report['version']} · kernel {report['kernel']} · libbpf {report['libbpf']}")
    click.echo("\nKernel capabilities (each from a real load and attach):")
    for name, feature in report["features"].items():
        state = "yes" if feature["available"] else "no "
        click.echo(f"  {name:<12} {state}  {_short(feature['detail'])}".rstrip())
    click.echo("\nMounts:")
    for name, mount in report["mounts"].items():
        click.echo(f"  {name:<12} {mount['path']}: {mount['detail']}")
    for key, (heading, _) in notes.items():
        if report[key]:
            click.echo(f"\n{heading}")
            for line in report[key]:
                click.echo(f"  {line}")
    click.echo("\nProbes:")
    for probe in plans:
        if probe.available:
            click.echo(f"  {probe.probe:<12} {probe.strategy:<12} {probe.span}")
            for name, why in probe.skipped.items():
                click.echo(f"  {'':<12} skipped {name}: {_short(why)}")
            for limitation in probe.limitations:
                click.echo(f"  {'':<12} {limitation}")
        else:
            click.echo(f"  {probe.probe:<12} {'unavailable':<12} {_short(probe.reason)}")


@click.command()
@json_option
@friendly_errors
def command(as_json: bool) -> None:
    """Print the kernel capability matrix and the strategy each probe will run: each probe's own
    object loaded and attached as the agent (at its default config) loads it."""
    require_privileges()
    features = probe_features()
    planned = plans(features, Config())
    report = {
        "version": __version__,
        "kernel": kernel_release(),
        "libbpf": libbpf.version(),
        "features": {name: f.as_dict() for name, f in features.items()},
        "mounts": {name: vars(m) for name, m in prepare_mounts().items()},
        "probes": {p.probe: p.as_dict() for p in planned},
    }
    # What each probe adds about this host (the XDP hooks other programs hold).
    notes = {key: note for face in faces() if face.check_notes for key, note in face.check_notes().items()}
    report.update({key: lines for key, (_, lines) in notes.items()})
    if as_json:
        emit_json(report)
    else:
        _print_text(report, planned, notes)
    if not any(p.available for p in planned):
        raise AiprobeError("no probe can run on this host")
