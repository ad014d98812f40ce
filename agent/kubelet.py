"""Kubernetes names of a workload, its pod, namespace and container name, from the kubelet's log
directories: no API server.

The kubelet names a pod's log directory `/var/log/pods/<namespace>_<pod>_<uid>` and links each
container's log as `/var/log/containers/<pod>_<namespace>_<container>-<container id>.log`, whichever
the runtime (containerd, CRI-O, Docker through cri-dockerd). The cgroup path gives the pod uid and
the container id (containers.py); these names give the rest. Only names are read, never a file or a
link's target. None of namespace, pod or container name may hold '_' (DNS labels and subdomains), so
a name that splits otherwise is not the kubelet's and is skipped.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import time
from dataclasses import replace
from pathlib import Path

from .containers import Workload

log = logging.getLogger("aiprobe.kubelet")

# Entries read from each directory (a node runs at most a few hundred pods); the rest are ignored.
MAX_ENTRIES = 16_384

_DNS_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
_DNS_SUBDOMAIN = r"[a-z0-9](?:[a-z0-9.-]{0,251}[a-z0-9])?"
_UID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
_POD_DIRECTORY = re.compile(rf"({_DNS_LABEL})_({_DNS_SUBDOMAIN})_({_UID})")
_CONTAINER_LOG = re.compile(rf"({_DNS_SUBDOMAIN})_({_DNS_LABEL})_({_DNS_LABEL})-([0-9a-f]{{64}})\.log")


def _names(directory: Path, limit: int) -> list[str]:
    """The first `limit` entry names of a directory; none when it is missing or unreadable."""
    try:
        with os.scandir(directory) as entries:
            names = [entry.name for entry in itertools.islice(entries, limit + 1)]
    except OSError:
        return []
    if len(names) > limit:
        log.warning("%s holds more than %d entries: pods beyond them keep no names", directory, limit)
    return names[:limit]


class KubeletLogs:
    """Pod uid -> (namespace, pod) and container id -> (namespace, pod, container name), read again
    when a workload is not found, at most once per `min_rescan_seconds` (pods outside Kubernetes, or
    sandbox containers, which have no log, are never found)."""

    def __init__(self, pod_logs: Path, container_logs: Path, min_rescan_seconds: float = 2.0,
                 max_entries: int = MAX_ENTRIES) -> None:
        self._directories = (pod_logs, container_logs)
        self._min_rescan = min_rescan_seconds
        self._max_entries = max_entries
        self._rescanned_at = -min_rescan_seconds
        self._pods: dict[str, tuple[str, str]] = {}
        self._containers: dict[str, tuple[str, str, str]] = {}
        self._named: dict[Workload, Workload] = {}  # the workloads found, bounded by the entries

    def named(self, workload: Workload) -> Workload:
        """The workload with its namespace, pod and container name where the kubelet's logs say them."""
        if not workload.pod_uid:
            return workload
        named = self._named.get(workload)
        if named is not None:
            return named
        if not self._found(workload):
            self._rescan()
        named = self._name(workload)
        if self._found(workload):
            if len(self._named) >= 2 * self._max_entries:  # cgroup paths of containers long gone
                self._named.clear()
            self._named[workload] = named
        return named

    def _found(self, workload: Workload) -> bool:
        return workload.pod_uid in self._pods and (not workload.container_id
                                                  or workload.container_id in self._containers)

    def _name(self, workload: Workload) -> Workload:
        namespace, pod = self._pods.get(workload.pod_uid, ("", ""))
        container = self._containers.get(workload.container_id)
        if container is None:
            return replace(workload, namespace=namespace, pod=pod)
        # The link names the pod too: where it disagrees with the uid's directory, neither names the container.
        if pod and container[:2] != (namespace, pod):
            return replace(workload, namespace=namespace, pod=pod)
        return replace(workload, namespace=container[0], pod=container[1], container_name=container[2])

    def _rescan(self) -> None:
        now = time.monotonic()
        if now - self._rescanned_at < self._min_rescan:
            return
        self._rescanned_at = now
        pod_logs, container_logs = self._directories
        pods = {}
        for match in filter(None, map(_POD_DIRECTORY.fullmatch, _names(pod_logs, self._max_entries))):
            namespace, pod, uid = match.groups()
            pods[uid] = (namespace, pod)
        containers = {}
        for match in filter(None, map(_CONTAINER_LOG.fullmatch, _names(container_logs, self._max_entries))):
            pod, namespace, container, container_id = match.groups()
            containers[container_id] = (namespace, pod, container)
        self._pods, self._containers, self._named = pods, containers, {}
