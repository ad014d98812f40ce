"""The send path's bottleneck rules (send latency's, the streams part's and the requests part's): what each means, its
PromQL and its default thresholds (`[rules.<name>]` overrides them)."""

from __future__ import annotations

from ...config import RuleConfig
from ...rules import FleetRule, RuleSpec, histogram_quantile, observation_rate, p99

# Blocking senders wait in the send; asynchronous servers (uvicorn, vLLM's API server) never do:
# their sockets stay unwritable instead. The agent takes the larger of the two p99s.
NETWORK_SEND_STALL = RuleSpec(
    False, "sends block or sockets stay unwritable {value:.3g}s (p99) in {target}: full socket buffers "
    "(slow clients, backpressure or congestion)",
    p99("aiprobe_tcp_sendmsg_duration_seconds"),
    "sends of {{ $labels.process }} in {{ $labels.container }} block or stay unwritable",
    "Full socket buffers: slow clients, backpressure or congestion.",
    guard="or\n" + p99("aiprobe_tcp_socket_unwritable_seconds") + " > %(threshold)s",
    name="network_send_stall",
    # p99 of tcp_sendmsg over the last interval, seconds
    default=RuleConfig(threshold=0.05, clear=0.02, for_seconds=10, severity="warning"),
)


TOKEN_STREAMS_STALLING = RuleSpec(
    False, "token streams of {target} stalled {value:.0f} times in the last 10 s (the evidence names the "
    "cause: network, cpu, gpu or server)",
    "sum by (instance, process, container, cause) (increase(aiprobe_stream_stalls_total[1m]))",
    "token streams of {{ $labels.process }} stall (cause: {{ $labels.cause }})",
    "Gaps between writes of streamed responses above stream_stall_threshold_ms. The cause label says "
    "why: network (the socket was full), cpu (the writer waited for a CPU), gpu (the process was inside "
    "a CUDA synchronization), server (the application was slow to produce).",
    name="token_streams_stalling",
    # stalls (gaps between writes above stream_stall_threshold_ms) of one process's responses in the window
    default=RuleConfig(threshold=0.0, clear=0.0, for_seconds=0, severity="warning"),
)


DURATION = "http_server_request_duration_seconds"


def _share_rule(name: str, statuses: str, answered: str, meaning: str, default: RuleConfig) -> RuleSpec:
    """A rule on the share of a server's (process, listening port) requests answered with `statuses`: the
    agent's over the last 10 s, the rule file's over 5 minutes."""
    by = "instance, server_port, process, container"
    return RuleSpec(
        False, f"{{target}} answered {{value:.2%}} of its requests in the last 10 s {answered} (the evidence has "
        "the status counts)",
        observation_rate(DURATION, by, "[5m]", f'{{http_response_status_code=~"{statuses}"}}')
        + f"\n/\n{observation_rate(DURATION, by, '[5m]')}",
        f"{{{{ $labels.process }}}} on port {{{{ $labels.server_port }}}} answers more than %(threshold_percent)s of "
        f"its requests {answered}",
        meaning, name=name, default=default)


# share of the requests of one server (process, port) answered 5xx in the window
HTTP_SERVER_ERRORS = _share_rule(
    "http_server_errors", "5..", "with server errors (5xx)",
    "Server errors (HTTP status 5xx) above the service's error budget: the server fails, or sheds load with 503s.",
    RuleConfig(threshold=0.001, clear=0.0005, for_seconds=0, severity="warning"))
# share of the requests of one server (process, port) answered 429 in the window
HTTP_THROTTLED = _share_rule(
    "http_throttled", "429", "with 429 (throttled)",
    "Requests refused with 429 Too Many Requests: a rate limit (tokens, requests) is reached; clients retry and "
    "wait.", RuleConfig(threshold=0.01, clear=0.005, for_seconds=0, severity="warning"))


# Replica skew across the fleet: the replicas of one workload run on several nodes, so only Prometheus sees
# them together. A workload is the pods of one Deployment, StatefulSet or DaemonSet: its pods' common name,
# the pod name less its ReplicaSet hash and random suffix (Deployment: <name>-<hash>-<5 chars>, DaemonSet:
# <name>-<5 chars>; both from Kubernetes' consonants-and-digits alphabet) or its ordinal (StatefulSet:
# <name>-<n>); other pods are workloads of one. The workload's namespace and pod are `exported_namespace` and
# `exported_pod` where the ServiceMonitor scrapes (the agent pod's own namespace and pod keep their names:
# deploy/kubernetes/README.md); the recorded series name them `namespace` and `pod`.
_SAFE = "[bcdfghjklmnpqrstvwxz2456789]"
POD_SUFFIX = f"(?:(?:-{_SAFE}{{6,10}})?-{_SAFE}{{5}}|-[0-9]+)?"
WORKLOAD = "namespace, workload, server_port"
SKEW_WINDOW = "5m"
# Peers' mean requests per replica per second below which the rules stay silent: five minutes of fewer
# requests vary by chance (about 1/sqrt(n)) as much as the tolerance.
SKEW_TRAFFIC_FLOOR = 0.5
SHARE_TOLERANCE = 0.15  # a replica's requests against its fair share (the workload's mean per replica)
SLOW_FACTOR = 2.5  # a replica's p95 against the median of its workload's replicas' p95s
REPLICA_RATE = "namespace_workload_pod:http_server_requests:rate5m"
FAIR_SHARE = "namespace_workload_pod:http_server_requests:fair_share_ratio"
REPLICA_P95 = "namespace_workload_pod:http_server_request_duration_seconds:p95"
PEER_MEDIAN = "namespace_workload_pod:http_server_request_duration_seconds_p95:peer_median_ratio"


_REPLICA = "exported_namespace, exported_pod, server_port"
_OF_PODS = '{exported_pod!=""}'  # the workloads' series: those the agent has a pod for


def _per_replica(inner: str) -> str:
    """`inner`, an aggregation by _REPLICA, per replica (namespace, workload, pod, listening port)."""
    for label, source, regex in (("namespace", "exported_namespace", "(.*)"), ("pod", "exported_pod", "(.*)"),
                                 ("workload", "exported_pod", f"(.+?){POD_SUFFIX}")):
        inner = f'label_replace({inner},\n  "{label}", "$1", "{source}", "{regex}")'
    return f"sum without (exported_namespace, exported_pod) (\n{inner}\n)"


def _against_peers(replica: str, peers: str) -> str:
    """Each replica's `replica` over its workload's `peers` (an aggregation of `replica` by WORKLOAD)."""
    return f"{replica}\n/ on ({WORKLOAD}) group_left\n{peers}"


def _with_traffic(comparison: str) -> str:
    """`comparison`, where the workload's replicas serve enough requests to judge."""
    return f"({comparison})\nand on ({WORKLOAD}) (avg by ({WORKLOAD}) ({REPLICA_RATE}) >= {SKEW_TRAFFIC_FLOOR:g})"


_PEERS = ("Peers: the replicas of one workload (the pods of one Deployment, StatefulSet or DaemonSet, "
          "by name) on the same port, over 5 minutes.")
REPLICA_SKEW = (
    FleetRule(record=REPLICA_RATE,
              expr=_per_replica(observation_rate(DURATION, _REPLICA, f"[{SKEW_WINDOW}]", _OF_PODS))),
    # 1 is the fair share: the workload's requests spread evenly over its replicas
    FleetRule(record=FAIR_SHARE, expr=_against_peers(REPLICA_RATE, f"avg by ({WORKLOAD}) ({REPLICA_RATE})")),
    # >= 0: not NaN (a replica without requests in the window)
    FleetRule(record=REPLICA_P95,
              expr=_per_replica(histogram_quantile(0.95, DURATION, _REPLICA, f"[{SKEW_WINDOW}]", _OF_PODS)) + " >= 0"),
    FleetRule(record=PEER_MEDIAN,
              expr=_against_peers(REPLICA_P95, f"quantile by ({WORKLOAD}) (0.5, {REPLICA_P95})")),
    FleetRule(
        name="replica_traffic_skew", for_seconds=600,
        expr=_with_traffic(f"{FAIR_SHARE} > {1 + SHARE_TOLERANCE:g} or {FAIR_SHARE} < {1 - SHARE_TOLERANCE:g}"),
        summary="{{ $labels.pod }} serves {{ $value | humanizePercentage }} of its fair share of the requests of "
                "{{ $labels.namespace }}/{{ $labels.workload }} on port {{ $labels.server_port }}",
        description=f"A replica's share of its workload's requests departs from its peers' by more than "
                    f"{SHARE_TOLERANCE:.0%}: the load balancer spreads connections, not requests (long-lived "
                    f"HTTP/2 or keep-alive connections pin clients to one replica), or weights or readiness "
                    f"differ. {_PEERS}"),
    FleetRule(
        name="replica_slow", for_seconds=600, expr=_with_traffic(f"{PEER_MEDIAN} > {SLOW_FACTOR:g}"),
        summary="{{ $labels.pod }}'s p95 is {{ printf \"%.1f\" $value }} times the median of its peers' in "
                "{{ $labels.namespace }}/{{ $labels.workload }} on port {{ $labels.server_port }}",
        description=f"A replica's p95 request duration exceeds {SLOW_FACTOR:g} times the median of its workload's "
                    f"replicas' p95s: a slow node, a noisy neighbour, a degraded GPU, or a longer queue. Needs three "
                    f"replicas (of two, neither can exceed twice their median). {_PEERS}"),
)
