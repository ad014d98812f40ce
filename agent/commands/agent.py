"""`aiprobe agent`: run the agent (aiprobe.daemon) and serve /metrics, /healthz and /api/v1/snapshot,
pushing alerts to Alertmanager and a JSON-lines log."""

from __future__ import annotations

import gc
import logging
import os
import resource
import socket
import sys
from collections.abc import Callable, Iterator
from typing import Any

import click

from .. import __version__, libbpf
from ..cli import require_privileges, ticks
from ..config import Config, ConfigError, load
from ..daemon import Agent
from ..model import Alert
from ..names import endpoint
from ..registry import catalog, selectable_names
from ..system import kernel_release

YOUNG_GC_THRESHOLD = 50_000  # objects allocated (less freed) between young collections; Python's is 700

log = logging.getLogger("aiprobe.agent")


def _csv(value: str | None) -> list[str] | None:
    return [item.strip() for item in value.split(",") if item.strip()] if value else None


class ConfigProblem(click.ClickException):
    exit_code = 2

    def show(self, file: Any = None) -> None:
        click.echo(f"aiprobe: config: {self.format_message()}", err=True)


@click.command()
@click.option("--config", "config_path", metavar="PATH", help="TOML config (docs/config.md).")
@click.option("--listen", help="HOST:PORT to serve /metrics, /healthz, /api/v1/snapshot (default 0.0.0.0:9645).")
@click.option("--interfaces", help="Comma-separated globs of interfaces to watch (default: all up, except lo).")
@click.option("--probes", help=f"Comma-separated probes to run (default: {','.join(selectable_names())}).")
@click.option("--alertmanager", "alertmanager_url", help="Alertmanager base URL to push alerts to.")
@click.option("--web.config.file", "web_config_file", metavar="PATH",
              help="TLS and basic auth, in the Prometheus exporter-toolkit web config format.")
@click.option("--dcgm-compatible", "dcgm", is_flag=True, default=None,
              help="Also export DCGM-exporter metric names for existing GPU dashboards.")
def command(config_path: str | None, listen: str | None, interfaces: str | None, probes: str | None,
            alertmanager_url: str | None, web_config_file: str | None, dcgm: bool | None) -> None:
    """Run every available probe and serve Prometheus metrics, health and the snapshot API."""
    try:
        config = load(config_path, catalog(), listen=listen, interfaces=_csv(interfaces), probes=_csv(probes),
                      alertmanager_url=alertmanager_url, web_config_file=web_config_file,
                      dcgm_compatible_metrics=dcgm)
    except ConfigError as exc:
        raise ConfigProblem(str(exc)) from None
    require_privileges()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="aiprobe: %(message)s")
    _raise_open_files_limit()
    run_agent(config, ticks)


def _raise_open_files_limit() -> None:
    """The soft limit of open files up to the hard one (as Prometheus does): clients, probes, the
    CUDA scan and netlink share it, and the usual soft 1024 is within reach of any local user."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = min(hard if hard != resource.RLIM_INFINITY else 1 << 20, 1 << 20)
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def _collect_garbage_rarely() -> None:
    """Once loaded: a refresh makes and drops thousands of records, each a few containers, and the
    cyclic collector's default pace (a young collection every 700 of them) spent a quarter of the
    exporter's CPU on them (benchmarks: 10k processes). References free them; cycles are few. So
    what start-up made is set aside (never scanned again) and young collections come 70 times rarer."""
    gc.freeze()
    gc.set_threshold(YOUNG_GC_THRESHOLD, *gc.get_threshold()[1:])


def run_agent(config: Config, ticks: Callable[[float | None, Callable[[], float]], Iterator[float]]) -> None:
    from aiprobe.exporters.alerts import AlertmanagerPusher, JsonLinesSink
    from aiprobe.exporters.http import AgentHTTPServer
    from aiprobe.exporters.prometheus import AgentCollector, exposition
    from aiprobe.exporters.webconfig import load_web_config

    sink = JsonLinesSink(config.alert_log)
    pusher = (AlertmanagerPusher(config.alertmanager_url, instance=socket.gethostname())
              if config.alertmanager_url else None)

    def on_transitions(transitions: list[Alert], now: float) -> None:
        sink.write(transitions, now)
        if pusher is not None:
            pusher.update(agent.alerts, changed=True)

    agent = Agent(config, on_transitions=on_transitions)
    collector = AgentCollector(config, build_info={"version": __version__, "kernel": kernel_release(),
                                                   "libbpf": libbpf.version()}, source=agent.scrape_readings)
    try:
        web = load_web_config(config.web_config_file) if config.web_config_file else None
    except ConfigError as exc:
        raise ConfigProblem(str(exc)) from None
    try:
        server = AgentHTTPServer(config.listen_address, exposition(collector), agent.snapshot, lambda: agent.healthy,
                                 web=web, snapshot_remote=config.snapshot_api == "network")
    except OSError as exc:
        raise ConfigProblem(f"listen {config.listen}: {exc.strerror}") from None
    try:
        agent.start()
        for name, status in agent.status.items():
            log.info("probe %s: %s", name, status.strategy if status.up else f"unavailable ({status.reason})")
        agent.refresh()
        collector.absorb(agent.readings)
        _collect_garbage_rarely()
        server.start()
        log.info("serving %s://%s/metrics (pid %d)", "https" if server.tls else "http",
                 endpoint(config.listen_address[0], server.port), os.getpid())
        for _ in ticks(None, lambda: agent.pacer.wait):
            with agent.pacer.timed():
                agent.refresh()
                collector.absorb(agent.readings)
            if pusher is not None:
                pusher.update(agent.alerts, changed=False)  # keeps resends current
    finally:
        server.close()
        agent.close()
        if pusher is not None:
            pusher.close()
        sink.close()
