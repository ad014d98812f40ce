"""Writes aiprobe-rules.yml from the agent's rule definitions (aiprobe.exporters.rules_file), then the
Kubernetes PrometheusRule that embeds it. Run it after changing a rule or a default threshold:

    .venv/bin/python deploy/prometheus/generate_rules.py
"""

from __future__ import annotations

import runpy
from pathlib import Path

from aiprobe.exporters.rules_file import render

HERE = Path(__file__).resolve().parent
RULES = HERE / "aiprobe-rules.yml"


def main() -> None:
    RULES.write_text(render())
    print(f"wrote {RULES.relative_to(HERE.parent.parent)}")
    runpy.run_path(str(HERE.parent / "kubernetes" / "generate_prometheusrule.py"), run_name="__main__")


if __name__ == "__main__":
    main()
