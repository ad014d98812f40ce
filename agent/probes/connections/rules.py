"""The connections probe's bottleneck rules: what each means, its PromQL and its default thresholds
(`[rules.<name>]` overrides them).

Per-listener overflows are signalled under netstat's `listen_queue_overflow` (its thresholds, its
`[rules.listen_queue_overflow]`): one alert name for one condition, its host-wide target "host" kept as
it was, and one more target per listener that overflowed, naming its port and process."""

from __future__ import annotations

from ...config import RuleConfig
from ...rules import RuleSpec

LISTENER = "instance, address, port, process, container"

ACCEPT_QUEUE_SATURATED = RuleSpec(
    name="accept_queue_saturated",
    # queue length over capacity at one listener; an overflow there counts as a full queue (1.0 or more)
    default=RuleConfig(threshold=0.9, clear=0.5, for_seconds=10, severity="warning"),
    fires_below=False,
    summary="the accept queue of {target} is {value:.0%} full: the server accepts more slowly than connections "
            "complete",
    query=f"max by ({LISTENER}) (aiprobe_listen_queue_length / aiprobe_listen_queue_capacity)",
    guard=f"or\nsum by ({LISTENER}) (rate(aiprobe_listen_overflows_total[1m])) > 0",
    prometheus_summary="the accept queue of {{ $labels.process }} on port {{ $labels.port }} is more than "
                       "%(threshold_percent)s full or overflows",
    description="Connections wait for accept() in a nearly full queue, or it overflowed: the accept loop falls "
                "behind (too few workers, a blocked event loop) or the backlog is too small.",
)

REUSEPORT_IMBALANCE = RuleSpec(
    fires_below=False,
    summary="connections on {target} are spread unevenly over its SO_REUSEPORT sockets: the busiest takes "
            "{value:.2g} times the mean share (the evidence names the stuck pids)",
    query="max by (instance, address, port) (aiprobe_reuseport_imbalance_ratio)",
    prometheus_summary="SO_REUSEPORT sockets on port {{ $labels.port }} take uneven shares of its connections",
    description="One worker of a SO_REUSEPORT group accepts far more, or far fewer, connections than the others: "
                "a stuck or busy worker still gets its hash share, and those connections wait in its queue.",
    name="reuseport_imbalance",
    # the busiest socket's share of the connections accepted in the last 10 s over the mean share
    default=RuleConfig(threshold=1.5, clear=1.2, for_seconds=30, severity="warning"),
)
