"""The overview's replica-skew row: the replicas of one workload (the pods of one Deployment, StatefulSet or
DaemonSet, by name) across every node, each one's share of the workload's requests and its p95 against the
median of its peers', as the fleet rules replica_traffic_skew and replica_slow judge them
(deploy/prometheus/aiprobe-rules.yml, docs/requests.md)."""

# The pod name's ReplicaSet hash and random suffix, or StatefulSet ordinal, as the fleet rules strip it
# (aiprobe.probes.sendlat.rules.POD_SUFFIX; tests/test_dashboards.py checks they are the same).
_SAFE = "[bcdfghjklmnpqrstvwxz2456789]"
POD_SUFFIX = f"(?:(?:-{_SAFE}{{6,10}})?-{_SAFE}{{5}}|-[0-9]+)?"
# The workload's namespace and pod as the ServiceMonitor stores them (deploy/kubernetes/README.md). Every
# node: a node filter would leave some replicas out of their workload.
REPLICAS = 'namespace=~"$namespace",exported_pod!=""'
WORKLOAD = "exported_namespace, workload, server_port"
REPLICA = WORKLOAD + ", exported_pod"
REPLICA_LEGEND = "{{exported_pod}} :{{server_port}}"
DURATION = "http_server_request_duration_seconds"


def per_replica(kit, series: str, by: str) -> str:
    """`series`' rate summed by `by`, with the workload named after its pods."""
    rated = f'rate({series}{{{REPLICAS}}}[{kit.RATE}])'
    return f'sum by ({by}) (label_replace({rated}, "workload", "$1", "exported_pod", "(.+?){POD_SUFFIX}"))'


def panels(kit):
    requests = DURATION + "_count"
    share = (f"{per_replica(kit, requests, REPLICA)}\n/ on ({WORKLOAD}) group_left\n"
             f"{per_replica(kit, requests, WORKLOAD)}")
    replica_p95 = (f"(histogram_quantile(0.95, {per_replica(kit, DURATION + '_bucket', REPLICA + ', le')})\n"
                   f"or histogram_quantile(0.95, {per_replica(kit, DURATION, REPLICA)}))")  # classic or native
    peers_median = f"quantile by ({WORKLOAD}) (0.5, {replica_p95})"
    return [
        kit.Panel("Traffic share per replica", [kit.Target(share, REPLICA_LEGEND)], unit="percentunit", width=12,
                  description="Each replica's share of its workload's HTTP requests; its fair share is 1/N of N "
                              "replicas. replica_traffic_skew fires when one departs from it by more than 15% for "
                              "10 minutes: connection-level balancing of long-lived (HTTP/2, keep-alive) "
                              "connections, weights or readiness."),
        kit.Panel("p95 per replica against its peers' median", [
            kit.Target(replica_p95, "p95 " + REPLICA_LEGEND),
            kit.Target(peers_median, "peers' median {{workload}} :{{server_port}}")], unit="s", width=12,
                  description="Each replica's p95 request duration and the median of its workload's replicas' "
                              "p95s. replica_slow fires when one exceeds 2.5 times the median for 10 minutes "
                              "(three replicas or more)."),
    ]
