"""The flows probe's keys of the config file (docs/config.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...config import Settings, limits, non_empty


@dataclass(frozen=True)
class FlowsSettings(Settings):
    interfaces: tuple[str, ...] = field(default=("*",), metadata=non_empty('["*"] for all'))  # globs, up ones
    exclude: tuple[str, ...] = ("lo",)  # globs never attached
    xdp_interfaces: tuple[str, ...] = ()  # physical NICs whose ingress is counted at native XDP
    top_flows: int = field(default=100, metadata=limits(1, 100_000, whole=True))  # flows exported one by one
    flow_idle_seconds: float = field(default=30.0, metadata=limits(1.0, 86_400.0))
    # Entries of the flow table (one per flow and direction), preallocated: 168 bytes of kernel memory each.
    max_flows: int = field(default=262_144, metadata=limits(1024, 4_194_304, whole=True))
