"""The architecture, checked: a probe is a package under agent/probes/ that the core never imports;
no import cycles; library modules import neither click nor the CLI; every probe declares itself once
in the registry, one owner per BPF object; every config key belongs to the agent or to one probe's
section."""

from __future__ import annotations

import ast
import tomllib
from dataclasses import fields
from pathlib import Path

from aiprobe.cli import subcommands
from aiprobe.config import Config
from aiprobe.registry import catalog, faces, selectable_names, specs

ROOT = Path(__file__).resolve().parent.parent
AGENT = ROOT / "agent"
PROBES = AGENT / "probes"


def module_of(path: Path) -> str:
    """aiprobe's dotted name of a file under agent/."""
    parts = path.relative_to(AGENT).with_suffix("").parts
    return ".".join(("aiprobe", *(parts[:-1] if parts[-1] == "__init__" else parts)))


def imports(path: Path) -> set[str]:
    """The absolute names of the modules a file imports (where it names one of aiprobe's modules,
    `from . import x` counts as importing x)."""
    package = module_of(path) if path.name == "__init__.py" else module_of(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found.add(module)
            found |= {f"{module}.{alias.name}" for alias in node.names}
    return found


def graph() -> dict[str, set[str]]:
    """Module -> the aiprobe modules it imports, for every module under agent/."""
    modules = {module_of(path): path for path in AGENT.rglob("*.py")}
    return {name: imports(path) & set(modules) - {name} for name, path in modules.items()}


def test_library_modules_import_neither_click_nor_the_cli() -> None:
    commands = {"aiprobe.cli"} | {name for name in graph() if name.startswith("aiprobe.commands")
                                  or name.rpartition(".")[2].endswith("command")}
    offenders = {name: sorted(imports(path) & ({"click"} | commands))
                 for path in AGENT.rglob("*.py") if (name := module_of(path)) not in commands}
    assert {name: found for name, found in offenders.items() if found} == {}


def test_the_core_imports_no_probe_and_probes_import_no_command_of_the_agent() -> None:
    core = {name: sorted(i for i in found if i.startswith("aiprobe.probes."))
            for name, found in graph().items() if not name.startswith("aiprobe.probes")}
    assert {name: found for name, found in core.items() if found} == {}


def test_no_import_cycle() -> None:
    edges, seen, cycles = graph(), set(), []

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycles.append([*path[path.index(module):], module])
            return
        if module in seen:
            return
        for imported in sorted(edges[module]):
            visit(imported, [*path, module])
        seen.add(module)

    for module in sorted(edges):
        visit(module, [])
    assert cycles == []


def test_every_package_under_agent_is_installed() -> None:
    """pyproject.toml lists packages (agent/ is installed as aiprobe): a probe's must be there."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {module_of(init) for init in AGENT.rglob("__init__.py")}
    assert packages <= listed


def test_every_probe_is_registered_once_with_a_factory_and_one_owner_per_bpf_object() -> None:
    names = [face.name for face in faces()]
    assert len(names) == len(set(names)), "a name registered twice"
    assert {"flows", "sendlat", "streams", "cuda", "sched", "nvml", "netstat"} <= set(names)
    assert all(spec.factory is not None for spec in specs())
    owners = [spec.bpf_object for spec in specs() if spec.bpf_object]
    assert len(owners) == len(set(owners)), "a BPF object with two owners"
    # streams and requests are parts of sendlat, sched of cuda; netstat runs always
    assert {spec.name: [part.name for part in spec.parts] for spec in specs() if spec.parts} == \
        {"sendlat": ["streams", "requests"], "cuda": ["sched"]}
    assert {"flows", "sendlat", "cuda", "nvml"} <= set(selectable_names())
    assert not {spec.name for spec in specs() if spec.always} & set(selectable_names())


def test_probe_commands_come_from_the_registry() -> None:
    commands = {"check": "aiprobe.commands.check", "top": "aiprobe.commands.top", "agent": "aiprobe.commands.agent",
                "flows": "aiprobe.probes.flows.command", "sendlat": "aiprobe.probes.sendlat.command",
                "streams": "aiprobe.probes.sendlat.streams_command", "cuda": "aiprobe.probes.cuda.command",
                "gpus": "aiprobe.probes.nvml.command"}
    found = subcommands()
    assert {name: f"{module}:command" for name, module in commands.items()}.items() <= found.items()
    for name, command in found.items():
        module = command.split(":")[0]
        assert name in commands or module.startswith("aiprobe.probes."), f"{name}: a command from outside a probe"


def test_every_config_key_is_the_agents_or_one_probes() -> None:
    sections = [face.settings for face in faces() if face.settings is not None]
    assert set(catalog().sections) == set(sections) and len(sections) == len(set(sections))
    keys = [f.name for section in sections for f in fields(section)] + [f.name for f in fields(Config)]
    assert len(keys) == len(set(keys)), "a key claimed twice"


def test_every_rule_is_declared_once_by_the_probe_judging_it() -> None:
    names = [rule.name for face in faces() for rule in face.rules]
    assert len(names) == len(set(names)) and "" not in names


def test_metric_tables_name_fields_their_records_have() -> None:
    for face in faces():
        for family in face.metrics:
            names = {f.name for f in fields(family.record)}
            getters = [family.value, family.sum_field,
                       *(g for _, g in family.labels), *(g for _, g in family.expand)]
            wrong = [g for g in getters if isinstance(g, str) and g and g not in names]
            assert wrong == [], f"{family.name}: {family.record.__name__} has no field {wrong}"
