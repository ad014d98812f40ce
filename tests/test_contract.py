"""Contract between Python and the built BPF objects, read from the objects themselves (libbpf opens
them; nothing is loaded, no root needed): every program and map name the agent looks up exists in
the .bpf.o it looks it up in."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
from aiprobe import features
from aiprobe.loader import BpfObject, object_btf
from aiprobe.probes.cuda import probe as cuda
from aiprobe.probes.sendlat import loops
from aiprobe.registry import ProbeSpec, specs

AGENT = Path(__file__).resolve().parent.parent / "agent"
# Calls whose first string argument names a map or a program.
_NAMING_CALLS = {"ring_buffer": "maps", "RingRecords": "maps", "_read_and_prune": "maps", "_program": "programs"}


def names_looked_up(module_name: str) -> dict[str, set[str]]:
    """{"maps": ..., "programs": ...}: the names a module (or every module of a package) looks up in
    `obj.maps[...]`, `obj.programs[...]`, the naming calls above and its `*_MAPS` / `*PROGRAMS`
    constants, with module constants (XDP_PROGRAM) resolved."""
    path = AGENT / module_name.replace(".", "/")
    if path.is_dir():
        found: dict[str, set[str]] = {"maps": set(), "programs": set()}
        for file in sorted(path.glob("*.py")):
            for kind, names in names_looked_up(f"{module_name}.{file.stem}").items():
                found[kind] |= names
        return found
    module = importlib.import_module(f"aiprobe.{module_name}")
    tree = ast.parse(path.with_suffix(".py").read_text())
    found = {"maps": set(), "programs": set()}

    def text(node: ast.AST) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name) and isinstance(getattr(module, node.id, None), str):
            return str(getattr(module, node.id))
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) \
                and node.value.attr in found and (name := text(node.slice)):
            found[node.value.attr].add(name)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute | ast.Name):
            called = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
            args = [text(arg) for arg in node.args]
            strings = [arg for arg in args if arg]
            if called in _NAMING_CALLS and strings:
                found[_NAMING_CALLS[called]].add(strings[0])
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            target = node.targets[0].id
            kind = "maps" if target.endswith("_MAPS") else "programs" if target.endswith("PROGRAMS") else None
            if kind:
                found[kind] |= {value for value in getattr(module, target) if isinstance(value, str)}
    return found


def contents(object_name: str) -> tuple[set[str], set[str]]:
    obj = BpfObject(object_name)
    try:
        return set(obj.maps), set(obj.programs)
    finally:
        obj.close()


def _package_of(spec: ProbeSpec) -> str:
    """The probe package declaring `spec` (probes.<name>), relative to aiprobe."""
    return spec.factory.__module__.removeprefix("aiprobe.").rpartition(".")[0]


def _unprefixed(maps: set[str]) -> set[str]:
    """Map names without the object's name that libbpf puts before its sections' (sendlat.rodata)."""
    return {name[name.find("."):] if "." in name else name for name in maps}


def test_the_bounded_loop_build_of_sendlat_is_the_same_object_with_shorter_walks() -> None:
    """Kernels without bpf_loop run sendlat.bpf.o built with bounded loops (bpf/loop.h): the same
    programs and maps, so every strategy and part runs on it; each walk reads at most what bpf_loop's does."""
    (maps, programs), (bounded_maps, bounded_programs) = contents(loops.OBJECT), contents(loops.BOUNDED_OBJECT)
    assert (_unprefixed(bounded_maps), bounded_programs) == (_unprefixed(maps), programs)
    looped, bounded = (object_btf(name).enum_values("walk_bound") for name in (loops.OBJECT, loops.BOUNDED_OBJECT))
    assert looped.keys() == bounded.keys()
    assert all(0 < bounded[walk] <= looped[walk] for walk in looped)


@pytest.mark.parametrize("spec", [s for s in specs() if s.bpf_object], ids=lambda s: s.name)
def test_probe_names_exist_in_its_object(spec) -> None:
    maps, programs = contents(spec.bpf_object)
    looked_up = names_looked_up(_package_of(spec))
    declared = {program for strategy in spec.strategies for program in strategy.programs}
    assert looked_up["maps"] - maps == set(), f"maps missing from {spec.bpf_object}.bpf.o"
    assert (looked_up["programs"] | declared) - programs == set(), f"programs missing from {spec.bpf_object}.bpf.o"


def test_the_scan_sees_lookups() -> None:
    assert names_looked_up("probes.flows") == {"maps": {"flows", "flow_counts", "free_slots", "unattributed", "lost"},
                                        "programs": {"flows_xdp", "flows_ingress", "flows_egress"}}
    assert {"procs", "proc_slots", "unwritable", "free_procs", "flows", "counters", "slow_sends"} <= \
        names_looked_up("probes.sendlat")["maps"]


def test_cuda_strategies_and_entry_points_exist_in_its_object() -> None:
    _, programs = contents(cuda.SPEC.bpf_object)
    strategies = cuda.STRATEGIES + tuple(map(cuda.without_fetch_atomics, cuda.STRATEGIES))
    wanted = {p for s in strategies for p in s.programs} | {e.program for e in cuda.ENTRY_POINTS}
    assert wanted - programs == set()


def test_feature_probes_exist_in_their_object() -> None:
    maps, programs = contents(features.FEATURE_OBJECT)
    looked_up = names_looked_up("features")
    assert looked_up["programs"], "the scan found no feature programs"
    assert looked_up["programs"] - programs == set()
    assert looked_up["maps"] - maps == set()
