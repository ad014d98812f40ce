"""`python -m benchmarks [NAME ...]`: run the bench_*.py modules (all, or those named) and print a table."""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys
import traceback

from benchmarks import Result


def _modules(selected: list[str]) -> list[str]:
    found = sorted(m.name for m in pkgutil.iter_modules([os.path.dirname(__file__)])
                   if m.name.startswith("bench_"))
    return [m for m in found if not selected or m.removeprefix("bench_") in selected]


def _print(results: list[Result]) -> None:
    if not results:
        print("no benchmark results")
        return
    width = max(len(f"{r.benchmark}: {r.case}") for r in results)
    print(f"{'benchmark':<{width}}  {'value':>12}  unit")
    for r in results:
        label = f"{r.benchmark}: {r.case}"
        print(f"{label:<{width}}  {r.value:>12.3f}  {r.unit}  {r.detail}".rstrip())


def main(argv: list[str]) -> int:
    if os.geteuid() != 0:
        print("benchmarks load BPF programs: run them as root (sudo make bench)", file=sys.stderr)
        return 1
    results: list[Result] = []
    failed = 0
    for name in _modules(argv):
        print(f"running {name} ...", file=sys.stderr, flush=True)
        try:
            results.extend(importlib.import_module(f"benchmarks.{name}").run())
        except Exception:
            failed += 1
            traceback.print_exc()
    _print(results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
