"""The nvml probe's keys of the config file (docs/config.md)."""

from __future__ import annotations

from dataclasses import dataclass

from ...config import Settings


@dataclass(frozen=True)
class NvmlSettings(Settings):
    dcgm_compatible_metrics: bool = False  # also export dcgm-exporter's names
