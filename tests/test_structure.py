"""The architecture, checked: library modules import neither click nor the CLI, every probe declares
itself once in the registry, and every config key belongs to the agent or to exactly one probe."""

from __future__ import annotations

import ast
from dataclasses import fields
from pathlib import Path

from aiprobe.cli import subcommands
from aiprobe.config import Config, probe_names
from aiprobe.registry import faces, specs

AGENT = Path(__file__).resolve().parent.parent / "agent"
# Keys about the agent as a whole rather than one probe.
AGENT_KEYS = {"listen", "interval_seconds", "probes", "traffic_floor_bytes_per_second", "alertmanager_url",
              "alert_log", "rules", "web_config_file", "snapshot_api", "max_process_labels", "idle_series_seconds",
              "strategies"}


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            found.add("." * node.level + (node.module or ""))
    return found


def test_library_modules_import_neither_click_nor_the_cli() -> None:
    offenders = {path.name: sorted(imports(path) & {"click", ".cli", "aiprobe.cli", ".commands"})
                 for path in AGENT.glob("*.py") if path.name != "cli.py"}
    assert {name: found for name, found in offenders.items() if found} == {}


def test_every_probe_is_registered_once_with_a_factory_and_one_owner_per_bpf_object() -> None:
    assert [face.name for face in faces()] == ["flows", "sendlat", "streams", "cuda", "sched", "nvml", "netstat"]
    assert all(spec.factory is not None for spec in specs())
    owners = [spec.bpf_object for spec in specs() if spec.bpf_object]
    assert len(owners) == len(set(owners)), "a BPF object with two owners"
    # streams is part of sendlat, sched of cuda; netstat runs always
    assert {spec.name: [part.name for part in spec.parts] for spec in specs() if spec.parts} == \
        {"sendlat": ["streams"], "cuda": ["sched"]}
    assert probe_names() == ("flows", "sendlat", "cuda", "nvml")


def test_probe_commands_come_from_the_registry() -> None:
    commands = {"check": "aiprobe.commands.check", "top": "aiprobe.commands.top", "agent": "aiprobe.commands.agent",
                "flows": "aiprobe.probes.flows.command", "sendlat": "aiprobe.probes.sendlat.command",
                "streams": "aiprobe.probes.sendlat.streams_command", "cuda": "aiprobe.probes.cuda.command",
                "gpus": "aiprobe.probes.nvml.command"}
    assert subcommands() == {name: f"{module}:command" for name, module in commands.items()}


def test_every_config_key_is_the_agents_or_one_probes() -> None:
    claimed = [key for face in faces() for key in face.config_keys]
    assert len(claimed) == len(set(claimed)), "a key claimed by two probes"
    assert {f.name for f in fields(Config)} == AGENT_KEYS | set(claimed)


def test_metric_tables_name_fields_their_records_have() -> None:
    for face in faces():
        for family in face.metrics:
            names = {f.name for f in fields(family.record)}
            getters = [family.value, family.sum_field,
                       *(g for _, g in family.labels), *(g for _, g in family.expand)]
            wrong = [g for g in getters if isinstance(g, str) and g and g not in names]
            assert wrong == [], f"{family.name}: {family.record.__name__} has no field {wrong}"
